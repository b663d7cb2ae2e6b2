"""`lagscope changepoints`: offline change-point detection on iteration-time series.

Reads a CSV with columns `series,index,value` (one row per observation, any number of
series, in any order), runs the same `BocdBank` the stream app runs (one update per
distinct index, NaN for a series without an observation there), and reports verified
onsets and recoveries as a table and, optionally, JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lagscope.cli.conventions import STDOUT, UsageError, examples, write_output
from lagscope.simulator import defaults
from lagscope.simulator.errors import TraceError

if TYPE_CHECKING:
    import numpy as np

    from lagscope.simulator.bocd import BocdConfig

# numpy and the detector are imported when the command runs: `--help` must stay cheap.

REQUIRED_COLUMNS = ("series", "index", "value")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "changepoints",
        help="find slowdown onsets and recoveries in iteration-time series (BOCD)",
        description="Bayesian online change-point detection with Falcon-style verification "
        "on series given as CSV rows series,index,value.",
        epilog=examples(
            "lagscope changepoints --input step_times.csv",
            "lagscope changepoints --input step_times.csv --json - | jq '.[].index'",
            "lagscope changepoints --input step_times.csv --min-change 0.05 --warmup 30",
        ),
    )
    parser.add_argument("--input", required=True, help="CSV file with columns series,index,value")
    parser.add_argument(
        "--json",
        dest="json_path",
        metavar="PATH",
        help="write the change points here as JSON ('-': stdout, the table then goes to stderr)",
    )
    parser.add_argument(
        "--min-change",
        type=float,
        default=defaults.BOCD_MIN_RELATIVE_CHANGE,
        help="verification threshold: relative change of the regime means",
    )
    parser.add_argument(
        "--hazard",
        type=float,
        default=defaults.BOCD_HAZARD,
        help="prior probability of a new regime at each observation",
    )
    parser.add_argument(
        "--max-run-length",
        type=int,
        default=defaults.BOCD_MAX_RUN_LENGTH,
        help="run lengths kept per series",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=defaults.BOCD_WARMUP,
        help="observations per series that set its scale before detection",
    )
    parser.set_defaults(handler=run, one_shot=True)


@dataclass(frozen=True)
class SeriesTable:
    names: list[str]
    #: Distinct indices of all series, ascending: one detector update each.
    indices: np.ndarray
    #: (len(indices), len(names)) values, NaN where a series has no observation.
    values: np.ndarray


def read_series_csv(path: Path) -> SeriesTable:
    """Parse and validate the CSV; errors name the file, line and column at fault."""
    import numpy as np

    try:
        handle = path.open(newline="", encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror})") from exc
    with handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None:
            raise TraceError(f"{path}: empty file, expected a header series,index,value")
        header = [name.strip() for name in header]
        missing = [name for name in REQUIRED_COLUMNS if name not in header]
        if missing:
            raise TraceError(
                f"{path}: line 1: missing column(s) {', '.join(missing)} "
                f"(header has {', '.join(header) or 'nothing'})"
            )
        position = {name: header.index(name) for name in REQUIRED_COLUMNS}
        series_names: dict[str, int] = {}
        seen: dict[tuple[int, int], int] = {}
        rows: list[tuple[int, int, float]] = []
        for record in reader:
            line = reader.line_num
            if not record or all(not field.strip() for field in record):
                continue
            if len(record) != len(header):
                raise TraceError(
                    f"{path}: line {line}: {len(record)} field(s), the header has {len(header)}"
                )
            name = record[position["series"]].strip()
            if not name:
                raise TraceError(f"{path}: line {line}, column 'series': empty series name")
            index = _parse_index(record[position["index"]], path, line)
            value = _parse_value(record[position["value"]], path, line)
            column = series_names.setdefault(name, len(series_names))
            if (column, index) in seen:
                raise TraceError(
                    f"{path}: line {line}, column 'index': series {name!r} already has index "
                    f"{index} (line {seen[(column, index)]})"
                )
            seen[(column, index)] = line
            rows.append((column, index, value))
    if not rows:
        raise TraceError(f"{path}: no observations after the header")
    columns = np.array([r[0] for r in rows], dtype=np.int64)
    raw_indices = np.array([r[1] for r in rows], dtype=np.int64)
    indices, step = np.unique(raw_indices, return_inverse=True)
    values = np.full((indices.size, len(series_names)), np.nan)
    values[step, columns] = [r[2] for r in rows]
    return SeriesTable(list(series_names), indices, values)


def _parse_index(field: str, path: Path, line: int) -> int:
    try:
        return int(field.strip())
    except ValueError:
        raise TraceError(
            f"{path}: line {line}, column 'index': {field!r} is not an integer"
        ) from None


def _parse_value(field: str, path: Path, line: int) -> float:
    try:
        value = float(field.strip())
    except ValueError:
        raise TraceError(
            f"{path}: line {line}, column 'value': {field!r} is not a number"
        ) from None
    if not math.isfinite(value) or value <= 0.0:
        raise TraceError(
            f"{path}: line {line}, column 'value': {field.strip()!r} is not a positive finite "
            "iteration time"
        )
    return value


def detect(table: SeriesTable, config: BocdConfig) -> list[dict[str, Any]]:
    """Verified change points, as JSON-ready dicts, ordered by series then index."""
    from lagscope.simulator.bocd import BocdBank

    bank = BocdBank(len(table.names), config)
    found: list[dict[str, Any]] = []
    for row in table.values:
        for event in bank.update(row):
            found.append(
                {
                    "series": table.names[event.series],
                    "index": int(table.indices[event.index]),
                    "kind": event.kind,
                    "before_mean": event.before_mean,
                    "after_mean": event.after_mean,
                    "probability": event.probability,
                }
            )
    order = {name: number for number, name in enumerate(table.names)}
    found.sort(key=lambda change: (order[change["series"]], change["index"]))
    return found


def format_table(changes: list[dict[str, Any]]) -> str:
    from lagscope.simulator.bocd import relative_change

    if not changes:
        return "no change points"
    width = max(len("series"), *(len(change["series"]) for change in changes))
    lines = [
        f"{'series':<{width}}  {'index':>10}  {'kind':<8}  {'before':>10}  {'after':>10}  "
        f"{'change':>8}  {'prob':>5}"
    ]
    for change in changes:
        # Signed larger-over-smaller change, the quantity the threshold applies to.
        sign = 1.0 if change["kind"] == "onset" else -1.0
        ratio = sign * relative_change(change["before_mean"], change["after_mean"])
        lines.append(
            f"{change['series']:<{width}}  {change['index']:>10}  {change['kind']:<8}  "
            f"{change['before_mean']:>10.4g}  {change['after_mean']:>10.4g}  "
            f"{ratio:>+8.1%}  {change['probability']:>5.2f}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from lagscope.simulator.bocd import BocdConfig

    try:
        config = BocdConfig(
            min_relative_change=args.min_change,
            hazard=args.hazard,
            max_run_length=args.max_run_length,
            warmup=args.warmup,
        )
    except ValueError as exc:
        raise UsageError(f"invalid detector settings: {exc}") from None
    table = read_series_csv(Path(args.input))
    changes = detect(table, config)
    print(format_table(changes), file=sys.stderr if args.json_path == STDOUT else sys.stdout)
    if args.json_path:
        where = write_output(args.json_path, json.dumps(changes, indent=2), option="--json")
        print(f"wrote {len(changes)} change point(s) to {where}", file=sys.stderr)
    return 0
