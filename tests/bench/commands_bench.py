"""The user's commands at scale (issue 69 items 2 and 4; item 1 for the commands that make
a long job): whole processes of the console script on generated jobs, as a new user runs
them; wall seconds and the peak RSS of the process with its children (an analysis
process, a broker's client threads), sampled every 0.1 s.

- ~100,000 GPUs (dp 1,568 x pp 8 x tp 8, 16 micro-batches: 12,544 workers), 4 and 8 steps:
  `generate`; `replay --log-dir` (target: 4 steps in under a minute); `replay --to-kafka`
  into a local broker on the same cores (likewise); `lagscope run` of the logs, two
  interleaved pairs, its marginal step ((8 steps - 4 steps) / 4, target <= 1 s) and peak
  (target <= 6 GB);
- 12,288 GPUs (dp 192) x 2,000 steps (`LAGSCOPE_BENCH_LONG_STEPS` sets them): `generate`
  and `replay --log-dir`, each a run of steps or a part of the file at a time: their peak
  against the 1.5 GB a 12,288-GPU host is held to (the hosts themselves over 2,000 steps:
  `long_job_bench`); and `analyze --steps` of 20 of its steps where the whole trace does
  not fit in memory (~27 GiB): those steps' row groups read alone. Not `lagscope run` of
  those logs here: 12 minutes, and the same memory `long_job_bench` measures.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

JOB_SHAPE = ("--pp", "8", "--tp", "8", "--microbatches", "16")
BIG_DP, BIG_STEPS = 1568, (4, 8)
LONG_DP, LONG_STEPS = 192, 2000
RUN_PAIRS = 2


def _lagscope() -> list[str]:
    script = Path(sys.executable).with_name("lagscope")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lagscope.cli"]


def _tree_rss_mb(pid: int) -> float:
    """RSS of `pid` and its descendants (MB)."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            with open(f"/proc/{current}/status") as status:
                total += next(int(line.split()[1]) for line in status if line.startswith("VmRSS"))
            with open(f"/proc/{current}/task/{current}/children") as children:
                pending += [int(child) for child in children.read().split()]
        except (OSError, StopIteration):
            continue
    return total / 1024


def _process(args: list[str]) -> tuple[float, float]:
    """Wall seconds and peak tree RSS (MB) of `lagscope ARGS`."""
    began = time.perf_counter()
    child = subprocess.Popen([*_lagscope(), *args], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)  # fmt: skip
    peak = 0.0
    stderr: list[bytes] = []
    reader = threading.Thread(target=lambda: stderr.append(child.stderr.read()), daemon=True)
    reader.start()
    while child.poll() is None:
        peak = max(peak, _tree_rss_mb(child.pid))
        time.sleep(0.1)
    took = time.perf_counter() - began
    reader.join()
    if child.returncode:
        raise RuntimeError(f"lagscope {' '.join(args)}: {b''.join(stderr).decode()[-2000:]}")
    return took, peak


def _row(benchmark: str, seconds: float, peak_mb: float, target: str = "") -> dict:
    return {"benchmark": benchmark, "value": seconds, "unit": "s", "target": target,
            "peak_rss_mb": round(peak_mb)}  # fmt: skip


