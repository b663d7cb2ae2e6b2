"""`lagscope stream` as a job's sidecar, a real process against a real broker: SIGTERM (the
trainer exited, Kubernetes stops its native sidecar) ships the logs to their end before it
exits, and the exit that ends a job's sidecar by itself waits for every rank's end record,
not for a quiet minute of the job."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lagscope.producers.events import JobInfo, RankIdentity, RankStepBatch, decode_batch
from lagscope.producers.log import KIND_BATCH, KIND_JOB, LogWriter
from lagscope.producers.reference_format import load_meta
from tests.conftest import REFERENCE_TRACES, REPO_ROOT
from tests.kafka_util import consume_all

START_NS = 1_770_000_000_000_000_000


def _batch(rank: int, step: int, n: int) -> RankStepBatch:
    return RankStepBatch.build(
        job_id="sidecar", attempt=0, rank=rank, dp_rank=rank, pp_rank=0, step=step,
        optype=["forward-compute"] * n, microbatch=list(range(n)), chunk=[0] * n,
        seq=list(range(n)), start_ns=[START_NS + step * 10**9 + i * 1000 for i in range(n)],
        duration_ns=[500] * n,
    )  # fmt: skip


def _job_record(rank: int, *, ended: bool) -> bytes:
    info = JobInfo.from_meta(load_meta(REFERENCE_TRACES / "meta-ST.yaml"), job_id="sidecar")
    info = info.model_copy(update={"rank_identity": RankIdentity(rank=rank)})
    if ended:
        info = info.model_copy(update={"ended_ns": START_NS + 10**12})
    return info.model_dump_json().encode()


def _stream(log_dir: Path, bootstrap: str, topics: dict[str, str], *flags: str):
    command = [
        sys.executable, "-m", "lagscope.cli", "stream", "--log-dir", str(log_dir),
        "--bootstrap-servers", bootstrap, "--topic-ops", topics["topic_ops"],
        "--topic-deadletter", topics["topic_deadletter"], "--topic-jobs", topics["topic_jobs"],
        *flags,
    ]  # fmt: skip
    return subprocess.Popen(
        command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for_line(process: subprocess.Popen, text: str, timeout_s: float = 60) -> list[str]:
    """stderr lines up to the first that holds `text`."""
    assert process.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"no line with {text!r} in {timeout_s} s: {''.join(lines)}")


def test_sigterm_ships_the_logs_to_their_end_then_exits_0(
    tmp_path: Path, kafka_bootstrap: str, kafka_topics: dict[str, str]
) -> None:
    """The trainer wrote a backlog (the sidecar started before its log directory existed)
    and exited: the SIGTERM that follows at once ends the sidecar only after Kafka
    confirmed every batch."""
    log_dir = tmp_path / "logs"
    process = _stream(log_dir, kafka_bootstrap, kafka_topics, "--drain-s", "120")
    _wait_for_line(process, "does not exist yet")
    sent = []
    for rank in range(2):
        with LogWriter(log_dir, rank, background=False) as writer:
            for step in range(150):
                batch = _batch(rank, step, n=2_000)  # ~60 KB each, ~18 MB in all
                writer.append(KIND_BATCH, batch.encode())
                sent.append(batch.batch_id)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=180)
    assert process.returncode == 0, err
    assert "the logs are shipped to their end" in err
    assert json.loads(out)["unshipped_bytes"] == 0
    delivered = consume_all(kafka_bootstrap, kafka_topics["topic_ops"])
    assert sorted({decode_batch(m.value).batch_id for m in delivered}) == sorted(sent)


@pytest.mark.slow  # waits for a broker that never answers (~12 s)
def test_sigterm_without_kafka_exits_1_with_the_count_once_the_drain_ends(
    tmp_path: Path,
) -> None:
    """Kafka does not answer: the drain cannot finish, and the sidecar says how much stayed
    in the logs when its time is up."""
    log_dir = tmp_path / "logs"
    with LogWriter(log_dir, 0, background=False) as writer:
        writer.append(KIND_BATCH, _batch(0, 0, n=10).encode())
    size = sum(f.stat().st_size for f in log_dir.rglob("*.lglog"))
    topics = {"topic_ops": "o", "topic_deadletter": "d", "topic_jobs": "j"}
    process = _stream(log_dir, "127.0.0.1:9", topics, "--drain-s", "2")
    _wait_for_line(process, "does not answer")
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 1, err
    assert "stopping after draining for 2 s" in err
    assert json.loads(out)["unshipped_bytes"] == size
    assert f"{size:,} bytes of the logs under {log_dir} were not delivered" in err


def test_the_sidecar_exits_after_every_ranks_end_not_after_a_quiet_spell(
    tmp_path: Path, kafka_bootstrap: str, kafka_topics: dict[str, str]
) -> None:
    log_dir = tmp_path / "logs"
    writers = [LogWriter(log_dir, rank, background=False) for rank in range(2)]
    for rank, writer in enumerate(writers):
        writer.append(KIND_JOB, _job_record(rank, ended=False))
        writer.append(KIND_BATCH, _batch(rank, 0, n=10).encode())
        writer.flush()
    flags = ("--exit-after-job-end-s", "0.5")
    process = _stream(log_dir, kafka_bootstrap, kafka_topics, *flags)
    # A job quiet for far longer than the exit's 0.5 s (loading a model, a checkpoint), and
    # then a job one of whose ranks ended: the sidecar stays.
    time.sleep(6)
    writers[0].append(KIND_JOB, _job_record(0, ended=True))
    writers[0].close()
    time.sleep(3)
    assert process.poll() is None, process.communicate()[1]
    # The last rank ends: the sidecar follows.
    writers[1].append(KIND_BATCH, _batch(1, 1, n=10).encode())
    writers[1].append(KIND_JOB, _job_record(1, ended=True))
    writers[1].close()
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert "every rank's end is shipped" in err
    assert json.loads(out)["unshipped_bytes"] == 0
    assert len(consume_all(kafka_bootstrap, kafka_topics["topic_ops"])) == 3
    # Restarted (a native sidecar restarts after a crash), it knows from its checkpoint
    # that the job ended, and does not wait for end records it already shipped.
    again = _stream(log_dir, kafka_bootstrap, kafka_topics, *flags)
    out, err = again.communicate(timeout=60)
    assert again.returncode == 0, err
    assert "every rank's end is shipped" in err
