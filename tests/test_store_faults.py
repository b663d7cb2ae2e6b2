"""The store fails under a running worker (real broker, real chDB): transiently, for
longer than the retries last, and for good until the worker is killed. Every step of the
job is stored exactly once in each case."""

from __future__ import annotations

from pathlib import Path

import pytest

from lagscope.producers.replay import replay
from lagscope.simulator.generate import JobSpec, generate_job
from tests.faulty_store import FAULT_ENV
from tests.worker_util import (
    create_topics,
    kafka_config,
    query_store,
    start_worker,
    wait_for_log,
)

#: A worker on a real broker against a failing store, end to end: slow.
pytestmark = pytest.mark.slow

N_STEPS = 30
SPEC = JobSpec(dp=2, pp=2, microbatches=2, steps=N_STEPS, name="flaky", seed=11)
#: Small passes and frequent writes and snapshots: the job's steps are written in many
#: inserts, and snapshots come while the store is down.
FAST = {
    "LAGSCOPE_WORKER__CHECKPOINT_INTERVAL_S": "0.5",
    "LAGSCOPE_WORKER__WRITE_INTERVAL_S": "0.05",
    "LAGSCOPE_WORKER__WRITE_EVERY_STEPS": "2",
    "LAGSCOPE_WORKER__TICK_INTERVAL_S": "0.2",
    "LAGSCOPE_WORKER__FETCH_MAX_BYTES": "4096",
    "LAGSCOPE_WORKER__TAKE_MAX_RUNS": "1",
    # retries give up after ~0.7 s: a 4 s outage outlasts them
    "LAGSCOPE_STORE__WRITE_ATTEMPTS": "4",
    "LAGSCOPE_STORE__WRITE_RETRY_MAX_WAIT_S": "0.4",
}
#: What makes a row of each per-step table unique within the job.
_ROW_KEYS = {"attribution": "step, kind, name", "worker_slowdown": "step, dp_rank, pp_rank"}


def _produce_job(bootstrap: str, topics: dict[str, str]) -> None:
    create_topics(bootstrap, topics)
    job = generate_job(SPEC)
    replay(job.trace, job.meta, kafka=kafka_config(bootstrap, topics), job_id="flaky",
           progress=None)  # fmt: skip


def _assert_every_step_stored_once(work: Path) -> None:
    counts = query_store(
        work,
        "SELECT count() AS rows, uniqExact(step) AS steps, countIf(complete) AS complete "
        "FROM steps WHERE job_id = 'flaky'",
    )[0]
    assert counts == {"rows": N_STEPS, "steps": N_STEPS, "complete": N_STEPS}
    # the per-step tables hold each step's rows once too (counted without FINAL)
    for table, key in _ROW_KEYS.items():
        sql = f"SELECT count() AS n, uniqExact({key}) AS unique_rows FROM {table}"
        rows = query_store(work, sql)[0]
        assert rows["n"] == rows["unique_rows"] > 0, (table, rows)


@pytest.mark.parametrize(
    ("fault", "expected_in_log"),
    [
        # within the retries: the write succeeds on a later attempt
        ("table=steps,after=0,count=2", "retrying in"),
        # longer than the retries: the steps stay pending, the worker holds back
        ("table=steps,after=0,seconds=4", "store unavailable, closed steps kept"),
    ],
    ids=["transient", "longer-than-the-retries"],
)
def test_a_failing_store_loses_and_duplicates_no_step(
    kafka_bootstrap, kafka_topics, tmp_path, fault, expected_in_log
):
    _produce_job(kafka_bootstrap, kafka_topics)
    work = tmp_path / "w"
    worker = start_worker(kafka_bootstrap, kafka_topics, work, group="flaky",
                          env={**FAST, FAULT_ENV: fault}, module="tests.faulty_store")  # fmt: skip
    assert worker.wait(180) == 0, worker.log()[-4000:]
    log = worker.log()
    assert "injected store fault #2" in log, log[-3000:]
    assert expected_in_log in log
    assert "Traceback" not in log, log[-3000:]
    _assert_every_step_stored_once(work)


def test_no_offset_is_committed_past_steps_the_store_does_not_have(
    kafka_bootstrap, kafka_topics, tmp_path
):
    """The store stays down while snapshots come due; the worker is killed; a new one on a
    healthy store must find every step the first one closed but could not store."""
    _produce_job(kafka_bootstrap, kafka_topics)
    work = tmp_path / "w"
    down = start_worker(kafka_bootstrap, kafka_topics, work, group="flaky", log_name="down.log",
                        env={**FAST, FAULT_ENV: "table=steps,after=0,seconds=100000"},
                        module="tests.faulty_store", exit_when_idle_s=None)  # fmt: skip
    wait_for_log(down, "store unavailable, closed steps kept", 3, timeout_s=120)
    assert down.process.poll() is None, down.log()[-3000:]
    down.kill9()
    first_log = down.log()
    assert "Traceback" not in first_log, first_log[-3000:]

    healthy = start_worker(kafka_bootstrap, kafka_topics, work, group="flaky", env=FAST,
                           log_name="healthy.log")  # fmt: skip
    assert healthy.wait(180) == 0, healthy.log()[-4000:]
    _assert_every_step_stored_once(work)


def test_a_worker_held_back_mid_backlog_closes_complete_steps_complete(
    kafka_bootstrap, kafka_topics, tmp_path
):
    """The store is down for longer than the lateness while the worker is mid-backlog:
    lateness follows the records' own timestamps, so the steps whose ranks all reported
    in time are closed complete once the worker goes on, however long it was held."""
    _produce_job(kafka_bootstrap, kafka_topics)
    work = tmp_path / "w"
    env = {
        **FAST,
        FAULT_ENV: "table=steps,after=0,seconds=4",
        "LAGSCOPE_PROCESSOR__LATENESS_S": "1",
    }
    worker = start_worker(kafka_bootstrap, kafka_topics, work, group="flaky", env=env,
                          module="tests.faulty_store")  # fmt: skip
    assert worker.wait(180) == 0, worker.log()[-4000:]
    assert "store unavailable, closed steps kept" in worker.log()
    _assert_every_step_stored_once(work)