def _big_job(work: Path) -> list[dict]:
    from lagscope.deploy.kafka_local import KafkaBroker

    rows = []
    gpus = f"{BIG_DP * 64:,} GPUs"
    for steps in BIG_STEPS:
        job, logs = work / f"job-{steps}", work / f"logs-{steps}"
        seconds, peak = _process(["generate", "--out", str(job), "--dp", str(BIG_DP),
                                  *JOB_SHAPE, "--steps", str(steps)])  # fmt: skip
        rows.append(_row(f"generate, {gpus} x {steps} steps", seconds, peak))
        source = ["--trace", str(job / "trace.parquet"), "--meta", str(job / "meta.yaml")]
        seconds, peak = _process(["replay", *source, "--log-dir", str(logs), "--no-progress"])
        rows.append(_row(f"replay --log-dir, {gpus} x {steps} steps", seconds, peak,
                         "< 60 s for 4 steps"))  # fmt: skip
    with KafkaBroker(work / "kafka") as broker:
        for steps in BIG_STEPS:
            job = work / f"job-{steps}"
            seconds, peak = _process([
                "replay", "--trace", str(job / "trace.parquet"), "--meta", str(job / "meta.yaml"),
                "--to-kafka", "--bootstrap-servers", broker.bootstrap,
                "--topic-ops", f"bench-ops-{steps}", "--no-progress",
            ])  # fmt: skip
            rows.append(_row(f"replay --to-kafka (a local broker), {gpus} x {steps} steps",
                             seconds, peak, "< 60 s for 4 steps"))  # fmt: skip
    runs: dict[int, list[tuple[float, float]]] = {steps: [] for steps in BIG_STEPS}
    for pair in range(RUN_PAIRS):
        for steps in BIG_STEPS:
            store = f"chdb://{work / f'store-{steps}-{pair}'}"
            runs[steps].append(_process(["run", "--log-dir", str(work / f"logs-{steps}"),
                                         "--dsn", store]))  # fmt: skip
    short, long = BIG_STEPS
    marginal = [
        (b[0] - a[0]) / (long - short) for a, b in zip(runs[short], runs[long], strict=True)
    ]
    peak = max(p for results in runs.values() for _, p in results)
    rows.append({
        "benchmark": f"lagscope run of the logs, {gpus}: marginal step ({long} - {short} steps)",
        "value": statistics.median(marginal), "spread": [min(marginal), max(marginal)],
        "unit": "s/step", "target": "<= 1 s; peak <= 6 GB", "peak_rss_mb": round(peak),
        "runs": len(marginal),
        "whole_runs_s": {n: [round(s, 2) for s, _ in done] for n, done in runs.items()},
    })  # fmt: skip
    return rows


def _long_job(work: Path, steps: int) -> list[dict]:
    job, logs = work / "long-job", work / "long-logs"
    what = f"{LONG_DP * 64:,} GPUs x {steps:,} steps"
    seconds, peak = _process(["generate", "--out", str(job), "--dp", str(LONG_DP), *JOB_SHAPE,
                              "--steps", str(steps)])  # fmt: skip
    rows = [_row(f"generate, {what}", seconds, peak, "peak <= 1,500 MB")]
    source = ["--trace", str(job / "trace.parquet"), "--meta", str(job / "meta.yaml")]
    seconds, peak = _process(["replay", *source, "--log-dir", str(logs), "--no-progress"])
    rows.append(_row(f"replay --log-dir, {what}", seconds, peak, "peak <= 1,500 MB"))
    rows.append(_analyze_window(job / "trace.parquet", source, steps))
    return rows


def _analyze_window(trace: Path, source: list[str], steps: int) -> dict:
    """`analyze --steps` of 20 steps in the middle of the long job, where the whole trace
    does not fit in this machine's memory (then those steps' row groups are read alone)."""
    from lagscope.cli.trace_memory import weight_beyond_memory

    first = steps // 2
    what = f"analyze --steps {first}-{first + 19} of the {LONG_DP * 64:,}-GPU job's {steps:,}"
    weight = weight_beyond_memory(trace)
    if weight is None:
        return {"benchmark": what, "value": None, "unit": "s",
                "skipped": "the whole trace fits in this machine's memory"}  # fmt: skip
    seconds, peak = _process(["analyze", *source, "--steps", f"{first}-{first + 19}"])
    row = _row(what, seconds, peak, "the whole does not fit: a window in bounded memory")
    row["whole_trace_needs_gib"] = round(weight.needed / 2**30, 1)
    return row


def run() -> list[dict]:
    forced = os.environ.get("LAGSCOPE_BENCH_LONG_STEPS")
    with tempfile.TemporaryDirectory(prefix="lagscope-commands-") as tmp:
        rows = _big_job(Path(tmp) / "big")
    with tempfile.TemporaryDirectory(prefix="lagscope-commands-") as tmp:
        rows += _long_job(Path(tmp), int(forced) if forced else LONG_STEPS)
    return rows
