"""Replay into per-rank logs at any size: one thread, a bounded number of open files, and the
logs read back as the trace (issue 69 item 2)."""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path

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
