"""What-if analysis speed and memory: the three reference traces and a 12,288-GPU job.

Each measurement runs in a fresh subprocess pinned to one core, so peak memory above the
interpreter's baseline (after imports) is measured cleanly and numpy cannot use a second
core.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REFERENCE = Path(
    os.environ.get("LAGSCOPE_REFERENCE_TRACES", REPO / "tests" / "data" / "reference-traces")
)

_CHILD = r"""
import json, statistics, sys, time, tracemalloc
import numpy as np
from lagscope.producers.reference_format import load_meta, load_trace
from lagscope.simulator.prepare import prepare
from lagscope.simulator.whatif import WhatIfAnalysis, Variant, analyze
from lagscope.simulator.generate import JobSpec, CostModel, generate_job

mode, arg = sys.argv[1], sys.argv[2]
if mode == "scale":
    job = generate_job(JobSpec(name="scale", dp=192, pp=8, tp=8, microbatches=32, steps=1,
                               cost=CostModel(noise_cv=0.03), seed=1))
    trace, meta = job.trace, job.meta
def vm(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
if mode == "trace":
    # The first parquet read imports pyarrow's lazy modules (~30 MB): part of the
    # interpreter's baseline, not of the analysis.
    load_trace(f"{arg}/trace-ST.parquet")
# Reset the kernel's peak-RSS mark so the peak below is this work's alone.
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
baseline_rss = vm("VmRSS")
tracemalloc.start()
def timed(fn, repeat=5):
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter(); out = fn(); times.append(time.perf_counter() - t)
    return out, statistics.median(times)
rows = {}
if mode == "trace":
    name = sys.argv[3]
    (trace, meta), rows["load"] = timed(lambda: (load_trace(f"{arg}/trace-{name}.parquet"),
                                                 load_meta(f"{arg}/meta-{name}.yaml")))
prepared, rows["prepare"] = timed(lambda: prepare(trace, meta))
wa, rows["compile"] = timed(lambda: WhatIfAnalysis(prepared))
_, rows["base simulation"] = timed(lambda: wa.run([Variant("measured", delay="all"),
                                                   Variant("measured"), Variant("ideal")]))
labels = sorted(set(prepared.node_optype))
def attributions():
    from lagscope.simulator import optypes as ot
    lab = [ot.report_label(t) for t in prepared.node_optype]
    sels = ([wa.nodes_labelled(lab, n) for n in sorted(set(lab))]
            + [wa.dp_rows(d) for d in range(prepared.n_dp)]
            + [wa.stage_rows(s) for s in range(prepared.n_stages)])
    return wa.run([Variant("ideal", swap=s) for s in sels])
_, rows["all attributions"] = timed(attributions)
result, rows["full analysis"] = timed(lambda: analyze(prepared))
if mode == "trace":
    rows["end to end"] = rows["load"] + rows["prepare"] + rows["full analysis"]
else:
    rows["end to end"] = rows["prepare"] + rows["full analysis"]
_, traced_peak = tracemalloc.get_traced_memory()
peak_rss = vm("VmHWM")
rows["peak memory (tracemalloc)"] = traced_peak / 2**20
rows["peak RSS above baseline"] = (peak_rss - baseline_rss) / 1024
rows["ops"] = int(trace.n_rows)
rows["slowdown"] = result.slowdown
print(json.dumps(rows))
"""


def _measure(*args: str) -> dict:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-c", _CHILD, *args]
    if hasattr(os, "sched_setaffinity"):
        cmd = ["taskset", "-c", "0", *cmd] if _has_taskset() else cmd
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _has_taskset() -> bool:
    return subprocess.run(["which", "taskset"], capture_output=True).returncode == 0


def run() -> list[dict]:
    rows: list[dict] = []
    for name in ("AR", "SE", "ST"):
        m = _measure("trace", str(REFERENCE), name)
        target_time = "< 0.15 s (reference ~1.3 s)" if name == "AR" else ""
        target_mem = "< 120 MB (reference ~240 MB)" if name == "AR" else ""
        for part in (
            "load",
            "prepare",
            "compile",
            "base simulation",
            "all attributions",
            "full analysis",
        ):
            rows.append(
                {"benchmark": f"{name}: {part}", "value": m[part], "unit": "s", "target": ""}
            )
        rows.append(
            {
                "benchmark": f"{name}: load + prepare + full analysis",
                "value": m["end to end"],
                "unit": "s",
                "target": target_time,
            }
        )
        rows.append(
            {
                "benchmark": f"{name}: peak RSS above baseline",
                "value": m["peak RSS above baseline"],
                "unit": "MiB",
                "target": target_mem,
            }
        )
        rows.append(
            {
                "benchmark": f"{name}: peak traced allocations",
                "value": m["peak memory (tracemalloc)"],
                "unit": "MiB",
                "target": "",
            }
        )
    m = _measure("scale", "-")
    label = "12,288 GPUs (dp192 x pp8 x tp8, 32 mb)"
    for part in ("prepare", "base simulation", "all attributions", "full analysis"):
        rows.append(
            {
                "benchmark": f"{label}: {part}",
                "value": m[part],
                "unit": "s",
                "target": "< 1 s" if part == "all attributions" else "",
            }
        )
    rows.append(
        {
            "benchmark": f"{label}: peak RSS above baseline",
            "value": m["peak RSS above baseline"],
            "unit": "MiB",
            "target": "",
        }
    )
    rows.append(
        {"benchmark": f"{label}: ops in trace", "value": m["ops"], "unit": "ops", "target": ""}
    )
    return rows
