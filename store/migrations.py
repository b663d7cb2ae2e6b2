"""The migrations that create and change the store's tables, in order: one function per
migration, each a list of idempotent statements (`IF NOT EXISTS`), so a migration
interrupted half-way, or two processes migrating at once, is safely re-run.

Every applied migration is recorded in `schema_version`; `apply_migrations` runs the ones
above the recorded version, in order. What the tables hold and why they are keyed as they
are: `store/schema.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from lagscope.store.schema import (
    DEDUP_WINDOW,
    DEFAULT_OPS_TTL_DAYS,
    EPISODES_TABLE,
    RANK_IDENTITY_TABLE,
    SCHEMA_VERSION_TABLE,
    STEPS_1M_COLUMNS,
    WORKER_RETAINED_TABLE,
    WORKER_STATE_TABLE,
    check_ttl_days,
    ops_ttl_clause,
    rollup_select,
)


@dataclass(frozen=True)
class Migration:
    version: int
    description: str
    statements: tuple[str, ...]


_SETTINGS = f"SETTINGS non_replicated_deduplication_window = {DEDUP_WINDOW}"
# Codecs: timestamps and step ids grow steadily (Delta/DoubleDelta), float series change
# slowly (Gorilla), small integers have few significant bits (T64); ZSTD on top.
_TS3 = "DateTime64(3) CODEC(DoubleDelta, ZSTD(1))"
_STEP = "UInt64 CODEC(Delta, ZSTD(1))"
_SMALL = "UInt32 CODEC(T64, ZSTD(1))"
_FLOAT = "Float64 CODEC(Gorilla, ZSTD(1))"
_VERSION = "UInt64 CODEC(Delta, ZSTD(1))"


# -- 1: the tables and the minute rollup of steps ---------------------------------------
def _create_ops(ops_ttl_days: int) -> str:
    return f"""CREATE TABLE IF NOT EXISTS ops (
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
        {ops_ttl_clause(ops_ttl_days)}
        {_SETTINGS}, ttl_only_drop_parts = 1"""


_CREATE_STEPS = f"""CREATE TABLE IF NOT EXISTS steps (
        job_id LowCardinality(String), attempt UInt32, step {_STEP}, ts {_TS3},
        complete Bool, missing_ranks Array(UInt32),
        actual_s {_FLOAT}, simulated_s {_FLOAT}, ideal_s {_FLOAT},
        slowdown {_FLOAT}, launch_slowdown {_FLOAT}, waste {_FLOAT},
        mfu_actual Nullable(Float64), mfu_ideal Nullable(Float64),
        n_gpus UInt32, gpu_seconds {_FLOAT}, gpu_seconds_wasted {_FLOAT},
        processed_at DateTime64(3) CODEC(Delta, ZSTD(1)), version {_VERSION}
    ) ENGINE = ReplacingMergeTree(version)
    ORDER BY (job_id, attempt, step) {_SETTINGS}"""

_CREATE_ATTRIBUTION = f"""CREATE TABLE IF NOT EXISTS attribution (
        job_id LowCardinality(String), attempt UInt32, step {_STEP}, ts {_TS3},
        kind LowCardinality(String), name LowCardinality(String),
        slowdown {_FLOAT}, version {_VERSION}
    ) ENGINE = ReplacingMergeTree(version)
    ORDER BY (job_id, attempt, kind, name, step) {_SETTINGS}"""

_CREATE_WORKER_SLOWDOWN = f"""CREATE TABLE IF NOT EXISTS worker_slowdown (
        job_id LowCardinality(String), attempt UInt32, step {_STEP}, ts {_TS3},
        dp_rank {_SMALL}, pp_rank {_SMALL}, slowdown {_FLOAT}, version {_VERSION}
    ) ENGINE = ReplacingMergeTree(version)
    ORDER BY (job_id, attempt, step, pp_rank, dp_rank) {_SETTINGS}"""

_CREATE_CHANGEPOINTS = f"""CREATE TABLE IF NOT EXISTS changepoints (
        job_id LowCardinality(String), attempt UInt32,
        series LowCardinality(String), step {_STEP}, ts {_TS3},
        kind LowCardinality(String), before_mean Float64, after_mean Float64,
        probability Float64, version {_VERSION}
    ) ENGINE = ReplacingMergeTree(version)
    ORDER BY (job_id, attempt, series, step, kind) {_SETTINGS}"""

_CREATE_DIAGNOSES = f"""CREATE TABLE IF NOT EXISTS diagnoses (
        job_id LowCardinality(String), attempt UInt32, step {_STEP}, ts {_TS3},
        cause LowCardinality(String), evidence String CODEC(ZSTD(3)),
        advice String CODEC(ZSTD(3)), predicted_speedup Nullable(Float64),
        version {_VERSION}
    ) ENGINE = ReplacingMergeTree(version)
    ORDER BY (job_id, attempt, step, cause) {_SETTINGS}"""

_CREATE_JOBS = f"""CREATE TABLE IF NOT EXISTS jobs (
        job_id LowCardinality(String), attempt UInt32,
        dp_size UInt32, pp_size UInt32, tp_size UInt32, cp_size UInt32,
        vpp_size UInt32, world_size UInt32,
        model_flops_per_step Nullable(Float64), gpu_peak_flops Nullable(Float64),
        started DateTime64(3), meta String CODEC(ZSTD(3)), version {_VERSION}
    ) ENGINE = ReplacingMergeTree(version)
    ORDER BY (job_id, attempt) {_SETTINGS}"""

_CREATE_DEAD_LETTERS = f"""CREATE TABLE IF NOT EXISTS dead_letters (
        ts DateTime64(3) CODEC(Delta, ZSTD(1)), job_id LowCardinality(String),
        source LowCardinality(String), reason String CODEC(ZSTD(3)),
        payload String CODEC(ZSTD(3)),
        payload_hash UInt64 MATERIALIZED cityHash64(payload)
    ) ENGINE = ReplacingMergeTree
    ORDER BY (job_id, source, ts, payload_hash) {_SETTINGS}"""


def _create_steps_1m() -> str:
    rollup_columns = ", ".join(f"{name} {type_}" for name, type_, _ in STEPS_1M_COLUMNS)
    return f"""CREATE TABLE IF NOT EXISTS steps_1m (
            job_id LowCardinality(String), attempt UInt32,
            minute DateTime CODEC(DoubleDelta, ZSTD(1)), {rollup_columns}
        ) ENGINE = SummingMergeTree
        ORDER BY (job_id, attempt, minute) {_SETTINGS}"""


_CREATE_STEPS_1M_MV = f"""CREATE MATERIALIZED VIEW IF NOT EXISTS steps_1m_mv TO steps_1m AS
    {rollup_select("")} FROM steps GROUP BY job_id, attempt, minute"""


def _tables(ops_ttl_days: int) -> Migration:
    return Migration(
        1,
        "tables, minute rollup of steps",
        (
            _create_ops(ops_ttl_days),
            _CREATE_STEPS,
            _CREATE_ATTRIBUTION,
            _CREATE_WORKER_SLOWDOWN,
            _CREATE_CHANGEPOINTS,
            _CREATE_DIAGNOSES,
            _CREATE_JOBS,
            _CREATE_DEAD_LETTERS,
            _create_steps_1m(),
            _CREATE_STEPS_1M_MV,
        ),
    )


# -- 2: the distributed worker's checkpoints --------------------------------------------
def _worker_checkpoints(ops_ttl_days: int) -> Migration:
    return Migration(
        2,
        "distributed worker checkpoints",
        (
            # One row per snapshot of a partition's step processor (the safe state
            # format of store/snapshot_format.py, without its retained steps); the
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
    )


# -- 3: whether a step was analysed, and how far to trust its simulation ----------------
def _steps_analysed_and_trusted(ops_ttl_days: int) -> Migration:
    return Migration(
        3,
        "steps: whether analysed and why not, simulation discrepancy and trust",
        (
            # Rows written before this migration: analysed iff they have figures.
            "ALTER TABLE steps ADD COLUMN IF NOT EXISTS analysed Bool DEFAULT isFinite(slowdown)",
            "ALTER TABLE steps ADD COLUMN IF NOT EXISTS reason String DEFAULT '' CODEC(ZSTD(3))",
            # |replayed - measured| / measured step time (whatif.md §10.4).
            "ALTER TABLE steps ADD COLUMN IF NOT EXISTS sim_discrepancy Float64 "
            "DEFAULT nan CODEC(Gorilla, ZSTD(1))",
            "ALTER TABLE steps ADD COLUMN IF NOT EXISTS trusted Bool "
            "DEFAULT sim_discrepancy <= 0.05",
        ),
    )


# -- 4, 5: the machine each rank runs on ------------------------------------------------
def _rank_identity(ops_ttl_days: int) -> Migration:
    return Migration(
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
    )


def _rank_identity_local_rank(ops_ttl_days: int) -> Migration:
    return Migration(
        5,
        "rank identity: the rank's index on its machine",
        (
            f"ALTER TABLE {RANK_IDENTITY_TABLE} ADD COLUMN IF NOT EXISTS local_rank UInt32 "
            "DEFAULT 0 AFTER rank",
        ),
    )


# -- 6: straggler episodes ---------------------------------------------------------------
def _episodes(ops_ttl_days: int) -> Migration:
    return Migration(
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
    )


# -- 7: jobs that ended -------------------------------------------------------------------
def _jobs_ended(ops_ttl_days: int) -> Migration:
    return Migration(
        7,
        "jobs: how many ranks ended, and when the job did",
        (
            # A rank's monitor, closed, writes its job record again with its end; the
            # job attempt's row is written again (version = ranks ended) as each does.
            # `ended_at` is set once every rank of the world ended: the job finished, or
            # raised through its monitors, and is not silent. A rank that hangs or is
            # killed never ends.
            "ALTER TABLE jobs ADD COLUMN IF NOT EXISTS ranks_ended UInt32 DEFAULT 0",
            "ALTER TABLE jobs ADD COLUMN IF NOT EXISTS ended_at Nullable(DateTime64(3))",
        ),
    )


# -- 8: the estimated part of an episode's loss ------------------------------------------
def _episodes_estimated(ops_ttl_days: int) -> Migration:
    return Migration(
        8,
        "episodes: the part of the loss estimated for steps found too late to price",
        (
            # Of `lost_s`: seconds and steps estimated from the worker's rise where its
            # steps were no longer held when the episode was found (`EpisodeCost`).
            f"ALTER TABLE {EPISODES_TABLE} ADD COLUMN IF NOT EXISTS estimated_lost_s Float64 "
            "DEFAULT 0 AFTER lost_s",
            f"ALTER TABLE {EPISODES_TABLE} ADD COLUMN IF NOT EXISTS estimated_steps UInt32 "
            "DEFAULT 0 AFTER estimated_lost_s",
        ),
    )


# -- 9: why a step closed without some of its ranks, and when its last batch came -------
def _steps_missing_reason(ops_ttl_days: int) -> Migration:
    return Migration(
        9,
        "steps: why each missing rank was missing; when the host had the step's last batch",
        (
            # "(dp 1, pp 0) sent step 46 but not this one", "... sent nothing for 7.1 s
            # (it may be silent 6.2 s: ...)": a rank that died, one that skipped the step,
            # or the end of the input (stream_app/lateness.py).
            "ALTER TABLE steps ADD COLUMN IF NOT EXISTS missing_reason String DEFAULT '' "
            "CODEC(ZSTD(3)) AFTER missing_ranks",
            # Where a step's latency goes: delivery (the rank's timer, the streamer, Kafka)
            # up to `received_at`, the host's windows, analysis and write after it.
            "ALTER TABLE steps ADD COLUMN IF NOT EXISTS received_at Nullable(DateTime64(3)) "
            "DEFAULT NULL CODEC(ZSTD(1)) AFTER processed_at",
        ),
    )


#: Every migration, in order; each takes the retention `ops` is created with.
_MIGRATIONS: tuple[Callable[[int], Migration], ...] = (
    _tables,
    _worker_checkpoints,
    _steps_analysed_and_trusted,
    _rank_identity,
    _rank_identity_local_rank,
    _episodes,
    _jobs_ended,
    _episodes_estimated,
    _steps_missing_reason,
)


def migrations(ops_ttl_days: int = DEFAULT_OPS_TTL_DAYS) -> tuple[Migration, ...]:
    """All migrations, in order (`ops_ttl_days`: the retention `ops` is created with)."""
    check_ttl_days(ops_ttl_days)
    return tuple(migration(ops_ttl_days) for migration in _MIGRATIONS)


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
