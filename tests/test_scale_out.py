"""Scale-out faults: three `lagscope worker` processes of one consumer group on a topic of
six partitions, sharing one store (a ClickHouse HTTP server over one chDB directory:
tests.chdb_http_server). One worker is killed with -9 mid-stream, another is added: every
step is analysed exactly once, with the numbers of an uninterrupted run, nothing lost.

Everything is real: the broker, the worker processes, the ClickHouse engine behind
ClickHouse's HTTP interface and the client the sink uses; the snapshot hand-over from
the killed worker to its successors goes through the shared store. The rebalance time
(kill -> the killed worker's partitions restored elsewhere -> their first step stored
again) is measured and printed.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import re
import time
import uuid
import zlib
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from lagscope.producers.replay import replay
from lagscope.store.errors import StoreError
from lagscope.store.sink import ClickHouseSink
from tests.conftest import load_reference
from tests.worker_util import (
    StoreServer,
    WorkerProcess,
    create_topics,
    kafka_config,
    start_store_server,
    start_worker,
)

pytestmark = pytest.mark.slow

PARTITIONS = 6
JOBS_PER_PARTITION = 2
#: Each job is the reference trace AR replayed this often (44 steps, 117k ops a time).
REPEAT = 4
GROUP = "scale"

#: Small passes and frequent snapshots, so the kill lands mid-window and a snapshot of
#: the killed worker's partitions is in the store to hand over.
WORKER_ENV = {
    "LAGSCOPE_WORKER__CHECKPOINT_INTERVAL_S": "1.0",
    "LAGSCOPE_WORKER__FETCH_MAX_BYTES": "131072",
    "LAGSCOPE_WORKER__TAKE_MAX_RUNS": "1",
}
#: Longer than the session timeout (6 s, tests.worker_util) and a rebalance: a survivor
#: whose own partitions are done does not leave before the killed one's move to it.
IDLE_EXIT_S = 12.0

_STEP_COLUMNS = (
    "step, complete, actual_s, simulated_s, ideal_s, slowdown, waste, gpu_seconds_wasted"
)
_ASSIGNED = re.compile(
    r"^\[([\d\- :,]+)\] \[\d+\] \[INFO\] Setting newly assigned partitions\s*\n(.*?) for group",
    re.M | re.S,
)
_LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"


@pytest.fixture
def store_server(tmp_path: Path):
    server = start_store_server(tmp_path / "store")
    try:
        yield server
    finally:
        server.stop()


def _topics(prefix: str) -> dict[str, str]:
    return {
        "topic_ops": f"{prefix}.ops",
        "topic_deadletter": f"{prefix}.deadletter",
        "topic_jobs": f"{prefix}.jobs",
    }


def _job_ids() -> list[str]:
    """Job ids that the producer's default partitioner (librdkafka's consistent_random:
    CRC-32 of the key) spreads evenly, JOBS_PER_PARTITION on each partition."""
    jobs: list[str] = []
    per_partition: dict[int, int] = defaultdict(int)
    for index in range(1000):
        job = f"job-{index:03d}"
        partition = zlib.crc32(job.encode()) % PARTITIONS
        if per_partition[partition] < JOBS_PER_PARTITION:
            per_partition[partition] += 1
            jobs.append(job)
        if len(jobs) == PARTITIONS * JOBS_PER_PARTITION:
            return jobs
    raise AssertionError("no even spread of job ids")


def _assignments(worker: WorkerProcess, topic: str) -> list[tuple[float, set[int]]]:
    """(wall time, partitions of `topic`) of every assignment the worker's log shows."""
    out = []
    for stamp, table in _ASSIGNED.findall(worker.log()):
        when = dt.datetime.strptime(stamp.strip(), _LOG_TIME).timestamp()
        found = re.search(rf"\|\s*{re.escape(topic)}\s*\|\s*\{{([\d, -]*)\}}", table)
        partitions: set[int] = set()
        for part in found.group(1).split(",") if found else []:
            first, _, last = part.strip().partition("-")  # faust writes {0-5} for 0..5
            partitions.update(range(int(first), int(last or first) + 1))
        out.append((when, partitions))
    return out


