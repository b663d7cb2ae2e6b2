"""A real torch job followed live through the real broker by `lagscope worker`s started as
an operator starts them: before the job's topics exist, after the job began, joining the
group mid-job, or killed mid-job (`kill -9` of the partition's owner). The workers share
one store (the ClickHouse HTTP interface over chDB, `tests.chdb_http_server`); once they
stored the job's final answer they are stopped, and `lagscope run` reads the same logs
into another database of that store. Their tables are then compared row for row.
Used by tests/test_cluster.py."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lagscope.producers.events import peek_header
from lagscope.producers.log import KIND_BATCH, RankLogReader, Record, list_rank_dirs
from lagscope.store.rows import episode_version
from lagscope.store.sink import ClickHouseSink
from tests.live_run import start_training
from tests.worker_util import (
    WorkerProcess,
    create_topics,
    start_store_server,
    start_streamer,
    start_worker,
)

#: Every table both hosts write for a job, the columns that order its rows, and those that
#: say when a host did something (they differ by design).
TABLES: dict[str, tuple[str, tuple[str, ...]]] = {
    "jobs": ("job_id, attempt", ("started",)),
    "rank_identity": ("job_id, attempt, rank", ()),
    "steps": ("job_id, attempt, step", ("processed_at", "received_at")),
    "attribution": ("job_id, attempt, kind, name, step", ()),
    "worker_slowdown": ("job_id, attempt, step, pp_rank, dp_rank", ()),
    "changepoints": ("job_id, attempt, series, step, kind", ()),
    "episodes": ("job_id, attempt, episode_id", ("updated_at",)),
    "diagnoses": ("job_id, attempt, step, cause, version", ()),
}
#: The workers' settings: a killed worker's partition moves on after 6 s (the broker's
#: least session), and a job is concluded idle only after the default 10 s, not the 1 s
#: of the other worker tests: a conclusion mid-job (a hand-over's pause) would be one
#: diagnosis more than `lagscope run` makes.
WORKER_ENV = {"LAGSCOPE_WORKER__ROLLUP_IDLE_S": "10"}


@dataclass(frozen=True)
class Plan:
    """How the operator starts the cluster around the job."""

    #: Make the topics first (False: the workers find them missing).
    topics_first: bool = True
    #: Workers started, and assigned, before the job.
    workers_before: int = 2
    #: A worker more is started when the job's logs reach each of these steps.
    start_at_steps: tuple[int, ...] = ()
    #: The partition's owner is killed (-9) when the logs reach this step.
    kill_owner_at_step: int | None = None


@dataclass
class Cluster:
    """What a run left to check: each worker's log, and the two databases' rows."""

    workers: list[WorkerProcess] = field(default_factory=list)
    killed: WorkerProcess | None = None
    #: table -> its rows, per database ("kafka": the workers', "embedded": lagscope run's).
    rows: dict[str, dict[str, list[dict[str, Any]]]] = field(default_factory=dict)

    def differences(self) -> dict[str, list[Any]]:
        """Per table, its first differences (a row count or a row's differing columns)."""
        found = {}
        for table in TABLES:
            mine, theirs = self.rows["embedded"][table], self.rows["kafka"][table]
            diffs: list[Any] = []
            if len(mine) != len(theirs):
                diffs.append(f"lagscope run {len(mine)} rows, the workers {len(theirs)}")
            for a, b in zip(mine, theirs, strict=False):
                differing = {k: (a[k], b.get(k)) for k in a if not _same(a[k], b.get(k))}
                if differing:
                    diffs.append(differing)
            if diffs:
                found[table] = diffs[:3]
        return found


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return a == b


def _rows(sink: ClickHouseSink, table: str) -> list[dict[str, Any]]:
    order, skip = TABLES[table]
    names, rows = sink.query(f"SELECT * FROM {table} FINAL ORDER BY {order}")
    return [{k: v for k, v in zip(names, row, strict=True) if k not in skip} for row in rows]


def latest_logged_step(logs: Path, readers: dict[Path, RankLogReader], seen: dict) -> int:
    """The lowest step every rank's log holds so far (-1 before each holds one)."""
    for directory in list_rank_dirs(logs):
        reader = readers.setdefault(directory, RankLogReader(directory, torn_grace_s=60.0))
        for item in reader.read(1 << 30):
            if isinstance(item, Record) and item.kind == KIND_BATCH:
                seen[directory] = max(seen.get(directory, -1), peek_header(item.payload)["step"])
    return min(seen.values()) if seen else -1


def _owner(workers: list[WorkerProcess], topic: str) -> WorkerProcess:
    """The worker that took the partition last (a restore or a fresh start says so)."""
    mark = f"partition {topic}[0]:"
    return max(workers, key=lambda worker: worker.log().rfind(mark))


def _concluded(sink: ClickHouseSink, job: str, steps: int) -> bool:
    try:
        _, rows = sink.query(
            "SELECT max(version) FROM diagnoses WHERE job_id = {job:String}", {"job": job}
        )
    except Exception:  # the tables appear when a worker first writes
        return False
    final = episode_version(steps - 1, final=True)
    return bool(rows) and rows[0][0] is not None and int(rows[0][0]) == final


def run_cluster(tmp_path: Path, bootstrap: str, topics: dict[str, str], job: str,
                knobs: list[str], plan: Plan, *, module: str = "tests.torch_jobs.pipeline_1f1b",
                steps: int = 80) -> Cluster:  # fmt: skip
    """Run the job with the cluster started as `plan` says; returns what each database
    holds of it, and the workers."""
    server = start_store_server(tmp_path / "store")
    cluster = Cluster()
    others: list[WorkerProcess] = []
    sinks: dict[str, ClickHouseSink] = {}
    try:
        sinks = {name: ClickHouseSink(server.dsn(name)) for name in ("kafka", "embedded")}
        for sink in sinks.values():
            sink.ensure_schema()
        logs = tmp_path / "logs"
        logs.mkdir()

        def worker() -> WorkerProcess:
            started = start_worker(
                bootstrap, topics, tmp_path / f"worker-{len(cluster.workers)}", group=job,
                exit_when_idle_s=None, dsn=server.dsn("kafka"), env=WORKER_ENV,
            )  # fmt: skip
            cluster.workers.append(started)
            return started

        if plan.topics_first:
            create_topics(bootstrap, topics)
        for _ in range(plan.workers_before):
            worker()
        deadline = time.monotonic() + 180
        while not all("newly assigned partitions" in w.log() for w in cluster.workers):
            for started in cluster.workers:
                assert started.process.poll() is None, started.log()[-3000:]
            assert time.monotonic() < deadline, "the workers joined no group in 180 s"
            time.sleep(0.2)
        others.append(start_streamer(bootstrap, topics, logs, tmp_path / "stream",
                                     idle_exit_s=None))  # fmt: skip
        training = start_training(module, logs, job, steps, knobs, tmp_path / "job.log")
        starts = sorted(plan.start_at_steps)
        kill_at = plan.kill_owner_at_step
        readers: dict[Path, RankLogReader] = {}
        seen: dict[Path, int] = {}
        while starts or kill_at is not None:
            logged = latest_logged_step(logs, readers, seen)
            while starts and logged >= starts[0]:
                starts.pop(0)
                worker()
            if kill_at is not None and logged >= kill_at:
                cluster.killed = _owner(cluster.workers, topics["topic_ops"])
                cluster.killed.kill9()
                kill_at = None
            if training.poll() is not None:
                break
            time.sleep(0.1)
        assert training.wait(300) == 0, (tmp_path / "job.log").read_text()[-3000:]
        while not _concluded(sinks["kafka"], job, steps):
            for started in cluster.workers:
                if started is not cluster.killed:
                    assert started.process.poll() is None, started.log()[-3000:]
            assert time.monotonic() < deadline + 300, "the workers stored no final answer"
            time.sleep(0.25)
        for process in [*cluster.workers, *others]:
            if process is not cluster.killed:
                process.process.terminate()
        for process in [*cluster.workers, *others]:
            if process is not cluster.killed:
                assert process.wait(60) == 0, process.log()[-3000:]
        ran = subprocess.run(
            [sys.executable, "-m", "lagscope.cli", "run", "--log-dir", str(logs), "--dsn",
             server.dsn("embedded")],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert ran.returncode == 0, ran.stderr[-3000:]
        cluster.rows = {
            name: {table: _rows(sink, table) for table in TABLES} for name, sink in sinks.items()
        }
        return cluster
    finally:
        for process in [*cluster.workers, *others]:
            if process.process.poll() is None:
                process.process.kill()
        for sink in sinks.values():
            sink.close()
        server.stop()
