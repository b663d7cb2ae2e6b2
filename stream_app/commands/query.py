"""`lagscope query "SELECT ..."`: ad-hoc SQL against the store (thin adapter).

The store is `--dsn`, else the environment's LAGSCOPE_CLICKHOUSE_DSN, else the embedded
chDB store in ./lagscope-data/chdb (`chdb://./lagscope-data/chdb`).

Exactly one statement runs (chDB would run a `;`-separated second one), and it runs with
ClickHouse's `readonly = 2` (reads, and settings changes, only) unless `--write` is given.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import math
import os
import sys
from typing import Any

from lagscope.stream_app.store_location import DEFAULT_DSN, DSN_ENV


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "query",
        help="run SQL against the lagscope store",
        description="Run one SQL statement against the lagscope ClickHouse store and print "
        "the result. Tables: steps, attribution, worker_slowdown, changepoints, diagnoses, "
        "jobs, ops, dead_letters, steps_1m (read derived tables with FINAL).",
    )
    parser.add_argument("sql", help='the statement, e.g. "SELECT * FROM steps FINAL LIMIT 5"')
    parser.add_argument(
        "--dsn",
        help=f"chdb:///dir or http(s)://user:pass@host:8123/db (default: ${DSN_ENV}, "
        f"else {DEFAULT_DSN})",
    )
    parser.add_argument(
        "--format", choices=("table", "csv", "json"), default="table", help="output format"
    )
    parser.add_argument(
        "--write",
        action="store_true",
        help="allow a statement that changes the store (default: read-only)",
    )
    parser.set_defaults(handler=run, extra="store")


def run(args: argparse.Namespace) -> int:
    from lagscope.stream_app.sink import ClickHouseSink, StoreError

    dsn = args.dsn or os.environ.get(DSN_ENV) or DEFAULT_DSN
    count = statement_count(args.sql)
    if count != 1:
        print(
            f"lagscope query: error: expected exactly one SQL statement, got {count} "
            "(separated by ';')",
            file=sys.stderr,
        )
        return 2
    try:
        with ClickHouseSink(dsn, create=False) as store:
            columns, rows = store.query(args.sql, settings=None if args.write else {"readonly": 2})
    except StoreError as exc:
        print(f"lagscope query: error: {exc}", file=sys.stderr)
        return 2
    if args.format == "json":
        records = [dict(zip(columns, map(_plain, row), strict=True)) for row in rows]
        print(json.dumps(records, indent=2))
    elif args.format == "csv":
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([_text(v) for v in row] for row in rows)
    else:
        print_table(columns, rows)
    return 0


def statement_count(sql: str) -> int:
    """How many statements `sql` holds, splitting on `;` outside ClickHouse's string
    literals ('...', with backslash escapes and doubled quotes), quoted identifiers ("..."
    and `...`) and comments (--, # and /* */); a segment of only blanks and comments is
    no statement."""
    count, has_code, i, n = 0, False, 0, len(sql)
    while i < n:
        char = sql[i]
        if char in "'\"`":
            has_code = True
            i += 1
            while i < n:
                if sql[i] == "\\":
                    i += 2
                    continue
                if sql[i] == char:
                    if i + 1 < n and sql[i + 1] == char:
                        i += 2
                        continue
                    break
                i += 1
        elif sql.startswith("--", i) or char == "#":
            newline = sql.find("\n", i)
            i = n if newline < 0 else newline
        elif sql.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if sql.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif sql.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
            continue
        elif char == ";":
            count += has_code
            has_code = False
        elif not char.isspace():
            has_code = True
        i += 1
    return count + has_code


def print_table(columns: list[str], rows: list[tuple[Any, ...]]) -> None:
    cells = [[_text(v) for v in row] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    numeric = [
        all(isinstance(row[i], int | float) and not isinstance(row[i], bool) for row in rows)
        for i in range(len(columns))
    ]

    def line(values: list[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ).rstrip()

    print(line(columns))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print(line(row))
    print(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")


def _plain(value: Any) -> Any:
    """A JSON-ready value: datetimes as ISO text, NaN/inf as null."""
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def _text(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if isinstance(value, list | tuple | dict):
        return json.dumps(_plain(value))
    return str(value)
