"""Pictures at production size: generated jobs of 128, 1,024, 12,288 and 99,840 GPUs
through whole `lagscope generate` and `lagscope analyze` processes (with and without
--report, --heatmap and --timeline), the pictures' own render times in process, their
sizes, and Chromium loading and screenshotting the report.

Each timing is the median of RUNS runs, with their spread (min, max): the machine is
shared. Until the clock estimate solved its graph iteratively (`simulator/clocks.py`),
`lagscope analyze` could not take the 99,840-GPU job (a dense least squares over 12,480
workers: 11 GB, unfinished after 3 minutes), and this bench analysed it in process without it.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

RUNS = 3
#: (GPUs, dp, pp, tp); tp ranks share their (dp, pp) worker.
SIZES = ((128, 8, 4, 4), (1024, 32, 4, 8), (12288, 192, 8, 8), (99840, 1560, 8, 8))
STEPS = 20
LAGSCOPE = [sys.executable, "-m", "lagscope.cli"]


def _process(command: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one whole process."""
    began = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    took = time.perf_counter() - began
    if status:
        raise RuntimeError(f"{' '.join(command)} failed: {child.stderr.read().decode()[-2000:]}")
    return took, usage.ru_maxrss / 1024


def _row(benchmark: str, values: list[float], unit: str, target: str = "") -> dict:
    return {
        "benchmark": benchmark,
        "value": statistics.median(values),
        "unit": unit,
        "target": target,
        "spread": [min(values), max(values)],
        "runs": len(values),
    }


def _timed(fn: Callable[[], object]) -> list[float]:
    times = []
    for _ in range(RUNS):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return times


def _chromium_times(report: Path) -> list[float] | None:
    """Seconds to load the report and take a full-page screenshot, per run."""
    chromium = os.environ.get("LAGSCOPE_CHROMIUM") or shutil.which("chromium")
    if not chromium:
        return None
    from playwright.sync_api import sync_playwright

    times = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=chromium, args=["--no-sandbox", "--disable-gpu"]
        )
        for _ in range(RUNS):
            page = browser.new_context(
                offline=True, viewport={"width": 1100, "height": 900}
            ).new_page()
            began = time.perf_counter()
            page.goto(report.as_uri())
            page.screenshot(path=str(report.with_suffix(".png")), full_page=True)
            times.append(time.perf_counter() - began)
            page.context.close()
        browser.close()
    return times


def _whole_processes(gpus: int, dp: int, pp: int, tp: int, work: Path) -> list[dict]:
    label = f"pictures {gpus:,} GPUs (dp {dp} x pp {pp} x tp {tp}, {STEPS} steps)"
    job = work / f"job-{gpus}"
    generate = [
        *LAGSCOPE, "generate", "--out", str(job), "--dp", str(dp), "--pp", str(pp),
        "--tp", str(tp), "--steps", str(STEPS),
        "--inject", f"slow_worker:dp={2 * dp // 3},stage={pp // 2},factor=1.5,"
        "start_step=5,end_step=15",
    ]  # fmt: skip
    generated = [_process(generate) for _ in range(RUNS)]
    analyze = [*LAGSCOPE, "analyze", "--trace", str(job / "trace.parquet"),
               "--meta", str(job / "meta.yaml")]  # fmt: skip
    bare = [_process(analyze) for _ in range(RUNS)]
    outputs = ["--report", str(work / f"{gpus}.html"), "--heatmap", str(work / f"{gpus}.png"),
               "--timeline", str(work / f"{gpus}.json")]  # fmt: skip
    pictured = [_process([*analyze, *outputs]) for _ in range(RUNS)]
    timeline = json.loads((work / f"{gpus}.json").read_text())["traceEvents"]
    rows = [
        _row(f"{label}: lagscope generate (process)", [t for t, _ in generated], "s"),
        _row(f"{label}: lagscope analyze (process)", [t for t, _ in bare], "s"),
        _row(
            f"{label}: analyze --report --heatmap --timeline (process)",
            [t for t, _ in pictured],
            "s",
        ),
        _row(f"{label}: analyze, peak RSS", [m for _, m in bare], "MiB"),
        _row(f"{label}: analyze with pictures, peak RSS", [m for _, m in pictured], "MiB"),
        _row(f"{label}: report size", [(work / f"{gpus}.html").stat().st_size / 1e3], "kB"),
        _row(f"{label}: heatmap PNG size", [(work / f"{gpus}.png").stat().st_size / 1e3], "kB"),
        _row(
            f"{label}: timeline size",
            [(work / f"{gpus}.json").stat().st_size / 1e6],
            "MB",
            "<= ~50 MB (250,000 slices)",
        ),
        _row(
            f"{label}: timeline slices",
            [sum(e["ph"] == "X" for e in timeline)],
            "slices",
            "<= 250,000",
        ),
    ]
    chromium = _chromium_times(work / f"{gpus}.html")
    if chromium:
        rows.append(_row(f"{label}: Chromium load + full-page screenshot", chromium, "s"))
    return rows


