"""The shared store of the multi-process tests (tests/chdb_http_server.py) answers as a
ClickHouse server does where clickhouse-connect changes how it sends a query: bound
parameters too long for a URL arrive as a multipart form."""

from __future__ import annotations

from pathlib import Path

from lagscope.store.sink import ClickHouseSink
from tests.worker_util import start_store_server


def test_a_lookup_too_long_for_a_url_is_answered(tmp_path: Path) -> None:
    """A worker's exactly-once lookup of 300 steps (a 256-step write of a backlog, and
    more) binds ~8 KB of keys: past clickhouse-connect's 4 KB, sent as a form."""
    server = start_store_server(tmp_path / "store")
    try:
        sink = ClickHouseSink(server.dsn("forms"))
        sink.ensure_schema()
        keys = [("a-job-with-a-long-name-of-a-real-cluster", 0, step) for step in range(300)]
        assert sink.stored_versions(keys) == {}
        _, rows = sink.query("SELECT length({steps:Array(UInt64)})", {"steps": list(range(3000))})
        assert rows == [(3000,)]
    finally:
        server.stop()
