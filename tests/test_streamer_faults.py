"""Fault injection with real processes: kill -9 the streamer, stop the broker mid-stream."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from lagscope.deploy.kafka_local import KafkaBroker
from lagscope.producers.events import batch_id_of, decode_batch
from lagscope.producers.log import list_log_files, list_rank_dirs
from lagscope.producers.reference_format import load_meta, load_trace
from lagscope.producers.replay import default_job_id, iter_step_batches, replay
from lagscope.producers.streamer import BATCH_ID_HEADER
from tests.conftest import REFERENCE_TRACES, REPO_ROOT
from tests.kafka_util import Message, consume_all

#: A real broker stopped, restarted and the streamer killed at random points: slow.
pytestmark = pytest.mark.slow

START_NS = 1_760_000_000_000_000_000


def _stream_cmd(log_dir: Path, bootstrap: str, topics: dict[str, str], idle_s: float) -> list[str]:
    return [
        sys.executable, "-m", "lagscope.cli", "stream", "--log-dir", str(log_dir),
        "--bootstrap-servers", bootstrap, "--topic-ops", topics["topic_ops"],
        "--topic-deadletter", topics["topic_deadletter"], "--topic-jobs", topics["topic_jobs"],
        "--idle-exit-s", str(idle_s),
    ]  # fmt: skip


def _expected_ops(repeat: int) -> Counter:
    trace = load_trace(REFERENCE_TRACES / "trace-AR.parquet")
    meta = load_meta(REFERENCE_TRACES / "meta-AR.yaml")
    return Counter(
        tuple(r.values())
        for _, _, batches in iter_step_batches(
            trace, meta, job_id=default_job_id(meta), start_wall_ns=START_NS, repeat=repeat
        )
        for batch in batches
        for r in batch.to_records()
    )


def _check_delivery(messages: list[Message], expected: Counter) -> int:
    """Consumed set == produced set; duplicates only as byte-identical re-sends of one id."""
    by_id: dict[bytes, bytes] = {}
    for message in messages:
        batch_id = message.headers[BATCH_ID_HEADER]
        if batch_id in by_id:
            assert by_id[batch_id] == message.value, "one batch id, two different contents"
        by_id[batch_id] = message.value
    got = Counter(
        tuple(r.values()) for value in by_id.values() for r in decode_batch(value).to_records()
    )
    missing = expected - got
    extra = got - expected
    assert not missing, f"{sum(missing.values())} ops lost, e.g. {next(iter(missing))}"
    assert not extra, f"{sum(extra.values())} ops not produced or twice, e.g. {next(iter(extra))}"
    return len(messages) - len(by_id)


def _shipped_everything(log_dir: Path) -> bool:
    """Whether the checkpoint says every rank's log was read and confirmed to its end."""
    checkpoint = log_dir / ".streamer-checkpoint.json"
    if not checkpoint.exists():
        return False
    positions = json.loads(checkpoint.read_text())["positions"]
    for directory in list_rank_dirs(log_dir):
        last = list_log_files(directory)[-1]
        position = positions.get(directory.name)
        if position != {"file": last, "offset": (directory / last).stat().st_size}:
            return False
    return True


def _check_batches(messages: list[Message], expected_ids: set[bytes]) -> int:
    """Batch-level check for large runs: ids are content hashes, so equal id sets mean equal
    op sets; each message's content must hash to its id. Returns the duplicate count."""
    by_id: dict[bytes, bytes] = {}
    for message in messages:
        batch_id = message.headers[BATCH_ID_HEADER]
        assert batch_id_of(message.value).encode() == batch_id
        if batch_id in by_id:
            assert by_id[batch_id] == message.value, "one batch id, two different contents"
        by_id[batch_id] = message.value
    missing = expected_ids - set(by_id)
    extra = set(by_id) - expected_ids
    assert not missing, f"{len(missing)} batches lost"
    assert not extra, f"{len(extra)} batches that were never written"
    return len(messages) - len(by_id)


