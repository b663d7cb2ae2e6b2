"""The store: everything that speaks SQL to ClickHouse (embedded chDB or a server), apart
from the dashboards' own queries and the user's `lagscope query`.

- `dsn.py`: where the store is (`--dsn`, `$LAGSCOPE_CLICKHOUSE_DSN`, the default) and how
  a DSN is read and shown without its password;
- `schema.py`: the tables, their names and the minute rollup; `migrations.py`: the
  ordered, idempotent migrations that create them;
- `rows.py`: the rows of every table, from the analysis and the hosts' records;
- `sink.py`: `ClickHouseSink`, idempotent columnar writes and parameter-bound queries;
  `errors.py`: what goes wrong with a store;
- `checkpoints.py` and `snapshot_format.py`: the distributed worker's checkpoints, in a
  format that holds data only.

The hosts (`stream_app`) write through it; the dashboards read the table names from it.
"""
