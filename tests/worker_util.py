"""Running `lagscope worker` as a subprocess against the real broker, reading its store.

A worker subprocess keeps its own chDB directory (chDB opens one directory per process,
and the test process already holds the session's), so its store is read back through
`lagscope query` in another subprocess once the worker is gone. Workers that share one store
(scale-out) use a `StoreServer` instead: tests.chdb_http_server, ClickHouse's HTTP interface
over one chDB directory in a process of its own (`start_worker(..., dsn=server.dsn(db))`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

from lagscope.producers.config import KafkaSettings, LagscopeConfig
from lagscope.producers.events import JobInfo
from tests.conftest import load_reference


def create_topics(bootstrap: str, topics: dict[str, str], *, ops_partitions: int = 1) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    wanted = [
        NewTopic(topics["topic_ops"], num_partitions=ops_partitions, replication_factor=1),
        NewTopic(
            topics["topic_jobs"],
            num_partitions=1,
            replication_factor=1,
            config={"cleanup.policy": "compact"},
        ),
    ]
    for future in admin.create_topics(wanted, request_timeout=15).values():
        future.result(timeout=15)


def st_job_announced(bootstrap: str, topics: dict[str, str]) -> tuple[object, object, Producer]:
    """The topics made and the ST job's record on `lagscope.jobs`: its trace, meta, and the
    producer for its batches."""
    create_topics(bootstrap, topics)
    trace, meta = load_reference("ST")
    info = JobInfo.from_meta(meta, job_id="ST")
    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(topics["topic_jobs"], key=info.key.encode(),
                     value=info.model_dump_json().encode())  # fmt: skip
    return trace, meta, producer


def kafka_config(bootstrap: str, topics: dict[str, str]) -> LagscopeConfig:
    return LagscopeConfig(kafka=KafkaSettings(bootstrap_servers=bootstrap, **topics))


def results_topic(topics: dict[str, str]) -> str:
    return topics["topic_ops"].removesuffix(".ops") + ".results"


@dataclass
class WorkerProcess:
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout_s: float) -> int:
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(
                f"worker did not finish in {timeout_s}s; log tail:\n{self.log()[-4000:]}"
            ) from None

    def kill9(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()


def start_worker(
    bootstrap: str,
    topics: dict[str, str],
    work_dir: Path,
    *,
    group: str,
    exit_when_idle_s: float | None = 3.0,
    env: dict[str, str] | None = None,
    log_name: str = "worker.log",
    module: str = "lagscope.cli",
    dsn: str | None = None,
    extra_args: tuple[str, ...] = (),
) -> WorkerProcess:
    """`lagscope worker` with its own chDB directory and faust data dir under `work_dir`
    (`module`: another entry point taking the same arguments, e.g. tests.faulty_store;
    `dsn`: a store of its own choosing instead, e.g. a shared `StoreServer`'s; `extra_args`:
    more options, e.g. `--log-level debug`)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    full_env = {
        **os.environ,
        "LAGSCOPE_KAFKA__TOPIC_OPS": topics["topic_ops"],
        "LAGSCOPE_KAFKA__TOPIC_JOBS": topics["topic_jobs"],
        "LAGSCOPE_KAFKA__TOPIC_DEADLETTER": topics["topic_deadletter"],
        "LAGSCOPE_KAFKA__TOPIC_RESULTS": results_topic(topics),
        # the broker's minimum: a killed worker's partitions move on quickly
        "LAGSCOPE_WORKER__SESSION_TIMEOUT_S": "6",
        "LAGSCOPE_WORKER__ROLLUP_IDLE_S": "1",
        **(env or {}),
    }
    command = [
        sys.executable,
        "-m",
        module,
        "worker",
        "--bootstrap",
        bootstrap,
        "--dsn",
        dsn or f"chdb://{work_dir / 'chdb'}",
        "--group",
        group,
        "--data-dir",
        str(work_dir / "faust"),
    ]
    if exit_when_idle_s is not None:
        command += ["--idle-exit-s", str(exit_when_idle_s)]
    command += extra_args
    log_path = work_dir / log_name
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    return WorkerProcess(process, log_path)


