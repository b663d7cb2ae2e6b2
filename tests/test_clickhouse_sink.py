"""The ClickHouse sink on the real embedded chDB engine: schema migrations, idempotent
writes (replays, re-processing, a crash mid-write) and the minute rollup."""

from __future__ import annotations

import time

import numpy as np
import pytest

from lagscope.store import migrations, schema
from lagscope.store.dsn import parse_dsn
from lagscope.store.errors import StoreError
from lagscope.store.sink import ClickHouseSink, SinkBatch

T0 = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC, a minute boundary + 20 s


@pytest.fixture
def store(chdb_dsn: str):
    sink = ClickHouseSink(chdb_dsn)
    sink.ensure_schema()
    yield sink
    sink.close()


def steps_columns(steps: list[int], slowdown: float, version: int) -> dict:
    n = len(steps)
    actual = np.full(n, 2.0)
    gpu_seconds = actual * 8
    return {
        "job_id": ["job-a"] * n,
        "attempt": [0] * n,
        "step": steps,
        "ts": T0 + 10.0 * np.asarray(steps, dtype=float),
        "complete": [True] * n,
        "missing_ranks": [[] for _ in range(n)],
        "actual_s": actual,
        "simulated_s": actual,
        "ideal_s": actual / slowdown,
        "slowdown": np.full(n, slowdown),
        "launch_slowdown": np.ones(n),
        "waste": np.full(n, 1 - 1 / slowdown),
        "mfu_actual": np.full(n, 0.4 / slowdown),
        "mfu_ideal": np.full(n, 0.4),
        "n_gpus": [8] * n,
        "gpu_seconds": gpu_seconds,
        "gpu_seconds_wasted": gpu_seconds * (1 - 1 / slowdown),
        "processed_at": np.full(n, T0 + 1000),
        "version": [version] * n,
    }


def attribution_columns(steps: list[int], value: float, version: int) -> dict:
    n = len(steps)
    return {
        "job_id": ["job-a"] * 2 * n,
        "attempt": [0] * 2 * n,
        "step": steps * 2,
        "ts": T0 + 10.0 * np.asarray(steps * 2, dtype=float),
        "kind": ["optype"] * 2 * n,
        "name": ["forward-compute"] * n + ["backward-compute"] * n,
        "slowdown": np.full(2 * n, value),
        "version": [version] * 2 * n,
    }


def step_batch(steps: list[int], slowdown: float, version: int) -> SinkBatch:
    batch = SinkBatch(f"job-a/0/{steps[0]}-{steps[-1]}/{version}")
    batch.add("steps", steps_columns(steps, slowdown, version))
    batch.add("attribution", attribution_columns(steps, slowdown, version))
    return batch


#: Ops must be recent: older ones are past the table's TTL and dropped.
OPS_T0 = float(int(time.time()))


