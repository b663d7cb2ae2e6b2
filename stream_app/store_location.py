"""Where the store is when a command is not told: one place, read by every command
(`run`, `query`, `worker`; `demo` keeps its own store inside the `--out` it deletes).

Light on purpose (no client library is imported), so that `--help` can show the default.
"""

from __future__ import annotations

#: The environment setting that names the store for every command and host.
DSN_ENV = "LAGSCOPE_CLICKHOUSE_DSN"

#: Default DSN: an embedded chDB store under the working directory.
DEFAULT_DSN = "chdb://./lagscope-data/chdb"

#: What `--help` says about a command's `--dsn`, the same for every command.
DSN_HELP = (
    f"the store: chdb:///dir (embedded) or http(s)://user:pass@host:8123/db "
    f"(default: ${DSN_ENV}, else {DEFAULT_DSN})"
)


def resolve_dsn(given: str | None) -> str:
    """The store a command uses: the one it was given, else the environment's, else the
    default. Every command resolves it here, so `lagscope run` writes where `lagscope
    query` and `lagscope worker` look."""
    import os

    return given or os.environ.get(DSN_ENV) or DEFAULT_DSN
