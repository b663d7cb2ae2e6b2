"""The ClickHouse sink: one DSN (`store/dsn.py`), idempotent columnar writes,
parameter-bound queries.

An embedded chDB store and a ClickHouse server both go through clickhouse-connect (1.12+
drives chDB in-process behind the same client interface), so the sink has one code path.
Writes follow the idempotence design of `store/schema.py`: every insert carries a
deterministic `insert_deduplication_token` derived from the batch's `dedup_token`, a step
already stored at the same or a newer version is skipped, and a superseded version is
retracted from the minute rollup first and its attribution / worker_slowdown rows are
deleted. Because of that, a write that failed half-way is safe to repeat: `write` retries a
failed write with bounded exponential back-off (`RetryPolicy`) before it gives up with a
StoreError; a batch that does not fit the schema (`BatchError`) is not retried.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import re
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import numpy as np
import pyarrow as pa

from lagscope.producers.redact import scrub
from lagscope.store import migrations, schema
from lagscope.store.dsn import DEFAULT_DSN, parse_dsn
from lagscope.store.errors import BatchError, StoreError

log = logging.getLogger("lagscope.sink")

ColumnData = Sequence[Any] | np.ndarray
_T = TypeVar("_T")

#: Tables a batch may write, in write order: `steps` last, because a stored step is what
#: marks its version as written (see `ClickHouseSink.write`); the episodes and the
#: diagnoses first after the job, because they are the news an on-call engineer waits for
#: (a write that opens an episode is made at once, and its other tables take most of it).
WRITABLE_TABLES: tuple[str, ...] = (
    "jobs",
    "episodes",
    "diagnoses",
    "ops",
    "worker_slowdown",
    "attribution",
    "changepoints",
    "dead_letters",
    "rank_identity",
    "steps",
)

#: Per-step tables written with `steps` from the same what-if result: a re-processed
#: step's new version replaces their rows of the old version as a whole. The first is
#: written first and ordered by step: a step without rows there has none in the others.
SUPERSEDED_WITH_STEPS: tuple[str, ...] = ("worker_slowdown", "attribution")

_DATETIME64 = re.compile(r"^(?:Nullable\()?DateTime64\((\d)")
_NULLABLE_FLOAT = re.compile(r"^Nullable\(Float(32|64)\)$")
_ARROW_TIME_UNITS = {0: "s", 3: "ms", 6: "us", 9: "ns"}


@dataclass(frozen=True)
class RetryPolicy:
    """How long a failed write is retried: `attempts` tries in all, waiting `first_wait_s`,
    then twice as long each time, at most `max_wait_s` between two tries."""

    attempts: int = 5
    first_wait_s: float = 0.1
    max_wait_s: float = 2.0

    def call(self, fn: Callable[..., _T], *args: Any, what: str = "store write") -> _T:
        """`fn(*args)`, retried on StoreError (not BatchError); the last error is raised."""
        from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

        def transient(exc: BaseException) -> bool:
            return isinstance(exc, StoreError) and not isinstance(exc, BatchError)

        def before_sleep(state: Any) -> None:
            log.warning(
                "%s failed (attempt %d of %d), retrying in %.1f s: %s",
                what,
                state.attempt_number,
                self.attempts,
                state.next_action.sleep,
                state.outcome.exception(),
            )

        retrying = Retrying(
            stop=stop_after_attempt(self.attempts),
            wait=wait_exponential(multiplier=self.first_wait_s, min=0, max=self.max_wait_s),
            retry=retry_if_exception(transient),
            before_sleep=before_sleep,
            reraise=True,
        )
        return retrying(fn, *args)


@dataclass
class SinkBatch:
    """One idempotent write: per table, columnar data (column name -> list or numpy
    array, all columns of a table equally long).

    `dedup_token` must be deterministic for the content (e.g. f"{job}/{attempt}/{first
    step}-{last step}/{version}"): a batch written again with the same token is dropped.
    Timestamp columns (DateTime64) take float seconds since the epoch, numpy datetime64
    or datetime objects. NaN in a Nullable float column is stored as NULL.
    """

    dedup_token: str
    tables: dict[str, dict[str, ColumnData]] = field(default_factory=dict)

    def add(self, table: str, columns: Mapping[str, ColumnData]) -> None:
        if table in self.tables:
            raise ValueError(f"SinkBatch {self.dedup_token!r}: table {table!r} added twice")
        self.tables[table] = dict(columns)

    def row_count(self, table: str) -> int:
        columns = self.tables.get(table)
        return len(next(iter(columns.values()))) if columns else 0

    @classmethod
    def merged(cls, batches: Sequence[SinkBatch]) -> SinkBatch:
        """`batches` as one write: each table's rows in their order, the token derived from
        theirs (so the same batches merge to the same token).

        >>> a, b = SinkBatch("a"), SinkBatch("b")
        >>> a.add("jobs", {"job_id": ["x"]}); b.add("jobs", {"job_id": ["y"]})
        >>> both = SinkBatch.merged([a, b])
        >>> both.tables["jobs"]["job_id"], both.dedup_token == SinkBatch.merged([a, b]).dedup_token
        (['x', 'y'], True)
        """
        digest = hashlib.sha256("\0".join(b.dedup_token for b in batches).encode())
        out = cls(f"merged/{digest.hexdigest()[:32]}/{len(batches)}")
        for batch in batches:
            for table, columns in batch.tables.items():
                into = out.tables.setdefault(table, {name: [] for name in columns})
                if set(into) != set(columns):
                    raise ValueError(f"SinkBatch {batch.dedup_token!r}: {table!r} columns differ")
                for name, values in columns.items():
                    into[name].extend(values.tolist() if isinstance(values, np.ndarray) else values)
        return out


@dataclass(frozen=True)
class WriteReport:
    #: Rows sent per table (after skipping steps already stored at that version or newer).
    inserted: dict[str, int]
    #: Steps rows skipped as replays or stale versions.
    steps_skipped: int
    #: Superseded step versions retracted from the minute rollup.
    steps_retracted: int
    #: Steps whose rows a write cut short had left, replaced (`replace_cut_short`).
    steps_replaced: int = 0


class ClickHouseSink:
    """Writes `SinkBatch`es to ClickHouse (embedded chDB or a server) and runs queries."""

    def __init__(
        self,
        dsn: str = DEFAULT_DSN,
        *,
        create: bool = True,
        connect_timeout_s: float = 10.0,
        retry: RetryPolicy | None = None,
    ):
        """Open the store. create=False: a chDB directory that does not exist is an error
        (a reader should not conjure an empty store out of a mistyped path). `retry`:
        how failed writes are retried (default `RetryPolicy()`)."""
        import clickhouse_connect
        from clickhouse_connect.driver.exceptions import ClickHouseError

        self.dsn = parse_dsn(dsn)
        self.retry = retry or RetryPolicy()
        self._column_types: dict[str, dict[str, tuple[str, bool]]] = {}
        # pyarrow imports pandas on its first array (half a second): pay it when the store
        # opens, not in the first write, which a live step's latency would carry.
        pa.array([0.0])
        if self.dsn.kind == "chdb" and self.dsn.path:
            data_dir = Path(self.dsn.path)
            if create:
                try:
                    data_dir.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise StoreError(
                        f"DSN {self.dsn.shown}: cannot create the chDB store in {data_dir} "
                        f"({exc.strerror or exc})"
                    ) from None
            elif not data_dir.is_dir():
                raise StoreError(f"DSN {self.dsn.shown}: no chDB store in {data_dir}")
        try:
            if self.dsn.kind == "chdb":
                self.client = clickhouse_connect.get_client(
                    interface="chdb", path=self.dsn.path or ":memory:"
                )
            else:
                # The database may not exist yet: connect to the server's default one and
                # switch after `CREATE DATABASE` (see `_use_database`).
                parts = urlsplit(self.dsn.url or "")
                # A server that does not answer is the StoreError below, in one line; the
                # client's own warning about it would be a second line of the same news.
                _quiet_client_warnings()
                self.client = clickhouse_connect.get_client(
                    interface=parts.scheme,
                    host=parts.hostname,
                    port=parts.port or (8443 if parts.scheme == "https" else 8123),
                    username=unquote(parts.username or "default"),
                    password=unquote(parts.password or ""),
                    connect_timeout=connect_timeout_s,
                )
        except (ClickHouseError, OSError) as exc:
            raise StoreError(
                f"cannot open ClickHouse store {self.dsn.shown}: {self.error_text(exc)}"
            ) from None
        finally:
            _quiet_client_warnings(False)
        self._use_database(create=False)

    # -- schema -------------------------------------------------------------------------
    def _use_database(self, *, create: bool) -> None:
        name = self.dsn.database
        if not name:
            return
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise StoreError(f"DSN {self.dsn.shown}: database name {name!r} is not an identifier")
        if create:
            self._command(f"CREATE DATABASE IF NOT EXISTS `{name}`")
        exists = self._command(
            "SELECT count() FROM system.databases WHERE name = {name:String}", {"name": name}
        )
        if int(exists or 0):
            self.client.database = name

    def ensure_schema(self, *, ops_ttl_days: int | None = None) -> list[int]:
        """Create the database and apply pending migrations; returns the migration
        versions applied. `ops_ttl_days`: the days raw ops are kept, set on the store
        whatever it had (a host whose settings name `store.ops_ttl_days`). Without it a
        new `ops` table gets the default and an existing one keeps its own: a run pointed
        at the cluster's store must not cut the 30 days the workers keep to 7 (ClickHouse
        deletes past a TTL at its next merge)."""
        self._use_database(create=True)
        try:
            applied = migrations.apply_migrations(
                self,
                ops_ttl_days=schema.DEFAULT_OPS_TTL_DAYS if ops_ttl_days is None else ops_ttl_days,
            )
        finally:
            self._column_types.clear()
        if ops_ttl_days is not None and self.ops_ttl_days() != ops_ttl_days:
            self._command(schema.ops_ttl_sql(ops_ttl_days))
        return applied

    def ops_ttl_days(self) -> int | None:
        """Days raw ops are kept, as the `ops` table says."""
        found = self._command(
            "SELECT extract(engine_full, 'toIntervalDay\\((\\d+)\\)') FROM system.tables "
            "WHERE database = currentDatabase() AND name = 'ops'"
        )
        return int(found) if found else None

    def schema_version(self) -> int:
        return migrations.current_version(self)

    # -- statements ---------------------------------------------------------------------
    def command(
        self, cmd: str, parameters: dict | None = None, settings: dict | None = None
    ) -> Any:
        """One statement with bound parameters; a failure is a StoreError."""
        return self._command(cmd, parameters, settings)

    def _command(
        self, cmd: str, parameters: dict | None = None, settings: dict | None = None
    ) -> Any:
        from clickhouse_connect.driver.exceptions import ClickHouseError

        try:
            return self.client.command(cmd, parameters=parameters, settings=settings)
        except (ClickHouseError, OSError) as exc:
            raise StoreError(f"{self.dsn.shown}: {self.error_text(exc, first_line=True)}") from None

    def query(
        self,
        sql: str,
        parameters: dict | None = None,
        settings: dict | None = None,
        *,
        bytes_columns: Sequence[str] = (),
    ) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run a SELECT with bound parameters ({name:Type} placeholders); returns
        (column names, rows). `bytes_columns`: String columns read as bytes, not text."""
        from clickhouse_connect.driver.exceptions import ClickHouseError

        try:
            result = self.client.query(
                sql,
                parameters=parameters,
                settings=settings,
                column_formats=dict.fromkeys(bytes_columns, "bytes") or None,
            )
        except (ClickHouseError, OSError) as exc:
            raise StoreError(
                f"{self.dsn.shown}: query failed: {self.error_text(exc, first_line=True)}"
            ) from None
        return list(result.column_names), list(result.result_rows)

    def stored_versions(
        self, keys: Sequence[tuple[str, int, int]]
    ) -> dict[tuple[str, int, int], int]:
        """The newest stored version of each of these (job, attempt, step) keys that is
        stored: a host leaves a re-processed step out with all its rows, and hands what it
        found to `write` (`stored_versions`), which then needs no lookup of its own."""
        versions: dict[tuple[str, int, int], int] = {}
        for part in bound_in_parts(keys):
            _, rows = self.query(
                "SELECT job_id, attempt, step, max(version) FROM steps "
                "WHERE (job_id, attempt, step) IN {keys:Array(Tuple(String, UInt32, UInt64))} "
                "GROUP BY job_id, attempt, step",
                {"keys": part},
            )
            versions.update({(j, int(a), int(s)): int(v) for j, a, s, v in rows})
        return versions

    def insert_rows(
        self, table: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], token: str
    ) -> None:
        """Insert rows (not columns) deduplicated by `token`, retried as writes are: a
        retried insert is stored once. For a few wide rows, such as checkpoints."""

        def insert() -> None:
            from clickhouse_connect.driver.exceptions import ClickHouseError

            known = self._table_columns(table)
            unknown = [name for name in columns if name not in known]
            if unknown:
                raise BatchError(f"insert into {table}: no column(s) {', '.join(unknown)}")
            try:
                # With the types given, the client sends the rows at once instead of
                # asking the store for the table's structure first (a round trip each).
                self.client.insert(
                    table,
                    list(rows),
                    column_names=list(columns),
                    column_type_names=[known[name][0] for name in columns],
                    settings={"insert_deduplicate": 1, "insert_deduplication_token": token},
                )
            except (ClickHouseError, OSError) as exc:
                raise StoreError(
                    f"{self.dsn.shown}: insert into {table} failed: "
                    f"{self.error_text(exc, first_line=True)}"
                ) from None

        self.retry.call(insert, what=f"insert into {table}")

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> ClickHouseSink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def error_text(self, exc: BaseException, *, first_line: bool = False) -> str:
        """A client error as a message may show it: a client library may quote the URL or
        the login it was given, so the DSN's password is masked wherever it appears."""
        text = _first_line(exc) if first_line else str(exc)
        written = (urlsplit(self.dsn.url).password or "") if self.dsn.url else ""
        # as the DSN spells it (p%40ss) and as the client was given it (p@ss)
        return scrub(text, [written, unquote(written)])

    # -- writes -------------------------------------------------------------------------
    def write(
        self,
        batch: SinkBatch,
        *,
        replace_cut_short: bool = False,
        stored_versions: Mapping[tuple[str, int, int], int] | None = None,
    ) -> WriteReport:
        """Insert a batch idempotently: replaying it, or writing an older version of its
        steps, changes nothing; a newer version of a step replaces the stored one. A failed
        write is retried as `self.retry` says (repeating a half-done write is safe).

        `replace_cut_short`: the batch's steps may have rows of an earlier write that was
        cut short before their `steps` row (a crash, a store failing past the retries),
        written as part of another batch: those rows are replaced rather than doubled.
        One lookup more; a host asks for it until it knows such writes are behind it.

        `stored_versions`: what `stored_versions` answered for the batch's steps just
        before (a key absent: not stored), so that the write does not look them up again;
        a retry looks them up itself (the failed try may have stored some)."""
        tries = 0

        def write_once() -> WriteReport:
            nonlocal tries
            tries += 1
            known = stored_versions if tries == 1 else None
            return self._write_once(batch, replace_cut_short, known)

        return self.retry.call(write_once, what=f"write of {batch.dedup_token!r}")

    def _write_once(
        self,
        batch: SinkBatch,
        replace_cut_short: bool = False,
        stored_versions: Mapping[tuple[str, int, int], int] | None = None,
    ) -> WriteReport:
        if not batch.dedup_token:
            raise BatchError("SinkBatch has no dedup_token; it must identify the content")
        unknown = sorted(set(batch.tables) - set(WRITABLE_TABLES))
        if unknown:
            raise BatchError(
                f"SinkBatch {batch.dedup_token!r}: unknown table(s) {', '.join(unknown)}; "
                f"writable: {', '.join(WRITABLE_TABLES)}"
            )
        prepared = {
            table: self._prepare_columns(batch.dedup_token, table, batch.tables[table])
            for table in WRITABLE_TABLES
            if table in batch.tables
        }
        skipped = retracted = 0
        superseded: list[tuple[str, int, int, int]] = []
        if "steps" in prepared:
            prepared["steps"], skipped, superseded, stored = self._newer_steps(
                prepared["steps"], stored_versions
            )
            for table in SUPERSEDED_WITH_STEPS:
                if table in prepared:
                    prepared[table] = _drop_stored_versions(prepared[table], stored)
            token = f"{batch.dedup_token}/steps_1m-retraction"
            for index, part in enumerate(bound_in_parts(superseded)):
                self._command(
                    schema.rollup_retraction_sql(),
                    {"keys": part},
                    {"insert_deduplication_token": f"{token}/{index}" if index else token},
                )
            retracted = len(superseded)
        tokens = {table: f"{batch.dedup_token}/{table}" for table in prepared}
        replaced = 0
        if replace_cut_short and "steps" in prepared:
            replaced = self._drop_cut_short(prepared["steps"])
            # Under the batch's own tokens they would be dropped as repeats of a cut-short
            # write's inserts, whose rows may be gone (deleted here, or by a replacement
            # itself cut short after its deletes): fresh ones, whether or not rows were
            # found. No duplicate can come of it: the steps row, inserted last, is the
            # marker, and what a write cut short left is deleted above first.
            fresh = uuid.uuid4().hex
            for table in SUPERSEDED_WITH_STEPS:
                if table in tokens:
                    tokens[table] = f"{tokens[table]}/replaced-{fresh}"
        inserted: dict[str, int] = {}
        for table, columns in prepared.items():
            if table == "steps" and superseded:
                self._delete_superseded_step_rows(superseded)
            n_rows = len(next(iter(columns.values())))
            inserted[table] = n_rows
            if n_rows:
                self._insert(table, columns, tokens[table])
        return WriteReport(inserted, skipped, retracted, replaced)

    def _drop_cut_short(self, steps: dict[str, pa.Array]) -> int:
        """Delete the per-step rows of these steps (none stored) that a write cut short
        left; returns how many steps had some."""
        found: set[tuple[str, int, int]] = set()
        for table in SUPERSEDED_WITH_STEPS:  # a replacement cut short may have emptied one
            for part in bound_in_parts(_step_keys(steps)):
                _, rows = self.query(
                    f"SELECT DISTINCT job_id, attempt, step FROM {table} WHERE "
                    "(job_id, attempt, step) IN {keys:Array(Tuple(String, UInt32, UInt64))}",
                    {"keys": part},
                )
                found.update((j, int(a), int(s)) for j, a, s in rows)
        if found:
            log.info("%d step(s) were partly stored by a write cut short: their rows are "
                     "replaced", len(found))  # fmt: skip
            for table in SUPERSEDED_WITH_STEPS:
                for part in bound_in_parts(sorted(found)):
                    self._command(
                        f"DELETE FROM {table} WHERE (job_id, attempt, step) IN "
                        "{keys:Array(Tuple(String, UInt32, UInt64))}",
                        {"keys": part},
                    )
        return len(found)

    def _delete_superseded_step_rows(self, superseded: list[tuple[str, int, int, int]]) -> None:
        """Delete the superseded versions' rows from the per-step result tables: the new
        version may lack some of them (an attribution name that vanished), and FINAL only
        replaces rows of the same key. Runs before the steps insert, so a crash before it
        is redone by the replay."""
        for table in SUPERSEDED_WITH_STEPS:
            for part in bound_in_parts(superseded):
                self._command(
                    f"DELETE FROM {table} WHERE (job_id, attempt, step, version) IN "
                    "{keys:Array(Tuple(String, UInt32, UInt64, UInt64))}",
                    {"keys": part},
                )

    def _insert(self, table: str, columns: dict[str, pa.Array], token: str) -> None:
        # Arrow: columnar all the way (numpy buffers, dictionary-encoded LowCardinality)
        # instead of the client's per-value Native serialisation, ~5x faster for ops.
        from clickhouse_connect.driver.exceptions import ClickHouseError

        try:
            self.client.insert_arrow(
                table,
                pa.table(columns),
                settings={"insert_deduplicate": 1, "insert_deduplication_token": token},
            )
        except (ClickHouseError, OSError) as exc:
            raise StoreError(
                f"{self.dsn.shown}: insert into {table} failed: {self.error_text(exc)}"
            ) from None

    def _newer_steps(
        self,
        columns: dict[str, pa.Array],
        stored_versions: Mapping[tuple[str, int, int], int] | None = None,
    ) -> tuple[
        dict[str, pa.Array],
        int,
        list[tuple[str, int, int, int]],
        dict[tuple[str, int, int], int],
    ]:
        """Keep the steps rows newer than what is stored (and the newest of duplicates in
        the batch); list the stored versions they supersede, and return the stored version
        of each step of the batch (`stored_versions` when the caller looked them up)."""
        keys = _step_keys(columns)
        versions = _python_values(columns["version"])
        newest_in_batch: dict[tuple[str, int, int], int] = {}
        for i, key in enumerate(keys):
            best = newest_in_batch.get(key)
            if best is None or versions[i] > versions[best]:
                newest_in_batch[key] = i
        if stored_versions is None:
            stored = self.stored_versions(list(newest_in_batch))
        else:
            stored = {k: stored_versions[k] for k in newest_in_batch if k in stored_versions}
        keep = np.zeros(len(keys), dtype=bool)
        superseded: list[tuple[str, int, int, int]] = []
        for key, i in newest_in_batch.items():
            old = stored.get(key)
            if old is None or versions[i] > old:
                keep[i] = True
                if old is not None:
                    superseded.append((*key, old))
        mask = pa.array(keep)
        kept = {name: values.filter(mask) for name, values in columns.items()}
        return kept, len(keys) - int(keep.sum()), sorted(superseded), stored

    def _table_columns(self, table: str) -> dict[str, tuple[str, bool]]:
        """column -> (type, must be given) of a table, from the store itself."""
        if table not in self._column_types:
            _, rows = self.query(
                "SELECT name, type, default_kind FROM system.columns "
                "WHERE database = currentDatabase() AND table = {table:String} "
                "ORDER BY position",
                {"table": table},
            )
            if not rows:
                raise StoreError(
                    f"{self.dsn.shown}: table {table} does not exist; run ensure_schema() first"
                )
            self._column_types[table] = {name: (t, not kind) for name, t, kind in rows}
        return self._column_types[table]

    def _prepare_columns(
        self, token: str, table: str, columns: Mapping[str, ColumnData]
    ) -> dict[str, pa.Array]:
        where = f"SinkBatch {token!r}, table {table}"
        known = self._table_columns(table)
        unknown = sorted(set(columns) - set(known))
        if unknown:
            raise BatchError(f"{where}: unknown column(s) {', '.join(unknown)}")
        missing = [
            name for name, (_, required) in known.items() if required and name not in columns
        ]
        if missing:
            raise BatchError(f"{where}: missing column(s) {', '.join(missing)}")
        lengths = {name: len(values) for name, values in columns.items()}
        if len(set(lengths.values())) > 1:
            raise BatchError(f"{where}: columns differ in length: {lengths}")
        out: dict[str, pa.Array] = {}
        for name, values in columns.items():
            type_ = known[name][0]
            try:
                out[name] = _to_arrow(values, type_)
            except (TypeError, ValueError, pa.ArrowException) as exc:
                raise BatchError(f"{where}, column {name} ({type_}): {exc}") from None
        return out


