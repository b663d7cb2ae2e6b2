"""`lagscope worker` whose store fails on purpose, for the store-fault tests.

The worker runs unchanged on its real chDB store; only the store client's inserts into one
table are made to fail the way a dropped connection fails them (clickhouse-connect's
OperationalError), as `LAGSCOPE_TEST_STORE_FAULT` says:

    table=steps,after=0,count=2     the 1st and 2nd inserts into steps fail
    table=steps,after=0,seconds=6   every insert into steps fails for 6 s from the 1st on
    table=steps,after=2,hang=1      the 3rd insert into steps never returns (a store that
                                    took the connection and never answers): the worker's
                                    loop is wedged, its metrics thread is not

Run as `python -m tests.faulty_store worker ...` (the arguments of `lagscope worker`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from clickhouse_connect.driver.exceptions import OperationalError

from lagscope.cli import main
from lagscope.stream_app import worker

FAULT_ENV = "LAGSCOPE_TEST_STORE_FAULT"


class InsertFault:
    """Decides, insert by insert, whether the store is down."""

    def __init__(self, spec: str) -> None:
        fields = dict(item.split("=", 1) for item in spec.split(","))
        self.table = fields.get("table", "steps")
        self.after = int(fields.get("after", 0))
        self.count = int(fields["count"]) if "count" in fields else None
        self.seconds = float(fields["seconds"]) if "seconds" in fields else None
        self.hang = fields.get("hang") == "1"
        self.seen = 0
        self.failed = 0
        self.down_since: float | None = None

    def check(self, table: str) -> None:
        if table != self.table:
            return
        self.seen += 1
        if self.seen <= self.after:
            return
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = now
        if self.count is not None and self.failed >= self.count:
            return
        if self.seconds is not None and now - self.down_since >= self.seconds:
            return
        self.failed += 1
        if self.hang:
            print(f"injected store hang: insert into {table}", file=sys.stderr, flush=True)
            threading.Event().wait()
        print(f"injected store fault #{self.failed}: insert into {table}", file=sys.stderr)
        raise OperationalError(f"injected fault: connection to the store lost ({table})")


class FaultyClickHouseSink(worker.ClickHouseSink):
    """The real sink; its client's inserts pass through an `InsertFault` first."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        fault = InsertFault(os.environ[FAULT_ENV])
        client = self.client
        insert, insert_arrow = client.insert, client.insert_arrow

        def faulty_insert(table: str, *a: Any, **kw: Any) -> Any:
            fault.check(table)
            return insert(table, *a, **kw)

        def faulty_insert_arrow(table: str, *a: Any, **kw: Any) -> Any:
            fault.check(table)
            return insert_arrow(table, *a, **kw)

        client.insert = faulty_insert
        client.insert_arrow = faulty_insert_arrow


if __name__ == "__main__":
    if os.environ.get(FAULT_ENV):
        worker.ClickHouseSink = FaultyClickHouseSink  # type: ignore[misc]
    sys.exit(main())