def test_kill_9_at_random_points_loses_nothing(
    tmp_path: Path, kafka_bootstrap: str, kafka_topics: dict[str, str]
) -> None:
    repeat = 40  # 4.7 M ops, 28,160 batches, ~134 MB of logs in 4 MiB files
    log_dir = tmp_path / "logs"
    trace = load_trace(REFERENCE_TRACES / "trace-AR.parquet")
    meta = load_meta(REFERENCE_TRACES / "meta-AR.yaml")
    stats = replay(trace, meta, log_dir=log_dir, start_wall_ns=START_NS, repeat=repeat,
                   progress=None, max_file_bytes=4 << 20)  # fmt: skip
    seed = int(os.environ.get("LAGSCOPE_FAULT_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    command = _stream_cmd(log_dir, kafka_bootstrap, kafka_topics, idle_s=0.3)
    kills_mid_stream = 0
    checkpoint = log_dir / ".streamer-checkpoint.json"
    # Frequent checkpoints (the first one of a run shows it is shipping, then we kill) and
    # little unconfirmed data in flight, so no run races through the whole log before its
    # kill however fast the machine is.
    env = {
        **os.environ,
        "LAGSCOPE_STREAMER__CHECKPOINT_INTERVAL_S": "0.05",
        "LAGSCOPE_STREAMER__MAX_IN_FLIGHT_BYTES": str(1 << 20),
    }
    for _ in range(14):
        before = checkpoint.stat().st_mtime_ns if checkpoint.exists() else 0
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, env=env)  # fmt: skip
        # Kill at a random moment once this run has confirmed deliveries, however long the
        # interpreter took to start on a loaded machine: every kill lands mid-stream.
        deadline = time.monotonic() + 30
        while (
            process.poll() is None
            and time.monotonic() < deadline
            and (not checkpoint.exists() or checkpoint.stat().st_mtime_ns == before)
        ):
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.1))
        still_running = process.poll() is None
        process.kill()  # SIGKILL: no flush, no final checkpoint
        process.wait()
        if still_running and not _shipped_everything(log_dir):
            kills_mid_stream += 1
    final = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-3000:]
    assert _shipped_everything(log_dir)
    assert kills_mid_stream >= 10, f"seed {seed}: only {kills_mid_stream} kills mid-stream"

    expected_ids = {
        batch.batch_id.encode()
        for _, _, batches in iter_step_batches(
            trace, meta, job_id=default_job_id(meta), start_wall_ns=START_NS, repeat=repeat
        )
        for batch in batches
    }
    assert len(expected_ids) == stats.batches
    messages = consume_all(kafka_bootstrap, kafka_topics["topic_ops"], timeout_s=180)
    duplicates = _check_batches(messages, expected_ids)
    assert len(messages) - duplicates == stats.batches
    print(f"seed {seed}: {kills_mid_stream} kills mid-stream, {duplicates} re-sent duplicates")
    assert len(consume_all(kafka_bootstrap, kafka_topics["topic_jobs"])) >= 1


def test_broker_stop_and_restart_mid_stream_delivers_everything(
    tmp_path: Path, own_broker: KafkaBroker, kafka_topics: dict[str, str]
) -> None:
    log_dir = tmp_path / "logs"
    # The sidecar starts beside the job: the log directory (its shared volume) exists, the
    # ranks' logs come later.
    log_dir.mkdir()
    trace = load_trace(REFERENCE_TRACES / "trace-AR.parquet")
    meta = load_meta(REFERENCE_TRACES / "meta-AR.yaml")
    env = {**os.environ, "LAGSCOPE_STREAMER__DELIVERY_TIMEOUT_MS": "2500"}
    streamer = subprocess.Popen(
        _stream_cmd(log_dir, own_broker.bootstrap, kafka_topics, idle_s=4.0),
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    # Ranks keep writing while the broker is away: ~7 s of replay at 200x.
    writer = threading.Thread(
        target=replay,
        args=(trace, meta),
        kwargs=dict(log_dir=log_dir, start_wall_ns=START_NS, speed=200.0, progress=None),
    )
    writer.start()
    time.sleep(2.0)
    own_broker.stop()
    time.sleep(4.0)  # longer than the delivery timeout: messages fail and are re-sent
    own_broker.start()
    writer.join()
    out, err = streamer.communicate(timeout=240)
    assert streamer.returncode == 0, err[-3000:]
    stats = json.loads(out.strip().splitlines()[-1])
    # The outage outlasted the delivery timeout: the rewind path re-sent from the log.
    assert stats["delivery_failures"] > 0 and stats["rewinds"] >= 1, stats
    messages = consume_all(own_broker.bootstrap, kafka_topics["topic_ops"], timeout_s=120)
    _check_delivery(messages, _expected_ops(1))
    assert stats["ops"] >= trace.n_rows
    assert consume_all(own_broker.bootstrap, kafka_topics["topic_deadletter"]) == []