def _to_arrow(values: ColumnData, type_: str) -> pa.Array:
    """An Arrow array that ClickHouse reads into a column of type `type_`."""
    match = _DATETIME64.match(type_)
    if match:
        precision = int(match.group(1))
        unit = _ARROW_TIME_UNITS.get(precision)
        arrow_type = pa.timestamp(unit) if unit else pa.int64()
        if type_.startswith("Nullable(") and not isinstance(values, np.ndarray):
            # None is NULL: the known values become ticks, the rest stays missing.
            values = list(values)
            known = [i for i, v in enumerate(values) if v is not None]
            ticks = _datetime64_ticks([values[i] for i in known], precision) if known else []
            full: list[int | None] = [None] * len(values)
            for i, tick in zip(known, ticks, strict=True):
                full[i] = int(tick)
            return pa.array(full, type=arrow_type)
        return pa.array(_datetime64_ticks(values, precision), type=arrow_type)
    if _NULLABLE_FLOAT.match(type_):
        floats = [None if v is None else float(v) for v in values]
        return pa.array(floats, type=pa.float64(), from_pandas=True)  # NaN -> null
    if "LowCardinality(String)" in type_:
        return pa.array(_sequence(values), type=pa.string()).dictionary_encode()
    if type_ == "String":
        return pa.array(_sequence(values), type=pa.string())
    return pa.array(_sequence(values))