def _in_process(gpus: int, dp: int, pp: int, tp: int, steps: int, work: Path) -> list[dict]:
    """The pictures' own cost, the analysis done once beforehand."""
    import numpy as np

    from lagscope.dashboards.heatmap import draw_worker_heatmap
    from lagscope.dashboards.report import ReportData, render_report
    from lagscope.simulator.diagnose import diagnose
    from lagscope.simulator.generate import JobSpec, SlowWorker, generate_job
    from lagscope.simulator.prepare import prepare
    from lagscope.simulator.timeline import choose_window, trace_events
    from lagscope.simulator.whatif import WhatIfAnalysis, analyze

    label = f"pictures {gpus:,} GPUs (dp {dp} x pp {pp} x tp {tp}, {steps} steps)"
    began = time.perf_counter()
    job = generate_job(
        JobSpec(name=f"{gpus}", dp=dp, pp=pp, tp=tp, steps=steps, seed=1,
                stragglers=(SlowWorker(dp=2 * dp // 3, stage=pp // 2, factor=1.5),))
    )  # fmt: skip
    prepared = prepare(job.trace, job.meta)
    result = analyze(prepared)
    diagnosis = diagnose(result, prepared)
    analysed = time.perf_counter() - began
    machines = {(d, s): f"node-{(s * dp + d) * tp // 8:05d}" for d in range(dp) for s in range(pp)}
    data = ReportData(title=f"{gpus:,} GPUs", result=result, diagnosis=diagnosis,
                      worker_machines=machines)  # fmt: skip
    page = render_report(data)
    report = work / f"in-process-{gpus}.html"
    report.write_text(page)

    def timeline() -> None:
        window = choose_window(
            np.asarray(result.step_slowdown), result.worker_slowdown, prepared.model.n_nodes
        )
        ideal = WhatIfAnalysis(prepared, result.ideal_cost).ideal_timeline()
        events = trace_events(prepared.select_steps(window.steps), ideal.start[:, 0],
                              ideal.end[:, 0], dp_ranks=window.dp_ranks)  # fmt: skip
        json.dumps({"traceEvents": events})

    draw_worker_heatmap(result.worker_slowdown, io.BytesIO())  # matplotlib's import, once
    rows = [
        _row(f"{label}: generate + analyse + diagnose (in process, once)", [analysed], "s"),
        _row(
            f"{label}: report render (in process)",
            _timed(lambda: render_report(data)),
            "s",
            "< 1 s",
        ),
        _row(
            f"{label}: report size", [len(page.encode()) / 1e3], "kB", "< 150 kB + 300 B a worker"
        ),
        _row(
            f"{label}: heatmap PNG (in process)",
            _timed(lambda: draw_worker_heatmap(result.worker_slowdown, io.BytesIO())),
            "s",
        ),
        _row(f"{label}: timeline window, events + JSON (in process)", _timed(timeline), "s"),
    ]
    chromium = _chromium_times(report)
    if chromium:
        rows.append(_row(f"{label}: Chromium load + full-page screenshot", chromium, "s", "< 5 s"))
    return rows


def run() -> list[dict]:
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="lagscope-pictures-") as tmp:
        work = Path(tmp)
        for gpus, dp, pp, tp in SIZES:
            rows += _whole_processes(gpus, dp, pp, tp, work)
        rows += _in_process(12288, 192, 8, 8, STEPS, work)
        rows += _in_process(99840, 1560, 8, 8, 2, work)
    return rows
