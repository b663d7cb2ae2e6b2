"""What a run stored, as one digest: two runs of the same job that stored the same numbers
give the same digest (the one- and two-process paths of `tests/bench/core_scale.py` and of
the worker, in `make bench`).

The derived tables as a reader sees them (`FINAL`: each key's latest version), every
column but the wall-clock times of processing (`processed_at`, `received_at`,
`updated_at`), every row, in a fixed order; floats by their exact repr, so a digest
differs where a bit does.

`python -m tests.bench.stored_rows DSN` prints the digest of a store no other process has
open (an exited worker's chDB directory).
"""

from __future__ import annotations

import hashlib
import sys

from lagscope.store.sink import ClickHouseSink

#: The tables a job's analysis writes.
TABLES = ("steps", "attribution", "worker_slowdown", "changepoints", "diagnoses", "episodes")
#: When a row was processed or written: the host's clock, not the job's.
WALL_CLOCK_COLUMNS = ("processed_at", "received_at", "updated_at")


def stored_digest(sink: ClickHouseSink) -> str:
    """The sha256 of the derived tables' rows, with each table's row count before it."""
    digest = hashlib.sha256()
    for table in TABLES:
        columns, rows = sink.query(f"SELECT * FROM {table} FINAL")
        keep = [i for i, name in enumerate(columns) if name not in WALL_CLOCK_COLUMNS]
        lines = sorted(repr(tuple(row[i] for i in keep)) for row in rows)
        digest.update(f"{table} {len(lines)}\n".encode())
        for line in lines:
            digest.update(line.encode() + b"\n")
    return digest.hexdigest()


if __name__ == "__main__":
    store = ClickHouseSink(sys.argv[1])
    print(stored_digest(store))
    store.close()
