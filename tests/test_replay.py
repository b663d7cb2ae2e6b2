"""Replay into per-rank logs at any size: one thread, a bounded number of open files, and the
logs read back as the trace (issue 69 item 2)."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from lagscope.producers import replay as replay_module
from lagscope.producers.events import JobInfo, decode_batch
from lagscope.producers.log import KIND_BATCH, KIND_JOB, Record, list_rank_dirs, read_all
from lagscope.producers.replay import LogDirInUse, iter_step_batches, replay
from lagscope.simulator.generate import JobSpec, generate_job

START_NS = 1_750_000_000_000_000_000
#: 96 ranks' logs, a few steps: many more logs than the open-file bound below.
SPEC = JobSpec(dp=48, pp=2, tp=2, microbatches=2, steps=3, seed=3)


@pytest.fixture(scope="module")
def job():
    return generate_job(SPEC)


def _open_log_files(log_dir: Path) -> int:
    """Files under `log_dir` this process holds open now."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        held += target.startswith(str(log_dir))
    return held


def test_a_replay_writes_every_rank_log_on_one_thread_with_few_files_open(
    job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread per rank's log stalled a 12,544-rank replay; now the logs are written by the
    replaying thread, at most `MAX_OPEN_FILES` of them open at once, and read back as the
    trace's batches, each once, then each rank's end."""
    monkeypatch.setattr(replay_module._LogDestination, "MAX_OPEN_FILES", 8, raising=False)
    log_dir = tmp_path / "logs"
    threads_before = threading.active_count()
    most_threads = most_open = 0

    class Watch:
        """After each step: the threads alive and the log files open."""

        def update(self, done: int, *, total: int | None = None, note: str = "") -> None:
            nonlocal most_threads, most_open
            most_threads = max(most_threads, threading.active_count())
            most_open = max(most_open, _open_log_files(log_dir))

    stats = replay(
        job.trace, job.meta, log_dir=log_dir, job_id="many", start_wall_ns=START_NS,
        progress=Watch(),
    )  # fmt: skip
    assert stats.batches == SPEC.dp * SPEC.pp * SPEC.steps
    assert most_threads == threads_before
    assert 0 < most_open <= 8
    assert _open_log_files(log_dir) == 0

    ranks = list_rank_dirs(log_dir)
    assert len(ranks) == SPEC.dp * SPEC.pp
    got: Counter = Counter()
    ended = set()
    for directory in ranks:
        # Each log is one file: a log that let go of its file appends to it again.
        assert len(list(directory.iterdir())) == 1
        for item in read_all(directory):
            assert isinstance(item, Record)
            if item.kind == KIND_BATCH:
                batch = decode_batch(item.payload)
                got[batch.rank, batch.step, batch.start_ns.tobytes()] += 1
            elif item.kind == KIND_JOB:
                info = JobInfo.model_validate_json(item.payload)
                if info.ended_ns is not None:
                    ended.add(info.rank_identity.rank)
    want = Counter(
        (batch.rank, batch.step, batch.start_ns.tobytes())
        for _, _, batches in iter_step_batches(
            job.trace, job.meta, job_id="many", start_wall_ns=START_NS
        )
        for batch in batches
    )
    assert got == want
    assert ended == set(range(SPEC.dp * SPEC.pp * SPEC.tp))


def test_a_second_replay_is_refused_from_any_log_of_the_first(job, tmp_path: Path) -> None:
    """Only each log's first record is read to find an earlier replay of the job attempt:
    its job record, or (the logs without it) its first batch."""
    log_dir = tmp_path / "logs"
    replay(job.trace, job.meta, log_dir=log_dir, job_id="twice", start_wall_ns=START_NS)
    first, *rest = list_rank_dirs(log_dir)
    for directory in [first, *rest[:-1]]:
        for file in directory.iterdir():
            file.unlink()
        directory.rmdir()
    with pytest.raises(LogDirInUse, match=f"{rest[-1].name} already holds job twice attempt 0"):
        replay(job.trace, job.meta, log_dir=log_dir, job_id="twice", start_wall_ns=START_NS)
    replay(job.trace, job.meta, log_dir=log_dir, job_id="twice", attempt=1, start_wall_ns=0)


def test_a_trace_file_larger_than_a_part_is_replayed_a_part_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file over `PART_BYTES` whose row groups hold its steps in order is replayed a
    part of whole steps at a time (a step split between two row groups stays whole), and
    writes the very batches the whole trace writes, twice over with `repeat`; its steps
    out of order, it is read whole."""
    from lagscope.producers import reference_format
    from lagscope.producers.reference_format import TraceParts, open_trace, write_traces
    from lagscope.simulator.errors import TraceError
    from lagscope.simulator.generate import JobGenerator

    spec = JobSpec(dp=4, pp=2, microbatches=2, steps=7, seed=5,
                   stragglers=[{"kind": "gc_pauses", "probability": 0.1, "pause_s": 0.002,
                                "start_step": 4}])  # fmt: skip
    generator = JobGenerator(spec)
    runs = list(generator.runs(max_ops=2 * generator.ops_per_step))
    path = tmp_path / "trace.parquet"
    # Each run written as three row groups: its steps cut where the rows are.
    thirds = (
        _rows(run.trace, part)
        for run in runs
        for part in np.array_split(np.arange(run.trace.n_rows), 3)
    )
    write_traces(thirds, path, spec.meta())
    whole = reference_format.load_trace(path)
    monkeypatch.setattr(reference_format, "PART_BYTES", 0)
    parts = open_trace(path, meta=spec.meta())
    assert isinstance(parts, TraceParts) and (parts.steps, parts.max_step) == (7, 6)
    other = spec.model_copy(update={"dp": 8}).meta()
    with pytest.raises(TraceError, match="describe different jobs: dp_size"):
        open_trace(path, meta=other)
    parts = dataclasses.replace(parts, part_rows=3 * generator.ops_per_step // 2)
    step_sets = [sorted(set(part.step.tolist())) for part in parts]
    assert step_sets == [[0, 1], [2, 3], [4, 5], [6]], step_sets

    def batches(trace) -> list[tuple]:
        return [
            (end, step, b.rank, b.start_ns.tobytes(), b.duration_ns.tobytes(),
             [b.optype_names[c] for c in b.optype])
            for end, step, found in iter_step_batches(
                trace, spec.meta(), job_id="parts", start_wall_ns=START_NS, repeat=2
            )
            for b in found
        ]  # fmt: skip

    assert batches(parts) == batches(whole)
    stats = replay(parts, spec.meta(), log_dir=tmp_path / "logs", start_wall_ns=START_NS)
    assert (stats.steps, stats.ops) == (7, whole.n_rows)

    shuffled = tmp_path / "shuffled.parquet"
    write_traces(reversed([run.trace for run in runs]), shuffled, spec.meta())
    assert not isinstance(open_trace(shuffled, meta=spec.meta()), TraceParts)


def _rows(trace, rows: np.ndarray):
    """The trace's `rows`, as a trace."""
    from lagscope.simulator.trace import Trace

    names = ("dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration", "seq_id",
             "mc", "mb_id", "gmc")  # fmt: skip
    columns = {name: getattr(trace, name)[rows] for name in names}
    return Trace.from_columns({**columns, "optype_names": trace.optype_names})


def test_a_replay_to_a_broker_that_is_down_ends_in_one_line(
    job, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], caplog
) -> None:
    """Nothing listens at the bootstrap address: the real producer's queue (made small)
    fills and Kafka confirms nothing, so the replay stops with an error saying so once
    `WAIT_S` (made short) passed, not after the whole trace at librdkafka's pace. Before
    that it said once that the broker does not answer, where librdkafka wrote a line of
    its own on stderr for each attempt to connect, several a second."""
    import socket

    from lagscope.producers.config import KafkaSettings, LagscopeConfig
    from lagscope.producers.replay import UndeliveredError

    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{unused.getsockname()[1]}"
    kafka = LagscopeConfig(kafka=KafkaSettings(
        bootstrap_servers=address, client_options={"queue.buffering.max.messages": 10},
    ))  # fmt: skip
    monkeypatch.setattr(replay_module._KafkaDestination, "WAIT_S", 2.0)
    began = time.monotonic()
    with pytest.raises(UndeliveredError, match=f"Kafka at {address} confirmed nothing for 2 s"):
        replay(job.trace, job.meta, kafka=kafka, job_id="down", start_wall_ns=START_NS)
    assert time.monotonic() - began < 30
    said = [r.getMessage() for r in caplog.records if r.name == "lagscope.replay"]
    assert len(said) == 1 and said[0].startswith(f"Kafka at {address} does not answer ("), said
    assert "Connection refused" in said[0]
    assert "FAIL" not in capfd.readouterr().err


def test_a_short_replay_to_a_broker_that_is_down_waits_once(
    job, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay whose batches all fit the producer's queue waits for Kafka at its end,
    `WAIT_S` (made short) once: its closing does not wait as long again for what the end
    gave up on."""
    import socket

    from lagscope.producers.config import KafkaSettings, LagscopeConfig
    from lagscope.producers.replay import UndeliveredError

    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{unused.getsockname()[1]}"
    monkeypatch.setattr(replay_module._KafkaDestination, "WAIT_S", 3.0)
    kafka = LagscopeConfig(kafka=KafkaSettings(bootstrap_servers=address))
    began = time.monotonic()
    with pytest.raises(UndeliveredError, match=f"not delivered to Kafka at {address} within 3 s"):
        replay(job.trace, job.meta, kafka=kafka, job_id="down", start_wall_ns=START_NS)
    assert 3.0 <= time.monotonic() - began < 5.5