def _sequence(values: ColumnData) -> np.ndarray | list:
    return values if isinstance(values, np.ndarray) else list(values)


#: Bound parameters travel as HTTP form fields, which a ClickHouse server takes up to
#: `http_max_field_value_size` (128 KiB by default) each: lists of keys are bound in parts
#: of at most this many bytes as ClickHouse's text format spells them (a worker's write of
#: several partitions' backlogs looks up thousands of steps).
BOUND_PART_BYTES = 64 * 1024


def bound_in_parts(keys: Sequence[tuple[Any, ...]]) -> Iterator[list[tuple[Any, ...]]]:
    """`keys` in parts that each bind to at most `BOUND_PART_BYTES` (none when empty).

    >>> [len(part) for part in bound_in_parts([("a-job", 0, step) for step in range(5000)])]
    [2897, 2103]
    """
    part: list[tuple[Any, ...]] = []
    size = 0
    for key in keys:
        # ('job', 0, 12): quotes or a separator per value, parentheses, a comma; a
        # string's escapes at most double it.
        cost = sum(2 * len(v) + 3 if isinstance(v, str) else len(str(v)) + 1 for v in key) + 3
        if part and size + cost > BOUND_PART_BYTES:
            yield part
            part, size = [], 0
        part.append(key)
        size += cost
    if part:
        yield part