def _current(worker: WorkerProcess, topic: str) -> set[int]:
    assignments = _assignments(worker, topic)
    return assignments[-1][1] if assignments else set()


def _log_times(worker: WorkerProcess, pattern: str) -> list[tuple[float, re.Match]]:
    """(wall time, match) of the log lines matching `pattern`."""
    out = []
    for line in worker.log().splitlines():
        found = re.search(pattern, line)
        if found and line.startswith("["):
            stamp = line[1 : line.index("]")]
            out.append((dt.datetime.strptime(stamp, _LOG_TIME).timestamp(), found))
    return out


def _wait(condition, timeout_s: float, what: str, workers: list[WorkerProcess]) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {w.log_path}:\n{w.log()[-2500:]}" for w in workers)
            raise AssertionError(f"{what}: not within {timeout_s} s\n{tails}")
        time.sleep(0.1)


class _Store:
    """Queries of the test process against the shared store, one client per database
    (opened once the database exists: a client opened before would stay on `default`)."""

    def __init__(self, server: StoreServer):
        self.server = server
        self.sinks: dict[str, ClickHouseSink] = {}

    def __call__(self, database: str, sql: str) -> list[tuple]:
        if database not in self.sinks:
            sink = ClickHouseSink(self.server.dsn(database), create=False)
            if sink.client.database != database:  # not created yet: nothing stored
                sink.close()
                return []
            self.sinks[database] = sink
        return self.sinks[database].query(sql)[1]

    def close(self) -> None:
        for sink in self.sinks.values():
            sink.close()


@pytest.fixture
def query(store_server: StoreServer):
    store = _Store(store_server)
    try:
        yield store
    finally:
        store.close()


def test_the_store_server_answers_the_client_as_a_clickhouse_server(store_server):
    """What the workers rely on, through clickhouse-connect: compressed multi-block
    inserts arrive whole, dedup tokens deduplicate, a request's settings stay its own,
    errors are ClickHouse's."""
    with ClickHouseSink(store_server.dsn("basics")) as sink:
        sink.ensure_schema()
        payloads = [random.Random(i).randbytes(64 * 1024) for i in range(300)]
        rows = [
            [dt.datetime(2026, 1, 1) + dt.timedelta(seconds=i), "job", "src", "why", payload]
            for i, payload in enumerate(payloads)
        ]
        for _ in range(2):  # the same token twice: the second insert is dropped
            sink.client.insert(
                "dead_letters",
                rows,
                column_names=["ts", "job_id", "source", "reason", "payload"],
                settings={"insert_deduplicate": 1, "insert_deduplication_token": "once"},
            )
        assert sink.query("SELECT count(), sum(length(payload)) FROM dead_letters")[1] == [
            (300, 300 * 64 * 1024)
        ]
        last = sink.client.query(
            "SELECT payload FROM dead_letters ORDER BY ts DESC LIMIT 1",
            column_formats={"payload": "bytes"},
        )
        assert last.result_rows == [(payloads[-1],)]
        setting = "SELECT getSetting('max_threads')"
        assert sink.query(setting, settings={"max_threads": 3})[1] == [(3,)]
        assert sink.query(setting)[1] != [(3,)]
        with pytest.raises(StoreError, match=r"Code: 60\. DB::Exception: .*UNKNOWN_TABLE"):
            sink.query("SELECT 1 FROM no_such_table")
        with pytest.raises(StoreError, match="Unknown setting"):
            sink.query("SELECT 1", settings={"no_such_setting": 1})
        assert sink.query("SELECT 1")[1] == [(1,)]


