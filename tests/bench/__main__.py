"""`make bench`: runs every `tests/bench/*_bench.py` module's `run()`, prints one table and
writes all rows to bench-results/bench.json.

Each row is {"benchmark", "value", "unit", "target"}; a module may add more keys ("spread":
[min, max] of the runs whose median is the value, shown beside the target).
Pass module names (e.g. `analysis`) to run only those: their rows replace theirs in
bench.json, the other modules' rows stay.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent.parent / "bench-results"


def main(argv: list[str]) -> int:
    wanted = set(argv)
    modules = sorted(p.stem for p in HERE.glob("*_bench.py"))
    rows: list[dict] = []
    for name in modules:
        if wanted and name.removesuffix("_bench") not in wanted and name not in wanted:
            continue
        print(f"running {name} ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        for row in importlib.import_module(f"tests.bench.{name}").run():
            rows.append({"module": name, **row})
        print(f"  {name} took {time.perf_counter() - started:.1f} s", file=sys.stderr)
    width = max((len(r["benchmark"]) for r in rows), default=10)
    print(f"{'benchmark':<{width}}  {'value':>14}  {'unit':<10}  target")
    for r in rows:
        value = r["value"]
        shown = f"{value:14.4g}" if isinstance(value, float) else f"{value!s:>14}"
        target = r.get("target", "")
        if "spread" in r:  # the median of several runs: their range too
            low, high = r["spread"]
            target = f"{target}  (runs {low:.4g}-{high:.4g}, n={r.get('runs', '?')})".strip()
        print(f"{r['benchmark']:<{width}}  {shown}  {r['unit']:<10}  {target}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "bench.json"
    ran = {row["module"] for row in rows}
    kept = [row for row in _earlier_rows(out) if row.get("module") not in ran] if wanted else []
    out.write_text(
        json.dumps(
            {
                "machine": {
                    "python": platform.python_version(),
                    "cpus": os.cpu_count(),
                    "platform": platform.platform(),
                },
                "rows": kept + rows,
            },
            indent=2,
        )
    )
    merged = f" (the other modules' {len(kept)} rows kept from before)" if kept else ""
    print(f"written to {out}{merged}", file=sys.stderr)
    return 0


def _earlier_rows(path: Path) -> list[dict]:
    """The rows a previous run wrote to `path` ([] when there are none to read): a run of
    some modules replaces theirs and keeps the others'."""
    try:
        rows = json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [row for row in rows if isinstance(row, dict)]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