def ops_batch(batch_id: str, n: int = 1000) -> SinkBatch:
    batch = SinkBatch(f"ops/{batch_id}")
    starts = np.datetime64(int(OPS_T0 * 1e9), "ns") + np.arange(n) * np.timedelta64(1000, "ns")
    batch.add(
        "ops",
        {
            "job_id": ["job-a"] * n,
            "attempt": np.zeros(n, np.uint32),
            "step": np.arange(n) // 100,
            "rank": np.arange(n) % 8,
            "dp_rank": np.arange(n) % 2,
            "pp_rank": (np.arange(n) // 2) % 4,
            "tp_rank": np.zeros(n, np.uint32),
            "cp_rank": np.zeros(n, np.uint32),
            "optype": ["forward-compute", "backward-compute"] * (n // 2),
            "seq": np.arange(n) % 100,
            "microbatch": np.zeros(n, np.uint32),
            "chunk": np.zeros(n, np.uint32),
            "start": starts,
            "duration_ns": np.full(n, 5000, np.uint64),
            "batch_id": [batch_id] * n,
        },
    )
    return batch


def rollup(store: ClickHouseSink) -> tuple:
    _, rows = store.query(
        "SELECT sum(steps), sum(complete_steps), round(sum(slowdown_sum), 9), "
        "sum(slowdown_count), round(sum(gpu_seconds_wasted), 9), sum(mfu_count) "
        "FROM steps_1m WHERE job_id = {job:String}",
        {"job": "job-a"},
    )
    return rows[0]


def stored_steps(store: ClickHouseSink) -> tuple:
    _, rows = store.query(
        "SELECT count(), round(sum(slowdown), 9), groupUniqArray(version) "
        "FROM steps FINAL WHERE job_id = {job:String}",
        {"job": "job-a"},
    )
    return rows[0]


# -- schema ---------------------------------------------------------------------------
def test_schema_is_versioned_and_idempotent(store: ClickHouseSink) -> None:
    latest = migrations.migrations()[-1].version
    assert store.schema_version() == latest
    assert store.ensure_schema() == []  # nothing pending: a no-op
    _, rows = store.query(
        "SELECT name, engine, sorting_key FROM system.tables "
        "WHERE database = currentDatabase() ORDER BY name"
    )
    tables = {name: (engine, key) for name, engine, key in rows}
    for name in ("ops", "steps", "attribution", "worker_slowdown", "changepoints"):
        assert tables[name][0] == "ReplacingMergeTree"
    for name in ("diagnoses", "jobs", "dead_letters", "schema_version"):
        assert name in tables
    assert tables["worker_state"][1] == "group_id, topic, partition"
    assert tables["worker_retained"][1] == "group_id, job_id, attempt, step"
    assert tables["steps_1m"][0] == "SummingMergeTree"
    assert tables["steps_1m_mv"][0] == "MaterializedView"
    assert tables["steps"][1] == "job_id, attempt, step"
    assert tables["worker_slowdown"][1] == "job_id, attempt, step, pp_rank, dp_rank"
    _, ttl = store.query(
        "SELECT engine_full FROM system.tables WHERE database = currentDatabase() AND name = 'ops'"
    )
    assert "toIntervalDay(7)" in ttl[0][0]


def test_migrations_resume_after_a_partial_run(chdb_dsn: str) -> None:
    """A migration interrupted after some statements is re-run as a whole, safely."""
    with ClickHouseSink(chdb_dsn) as sink:
        sink._use_database(create=True)
        migrations.current_version(sink)
        sink.command(migrations.migrations()[0].statements[1])  # only `steps` exists
        every = [m.version for m in migrations.migrations()]
        assert sink.ensure_schema() == every
        assert sink.ensure_schema() == []
        _, rows = sink.query("SELECT count() FROM schema_version FINAL")
        assert rows == [(len(every),)]


def test_ops_ttl_is_configurable(store: ClickHouseSink) -> None:
    assert store.ops_ttl_days() == schema.DEFAULT_OPS_TTL_DAYS
    store.ensure_schema(ops_ttl_days=30)
    assert store.ops_ttl_days() == 30
    # Another host opening the store without a TTL of its own (`lagscope run`, the demo)
    # keeps the workers' 30 days: the default would delete 23 days of raw ops.
    store.ensure_schema()
    assert store.ops_ttl_days() == 30
    with pytest.raises(ValueError, match="ops_ttl_days"):
        migrations.migrations(ops_ttl_days=0)


@pytest.mark.parametrize("configured, kept", [(None, 30), (14, 14)])
def test_a_worker_sets_the_ttl_only_when_told(
    chdb_dsn: str, configured: int | None, kept: int
) -> None:
    """A worker started without `store.ops_ttl_days` (a restart with a config that lost
    it) leaves the store's 30 days as they are; one told 14 sets 14."""
    from lagscope.stream_app.worker import FaustWorker
    from lagscope.stream_app.worker_config import WorkerConfig

    with ClickHouseSink(chdb_dsn) as sink:
        sink.ensure_schema(ops_ttl_days=30)
    store = {"dsn": chdb_dsn} | ({"ops_ttl_days": configured} if configured else {})
    worker = FaustWorker(WorkerConfig(kafka={"bootstrap_servers": "127.0.0.1:1"}, store=store))
    try:
        assert worker.sink.ops_ttl_days() == kept
    finally:
        worker.close()
        worker.sink.close()


# -- idempotent writes ------------------------------------------------------------------
def test_replayed_batch_changes_nothing(store: ClickHouseSink) -> None:
    batch = step_batch([1, 2, 3, 4, 5, 6, 7], slowdown=1.5, version=1)
    store.write(batch)
    before = (stored_steps(store), rollup(store))
    report = store.write(batch)
    assert report.steps_skipped == 7
    assert (stored_steps(store), rollup(store)) == before
    assert before[1] == (7, 7, 10.5, 7, round(7 * 16 * (1 - 1 / 1.5), 9), 7)
    _, rows = store.query("SELECT count() FROM attribution")  # without FINAL: no extra rows
    assert rows == [(14,)]


def test_reprocessed_step_replaces_the_old_version_in_tables_and_rollup(
    store: ClickHouseSink,
) -> None:
    store.write(step_batch([1, 2, 3], slowdown=1.5, version=1))
    report = store.write(step_batch([2, 3], slowdown=2.0, version=2))
    assert report.steps_retracted == 2
    count, total, versions = stored_steps(store)
    assert (count, total, sorted(versions)) == (3, 5.5, [1, 2])
    wasted = 16 * (1 - 1 / 1.5) + 2 * 16 * (1 - 1 / 2.0)
    assert rollup(store) == (3, 3, 5.5, 3, round(wasted, 9), 3)
    _, rows = store.query(
        "SELECT step, slowdown FROM attribution FINAL WHERE name = 'forward-compute' ORDER BY step"
    )
    assert rows == [(1, 1.5), (2, 2.0), (3, 2.0)]
    # The old version arriving late (a stale replay) is ignored, also by the rollup.
    late = store.write(step_batch([1, 2, 3], slowdown=1.5, version=1))
    assert late.steps_skipped == 3
    assert stored_steps(store)[:2] == (3, 5.5)
    assert rollup(store) == (3, 3, 5.5, 3, round(wasted, 9), 3)


def test_superseded_step_loses_attribution_names_absent_from_the_new_version(
    store: ClickHouseSink,
) -> None:
    store.write(step_batch([1, 2, 3], slowdown=1.5, version=1))
    store.write(step_batch([2, 3], slowdown=2.0, version=2))
    # A name absent from the new version does not linger from the old one.
    batch = SinkBatch("job-a/0/3-3/3")
    batch.add("steps", steps_columns([3], slowdown=2.5, version=3))
    only_forward = attribution_columns([3], 2.5, version=3)
    batch.add("attribution", {k: v[:1] for k, v in only_forward.items()})
    store.write(batch)
    _, rows = store.query("SELECT name, slowdown FROM attribution FINAL WHERE step = 3")
    assert rows == [("forward-compute", 2.5)]
    # A stale replay with new content (past the token window) does not resurrect it.
    stale = step_batch([2, 3], slowdown=2.0, version=2)
    stale.dedup_token += "/re-batched"
    assert store.write(stale).inserted["attribution"] == 0
    _, rows = store.query("SELECT name, slowdown FROM attribution FINAL WHERE step = 3")
    assert rows == [("forward-compute", 2.5)]
    wasted = 16 * (1 - 1 / 1.5) + 16 * (1 - 1 / 2.0) + 16 * (1 - 1 / 2.5)
    assert rollup(store) == (3, 3, 6.0, 3, round(wasted, 9), 3)


def test_rollup_survives_a_crash_between_retraction_and_insert(
    store: ClickHouseSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.write(step_batch([1, 2], slowdown=1.5, version=1))
    real_insert = store._insert

    def crash_on_steps(table, columns, token):
        if table == "steps":
            raise RuntimeError("worker died")
        real_insert(table, columns, token)

    monkeypatch.setattr(store, "_insert", crash_on_steps)
    with pytest.raises(RuntimeError):
        store.write(step_batch([1, 2], slowdown=3.0, version=2))
    monkeypatch.undo()
    store.write(step_batch([1, 2], slowdown=3.0, version=2))  # the replay after restart
    assert stored_steps(store)[:2] == (2, 6.0)
    assert rollup(store)[:4] == (2, 2, 6.0, 2)


def test_insert_token_alone_keeps_the_rollup_from_doubling(store: ClickHouseSink) -> None:
    """Below the sink's own version check: chDB drops a block whose token it has seen,
    and a dropped block does not fire the materialized view."""
    columns = store._prepare_columns("t", "steps", steps_columns([1, 2], 1.5, version=1))
    for _ in range(3):
        store._insert("steps", columns, "same-token")
    _, rows = store.query("SELECT count() FROM steps")
    assert rows == [(2,)]
    assert rollup(store)[:3] == (2, 2, 3.0)


def test_replayed_ops_batch_is_dropped(store: ClickHouseSink) -> None:
    store.write(ops_batch("b1"))
    store.write(ops_batch("b1"))
    store.write(ops_batch("b2", n=200))
    _, rows = store.query("SELECT count(), uniqExact(batch_id), min(start) FROM ops")
    assert rows[0][:2] == (1200, 2)
    assert rows[0][2].timestamp() == pytest.approx(OPS_T0)


def test_nan_mfu_is_stored_as_null(store: ClickHouseSink) -> None:
    batch = SinkBatch("nan-mfu")
    columns = steps_columns([1, 2], 1.5, version=1)
    columns["mfu_actual"] = np.array([np.nan, 0.3])
    batch.add("steps", columns)
    store.write(batch)
    _, rows = store.query("SELECT step, mfu_actual FROM steps ORDER BY step")
    assert rows == [(1, None), (2, 0.3)]
    assert rollup(store)[5] == 1


# -- bad input --------------------------------------------------------------------------
def test_batch_errors_name_table_and_column(store: ClickHouseSink) -> None:
    batch = SinkBatch("bad")
    batch.add("stepz", {"x": [1]})
    with pytest.raises(StoreError, match=r"unknown table.*stepz"):
        store.write(batch)
    columns = steps_columns([1], 1.5, 1)
    del columns["slowdown"]
    batch = SinkBatch("bad")
    batch.add("steps", columns)
    with pytest.raises(StoreError, match=r"table steps: missing column.*slowdown"):
        store.write(batch)
    columns = steps_columns([1, 2], 1.5, 1) | {"colour": [1, 2]}
    batch = SinkBatch("bad")
    batch.add("steps", columns)
    with pytest.raises(StoreError, match=r"unknown column.*colour"):
        store.write(batch)
    columns = steps_columns([1, 2], 1.5, 1) | {"step": [1]}
    batch = SinkBatch("bad")
    batch.add("steps", columns)
    with pytest.raises(StoreError, match="differ in length"):
        store.write(batch)
    columns = steps_columns([1], 1.5, 1) | {"ts": ["yesterday"]}
    batch = SinkBatch("bad")
    batch.add("steps", columns)
    with pytest.raises(StoreError, match="column ts"):
        store.write(batch)
    with pytest.raises(StoreError, match="dedup_token"):
        store.write(SinkBatch(""))


def test_query_binds_parameters_and_reports_sql_errors(store: ClickHouseSink) -> None:
    hostile = "x'; DROP TABLE steps; --"
    assert store.query("SELECT {v:String} AS v", {"v": hostile}) == (["v"], [(hostile,)])
    with pytest.raises(StoreError, match=r"query failed.*Syntax error"):
        store.query("SELEC 1")
    with pytest.raises(StoreError, match="nope"):
        store.query("SELECT * FROM nope")


@pytest.mark.parametrize(
    ("dsn", "kind", "path", "database"),
    [
        ("chdb:///var/lib/x", "chdb", "/var/lib/x", None),
        ("chdb://./lagscope-data/chdb", "chdb", "./lagscope-data/chdb", None),
        ("chdb://memory", "chdb", None, None),
        ("chdb:///d?database=prod", "chdb", "/d", "prod"),
        ("http://u:secret@ch.example:8123/lag", "http", None, "lag"),
        ("https://ch.example/", "http", None, None),
    ],
)
def test_dsn_forms(dsn: str, kind: str, path: str | None, database: str | None) -> None:
    parsed = parse_dsn(dsn)
    assert (parsed.kind, parsed.path, parsed.database) == (kind, path, database)
    assert "secret" not in parsed.shown


@pytest.mark.parametrize("dsn", ["", "postgres://h/db", "chdb:///d?colour=red", "http://"])
def test_bad_dsn_is_a_clear_error(dsn: str) -> None:
    with pytest.raises(StoreError, match="DSN"):
        parse_dsn(dsn)


def test_unreachable_server_is_a_store_error() -> None:
    with pytest.raises(StoreError, match="cannot open ClickHouse store http://u:\\*\\*\\*@"):
        ClickHouseSink("http://u:pw@127.0.0.1:9/db", connect_timeout_s=1)