def _step_keys(columns: dict[str, pa.Array]) -> list[tuple[str, int, int]]:
    """The (job_id, attempt, step) key of every row of a per-step table's columns."""
    return list(
        zip(
            _python_values(columns["job_id"]),
            _python_values(columns["attempt"]),
            _python_values(columns["step"]),
            strict=True,
        )
    )


def _drop_stored_versions(
    columns: dict[str, pa.Array], stored: dict[tuple[str, int, int], int]
) -> dict[str, pa.Array]:
    """Rows of a per-step table without those of a step version already stored or older
    (a replay or a stale re-processing)."""
    if not stored:
        return columns
    keys = zip(
        _python_values(columns["job_id"]),
        _python_values(columns["attempt"]),
        _python_values(columns["step"]),
        _python_values(columns["version"]),
        strict=True,
    )
    keep = pa.array([version > stored.get((j, a, s), -1) for j, a, s, version in keys])
    return {name: values.filter(keep) for name, values in columns.items()}


def _python_values(array: pa.Array) -> list:
    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    return array.to_pylist()


def _datetime64_ticks(values: ColumnData, precision: int) -> np.ndarray:
    """Integer ticks of a DateTime64(precision) column from epoch seconds, numpy
    datetime64 or datetime objects."""
    scale = 10**precision
    array = np.asarray(values)
    if np.issubdtype(array.dtype, np.datetime64):
        nanoseconds = array.astype("datetime64[ns]").astype(np.int64)
        return nanoseconds // 10 ** (9 - precision)
    if array.dtype.kind in "fiu":
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise ValueError("timestamps must be finite seconds since the epoch")
        if array.dtype.kind == "f":
            return np.rint(array.astype(np.float64) * scale).astype(np.int64)
        return array.astype(np.int64) * scale
    out = []
    for value in values:
        if not isinstance(value, dt.datetime):
            raise TypeError(f"expected epoch seconds or datetimes, got {type(value).__name__}")
        moment = value if value.tzinfo else value.replace(tzinfo=dt.UTC)
        out.append(round(moment.timestamp() * scale))
    return np.array(out, dtype=np.int64)


#: clickhouse-connect's HTTP transport, which warns before it raises what the sink reports.
_CLIENT_TRANSPORT_LOG = "clickhouse_connect.driver._backend.http_sync"


def _quiet_client_warnings(quiet: bool = True) -> None:
    """Hold back the transport's warnings while a sink connects (the sink's StoreError says
    the same, once), and let them through again after."""
    logging.getLogger(_CLIENT_TRANSPORT_LOG).setLevel(logging.ERROR if quiet else logging.NOTSET)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
