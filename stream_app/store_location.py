"""Where the store is when a command is not told: one place, read by every command.

Light on purpose (no client library is imported), so that `--help` can show the default.
"""

from __future__ import annotations

#: The environment setting that names the store for every command and host.
DSN_ENV = "LAGSCOPE_CLICKHOUSE_DSN"

#: Default DSN: an embedded chDB store under the working directory.
DEFAULT_DSN = "chdb://./lagscope-data/chdb"