def test_three_workers_one_killed_one_added_analyse_every_step_once(
    kafka_bootstrap, store_server, query, tmp_path
):
    trace, meta = load_reference("AR")
    n_steps = REPEAT * len(np.unique(trace.step))
    prefix = f"test-{uuid.uuid4().hex[:10]}"

    # The uninterrupted run: one worker, one job of the same input, its own database.
    ref_topics = _topics(f"{prefix}-ref")
    create_topics(kafka_bootstrap, ref_topics)
    replay(trace, meta, kafka=kafka_config(kafka_bootstrap, ref_topics), job_id="ref",
           repeat=REPEAT, progress=None)  # fmt: skip
    reference = start_worker(kafka_bootstrap, ref_topics, tmp_path / "ref", group="ref",
                             env=WORKER_ENV, dsn=store_server.dsn("ref"))  # fmt: skip
    assert reference.wait(180) == 0, reference.log()[-4000:]

    topics = _topics(prefix)
    ops = topics["topic_ops"]
    create_topics(kafka_bootstrap, topics, ops_partitions=PARTITIONS)
    config = kafka_config(kafka_bootstrap, topics)
    jobs = _job_ids()
    for job in jobs:
        replay(trace, meta, kafka=config, job_id=job, repeat=REPEAT, progress=None)
    partition_of = {job: zlib.crc32(job.encode()) % PARTITIONS for job in jobs}

    dsn = store_server.dsn(GROUP)

    def worker(name: str) -> WorkerProcess:
        return start_worker(kafka_bootstrap, topics, tmp_path / name, group=GROUP,
                            env=WORKER_ENV, dsn=dsn, exit_when_idle_s=IDLE_EXIT_S)  # fmt: skip

    workers = [worker(f"w{index}") for index in range(3)]

    def settled() -> bool:
        owned = [_current(w, ops) for w in workers]
        return all(owned) and sorted(p for o in owned for p in o) == list(range(PARTITIONS))

    _wait(settled, 120, "three workers sharing the six partitions", workers)
    victim = next(w for w in workers if _current(w, ops))
    moved = _current(victim, ops)
    moved_jobs = [job for job in jobs if partition_of[job] in moved]
    # Past a durable snapshot of each of its partitions, then at a random moment:
    # mid-window, mid-write or mid-snapshot.
    snapshots = (
        "SELECT DISTINCT partition FROM worker_state "
        f"WHERE group_id = '{GROUP}' AND topic = '{ops}'"
    )
    _wait(lambda: moved <= {p for (p,) in query(GROUP, snapshots)}, 120,
          "a snapshot of each partition of the worker to kill", workers)  # fmt: skip
    time.sleep(random.Random(7).uniform(0.0, 0.5))
    assert victim.process.poll() is None, victim.log()[-4000:]
    victim.kill9()
    killed_at = time.time()
    survivors = [w for w in workers if w is not victim]

    # What the killed worker left: its jobs were not finished (work remained to hand over).
    stored = dict(query(GROUP, "SELECT job_id, count() FROM steps GROUP BY job_id"))
    left = {job: n_steps - stored.get(job, 0) for job in moved_jobs}
    assert sum(left.values()) > 0, f"the killed worker had finished its jobs: {stored}"
    assert any(stored.get(job, 0) for job in moved_jobs), f"killed before any step: {stored}"

    # The rebalance: the killed worker's partitions restored from its snapshots by the others.
    restored_pattern = rf"partition {re.escape(ops)}\[(\d+)\]: restored snapshot at offset"

    def restored_times() -> dict[int, float]:
        times: dict[int, float] = {}
        for w in survivors:
            for when, found in _log_times(w, restored_pattern):
                number = int(found.group(1))
                if when >= killed_at - 0.001 and number in moved:
                    times.setdefault(number, when)
        return times

    _wait(lambda: set(restored_times()) == moved, 60, "the killed worker's partitions moved",
          workers)  # fmt: skip
    restored_at = max(restored_times().values())
    rebalance_s = restored_at - killed_at

    # One worker added back: it joins, the group rebalances once more.
    joined = worker("w3")
    started_at = time.time()
    workers.append(joined)
    _wait(lambda: bool(_assignments(joined, ops)), 60, "the added worker's assignment", workers)
    join_s = _assignments(joined, ops)[0][0] - started_at

    for w in [*survivors, joined]:
        assert w.wait(180) == 0, w.log()[-4000:]
        # No partition ever jumped past records it had not read (a stale fetch taken
        # after its partition came back to this worker: the steps in between were lost).
        counters = json.loads(re.findall(r'\{"worker_counters": .*\}', w.log())[-1])
        assert counters["worker_counters"]["records_never_read"] == 0, w.log_path

    # The first step of a moved job stored after the kill (write time in the store).
    first_after = query(
        GROUP,
        "SELECT toUnixTimestamp64Milli(min(processed_at)) FROM steps "
        f"WHERE job_id IN ({', '.join(repr(j) for j in moved_jobs)}) "
        f"AND processed_at > fromUnixTimestamp64Milli(toInt64({int(killed_at * 1000)}))",
    )[0][0]
    processed_again_s = first_after / 1000 - killed_at if first_after else float("nan")
    print(
        f"\nscale-out: killed a worker owning partitions {sorted(moved)} "
        f"({sum(left.values())} steps of {len(moved_jobs)} jobs left); "
        f"rebalance (kill -> partitions restored elsewhere) {rebalance_s:.1f} s; "
        f"first step of a moved job stored {processed_again_s:.1f} s after the kill; "
        f"an added worker got partitions {join_s:.1f} s after its start"
    )
    assert rebalance_s < 30, rebalance_s

    # Every step exactly once (counted without FINAL), none lost.
    rows, unique = query(GROUP, "SELECT count(), uniqExact(job_id, attempt, step) FROM steps")[0]
    stored_steps = defaultdict(set)
    for job, step in query(GROUP, "SELECT job_id, step FROM steps"):
        stored_steps[job].add(step)
    ref_steps = {step for (step,) in query("ref", "SELECT step FROM steps")}
    missing = {job: sorted(ref_steps - stored_steps[job]) for job in jobs}
    assert (rows, unique) == (len(jobs) * n_steps, len(jobs) * n_steps), (
        {job: (partition_of[job], steps) for job, steps in missing.items() if steps},
        sorted(moved),
    )
    per_job = {
        job: (n, complete)
        for job, n, complete in query(
            GROUP,
            "SELECT job_id, count(), countIf(complete) FROM steps GROUP BY job_id",
        )
    }
    assert per_job == {job: (n_steps, n_steps) for job in jobs}

    # The numbers of the uninterrupted run, step by step, for every job.
    want = query("ref", f"SELECT {_STEP_COLUMNS} FROM steps ORDER BY step")
    got = defaultdict(list)
    for job, *row in query(
        GROUP, f"SELECT job_id, {_STEP_COLUMNS} FROM steps ORDER BY job_id, step"
    ):
        got[job].append(tuple(row))
    for job in jobs:
        assert got[job] == want, job
    # The derived tables hold no duplicate either.
    for table in ("attribution", "worker_slowdown"):
        ref_n = query("ref", f"SELECT count() FROM {table}")[0][0]
        counts = dict(query(GROUP, f"SELECT job_id, count() FROM {table} GROUP BY job_id"))
        assert counts == {job: ref_n for job in jobs}, table
    # Each job rolled up to the uninterrupted run's verdict.
    rollup = (
        "SELECT job_id, argMax(step, step), "
        "argMax(JSONExtractFloat(evidence, 'slowdown'), step) FROM diagnoses FINAL GROUP BY job_id"
    )
    (_, ref_step, ref_slowdown), = query("ref", rollup)  # fmt: skip
    assert {job: (s, x) for job, s, x in query(GROUP, rollup)} == {
        job: (ref_step, ref_slowdown) for job in jobs
    }
    assert query(GROUP, "SELECT count() FROM dead_letters")[0][0] == 0
    # The hand-overs found every retained step their snapshots name.
    for w in workers:
        assert "missing from the checkpoint store" not in w.log(), w.log_path


