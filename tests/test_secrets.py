"""A password given to any command, in any place a user puts one, never appears in what the
command prints (messages, log lines and errors) nor in a path it creates, and a setting that
cannot work ends in one line, not a traceback (issues 16 and 27, secrets)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SECRET = "s3cr3t-Pa55word"
REFERENCE = Path(__file__).resolve().parent / "data" / "reference-traces"
ST_TRACE, ST_META = REFERENCE / "trace-ST.parquet", REFERENCE / "meta-ST.yaml"
#: A ClickHouse server nobody listens on: every command fails to reach it.
DSN = f"http://lagscope:{SECRET}@127.0.0.1:9/lagscope"


def lagscope(
    *args: str, env: dict[str, str] | None = None, cwd: Path
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lagscope.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        check=False,
    )


def cases(tmp: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    broken_yaml, bad_json, logs = tmp / "broken.yaml", tmp / "bad.json", tmp / "logs"
    stream = ["stream", "--log-dir", str(logs), "--bootstrap-servers", "127.0.0.1:9"]
    replay = ["replay", "--trace", str(ST_TRACE), "--meta", str(ST_META), "--to-kafka",
              "--bootstrap-servers", "127.0.0.1:9"]  # fmt: skip
    push = ["dashboards", "push", "--timeout-s", "2"]
    return {
        "run --dsn": (["run", "--log-dir", str(logs), "--dsn", DSN], {}),
        "run, DSN from the environment": (
            ["run", "--log-dir", str(logs)],
            {"LAGSCOPE_CLICKHOUSE_DSN": DSN},
        ),
        "run, chdb DSN with a login": (
            ["run", "--log-dir", str(logs), "--dsn", f"chdb://lagscope:{SECRET}@/{tmp}/store"],
            {},
        ),
        "run, chdb DSN with a password option": (
            ["run", "--log-dir", str(logs), "--dsn", f"chdb:///{tmp}/store?password={SECRET}"],
            {},
        ),
        "run, server DSN with a password option": (
            ["run", "--log-dir", str(logs), "--dsn", f"http://u@127.0.0.1:9/db?password={SECRET}"],
            {},
        ),
        "run, server DSN whose port is no number": (
            ["run", "--log-dir", str(logs), "--dsn", f"http://u:{SECRET}@127.0.0.1:port/db"],
            {},
        ),
        "run, DSN of an unknown kind": (
            ["run", "--log-dir", str(logs), "--dsn", f"clickhouse://u:{SECRET}@127.0.0.1/db"],
            {},
        ),
        "query --dsn": (["query", "SELECT 1", "--dsn", DSN], {}),
        "query, chdb DSN with a login": (
            ["query", "SELECT 1", "--dsn", f"chdb://u:{SECRET}@/{tmp}/store"],
            {},
        ),
        "worker --dsn": (
            ["worker", "--dsn", DSN, "--bootstrap-servers", "127.0.0.1:9", "--idle-exit-s", "2"],
            {},
        ),
        "worker, store DSN from the environment": (
            ["worker", "--bootstrap-servers", "127.0.0.1:9", "--idle-exit-s", "2"],
            {"LAGSCOPE_STORE__DSN": DSN},
        ),
        "worker, chdb DSN with a login": (
            [
                "worker",
                "--dsn",
                f"chdb://u:{SECRET}@/{tmp}/store",
                "--bootstrap-servers",
                "127.0.0.1:9",
                "--idle-exit-s",
                "2",
            ],
            {},
        ),
        "worker, SASL settings in the config file and no broker": (
            [
                "worker",
                "--dsn",
                "chdb://memory",
                "--config",
                str(tmp / "sasl.yaml"),
                "--idle-exit-s",
                "2",
            ],
            {},
        ),
        "worker, misspelt client option in the config file": (
            ["worker", "--dsn", "chdb://memory", "--config", str(tmp / "options.yaml")],
            {},
        ),
        "stream, misspelt --kafka-option": (
            [*stream, "--kafka-option", f"sasl.password:{SECRET}"],
            {},
        ),
        "stream, --kafka-option librdkafka does not know": (
            [*stream, "--kafka-option", f"sasl.pasword={SECRET}"],
            {},
        ),
        "stream, misspelt client option in the environment": (
            [*stream],
            {"LAGSCOPE_KAFKA__CLIENT_OPTIONS": json.dumps({"sasl.pasword": SECRET})},
        ),
        "stream, a login in the broker address (nothing shipped)": (
            [
                "stream",
                "--log-dir",
                str(logs),
                "--idle-exit-s",
                "1",
                "--bootstrap-servers",
                f"PLAINTEXT://lagscope:{SECRET}@127.0.0.1:9",
            ],
            {},
        ),
        "stream, yaml syntax error": ([*stream, "--config", str(broken_yaml)], {}),
        "stream, json syntax error": ([*stream, "--config", str(bad_json)], {}),
        "worker, yaml syntax error": (
            ["worker", "--dsn", "chdb://memory"],
            {"LAGSCOPE_CONFIG": str(broken_yaml)},
        ),
        "stream, invalid option next to the password in the environment": (
            [*stream],
            {"LAGSCOPE_KAFKA__SASL_PASSWORD": SECRET, "LAGSCOPE_KAFKA__NO_SUCH": "1"},
        ),
        "replay, --kafka-option librdkafka does not know": (
            [*replay, "--kafka-option", f"sasl.pasword={SECRET}"],
            {},
        ),
        "dashboards push, password in the URL": (
            [*push, "--url", f"http://admin:{SECRET}@127.0.0.1:9"],
            {},
        ),
        "dashboards push, password in a URL whose port is no number": (
            [*push, "--url", f"http://admin:{SECRET}@127.0.0.1:port"],
            {},
        ),
        "dashboards push, token and data source password": (
            [
                *push,
                "--url",
                "http://127.0.0.1:9",
                "--token",
                SECRET,
                "--clickhouse-password",
                SECRET,
            ],
            {},
        ),
        "dashboards push, token from the environment": (
            [*push, "--url", "http://127.0.0.1:9"],
            {"GRAFANA_TOKEN": SECRET, "CLICKHOUSE_GRAFANA_PASSWORD": SECRET},
        ),
    }


@pytest.fixture(scope="module")
def rank_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One rank's log, replayed once for every command: `run` gets as far as its store."""
    logs = tmp_path_factory.mktemp("secrets") / "logs"
    replayed = subprocess.run(
        [sys.executable, "-m", "lagscope", "replay", "--trace", str(ST_TRACE), "--meta",
         str(ST_META), "--log-dir", str(logs), "--no-progress"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert replayed.returncode == 0, replayed.stderr
    return logs


@pytest.mark.slow  # every command run against a failing setting (~80 s in all)
@pytest.mark.parametrize("name", list(cases(Path("unused"))))
def test_no_command_shows_a_password(tmp_path: Path, rank_logs: Path, name: str) -> None:
    (tmp_path / "broken.yaml").write_text(
        f"kafka:\n  sasl_password: {SECRET}\n  sasl_username: [unclosed\n"
    )
    (tmp_path / "bad.json").write_text(f'{{"kafka": {{"sasl_password": "{SECRET}",}}}}')
    (tmp_path / "sasl.yaml").write_text(
        "kafka:\n  bootstrap_servers: 127.0.0.1:9\n  security_protocol: SASL_PLAINTEXT\n"
        f"  sasl_mechanism: SCRAM-SHA-512\n  sasl_username: lagscope\n  sasl_password: {SECRET}\n"
    )
    (tmp_path / "options.yaml").write_text(
        f"kafka:\n  client_options:\n    sasl.pasword: {SECRET}\n"
    )
    shutil.copytree(rank_logs, tmp_path / "logs")  # a command may write beside its logs
    args, env = cases(tmp_path)[name]
    done = lagscope(*args, env=env, cwd=tmp_path)
    output = done.stdout + done.stderr
    # 2: settings that cannot work; 1: the logs were not shipped (the count is the error)
    assert done.returncode == (1 if "nothing shipped" in name else 2), output
    assert SECRET not in output, output
    assert "Traceback" not in output, output
    # one error line; a command that does not log says nothing else (a client library's
    # own warning included), the worker and the sidecar may have logged before it
    lines = done.stderr.strip().splitlines()
    assert len([line for line in lines if "error:" in line]) == 1, done.stderr
    if args[0] not in ("worker", "stream"):
        assert len(lines) == 1, done.stderr
    assert output.strip().splitlines()[-1].startswith(f"lagscope {args[0]}"), output
    assert "error:" in output
    # ... nor in a path: no file or directory is named after it
    assert not [p for p in tmp_path.rglob("*") if SECRET in str(p)]


def test_a_working_pipeline_logs_no_password(
    tmp_path: Path, kafka_bootstrap: str, kafka_topics: dict[str, str]
) -> None:
    """The passwords of a pipeline that works (a SASL password the plaintext test broker
    does not ask for, a store DSN's password) stay out of every line of the sidecar and of
    the worker at debug level, from start to end."""
    from tests.worker_util import create_topics, start_store_server, start_worker

    replayed = lagscope(
        "replay", "--trace", str(ST_TRACE), "--meta", str(ST_META), "--log-dir", "logs",
        "--no-progress", cwd=tmp_path,
    )  # fmt: skip
    assert replayed.returncode == 0, replayed.stderr
    create_topics(kafka_bootstrap, kafka_topics)
    topics = [f"--{name.replace('_', '-')}={topic}" for name, topic in kafka_topics.items()]
    shipped = lagscope(
        "stream", "--log-dir", "logs", "--bootstrap-servers", kafka_bootstrap,
        "--idle-exit-s", "1", *topics, cwd=tmp_path,
        env={"LAGSCOPE_KAFKA__SASL_USERNAME": "lagscope", "LAGSCOPE_KAFKA__SASL_PASSWORD": SECRET},
    )  # fmt: skip
    assert shipped.returncode == 0, shipped.stderr
    assert SECRET not in shipped.stdout + shipped.stderr
    store = start_store_server(tmp_path / "store")
    try:
        dsn = store.dsn("lagscope").replace("http://", f"http://lagscope:{SECRET}@")
        worker = start_worker(
            kafka_bootstrap, kafka_topics, tmp_path / "w", group="secrets", dsn=dsn,
            env={"LAGSCOPE_KAFKA__SASL_PASSWORD": SECRET}, extra_args=("--log-level", "debug"),
        )  # fmt: skip
        assert worker.wait(300) == 0, worker.log()[-4000:]
        log = worker.log()
    finally:
        store.stop()
    assert "steps" in log.lower() and SECRET not in log
    assert not [p for p in tmp_path.rglob("*") if SECRET in p.name]
