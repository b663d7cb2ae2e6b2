"""The Prometheus endpoints of the streamer and the worker, scraped over HTTP from real
components: a streamer shipping a reference trace's logs to the real broker, and a
`lagscope worker` subprocess draining a trace from it into chDB."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from confluent_kafka import Producer
from prometheus_client.parser import text_string_to_metric_families

from lagscope.producers.log import rank_dir
from lagscope.producers.reference_format import load_meta, load_trace
from lagscope.producers.replay import replay
from lagscope.producers.streamer import Streamer
from tests.conftest import REFERENCE_TRACES, load_reference
from tests.kafka_util import consume_all
from tests.worker_util import create_topics, kafka_config, query_store, start_worker

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_streamer_endpoint_counts_what_it_shipped(
    tmp_path: Path, streamer_config, kafka_bootstrap: str, kafka_topics: dict[str, str]
) -> None:
    trace = load_trace(REFERENCE_TRACES / "trace-AR.parquet")
    meta = load_meta(REFERENCE_TRACES / "meta-AR.yaml")
    log_dir = tmp_path / "logs"
    shipped = replay(trace, meta, log_dir=log_dir, progress=None)
    # A rank directory of garbage: dead letters to count.
    rank_dir(log_dir, 999).mkdir()
    (rank_dir(log_dir, 999) / "00000000000000000001-0001.lglog").write_bytes(bytes(range(256)) * 8)

    streamer = Streamer(
        streamer_config(log_dir, metrics_port=0, metrics_addr="127.0.0.1", idle_exit_s=1.0)
    )
    streamer.ensure_topics()
    before = time.time()
    server = streamer.serve_metrics()
    assert server is not None and server.port > 0
    idle = scrape(server.port)  # nothing shipped yet: every counter exists, at 0
    assert value(idle, "lagscope_streamer_ops_total") == 0
    assert value(idle, "lagscope_streamer_last_delivery_timestamp_seconds") == 0

    during: list[Samples] = []
    runner = threading.Thread(target=lambda: during.append(scrape(server.port)))
    result: list = []
    main = threading.Thread(target=lambda: result.append(streamer.run()))
    main.start()
    runner.start()
    runner.join(10)
    main.join(60)
    assert not main.is_alive()
    stats = result[0]

    try:
        final = scrape(server.port)  # the endpoint outlives run(): the last counts
    finally:
        streamer.close_metrics()
    assert value(final, "lagscope_streamer_ops_total") == stats.ops == trace.n_rows
    assert value(final, "lagscope_streamer_batches_total") == shipped.batches == 704
    # The job's record, and each of its 64 ranks' end (the replay ran to its end).
    assert value(final, "lagscope_streamer_jobs_total") == 1 + 64
    dead = consume_all(kafka_bootstrap, kafka_topics["topic_deadletter"])
    assert value(final, "lagscope_streamer_dead_letters_total") == stats.dead_letters == len(dead)
    assert len(dead) > 0
    assert value(final, "lagscope_streamer_bytes_total") == stats.bytes > 0
    assert value(final, "lagscope_streamer_delivery_failures_total") == 0
    assert value(final, "lagscope_streamer_in_flight_bytes") == 0
    assert value(final, "lagscope_streamer_kafka_up") == 1
    last_delivery = value(final, "lagscope_streamer_last_delivery_timestamp_seconds")
    assert before <= last_delivery <= time.time()
    # A scrape mid-run never shows more than the end.
    assert during and all(
        during[0][key] <= final[key] for key in during[0] if key[0].endswith("_total")
    )
    with pytest.raises(urllib.error.URLError):
        scrape(server.port)


def _probe(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_streamer_probes_judge_its_loop_and_kafka(tmp_path: Path) -> None:
    """/readyz fails while Kafka does not answer (the logs keep everything meanwhile),
    /healthz once the shipping loop stopped going round; /metrics carries the build."""
    from lagscope.deploy.kafka_local import free_port
    from lagscope.producers.config import KafkaSettings, LagscopeConfig, StreamerSettings

    config = LagscopeConfig(
        kafka=KafkaSettings(bootstrap_servers=f"127.0.0.1:{free_port()}"),
        streamer=StreamerSettings(
            log_dir=tmp_path, metrics_port=0, metrics_addr="127.0.0.1", stall_s=30
        ),
    )
    streamer = Streamer(config)
    server = streamer.serve_metrics()
    assert server is not None
    try:
        assert _probe(server.port, "/readyz")[0] == 200
        streamer.ensure_topics(timeout_s=0.5)  # no broker: an outage begins
        status, reason = _probe(server.port, "/readyz")
        assert status == 503 and "has not answered for" in reason, reason
        assert _probe(server.port, "/healthz")[0] == 200
        streamer.heartbeat.at -= 31  # the loop stopped going round 31 s ago
        status, reason = _probe(server.port, "/healthz")
        assert status == 503 and "has not gone round for 3" in reason, reason
        samples = scrape(server.port)
        (build,) = [labels for name, labels in samples if name == "lagscope_build_info"]
        assert dict(build)["component"] == "streamer"
        assert ("process_start_time_seconds", frozenset()) in samples
    finally:
        streamer.close_metrics()
        streamer.close(timeout_s=0)


def test_streamer_without_a_port_serves_nothing_and_never_imports_prometheus(
    tmp_path: Path,
) -> None:
    """The training node's case: the streamer module and a streamer with no metrics port
    leave prometheus_client unimported."""
    script = (
        "import sys\n"
        "from lagscope.producers.config import LagscopeConfig, StreamerSettings\n"
        "from lagscope.producers.streamer import Streamer\n"
        "class P:\n"
        "    def poll(self, t): return 0\n"
        f"s = Streamer(LagscopeConfig(streamer=StreamerSettings(log_dir={str(tmp_path)!r},"
        " idle_exit_s=0.1)), producer=P())\n"
        "s.run()\n"
        "assert s.metrics is None\n"
        "print('prometheus_client' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_worker_endpoint_after_draining_a_trace(
    kafka_bootstrap: str, kafka_topics: dict[str, str], tmp_path: Path
) -> None:
    create_topics(kafka_bootstrap, kafka_topics)
    trace, meta = load_reference("AR")
    shipped = replay(trace, meta, kafka=kafka_config(kafka_bootstrap, kafka_topics),
                     job_id="AR", progress=None)  # fmt: skip
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    producer.produce(kafka_topics["topic_ops"], key=b"AR", value=b"not a batch")
    producer.flush(10)
    n_steps = len(np.unique(trace.step))

    worker = start_worker(
        kafka_bootstrap, kafka_topics, tmp_path / "w", group="metrics", exit_when_idle_s=None,
        env={"LAGSCOPE_WORKER__METRICS_PORT": "0", "LAGSCOPE_WORKER__METRICS_ADDR": "127.0.0.1"},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        port = None
        while port is None:
            found = re.search(r"worker metrics on http://127\.0\.0\.1:(\d+)/metrics", worker.log())
            port = int(found.group(1)) if found else None
            assert worker.process.poll() is None, worker.log()[-4000:]
            assert time.monotonic() < deadline, worker.log()[-4000:]
            time.sleep(0.1)
        partition = {"topic": kafka_topics["topic_ops"], "partition": "0"}
        lag_key = ("lagscope_worker_consumer_lag_records", frozenset(partition.items()))
        while True:
            samples = scrape(port)
            drained = (
                value(samples, "lagscope_worker_steps_total", complete="true") == n_steps
                and samples.get(lag_key) == 0
            )
            if drained:
                break
            assert worker.process.poll() is None, worker.log()[-4000:]
            assert time.monotonic() < deadline, (samples, worker.log()[-4000:])
            time.sleep(0.2)
    finally:
        worker.process.terminate()
        worker.wait(60)

    assert value(samples, "lagscope_worker_records_total") == shipped.batches + 1
    assert value(samples, "lagscope_worker_ops_total") == trace.n_rows
    assert value(samples, "lagscope_worker_steps_total", complete="false") == 0
    assert value(samples, "lagscope_worker_dead_letters_total", reason="undecodable") == 1
    assert value(samples, "lagscope_worker_dead_letters_total", reason="rejected") == 0
    assert value(samples, "lagscope_worker_step_processing_seconds_count") == n_steps
    assert value(samples, "lagscope_worker_step_processing_seconds_bucket", le="+Inf") == n_steps
    assert value(samples, "lagscope_worker_step_processing_seconds_sum") > 0
    assert value(samples, "lagscope_worker_last_step_timestamp_seconds") > 0
    assert value(samples, "lagscope_worker_store_failing") == 0
    stored = query_store(tmp_path / "w", "SELECT count() AS n FROM steps")
    assert stored == [{"n": n_steps}]