def test_a_pass_waiting_through_a_rebalance_leaves_the_revoked_partition_to_its_owner(
    kafka_bootstrap, store_server, query, tmp_path
):
    """A worker's pass that waits (here for its jobs' records) while a rebalance takes one
    of its partitions away must not process that partition's records when the wait ends:
    done, the partition came back to life beside its new owner (restored, snapshotted,
    its offsets committed by a worker that no longer owns it: a later hand-over then
    skipped records no snapshot held, the steps lost once in a scale-out run). Only
    owners restore a partition, and every step is stored once, complete."""
    from lagscope.simulator.generate import JobSpec, generate_job

    prefix = f"test-{uuid.uuid4().hex[:10]}"
    topics = _topics(prefix)
    ops = topics["topic_ops"]
    create_topics(kafka_bootstrap, topics, ops_partitions=2)
    jobs = {zlib.crc32(f"job-{i}".encode()) % 2: f"job-{i}" for i in range(20)}
    assert sorted(jobs) == [0, 1]
    job = generate_job(JobSpec(dp=2, pp=2, microbatches=2, steps=12, name="mid-pass", seed=5))
    # The ops first, their job records held back (sent to a topic no worker reads).
    elsewhere = {**topics, "topic_jobs": f"{prefix}.jobs-later"}
    for job_id in jobs.values():
        replay(job.trace, job.meta, kafka=kafka_config(kafka_bootstrap, elsewhere),
               job_id=job_id, progress=None)  # fmt: skip
    env = {"LAGSCOPE_WORKER__JOB_WAIT_S": "120"}
    dsn = store_server.dsn("midpass")

    def worker(name: str) -> WorkerProcess:
        return start_worker(kafka_bootstrap, topics, tmp_path / name, group="midpass",
                            env=env, dsn=dsn, exit_when_idle_s=4.0)  # fmt: skip

    first = worker("first")
    workers = [first]
    _wait(lambda: _current(first, ops) == {0, 1}, 60, "the first worker owning both", workers)
    time.sleep(2.0)  # its first pass has both partitions' records and waits for the jobs
    second = worker("second")
    workers.append(second)
    _wait(lambda: len(_current(second, ops)) == 1 and len(_current(first, ops)) == 1, 60,
          "the two workers sharing the partitions", workers)  # fmt: skip
    # The job records arrive: the waiting passes of both workers go on.
    held = {**topics, "topic_ops": f"{prefix}.ops-elsewhere"}
    for job_id in jobs.values():
        replay(job.trace, job.meta, kafka=kafka_config(kafka_bootstrap, held), job_id=job_id,
               progress=None)  # fmt: skip
    for w in workers:
        assert w.wait(120) == 0, w.log()[-4000:]
        assert "Traceback" not in w.log(), w.log_path

    taken = rf"partition {re.escape(ops)}\[(\d+)\]: (?:restored snapshot|no snapshot)"
    for w in workers:
        assignments = _assignments(w, ops)
        for when, found in _log_times(w, taken):
            owned = [parts for at, parts in assignments if at <= when][-1]
            assert int(found.group(1)) in owned, (w.log_path, found.group(0), assignments)
    n_steps = len(np.unique(job.trace.step))
    per_job = query("midpass", "SELECT job_id, count(), countIf(complete), "
                    "uniqExact(step) FROM steps GROUP BY job_id ORDER BY job_id")  # fmt: skip
    assert per_job == [(j, n_steps, n_steps, n_steps) for j in sorted(jobs.values())]
