"""`lagscope query "SELECT ..."`: ad-hoc SQL against the store (thin adapter).

The store is `--dsn`, else the environment's LAGSCOPE_CLICKHOUSE_DSN, else the embedded
chDB store in ./lagscope-data/chdb (`chdb://./lagscope-data/chdb`), as for every command.

Rows are streamed from the store to stdout block by block: a result of any size is never
held in memory whole. CSV and JSON keep every float's full precision (the shortest text
that reads back to the same double); the table, for eyes, shows six significant digits and
sizes its columns on the first block of rows.

Exactly one statement runs (chDB would run a `;`-separated second one), and it runs with
ClickHouse's `readonly = 2` (reads, and settings changes, only) unless `--write` is given.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import itertools
import json
import math
import sys
from collections.abc import Iterable
from typing import Any

from lagscope.cli.conventions import examples
from lagscope.store.dsn import DSN_HELP, resolve_dsn

#: chDB's answer to a streamed statement that is not a query (DROP, INSERT, ...).
STREAMING_UNSUPPORTED = "Streaming query is not supported"

#: Rows the table format sizes its columns on (and the rows buffered at most).
TABLE_BLOCK_ROWS = 1000


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "query",
        help="run SQL against the lagscope store",
        description="Run one SQL statement against the lagscope ClickHouse store and print "
        "the result. Tables: steps, attribution, worker_slowdown, changepoints, diagnoses, "
        "jobs, ops, dead_letters, steps_1m (read derived tables with FINAL).",
        epilog=examples(
            'lagscope query "SELECT step, slowdown FROM steps FINAL ORDER BY step"',
            'lagscope query --format csv "SELECT * FROM ops" > ops.csv',
            'lagscope query --dsn chdb://out/demo/chdb --format json "SELECT * FROM jobs FINAL"',
        ),
    )
    parser.add_argument("sql", help='the statement, e.g. "SELECT * FROM steps FINAL LIMIT 5"')
    parser.add_argument("--dsn", help=DSN_HELP)
    parser.add_argument(
        "--format",
        choices=("table", "csv", "json"),
        default="table",
        help="output format (csv and json keep full float precision)",
    )
    parser.add_argument(
        "--write",
        action="store_true",
        help="allow a statement that changes the store (default: read-only)",
    )
    parser.set_defaults(handler=run, extra="store")


def run(args: argparse.Namespace) -> int:
    from clickhouse_connect.driver.exceptions import ClickHouseError

    from lagscope.store.errors import StoreError
    from lagscope.store.sink import ClickHouseSink

    count = statement_count(args.sql)
    if count != 1:
        print(
            f"lagscope query: error: expected exactly one SQL statement, got {count} "
            "(separated by ';')",
            file=sys.stderr,
        )
        return 2
    try:
        with ClickHouseSink(resolve_dsn(args.dsn), create=False) as store:
            settings = None if args.write else {"readonly": 2}
            try:
                with store.client.query_rows_stream(args.sql, settings=settings) as rows:
                    columns = list(rows.source.column_names)
                    WRITERS[args.format](columns, rows)
                    return 0
            except BrokenPipeError:
                raise  # the reader left (`| head`): silence and 141, not a failed query
            except (ClickHouseError, OSError) as exc:
                if STREAMING_UNSUPPORTED not in str(exc):
                    first_line = store.error_text(exc, first_line=True)
                    raise StoreError(f"{store.dsn.shown}: query failed: {first_line}") from None
            # chDB streams SELECTs only; DDL and writes return no rows worth streaming.
            columns, result = store.query(args.sql, settings=settings)
            WRITERS[args.format](columns, result)
    except StoreError as exc:
        print(f"lagscope query: error: {exc}", file=sys.stderr)
        return 2
    return 0


def write_json(columns: list[str], rows: Iterable[tuple[Any, ...]]) -> None:
    """A JSON array of one object per row, written as the rows arrive."""
    out = sys.stdout
    separator = "[\n  "
    for row in rows:
        out.write(separator + json.dumps(dict(zip(columns, map(_plain, row), strict=True))))
        separator = ",\n  "
    out.write("[]\n" if separator.startswith("[") else "\n]\n")


def write_csv(columns: list[str], rows: Iterable[tuple[Any, ...]]) -> None:
    writer = csv.writer(sys.stdout, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([_exact_text(v) for v in row])


def write_table(columns: list[str], rows: Iterable[tuple[Any, ...]]) -> None:
    """Aligned columns, sized on the first block of rows (later wider values push their
    line out rather than hold the whole result back)."""
    iterator = iter(rows)
    first = list(itertools.islice(iterator, TABLE_BLOCK_ROWS))
    print_table(columns, first, more=iterator)


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


def print_table(
    columns: list[str],
    rows: list[tuple[Any, ...]],
    more: Iterable[tuple[Any, ...]] = (),
) -> None:
    """`rows` size the columns; `more` rows follow in the same layout."""
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
    count = len(rows)
    for row in more:
        print(line([_text(v) for v in row]))
        count += 1
    print(f"({count} row{'s' if count != 1 else ''})")


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


def _exact_text(value: Any) -> str:
    """CSV text of a value: floats as their shortest exact repr, the rest as in the table."""
    if isinstance(value, float):
        return repr(value)
    return _text(value)


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


WRITERS = {"json": write_json, "csv": write_csv, "table": write_table}
