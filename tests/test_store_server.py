"""The shared store of the multi-process tests (tests/chdb_http_server.py) answers as a
ClickHouse server does where clickhouse-connect changes how it sends a query: bound
parameters too long for a URL arrive as a multipart form."""

from __future__ import annotations

from pathlib import Path

import pytest

from lagscope.store.errors import StoreError
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


def test_a_lookup_of_thousands_of_steps_binds_its_keys_in_parts(tmp_path: Path) -> None:
    """A worker's write of several partitions' backlogs looks up thousands of steps: bound
    whole, the keys are a form field longer than a ClickHouse server takes (128 KiB), and
    the request fails. The sink binds them in parts."""
    server = start_store_server(tmp_path / "store")
    try:
        sink = ClickHouseSink(server.dsn("parts"))
        sink.ensure_schema()
        job = "a-job-with-a-long-name-of-a-real-cluster-and-its-attempt"
        keys = [(job, 0, step) for step in range(3_000)]
        with pytest.raises(StoreError, match="field value too long"):
            sink.query(
                "SELECT count() FROM steps WHERE (job_id, attempt, step) IN "
                "{keys:Array(Tuple(String, UInt32, UInt64))}",
                {"keys": keys},
            )
        stored = keys[::7]
        sink.client.command(
            "INSERT INTO steps (job_id, attempt, step, version) "
            "SELECT {job:String}, 0, number * 7, 3 FROM numbers({n:UInt32})",
            {"job": job, "n": len(stored)},
        )
        assert sink.stored_versions(keys) == dict.fromkeys(stored, 3)
    finally:
        server.stop()