def wait_for_log(worker: WorkerProcess, text: str, count: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while worker.log().count(text) < count:
        if worker.process.poll() is not None:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"no {count}x {text!r} in {timeout_s}s:\n{worker.log()[-3000:]}")
        time.sleep(0.05)


def query_store(work_dir: Path, sql: str) -> list[dict[str, Any]]:
    """Rows of `sql` against the worker's chDB store (the worker must have exited)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "lagscope.cli",
            "query",
            "--dsn",
            f"chdb://{work_dir / 'chdb'}",
            "--format",
            "json",
            sql,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"query failed: {done.stderr}")
    return json.loads(done.stdout)


@dataclass
class StoreServer:
    """tests.chdb_http_server in a subprocess: one store (a chDB directory) that several
    worker processes share through ClickHouse's HTTP interface."""

    process: subprocess.Popen
    url: str
    log_path: Path

    def dsn(self, database: str) -> str:
        return f"{self.url}/{database}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_store_server(data_dir: Path, *, timeout_s: float = 60.0) -> StoreServer:
    """Start the shared store on 127.0.0.1 and a free port; returns once it answers."""
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir.parent / f"{data_dir.name}-server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.chdb_http_server", "--port", "0",
             "--data-dir", str(data_dir)],
            stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parent.parent,
        )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    prefix = "chdb-http-server listening on "
    while True:
        text = log_path.read_text(errors="replace")
        line = next((x for x in text.splitlines() if x.startswith(prefix)), None)
        if line is not None:
            return StoreServer(process, line.removeprefix(prefix).strip(), log_path)
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise AssertionError(f"the store server did not start:\n{text[-3000:]}")
        time.sleep(0.05)


def topic_env(topics: dict[str, str]) -> dict[str, str]:
    """The environment that points a lagscope command at one test's topics."""
    return {
        "LAGSCOPE_KAFKA__TOPIC_OPS": topics["topic_ops"],
        "LAGSCOPE_KAFKA__TOPIC_JOBS": topics["topic_jobs"],
        "LAGSCOPE_KAFKA__TOPIC_DEADLETTER": topics["topic_deadletter"],
        "LAGSCOPE_KAFKA__TOPIC_RESULTS": results_topic(topics),
    }


def start_streamer(
    bootstrap: str,
    topics: dict[str, str],
    log_dir: Path,
    work_dir: Path,
    *,
    idle_exit_s: float | None = 3.0,
    log_name: str = "stream.log",
) -> WorkerProcess:
    """`lagscope stream` (the sidecar) over `log_dir`, its checkpoint under `work_dir`."""
    work_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "lagscope.cli", "stream", "--log-dir", str(log_dir),
        "--bootstrap-servers", bootstrap, "--checkpoint", str(work_dir / "stream-checkpoint.json"),
    ]  # fmt: skip
    if idle_exit_s is not None:
        command += ["--idle-exit-s", str(idle_exit_s)]
    log_path = work_dir / log_name
    with open(log_path, "wb") as log:
        # The sidecar has no results topic: a setting it does not know is an error.
        env = {k: v for k, v in topic_env(topics).items() if not k.endswith("TOPIC_RESULTS")}
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}
        )
    return WorkerProcess(process, log_path)


def query_dsn(dsn: str, sql: str) -> list[dict[str, Any]]:
    """Rows of `sql` against any store, through `lagscope query` in a process of its own
    (a chDB directory opens in one process at a time)."""
    done = subprocess.run(
        [sys.executable, "-m", "lagscope.cli", "query", "--dsn", dsn,
         "--format", "json", sql],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise AssertionError(f"query failed: {done.stderr}")
    return json.loads(done.stdout)
