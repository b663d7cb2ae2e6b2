"""`lagscope worker` starts anywhere: an empty working directory and a store elsewhere, a
broker that does not answer yet, a state directory that cannot be made. Each is one line
(per attempt, for the broker), never a traceback, and nothing is left behind in the
working directory or the temporary one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lagscope.producers.replay import replay
from tests.conftest import load_reference
from tests.worker_util import create_topics, kafka_config, query_store, topic_env


def _worker(args: list[str], cwd: Path, env: dict[str, str] | None = None,
            timeout_s: float = 180) -> subprocess.CompletedProcess:  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "lagscope.cli", "worker", *args],
        cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True,
        timeout=timeout_s, check=False,
    )  # fmt: skip


@pytest.mark.slow  # waits out the broker attempts (~11 s each)
@pytest.mark.parametrize("store", ["default", "existing"])
def test_a_broker_that_does_not_answer_is_waited_for_one_line_per_attempt(
    tmp_path: Path, store: str
):
    """... and the store is left as it was: the default one the worker made in the working
    directory is removed again (nothing was consumed), one it was given is kept."""
    empty = tmp_path / "empty"
    empty.mkdir()
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    existing = tmp_path / "store"
    existing.mkdir()
    (existing / "kept").write_text("the user's")
    args = ["--dsn", f"chdb://{existing}"] if store == "existing" else []
    env = {"LAGSCOPE_WORKER__BROKER_RETRY_S": "1", "TMPDIR": str(scratch)}
    done = _worker(
        [*args, "--bootstrap-servers", "127.0.0.1:1", "--idle-exit-s", "4"],
        empty,
        {**env, "LAGSCOPE_CLICKHOUSE_DSN": ""},
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output, output
    waiting = [line for line in output.splitlines() if "does not answer" in line]
    assert len(waiting) >= 2 and all("attempt" in line for line in waiting), output
    (error,) = [line for line in output.splitlines() if "error:" in line]
    assert error.startswith("lagscope worker: error: no Kafka broker answers at 127.0.0.1:1")
    # Nothing made in the working directory, and its temporary state directory is gone.
    assert list(empty.iterdir()) == []
    assert list(scratch.iterdir()) == []
    assert (existing / "kept").read_text() == "the user's"


def test_a_state_directory_that_cannot_be_made_is_one_line(tmp_path: Path):
    (tmp_path / "taken").write_text("a file, not a directory")
    done = _worker(
        ["--dsn", f"chdb://{tmp_path / 'store'}", "--bootstrap-servers", "127.0.0.1:1",
         "--data-dir", str(tmp_path / "taken" / "worker")],
        tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"lagscope worker: error: worker.data_dir (--data-dir) {tmp_path / 'taken' / 'worker'}: "
        "cannot create it (Not a directory)"
    ]


def test_the_worker_runs_from_an_empty_directory(
    kafka_bootstrap: str, kafka_topics: dict[str, str], tmp_path: Path
) -> None:
    """Started where it can write nothing of its own (an empty directory, the store
    elsewhere, no --data-dir), it analyses a job and exits when idle, leaving the
    directory as it found it."""
    create_topics(kafka_bootstrap, kafka_topics)
    trace, meta = load_reference("ST")
    replay(trace, meta, kafka=kafka_config(kafka_bootstrap, kafka_topics), job_id="ST",
           progress=None)  # fmt: skip
    empty = tmp_path / "empty"
    empty.mkdir()
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = _worker(
        ["--dsn", f"chdb://{tmp_path / 'w' / 'chdb'}", "--bootstrap-servers", kafka_bootstrap,
         "--group", "anywhere", "--idle-exit-s", "4"],
        empty,
        {**topic_env(kafka_topics), "LAGSCOPE_WORKER__ROLLUP_IDLE_S": "1",
         "TMPDIR": str(scratch)},
        timeout_s=300,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "Traceback" not in done.stdout + done.stderr
    assert list(empty.iterdir()) == []
    assert list(scratch.iterdir()) == []
    (row,) = query_store(tmp_path / "w", "SELECT count() AS n FROM steps FINAL")
    assert row["n"] == len(set(trace.step.tolist()))


def test_sigterm_while_waiting_for_the_broker_is_one_line_and_leaves_nothing(tmp_path: Path):
    """An orchestrator stops a worker that is still waiting for Kafka: it says so in one
    line, exits 143, and removes the default store it made in the working directory."""
    import signal
    import time

    empty = tmp_path / "empty"
    empty.mkdir()
    worker = subprocess.Popen(
        [sys.executable, "-m", "lagscope.cli", "worker", "--bootstrap-servers", "127.0.0.1:1"],
        cwd=empty, env={**os.environ, "LAGSCOPE_WORKER__BROKER_RETRY_S": "1",
                        "LAGSCOPE_CLICKHOUSE_DSN": "", "TMPDIR": str(tmp_path)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(4)
    worker.send_signal(signal.SIGTERM)
    out, err = worker.communicate(timeout=30)
    assert worker.returncode == 143, err
    assert "Traceback" not in out + err, err
    assert err.strip().splitlines()[-1] == "lagscope worker: terminated while waiting for Kafka"
    assert list(empty.iterdir()) == []
