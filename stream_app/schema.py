"""ClickHouse schema of the lagscope store, created by ordered, idempotent migrations.

Every applied migration is recorded in `schema_version`; `apply_migrations` runs the ones
above the recorded version, in order. Each statement is `IF NOT EXISTS`, so a migration
interrupted half-way (or two processes migrating at once) is safely re-run.

Tables and their ORDER BY (the dashboards' access paths: one job's attempt, a step range):

- `ops` (job_id, attempt, step, rank, start, optype, seq): raw ops of a step for the
  timeline drill-down; partitioned by day and TTL-limited (`ops_ttl_days`, default 7,
  changed by `ensure_schema(ops_ttl_days=...)`).
- `steps` (job_id, attempt, step): one row per closed step, analysed or not (`analysed`,
  `reason`), with the simulation discrepancy and whether it is `trusted`; the slowdown /
  MFU panels.
- `attribution` (job_id, attempt, kind, name, step): one series per (kind, name), read as
  "S_X over steps" for a kind (optype, dp_rank, stage, launch_*).
- `worker_slowdown` (job_id, attempt, step, pp_rank, dp_rank): the DPxPP heatmap of a step
  range.
- `changepoints` (job_id, attempt, series, step, kind), `diagnoses` (job_id, attempt,
  step, cause), `jobs` (job_id, attempt), `dead_letters` (job_id, source, ts, ...).
- `episodes` (job_id, attempt, episode_id): straggler episodes found while the job runs,
  one row per state (open, kept current, closed, refined at the job's end); `FINAL`
  gives each episode's latest state.
- `steps_1m` (job_id, attempt, minute): minute rollup of `steps`, filled by the
  materialized view `steps_1m_mv`.
- `worker_state` (group_id, topic, partition) and `worker_retained` (group_id, job_id,
  attempt, step): the distributed worker's checkpoints (see stream_app/worker.py).

Idempotence. Derived tables are ReplacingMergeTree(version): a re-processed step is written
with a higher `version` and reads take the latest (`FINAL`, or argMax by version).
Identical replays are dropped at insert by `insert_deduplication_token`, which plain
MergeTree honours within `non_replicated_deduplication_window` blocks; a deduplicated
insert does not fire the materialized views, so the rollup is not doubled either. A
changed re-processing does fire the view, so the sink first writes a retraction of the
superseded version into the rollup (`steps_1m` is a SummingMergeTree of signed counts and
sums; `rollup_retraction_sql` mirrors the view's SELECT with negated aggregates). Hence the
rollup holds sums and counts only (averages are sum / count): a maximum cannot be retracted;
take maxima from `steps FINAL`.

Reads: `steps`, `attribution`, `worker_slowdown`, `jobs`, ... with `FINAL`. When a step is
superseded the sink also deletes the old version's `attribution` and `worker_slowdown`
rows (a name may vanish from the new version, and FINAL only replaces rows of equal key).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

SCHEMA_VERSION_TABLE = "schema_version"
#: Tables of the distributed worker's checkpoints (stream_app/worker.py).
WORKER_STATE_TABLE = "worker_state"
WORKER_RETAINED_TABLE = "worker_retained"
RANK_IDENTITY_TABLE = "rank_identity"
EPISODES_TABLE = "episodes"
DEFAULT_OPS_TTL_DAYS = 7
#: Recent insert blocks whose tokens a table remembers: replays after a crash come within
#: minutes, i.e. well inside this many batches.
DEDUP_WINDOW = 10_000

_SETTINGS = f"SETTINGS non_replicated_deduplication_window = {DEDUP_WINDOW}"
# Codecs: timestamps and step ids grow steadily (Delta/DoubleDelta), float series change
# slowly (Gorilla), small integers have few significant bits (T64); ZSTD on top.
_TS3 = "DateTime64(3) CODEC(DoubleDelta, ZSTD(1))"
_STEP = "UInt64 CODEC(Delta, ZSTD(1))"
_SMALL = "UInt32 CODEC(T64, ZSTD(1))"
_FLOAT = "Float64 CODEC(Gorilla, ZSTD(1))"
_VERSION = "UInt64 CODEC(Delta, ZSTD(1))"

#: Columns of the minute rollup of `steps`: (name, type, aggregate over `steps` rows).
STEPS_1M_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("steps", "Int64", "count()"),
    ("complete_steps", "Int64", "countIf(complete)"),
    ("slowdown_sum", "Float64", "sumIf(slowdown, isFinite(slowdown))"),
    ("slowdown_count", "Int64", "countIf(isFinite(slowdown))"),
    ("gpu_seconds", "Float64", "sumIf(gpu_seconds, isFinite(gpu_seconds))"),
    (
        "gpu_seconds_wasted",
        "Float64",
        "sumIf(gpu_seconds_wasted, isFinite(gpu_seconds_wasted))",
    ),
    ("mfu_sum", "Float64", "sumIf(assumeNotNull(mfu_actual), isFinite(mfu_actual))"),
    ("mfu_count", "Int64", "countIf(isFinite(mfu_actual))"),
)
_ROLLUP_KEY = "job_id, attempt, toStartOfMinute(ts) AS minute"


def _rollup_select(sign: str) -> str:
    aggregates = ", ".join(f"{sign}{expr} AS {name}" for name, _, expr in STEPS_1M_COLUMNS)
    return f"SELECT {_ROLLUP_KEY}, {aggregates}"


def rollup_retraction_sql() -> str:
    """INSERT of the negated rollup contribution of given (job_id, attempt, step, version)
    rows of `steps` (parameter `keys`); `LIMIT 1 BY` guards against an unmerged duplicate."""
    return (
        f"INSERT INTO steps_1m {_rollup_select('-')} FROM ("
        "SELECT * FROM steps WHERE (job_id, attempt, step, version) IN "
        "{keys:Array(Tuple(String, UInt32, UInt64, UInt64))} "
        "LIMIT 1 BY job_id, attempt, step, version) GROUP BY job_id, attempt, minute"
    )


@dataclass(frozen=True)
class Migration:
    version: int
    description: str
    statements: tuple[str, ...]


def _check_ttl_days(ops_ttl_days: int) -> None:
    if not isinstance(ops_ttl_days, int) or isinstance(ops_ttl_days, bool) or ops_ttl_days < 1:
        raise ValueError(f"ops_ttl_days must be a positive integer, got {ops_ttl_days!r}")


def _ops_ttl(ops_ttl_days: int) -> str:
    return f"TTL toDateTime(start) + INTERVAL {ops_ttl_days} DAY"


def ops_ttl_sql(ops_ttl_days: int) -> str:
    """ALTER of the raw ops' retention. Existing parts are not rewritten: expired ones are
    dropped as merges and TTL passes reach them."""
    _check_ttl_days(ops_ttl_days)
    return (
        f"ALTER TABLE ops MODIFY {_ops_ttl(ops_ttl_days)} SETTINGS materialize_ttl_after_modify = 0"
    )


def migrations(ops_ttl_days: int = DEFAULT_OPS_TTL_DAYS) -> tuple[Migration, ...]:
    """All migrations, in order (`ops_ttl_days`: the retention `ops` is created with)."""
    _check_ttl_days(ops_ttl_days)
    rollup_columns = ", ".join(f"{name} {type_}" for name, type_, _ in STEPS_1M_COLUMNS)
    return (
        Migration(
            1,
            "tables, minute rollup of steps",
            (
                f"""CREATE TABLE IF NOT EXISTS ops (
                    job_id LowCardinality(String), attempt UInt32, step {_STEP},
                    rank {_SMALL}, dp_rank {_SMALL}, pp_rank {_SMALL}, tp_rank {_SMALL},
                    cp_rank {_SMALL}, optype LowCardinality(String), seq {_SMALL},
                    microbatch {_SMALL}, chunk {_SMALL},
                    start DateTime64(9) CODEC(Delta, ZSTD(1)),
                    duration_ns UInt64 CODEC(T64, ZSTD(1)),
                    batch_id String CODEC(ZSTD(1))
                ) ENGINE = ReplacingMergeTree
                PARTITION BY toDate(start)
                ORDER BY (job_id, attempt, step, rank, start, optype, seq)
                {_ops_ttl(ops_ttl_days)}
                {_SETTINGS}, ttl_only_drop_parts = 1""",
                f"""CREATE TABLE IF NOT EXISTS steps (
                    job_id LowCardinality(String), attempt UInt32, step {_STEP}, ts {_TS3},
                    complete Bool, missing_ranks Array(UInt32),
                    actual_s {_FLOAT}, simulated_s {_FLOAT}, ideal_s {_FLOAT},
                    slowdown {_FLOAT}, launch_slowdown {_FLOAT}, waste {_FLOAT},
                    mfu_actual Nullable(Float64), mfu_ideal Nullable(Float64),
                    n_gpus UInt32, gpu_seconds {_FLOAT}, gpu_seconds_wasted {_FLOAT},
                    processed_at DateTime64(3) CODEC(Delta, ZSTD(1)), version {_VERSION}
                ) ENGINE = ReplacingMergeTree(version)
                ORDER BY (job_id, attempt, step) {_SETTINGS}""",
                f"""CREATE TABLE IF NOT EXISTS attribution (
                    job_id LowCardinality(String), attempt UInt32, step {_STEP}, ts {_TS3},
                    kind LowCardinality(String), name LowCardinality(String),
                    slowdown {_FLOAT}, version {_VERSION}
                ) ENGINE = ReplacingMergeTree(version)
                ORDER BY (job_id, attempt, kind, name, step) {_SETTINGS}""",
                f"""CREATE TABLE IF NOT EXISTS worker_slowdown (
                    job_id LowCardinality(String), attempt UInt32, step {_STEP}, ts {_TS3},
                    dp_rank {_SMALL}, pp_rank {_SMALL}, slowdown {_FLOAT}, version {_VERSION}
                ) ENGINE = ReplacingMergeTree(version)
                ORDER BY (job_id, attempt, step, pp_rank, dp_rank) {_SETTINGS}""",
                f"""CREATE TABLE IF NOT EXISTS changepoints (
                    job_id LowCardinality(String), attempt UInt32,
                    series LowCardinality(String), step {_STEP}, ts {_TS3},
                    kind LowCardinality(String), before_mean Float64, after_mean Float64,
                    probability Float64, version {_VERSION}
                ) ENGINE = ReplacingMergeTree(version)
                ORDER BY (job_id, attempt, series, step, kind) {_SETTINGS}""",
                f"""CREATE TABLE IF NOT EXISTS diagnoses (
                    job_id LowCardinality(String), attempt UInt32, step {_STEP}, ts {_TS3},
                    cause LowCardinality(String), evidence String CODEC(ZSTD(3)),
                    advice String CODEC(ZSTD(3)), predicted_speedup Nullable(Float64),
                    version {_VERSION}
                ) ENGINE = ReplacingMergeTree(version)
                ORDER BY (job_id, attempt, step, cause) {_SETTINGS}""",
                f"""CREATE TABLE IF NOT EXISTS jobs (
                    job_id LowCardinality(String), attempt UInt32,
                    dp_size UInt32, pp_size UInt32, tp_size UInt32, cp_size UInt32,
                    vpp_size UInt32, world_size UInt32,
                    model_flops_per_step Nullable(Float64), gpu_peak_flops Nullable(Float64),
                    started DateTime64(3), meta String CODEC(ZSTD(3)), version {_VERSION}
                ) ENGINE = ReplacingMergeTree(version)
                ORDER BY (job_id, attempt) {_SETTINGS}""",
                f"""CREATE TABLE IF NOT EXISTS dead_letters (
                    ts DateTime64(3) CODEC(Delta, ZSTD(1)), job_id LowCardinality(String),
                    source LowCardinality(String), reason String CODEC(ZSTD(3)),
                    payload String CODEC(ZSTD(3)),
                    payload_hash UInt64 MATERIALIZED cityHash64(payload)
                ) ENGINE = ReplacingMergeTree
                ORDER BY (job_id, source, ts, payload_hash) {_SETTINGS}""",
                f"""CREATE TABLE IF NOT EXISTS steps_1m (
                    job_id LowCardinality(String), attempt UInt32,
                    minute DateTime CODEC(DoubleDelta, ZSTD(1)), {rollup_columns}
                ) ENGINE = SummingMergeTree
                ORDER BY (job_id, attempt, minute) {_SETTINGS}""",
                f"""CREATE MATERIALIZED VIEW IF NOT EXISTS steps_1m_mv TO steps_1m AS
                {_rollup_select("")} FROM steps GROUP BY job_id, attempt, minute""",
            ),
        ),
        Migration(
            2,
            "distributed worker checkpoints",
            (
                # One row per snapshot of a partition's step processor (the safe state
                # format of stream_app.snapshot_format, without its retained steps); the
                # newest next_offset wins.
                f"""CREATE TABLE IF NOT EXISTS {WORKER_STATE_TABLE} (
                    group_id String, topic String, partition UInt32, next_offset UInt64,
                    written_at DateTime64(3), state String CODEC(ZSTD(1))
                ) ENGINE = ReplacingMergeTree(next_offset)
                ORDER BY (group_id, topic, partition)""",
                # The steps a processor retains for its job's roll-up, each written once
                # when first checkpointed, so a snapshot costs what changed, not the
                # whole window. Rows outlive their window by the TTL only.
                f"""CREATE TABLE IF NOT EXISTS {WORKER_RETAINED_TABLE} (
                    group_id String, job_id String, attempt UInt32, step UInt64,
                    written_at DateTime CODEC(Delta, ZSTD(1)), inputs String CODEC(ZSTD(1))
                ) ENGINE = ReplacingMergeTree
                ORDER BY (group_id, job_id, attempt, step)
                TTL written_at + INTERVAL 30 DAY""",
            ),
        ),
        Migration(
            3,
            "steps: whether analysed and why not, simulation discrepancy and trust",
            (
                # Rows written before this migration: analysed iff they have figures.
                "ALTER TABLE steps ADD COLUMN IF NOT EXISTS analysed Bool "
                "DEFAULT isFinite(slowdown)",
                "ALTER TABLE steps ADD COLUMN IF NOT EXISTS reason String DEFAULT '' "
                "CODEC(ZSTD(3))",
                # |replayed - measured| / measured step time (whatif.md §10.4).
                "ALTER TABLE steps ADD COLUMN IF NOT EXISTS sim_discrepancy Float64 "
                "DEFAULT nan CODEC(Gorilla, ZSTD(1))",
                "ALTER TABLE steps ADD COLUMN IF NOT EXISTS trusted Bool "
                "DEFAULT sim_discrepancy <= 0.05",
            ),
        ),
        Migration(
            4,
            "rank identity: the machine each rank of a job attempt runs on",
            (
                # One row per (job, attempt, rank): what the node view joins worker
                # slowdowns with to rank machines across jobs. `node` is the scheduler's or
                # Kubernetes' node name where known, else empty (the host then names it).
                f"""CREATE TABLE IF NOT EXISTS {RANK_IDENTITY_TABLE} (
                    job_id LowCardinality(String), attempt UInt32, rank UInt32,
                    dp_rank UInt32, pp_rank UInt32, tp_rank UInt32, cp_rank UInt32,
                    host LowCardinality(String), node LowCardinality(String), pod String,
                    gpu Nullable(Int32), pci_bus_id String, version {_VERSION}
                ) ENGINE = ReplacingMergeTree(version)
                ORDER BY (job_id, attempt, rank) {_SETTINGS}""",
            ),
        ),
        Migration(
            5,
            "rank identity: the rank's index on its machine",
            (
                f"ALTER TABLE {RANK_IDENTITY_TABLE} ADD COLUMN IF NOT EXISTS local_rank UInt32 "
                "DEFAULT 0 AFTER rank",
            ),
        ),
        Migration(
            6,
            "episodes: straggler episodes found while the job runs",
            (
                # One row per state of an episode (opened, kept current every step while
                # open, closed, refined at the job's end); FINAL gives each one's latest.
                # `version` = 2 x the job's last closed step (+1 for the refined state at
                # the job's end), the same whichever host wrote it.
                f"""CREATE TABLE IF NOT EXISTS {EPISODES_TABLE} (
                    job_id LowCardinality(String), attempt UInt32, episode_id UInt32,
                    state LowCardinality(String),
                    onset_step {_STEP}, recovery_step Nullable(UInt64),
                    onset_ts DateTime64(3), recovery_ts Nullable(DateTime64(3)),
                    last_step UInt64, last_ts DateTime64(3),
                    cause LowCardinality(String), optype LowCardinality(String),
                    dp_rank Int32, pp_rank Int32, workers Array(String),
                    node LowCardinality(String), host LowCardinality(String),
                    gpu Nullable(Int32),
                    share Float64, lost_s Float64, gpu_seconds_lost Float64,
                    first_seen_step UInt64, final Bool,
                    summary String CODEC(ZSTD(3)), evidence String CODEC(ZSTD(3)),
                    advice String CODEC(ZSTD(3)),
                    updated_at DateTime64(3), version {_VERSION}
                ) ENGINE = ReplacingMergeTree(version)
                ORDER BY (job_id, attempt, episode_id) {_SETTINGS}""",
            ),
        ),
    )


class CommandRunner(Protocol):
    def command(self, cmd: str, parameters: dict | None = None, settings: dict | None = None):
        """Run one statement (the clickhouse-connect client's `command`)."""


def current_version(client: CommandRunner) -> int:
    client.command(
        f"CREATE TABLE IF NOT EXISTS {SCHEMA_VERSION_TABLE} (version UInt32, "
        "description String, applied_at DateTime64(3) DEFAULT now64(3)) "
        "ENGINE = ReplacingMergeTree ORDER BY version"
    )
    return int(client.command(f"SELECT max(version) FROM {SCHEMA_VERSION_TABLE}") or 0)


def apply_migrations(
    client: CommandRunner, *, ops_ttl_days: int = DEFAULT_OPS_TTL_DAYS
) -> list[int]:
    """Apply the migrations above the recorded version, in order; returns those applied."""
    applied: list[int] = []
    version = current_version(client)
    for migration in migrations(ops_ttl_days):
        if migration.version <= version:
            continue
        for statement in migration.statements:
            client.command(statement)
        client.command(
            f"INSERT INTO {SCHEMA_VERSION_TABLE} (version, description) "
            "VALUES ({version:UInt32}, {description:String})",
            parameters={"version": migration.version, "description": migration.description},
        )
        applied.append(migration.version)
    return applied
