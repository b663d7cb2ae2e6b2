"""Where the store is, and what a DSN names.

Where: the store a command is given, else `$LAGSCOPE_CLICKHOUSE_DSN`, else the default;
one place, read by every command (`run`, `query`, `worker`; `demo` keeps its own store
inside the `--out` it deletes).

DSN forms:

- `chdb:///abs/dir`, `chdb://./rel/dir`, `chdb://memory`: the embedded chDB engine (no
  server) keeping its data in that directory; `?database=name` picks a database (default
  `default`). chDB opens one directory per process: every sink of a process must name the
  same one.
- `http://user:pass@host:8123/db`, `https://...:8443/db`: a ClickHouse server.

A DSN is shown in messages without its password (`ParsedDsn.shown`, `shown_dsn`).

Light on purpose (no client library is imported), so that `--help` can show the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from lagscope.producers.redact import MASK, redact_url
from lagscope.store.errors import StoreError

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


def directory_to_make(dsn: str) -> Path | None:
    """The outermost directory that opening `dsn`'s embedded store would make (None: a
    server, a store in memory, or one whose directory exists): what a command that made
    the store and then stored nothing may remove again, and nothing more.

    >>> directory_to_make("http://localhost:8123/default") is None
    True
    >>> directory_to_make("chdb:///") is None
    True
    >>> str(directory_to_make("chdb:///nonexistent-root/lagscope-data/chdb"))
    '/nonexistent-root'
    """
    parsed = parse_dsn(dsn)
    if parsed.kind != "chdb" or not parsed.path:
        return None
    made = None
    for directory in (Path(parsed.path).absolute(), *Path(parsed.path).absolute().parents):
        if directory.exists():
            break
        made = directory
    return made


@dataclass(frozen=True)
class ParsedDsn:
    kind: str  # "chdb" or "http"
    path: str | None = None  # chdb data directory; None keeps data in memory
    database: str | None = None
    url: str | None = None  # http(s) DSN for clickhouse-connect

    @property
    def shown(self) -> str:
        """The DSN without its password, for messages."""
        if self.kind == "chdb":
            return f"chdb://{self.path or 'memory'}" + (
                f"?database={self.database}" if self.database else ""
            )
        parts = urlsplit(self.url or "")
        netloc = parts.hostname or ""
        if parts.port:
            netloc += f":{parts.port}"
        if parts.username:
            netloc = f"{parts.username}:{MASK}@{netloc}"
        return f"{parts.scheme}://{netloc}{parts.path}"


def parse_dsn(dsn: str) -> ParsedDsn:
    """Split a DSN into what the client needs; a DSN of another form is a StoreError, whose
    message shows the DSN without its password (`shown_dsn`)."""
    if not isinstance(dsn, str) or not dsn.strip():
        raise StoreError("ClickHouse DSN is empty; expected chdb:///dir or http://host:8123/db")
    dsn = dsn.strip()
    if dsn.startswith("chdb://"):
        rest, _, query = dsn.removeprefix("chdb://").partition("?")
        if "@" in rest.partition("/")[0]:
            # chdb://user:pw@/dir would otherwise be a directory named after the password.
            raise StoreError(
                f"DSN {shown_dsn(dsn)}: an embedded chDB store has no user or password; "
                "write chdb:///path/to/dir"
            )
        options = parse_qs(query, keep_blank_values=True)
        unknown = sorted(set(options) - {"database"})
        if unknown:
            raise StoreError(
                f"DSN {shown_dsn(dsn)}: unknown option(s) {', '.join(unknown)} "
                "(a chDB DSN takes only ?database=NAME)"
            )
        path = unquote(rest)
        database = options.get("database", [None])[0]
        in_memory = path in ("", "memory", ":memory:")
        return ParsedDsn("chdb", path=None if in_memory else path, database=database)
    try:
        parts = urlsplit(dsn)
        hostname, _ = parts.hostname, parts.port
    except ValueError as exc:  # a port that is no number, a broken IPv6 address
        raise StoreError(
            f"DSN {shown_dsn(dsn)}: not a valid URL ({redact_url(str(exc))})"
        ) from None
    if parts.scheme in ("http", "https") and hostname:
        if parts.query:
            names = ", ".join(sorted(parse_qs(parts.query, keep_blank_values=True))) or "?"
            raise StoreError(
                f"DSN {shown_dsn(dsn)}: unknown option(s) {names} (a server DSN takes none: "
                "write http(s)://user:password@host:8123/database)"
            )
        database = parts.path.strip("/") or None
        return ParsedDsn("http", database=database, url=dsn)
    raise StoreError(
        f"DSN {shown_dsn(dsn)} is not supported: use chdb:///path/to/dir (embedded) "
        "or http(s)://user:pass@host:8123/db (server)"
    )


def shown_dsn(dsn: str) -> str:
    """A DSN as a message may show it: no password, no secret option, and nothing before
    an `@` of a DSN without a scheme (`user:pw@host`).

    >>> shown_dsn("chdb://user:pw@/data?password=pw")
    'chdb://user:***@/data?password=***'
    >>> shown_dsn("user:pw@clickhouse:8123")
    '***@clickhouse:8123'
    """
    shown = redact_url(dsn)
    if "://" not in shown and "@" in shown:
        shown = f"{MASK}@{shown.rpartition('@')[2]}"
    return shown
