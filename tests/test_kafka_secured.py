"""Kafka that requires a login: SASL_SSL with SCRAM-SHA-512 over TLS (issue 16 item 6).

A broker of its own (deploy/kafka_local.py) listens on PLAINTEXT for the test's own
set-up and on SASL_SSL for lagscope, with its user created by Kafka's storage formatter
and its certificate signed by a CA made at start. The streamer and the worker log in and
carry a reference trace end to end; a wrong password stops each with one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from lagscope.deploy.kafka_local import KafkaBroker
from lagscope.producers.config import KafkaSettings, LagscopeConfig, StreamerSettings
from lagscope.producers.reference_format import load_meta, load_trace
from lagscope.producers.replay import replay
from lagscope.producers.streamer import Streamer
from tests.conftest import REFERENCE_TRACES
from tests.kafka_util import consume_all
from tests.worker_util import create_topics, query_store, start_worker

#: A real broker with SASL/TLS, streamer and worker end to end: slow.
pytestmark = pytest.mark.slow

USER = "lagscope-svc"
PASSWORD = "Scram-pw-7f3e9a1c"
WRONG = "Wrong-pw-0b2d4c6e"


@pytest.fixture(scope="module")
def secured_broker(tmp_path_factory):
    broker = KafkaBroker(tmp_path_factory.mktemp("kafka-secured"), scram_users={USER: PASSWORD})
    broker.start()
    yield broker
    broker.stop()


def secured_env(broker: KafkaBroker, password: str) -> dict[str, str]:
    return {
        "LAGSCOPE_KAFKA__BOOTSTRAP_SERVERS": broker.secure_bootstrap,
        "LAGSCOPE_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
        "LAGSCOPE_KAFKA__SASL_MECHANISM": "SCRAM-SHA-512",
        "LAGSCOPE_KAFKA__SASL_USERNAME": USER,
        "LAGSCOPE_KAFKA__SASL_PASSWORD": password,
        "LAGSCOPE_KAFKA__SSL_CA_LOCATION": str(broker.ca_file),
    }


def secured_settings(broker: KafkaBroker, topics: dict[str, str], password: str):
    return KafkaSettings(
        bootstrap_servers=broker.secure_bootstrap,
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username=USER,
        sasl_password=password,
        ssl_ca_location=str(broker.ca_file),
        **topics,
    )


def new_topics() -> dict[str, str]:
    prefix = f"secured-{uuid.uuid4().hex[:8]}"
    return {
        "topic_ops": f"{prefix}.ops",
        "topic_deadletter": f"{prefix}.deadletter",
        "topic_jobs": f"{prefix}.jobs",
    }


def test_streamer_and_worker_log_in_and_carry_a_trace(secured_broker, tmp_path):
    topics = new_topics()
    create_topics(secured_broker.bootstrap, topics)
    trace = load_trace(REFERENCE_TRACES / "trace-AR.parquet")
    meta = load_meta(REFERENCE_TRACES / "meta-AR.yaml")
    replay(trace, meta, log_dir=tmp_path / "logs", job_id="AR", progress=None)
    config = LagscopeConfig(
        kafka=secured_settings(secured_broker, topics, PASSWORD),
        streamer=StreamerSettings(log_dir=tmp_path / "logs", idle_exit_s=0.5),
    )
    stats = Streamer(config).run()
    assert stats.ops == trace.n_rows
    assert len(consume_all(secured_broker.bootstrap, topics["topic_ops"])) == 704

    # The worker's own flag and environment point it at the SASL_SSL listener only.
    worker = start_worker(
        secured_broker.secure_bootstrap,
        topics,
        tmp_path / "w",
        group="secured",
        env=secured_env(secured_broker, PASSWORD),
    )
    assert worker.wait(180) == 0, worker.log()[-4000:]
    counts = query_store(
        tmp_path / "w", "SELECT count() AS n, countIf(complete) AS complete FROM steps"
    )
    assert counts == [{"n": 44, "complete": 44}]


@pytest.mark.parametrize("command", ["stream", "worker"])
def test_a_wrong_password_stops_with_one_line(secured_broker, tmp_path, command):
    topics = new_topics()
    create_topics(secured_broker.bootstrap, topics)
    (tmp_path / "logs").mkdir()
    env = {**os.environ, **secured_env(secured_broker, WRONG)}
    env.update({f"LAGSCOPE_KAFKA__{k.upper()}": v for k, v in topics.items()})
    arguments = {
        "stream": ["--log-dir", str(tmp_path / "logs")],
        "worker": ["--dsn", f"chdb://{tmp_path / 'chdb'}", "--data-dir", str(tmp_path / "f")],
    }[command]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "lagscope.cli", command, *arguments],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1, output
    assert f"rejected the login of user {USER!r}" in lines[0]
    assert "SCRAM-SHA-512" in lines[0] and secured_broker.secure_bootstrap in lines[0]
    assert "Traceback" not in output and WRONG not in output and PASSWORD not in output
    assert time.monotonic() - started < 60
