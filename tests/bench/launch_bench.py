"""What `lagscope launch` costs a training step beside the explicit monitor's cost.

The DDP job of tests/torch_jobs (4 gloo ranks, the emulated accelerator of torch_bench,
`tests/bench/timed_jobs.py` stamping each step on every rank) runs three ways, each a
whole process of its own: without lagscope, with `lagscope.torch.monitor(...)` in the job,
and without it under `lagscope launch` (the injected sitecustomize, the import hooks, the
automatic monitor found at the first update, the data loader's hook on every iterator).
The three run in interleaved triples, each triple in a rotated order (a run's place in
its triple moves its time on this machine, whichever it is).

Rows: each way's median step (the median over runs, with their range); the step-time
overhead of each monitored way over the triple's run without lagscope, and of the launch
over the explicit monitor (the mean of the triples' ratios, its 95 % t-interval and its
range); and the training thread's CPU per step, launch less explicit (the median over
triples, their range): CPU clocks do not count what other processes take, so they
resolve what step times cannot on a shared machine.

`LAGSCOPE_BENCH_LAUNCH_TRIPLES` (default 4) and `LAGSCOPE_BENCH_LAUNCH_STEPS` (default 60)
scale it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parents[2]
WAYS = ("none", "explicit", "launch")
_TRIPLES = int(os.environ.get("LAGSCOPE_BENCH_LAUNCH_TRIPLES", "4"))
_STEPS = int(os.environ.get("LAGSCOPE_BENCH_LAUNCH_STEPS", "60"))
#: Steps left out of each run's medians: the warm-up, DDP's re-bucketing, the monitors'
#: first step (the launch's starts at the end of step 0).
_WARM_UP = 4


def _run(way: str, tmp: Path) -> dict[str, Any]:
    """One run of the job, `way`; its median step and training-thread CPU per step."""
    out = Path(tempfile.mkdtemp(dir=tmp, prefix=f"{way}-"))
    command = [sys.executable, "-m", "tests.bench.launch_bench", "--job", way, str(out)]
    if way == "launch":
        command = [sys.executable, "-m", "lagscope", "launch", "--log-dir", str(out / "launch"),
                   "--job-id", "bench", "--", *command]  # fmt: skip
    subprocess.run(command, cwd=REPOSITORY, check=True, capture_output=True, timeout=600)
    ranks = [json.loads(f.read_text()) for f in sorted((out / "bench").glob("rank-*.json"))]
    steps = len(ranks[0]["step_seconds"])
    per_step = [statistics.fmean(r["step_seconds"][s] for r in ranks) for s in range(steps)]
    cpu = [statistics.fmean(r["step_cpu_seconds"][s] for r in ranks) for s in range(steps)]
    recorded = any((out / d).is_dir() and any((out / d).iterdir()) for d in ("logs", "launch"))
    return {
        "step_s": statistics.median(per_step[_WARM_UP:]),
        "cpu_s": statistics.median(cpu[_WARM_UP:]),
        "recorded": recorded,
    }


def _job(way: str, out: Path) -> None:
    """The job itself, in this process (`python -m tests.bench.launch_bench --job WAY OUT`)."""
    from tests.bench.timed_jobs import JOBS
    from tests.bench.torch_bench import _BLOCK_MS, _DDP_KNOBS
    from tests.torch_jobs.harness import Knobs, launch

    worker, defaults = JOBS["DDP"]
    knobs = Knobs(**{**defaults, **_DDP_KNOBS, "log_dir": str(out / "logs"), "steps": _STEPS,
                     "block_ms": _BLOCK_MS, "monitor": way == "explicit"})  # fmt: skip
    launch(worker, knobs)


def _mean_ci(values: list[float]) -> tuple[float, float, float]:
    from tests.bench.torch_bench import _mean_ci as mean_ci

    return mean_ci(values)


def _ratio_row(name: str, ratios: list[float], note: str) -> dict[str, Any]:
    mean, low, high = _mean_ci(ratios)
    return {"benchmark": name, "value": mean, "unit": "%",
            "target": f"95% CI {low:+.2f} to {high:+.2f}", "ci95": [low, high],
            "spread": [min(ratios), max(ratios)], "runs": len(ratios),
            "note": note}  # fmt: skip


def run() -> list[dict[str, Any]]:
    runs: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        for triple in range(_TRIPLES):
            order = WAYS[triple % 3 :] + WAYS[: triple % 3]
            for way in order:
                runs[way].append(_run(way, tmp))
    for way in ("explicit", "launch"):
        assert all(r["recorded"] for r in runs[way]), f"the {way} runs recorded nothing"
    assert not any(r["recorded"] for r in runs["none"])

    def ratios(a: str, b: str) -> list[float]:
        return [
            (x["step_s"] / y["step_s"] - 1) * 100 for x, y in zip(runs[a], runs[b], strict=True)
        ]

    cpu_us = [(x["cpu_s"] - y["cpu_s"]) * 1e6
              for x, y in zip(runs["launch"], runs["explicit"], strict=True)]  # fmt: skip
    where = f"DDP, 4 gloo ranks, {_STEPS} steps a run, {_TRIPLES} interleaved triples"
    rows: list[dict[str, Any]] = []
    for way, label in (("none", "no lagscope"), ("explicit", "lagscope.torch.monitor()"),
                       ("launch", "lagscope launch")):  # fmt: skip
        steps_ms = [r["step_s"] * 1e3 for r in runs[way]]
        rows.append({"benchmark": f"launch: DDP job median step, {label}",
                     "value": statistics.median(steps_ms), "unit": "ms", "target": "",
                     "spread": [min(steps_ms), max(steps_ms)], "runs": len(steps_ms)})  # fmt: skip
    rows += [
        _ratio_row("launch: step-time overhead, explicit monitor over none",
                   ratios("explicit", "none"), where),
        _ratio_row("launch: step-time overhead, lagscope launch over none",
                   ratios("launch", "none"), where),
        _ratio_row("launch: step time, lagscope launch over the explicit monitor",
                   ratios("launch", "explicit"),
                   f"what the launcher adds to the monitor's own cost; {where}"),
        {"benchmark": "launch: training thread CPU per step, lagscope launch less explicit",
         "value": statistics.median(cpu_us), "unit": "us", "target": "~0",
         "spread": [min(cpu_us), max(cpu_us)], "runs": len(cpu_us),
         "note": f"each triple's launched run less its explicit run, medians of the ranks' "
                 f"steps on the training thread's CPU clock; {where}"},
    ]  # fmt: skip
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["--job"]:
        _job(sys.argv[2], Path(sys.argv[3]))
    else:
        print(json.dumps(run(), indent=2))
