"""A password given to any command, in any place a user puts one, never appears in what the
command prints: messages, log lines and errors (issue 16, secrets)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SECRET = "s3cr3t-Pa55word"
#: A ClickHouse server nobody listens on: every command fails to reach it.
DSN = f"http://lagscope:{SECRET}@127.0.0.1:9/lagscope"


def lagscope(
    *args: str, env: dict[str, str] | None = None, cwd: Path
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lagscope.stream_app.cli", *args],
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
    return {
        "run --dsn": (["run", "--logs", str(logs), "--dsn", DSN], {}),
        "run, DSN from the environment": (
            ["run", "--logs", str(logs)],
            {"LAGSCOPE_CLICKHOUSE_DSN": DSN},
        ),
        "query --dsn": (["query", "SELECT 1", "--dsn", DSN], {}),
        "worker --dsn": (["worker", "--dsn", DSN, "--bootstrap", "127.0.0.1:9"], {}),
        "worker, store DSN from the environment": (
            ["worker", "--bootstrap", "127.0.0.1:9"],
            {"LAGSCOPE_STORE__DSN": DSN},
        ),
        "stream, misspelt --kafka-option": (
            [*stream, "--kafka-option", f"sasl.password:{SECRET}"],
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
    }


@pytest.mark.parametrize("name", list(cases(Path("unused"))))
def test_no_command_shows_a_password(tmp_path: Path, name: str) -> None:
    (tmp_path / "broken.yaml").write_text(
        f"kafka:\n  sasl_password: {SECRET}\n  sasl_username: [unclosed\n"
    )
    (tmp_path / "bad.json").write_text(f'{{"kafka": {{"sasl_password": "{SECRET}",}}}}')
    (tmp_path / "logs").mkdir()
    args, env = cases(tmp_path)[name]
    done = lagscope(*args, env=env, cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert SECRET not in output, output
    assert "Traceback" not in output, output
    assert "error:" in output
