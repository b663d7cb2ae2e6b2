"""`make bench`: runs every `tests/bench/*_bench.py` module's `run()`, prints one table and
writes all rows to bench-results/bench.json.

Each row is {"benchmark", "value", "unit", "target"}; a module may add more keys ("spread":
[min, max] of the runs whose median is the value, shown beside the target).
Pass module names (e.g. `analysis`) to run only those.
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
    out.write_text(
        json.dumps(
            {
                "machine": {
                    "python": platform.python_version(),
                    "cpus": os.cpu_count(),
                    "platform": platform.platform(),
                },
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"written to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
