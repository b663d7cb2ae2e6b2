"""A worker's probes judge the worker, not the HTTP thread that answers them: real
`lagscope worker` processes on a real broker, one whose loop is wedged in a store write
that never returns (its `/metrics` still answers: the old probe saw nothing), and one
whose store and Kafka go away under it."""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from lagscope.deploy.kafka_local import free_port
from lagscope.producers.replay import replay
from lagscope.simulator.generate import JobSpec, generate_job
from tests.faulty_store import FAULT_ENV
from tests.worker_util import (
    create_topics,
    kafka_config,
    start_store_server,
    start_worker,
    wait_for_log,
)

#: Real workers on a real broker, waiting out their stall limit: slow.
pytestmark = pytest.mark.slow

STALL_S = 4.0


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _wait_for(port: int, path: str, status: int, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    last: tuple[int, str] | None = None
    while time.monotonic() < deadline:
        try:
            last = _get(port, path)
        except OSError:  # not serving yet
            time.sleep(0.2)
            continue
        if last[0] == status:
            return last[1]
        time.sleep(0.2)
    raise AssertionError(f"{path} never answered {status} in {timeout_s} s; last: {last}")


def _produce_job(bootstrap: str, topics: dict[str, str], name: str, steps: int) -> None:
    create_topics(bootstrap, topics)
    job = generate_job(JobSpec(dp=2, pp=2, microbatches=2, steps=steps, name=name, seed=3))
    replay(job.trace, job.meta, kafka=kafka_config(bootstrap, topics), job_id=name,
           progress=None)  # fmt: skip


def test_a_worker_wedged_in_a_store_write_fails_liveness_while_metrics_answer(
    kafka_bootstrap: str, kafka_topics: dict[str, str], tmp_path: Path
) -> None:
    _produce_job(kafka_bootstrap, kafka_topics, "wedged", steps=40)
    port = free_port()
    env = {
        FAULT_ENV: "table=steps,after=0,hang=1",
        "LAGSCOPE_WORKER__STALL_S": str(STALL_S),
        "LAGSCOPE_WORKER__METRICS_PORT": str(port),
        "LAGSCOPE_WORKER__METRICS_ADDR": "127.0.0.1",
        "LAGSCOPE_WORKER__WRITE_INTERVAL_S": "0.05",
        "LAGSCOPE_WORKER__WRITE_EVERY_STEPS": "2",
        "LAGSCOPE_WORKER__FETCH_MAX_BYTES": "4096",
        "LAGSCOPE_WORKER__TAKE_MAX_RUNS": "1",
    }
    worker = start_worker(kafka_bootstrap, kafka_topics, tmp_path / "w", group="wedged",
                          env=env, module="tests.faulty_store", exit_when_idle_s=None)  # fmt: skip
    try:
        assert "ok: " in _wait_for(port, "/healthz", 200, timeout_s=120)
        wait_for_log(worker, "injected store hang", 1, timeout_s=120)
        assert worker.process.poll() is None, worker.log()[-3000:]
        # Alive by the old probe's measure: the metrics thread answers, with the build and
        # the process' own metrics.
        status, metrics = _get(port, "/metrics")
        assert status == 200
        assert 'lagscope_build_info{component="worker"' in metrics
        assert "process_resident_memory_bytes" in metrics
        assert "python_info" in metrics
        began = time.monotonic()
        # Wedged in its first pass, the loop may not have ticked yet: then it has its
        # start's allowance (5 x stall_s) instead of stall_s.
        reason = _wait_for(port, "/healthz", 503, timeout_s=5 * STALL_S + 30)
        assert time.monotonic() - began <= 5 * STALL_S + 30
        # Either check sees the wedge first, by the machine's load: the loop that has not
        # gone round, or the records it has not taken.
        assert re.match(
            r"failing: (the worker's loop has not (gone round|started)"
            r"|records wait and the core has taken none)",
            reason,
        ), reason
        assert _get(port, "/metrics")[0] == 200
    finally:
        worker.kill9()


def test_readiness_follows_the_store_and_kafka(
    own_broker, kafka_topics: dict[str, str], tmp_path: Path
) -> None:
    store = start_store_server(tmp_path / "store")
    port = free_port()
    dsn = store.dsn("health").replace("http://", "http://writer:s3cret@", 1)
    env = {
        # above what a core call retrying a dead store takes (its writes' back-off)
        "LAGSCOPE_WORKER__STALL_S": "60",
        "LAGSCOPE_WORKER__METRICS_PORT": str(port),
        "LAGSCOPE_WORKER__METRICS_ADDR": "127.0.0.1",
    }
    _produce_job(own_broker.bootstrap, kafka_topics, "ready", steps=5)
    worker = start_worker(own_broker.bootstrap, kafka_topics, tmp_path / "w", group="ready",
                          env=env, dsn=dsn, exit_when_idle_s=None)  # fmt: skip
    try:
        assert "answer" in _wait_for(port, "/readyz", 200, timeout_s=120)
        store.stop()
        reason = _wait_for(port, "/readyz", 503, timeout_s=30)
        assert f"the store {store.url.replace('http://', 'http://writer:***@')}/health" in reason
        assert "s3cret" not in reason
        own_broker.stop()
        deadline = time.monotonic() + 30
        while "Kafka at" not in reason and time.monotonic() < deadline:
            reason = _wait_for(port, "/readyz", 503, timeout_s=30)
        assert f"Kafka at {own_broker.bootstrap} does not answer" in reason
        assert "the store" in reason
        # Liveness is not readiness: a worker with nothing to take and nothing to reach
        # stays alive (a restart would bring neither back).
        assert _get(port, "/healthz")[0] == 200
    finally:
        worker.kill9()
        store.stop()
