"""ClickHouse schema of the lagscope store: its tables, their names and the minute rollup
of `steps`. The tables are created and changed by ordered, idempotent migrations
(`store/migrations.py`).

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
  Their JSON documents (`evidence`, `advice`, `meta`) are strict JSON, null where a
  figure has no value (`rows.json_text`), so ClickHouse's JSON functions read them.
- `jobs` holds each job attempt's layout and its record, and how many of its ranks said
  they ended (`ranks_ended`; a rank's closed monitor writes its record once more, with its
  end); `ended_at` is set once every rank did: the job finished, and the alert rules
  leave it (written again, version = ranks ended, as each one does).
- `episodes` (job_id, attempt, episode_id): straggler episodes found while the job runs,
  one row per state (open, kept current, closed, refined at the job's end); `FINAL`
  gives each episode's latest state. Of its `lost_s`, `estimated_lost_s` over
  `estimated_steps` were estimated: steps no longer held when the episode was found.
- `steps_1m` (job_id, attempt, minute): minute rollup of `steps`, filled by the
  materialized view `steps_1m_mv`.
- `worker_state` (group_id, topic, partition) and `worker_retained` (group_id, job_id,
  attempt, step): the distributed worker's checkpoints (`store/checkpoints.py`).

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


def rollup_select(sign: str) -> str:
    """The rollup's SELECT over `steps` rows (`sign` "-": the negated contribution)."""
    aggregates = ", ".join(f"{sign}{expr} AS {name}" for name, _, expr in STEPS_1M_COLUMNS)
    return f"SELECT {_ROLLUP_KEY}, {aggregates}"


def rollup_retraction_sql() -> str:
    """INSERT of the negated rollup contribution of given (job_id, attempt, step, version)
    rows of `steps` (parameter `keys`); `LIMIT 1 BY` guards against an unmerged duplicate."""
    return (
        f"INSERT INTO steps_1m {rollup_select('-')} FROM ("
        "SELECT * FROM steps WHERE (job_id, attempt, step, version) IN "
        "{keys:Array(Tuple(String, UInt32, UInt64, UInt64))} "
        "LIMIT 1 BY job_id, attempt, step, version) GROUP BY job_id, attempt, minute"
    )


def check_ttl_days(ops_ttl_days: int) -> None:
    if not isinstance(ops_ttl_days, int) or isinstance(ops_ttl_days, bool) or ops_ttl_days < 1:
        raise ValueError(f"ops_ttl_days must be a positive integer, got {ops_ttl_days!r}")


def ops_ttl_clause(ops_ttl_days: int) -> str:
    """The TTL clause of `ops`: raw ops are kept `ops_ttl_days` days."""
    return f"TTL toDateTime(start) + INTERVAL {ops_ttl_days} DAY"


def ops_ttl_sql(ops_ttl_days: int) -> str:
    """ALTER of the raw ops' retention. Existing parts are not rewritten: expired ones are
    dropped as merges and TTL passes reach them."""
    check_ttl_days(ops_ttl_days)
    return (
        f"ALTER TABLE ops MODIFY {ops_ttl_clause(ops_ttl_days)} "
        "SETTINGS materialize_ttl_after_modify = 0"
    )
