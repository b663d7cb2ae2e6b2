"""Config precedence and errors; replay timing, pace and CLI."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lagscope.producers.config import ConfigError, LagscopeConfig, load_config
from lagscope.producers.events import JobInfo, decode_batch
from lagscope.producers.log import KIND_BATCH, KIND_JOB, Record, list_rank_dirs, read_all
from lagscope.producers.reference_format import load_meta, load_trace
from lagscope.producers.replay import replay
from tests.conftest import REFERENCE_TRACES, REPO_ROOT


def test_config_precedence_file_env_flags(tmp_path: Path) -> None:
    path = tmp_path / "lagscope.yaml"
    path.write_text(
        "kafka:\n  bootstrap_servers: file:9092\n  topic_ops: from-file\n"
        "  security_protocol: SASL_SSL\n  sasl_mechanism: SCRAM-SHA-512\n"
        "  sasl_username: u\n  sasl_password: secret\n"
        "streamer:\n  linger_ms: 7\n"
    )
    env = {
        "LAGSCOPE_KAFKA__TOPIC_OPS": "from-env",
        "LAGSCOPE_STREAMER__LINGER_MS": "9",
        "LAGSCOPE_KAFKA__CLIENT_OPTIONS": '{"socket.keepalive.enable": true}',
    }
    config = load_config(
        file=path, env=env, overrides={"kafka": {"bootstrap_servers": "flag:1", "topic_ops": None}}
    )
    assert config.kafka.bootstrap_servers == "flag:1"
    assert config.kafka.topic_ops == "from-env"
    assert config.streamer.linger_ms == 9
    client = config.kafka.client_config()
    assert client["sasl.password"] == "secret"
    assert client["security.protocol"] == "SASL_SSL"
    assert client["socket.keepalive.enable"] is True
    assert "secret" not in repr(config)


def test_config_errors_name_the_field_and_source(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"streamer\.linger_ms \(from \$LAGSCOPE_STREAMER__LINGER_MS\)"
    ):
        load_config(env={"LAGSCOPE_STREAMER__LINGER_MS": "-3"})
    with pytest.raises(
        ConfigError, match=r"kafka\.bootstrap_server \(from the command line\): no such setting"
    ):
        load_config(env={}, overrides={"kafka": {"bootstrap_server": "x"}})
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(file=tmp_path / "missing.yaml", env={})


def test_config_model_is_extensible_by_later_components() -> None:
    from pydantic import BaseModel

    class SinkSettings(BaseModel):
        batch_rows: int = 1000

    class AppConfig(LagscopeConfig):
        sink: SinkSettings = SinkSettings()

    config = load_config(AppConfig, env={"LAGSCOPE_SINK__BATCH_ROWS": "5"})
    assert config.sink.batch_rows == 5
    assert config.kafka.topic_ops == "lagscope.ops"


@pytest.fixture(scope="module")
def reference():
    return load_trace(REFERENCE_TRACES / "trace-AR.parquet"), load_meta(
        REFERENCE_TRACES / "meta-AR.yaml"
    )


def test_replay_maps_times_to_wall_clock_per_step(tmp_path: Path, reference) -> None:
    trace, meta = reference
    start = 1_700_000_000_000_000_000
    replay(trace, meta, log_dir=tmp_path, start_wall_ns=start, progress=None)
    batches = []
    for directory in list_rank_dirs(tmp_path):
        for item in read_all(directory):
            assert isinstance(item, Record)
            if item.kind == KIND_BATCH:
                batches.append(decode_batch(item.payload))
    assert len(batches) == 704 and sum(b.n_ops for b in batches) == trace.n_rows
    steps = sorted({b.step for b in batches})
    first_step = [b for b in batches if b.step == steps[0]]
    # Step 0's origin is the start: op start = start + start_ts.
    rows = (trace.step == steps[0]) & (trace.rank == first_step[0].rank)
    expected = start + np.round(trace.start_ts[rows].astype(np.float64) * 1e9).astype(np.int64)
    assert sorted(first_step[0].start_ns.tolist()) == sorted(expected.tolist())
    # Steps follow each other: each step starts after the previous one ended.
    ends = {s: max(int((b.start_ns + b.duration_ns).max()) for b in batches if b.step == s)
            for s in steps}  # fmt: skip
    starts = {s: min(int(b.start_ns.min()) for b in batches if b.step == s) for s in steps}
    assert all(starts[b] >= ends[a] - 1 for a, b in itertools.pairwise(steps))
    for batch in batches:
        assert (batch.tp_rank, batch.cp_rank) == (0, 0)
        assert batch.pp_rank == int(trace.stage[trace.rank == batch.rank][0])
    # The job's record once, then, after each rank's last batch in its own log, every rank
    # of the world saying it ended at the last step's end (the TP/CP ranks the trace does
    # not hold, in the log of the job's record).
    records = {
        d.name: [i for i in read_all(d) if isinstance(i, Record)] for d in list_rank_dirs(tmp_path)
    }
    infos = [
        JobInfo.model_validate_json(i.payload)
        for r in records.values()
        for i in r
        if i.kind == KIND_JOB
    ]
    assert sum(info.ended_ns is None for info in infos) == 1
    ended = {info.rank_identity.rank: info.ended_ns for info in infos if info.ended_ns is not None}
    assert sorted(ended) == list(range(meta.world_size))
    assert set(ended.values()) == {max(ends.values())}
    for name, items in records.items():
        rank = int(name.removeprefix("rank-"))
        kinds = [
            "end" if item.kind == KIND_JOB and _ended_rank(item) == rank else item.kind
            for item in items
        ]
        assert "end" in kinds and kinds.index("end") > len(kinds) - 1 - kinds[::-1].index(
            KIND_BATCH
        )


def _ended_rank(item: Record) -> int | None:
    """The rank a job record says ended (None: it says no rank ended)."""
    info = JobInfo.model_validate_json(item.payload)
    return info.rank_identity.rank if info.ended_ns is not None else None


def test_an_interrupted_replay_ends_no_rank(tmp_path: Path, reference) -> None:
    """A replay stopped part way is a job whose ranks were killed: none says it ended."""
    trace, meta = reference

    def interrupt_at_the_third_step(_: float, waits: list[float] = []) -> None:  # noqa: B006
        waits.append(_)
        if len(waits) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replay(trace, meta, log_dir=tmp_path, speed=10.0, progress=None,
               sleep=interrupt_at_the_third_step)  # fmt: skip
    infos = [JobInfo.model_validate_json(i.payload) for d in list_rank_dirs(tmp_path)
             for i in read_all(d) if isinstance(i, Record) and i.kind == KIND_JOB]  # fmt: skip
    assert len(infos) == 1 and infos[0].ended_ns is None


def test_replay_paces_steps_by_speed(tmp_path: Path, reference) -> None:
    trace, meta = reference
    waits: list[float] = []
    replay(trace, meta, log_dir=tmp_path, speed=10.0, progress=None, sleep=waits.append)
    # The fake sleep does not wait, so each wait is the whole time to that step's end.
    assert len(waits) == 44
    assert waits == sorted(waits)
    end = trace.start_ts.astype(float) + trace.duration.astype(float)
    total_span = sum(end[trace.step == s].max() for s in np.unique(trace.step))
    assert waits[-1] == pytest.approx(total_span / 10.0, rel=0.02)
    with pytest.raises(ValueError, match="speed must be >= 0"):
        replay(trace, meta, log_dir=tmp_path, speed=-1, progress=None)


def test_replay_cli_writes_logs_and_plain_progress_off_a_terminal(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "lagscope.cli", "replay",
         "--trace", str(REFERENCE_TRACES / "trace-ST.parquet"),
         "--meta", str(REFERENCE_TRACES / "meta-ST.yaml"), "--log-dir", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["ops"] == load_trace(REFERENCE_TRACES / "trace-ST.parquet").n_rows
    # stderr is a pipe here: the progress is plain lines, no carriage-return redraws.
    assert "replay: 32/32 steps, 6,784 ops" in result.stderr
    assert "\r" not in result.stderr
    assert list_rank_dirs(tmp_path)
