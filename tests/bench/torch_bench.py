"""lagscope.torch benchmarks: the monitor's cost on the training thread per recorded op,
the CPU of its own thread per rank-step, and the step-time overhead on the real DDP and
DP 2 x PP 2 1F1B jobs of tests/torch_jobs (gloo on CPU, 4 ranks, the emulated device of the
verdict tests), on a quiet machine and with every core busy.

Per-op cost: a world of one gloo rank in this process; the same loop runs with the monitor
recording and without it, back to back, on the training thread's CPU clock (least of each
over the rounds), with a step boundary every 100 ops: for a module's forward (the timed
forward wrapper, one op) and for a data-parallel all-reduce (the wrapper and the op; the
unrecorded loop goes through the same wrapper with the monitor inactive, so the difference
is what recording costs beyond one attribute check).

Step-time overhead, two designs, each with its 95 % confidence interval:

- paired runs: whole jobs with and without the monitor, in pairs, alternating which runs
  first (the second run of a pair is a little slower on this machine, whichever it is); the
  estimate is the mean of the pairs' step-time ratios, its interval a t-interval over
  pairs. Whole runs differ by ~1 % on their own (which cores, how late each sleep wakes),
  so it resolves a few % with a few pairs, 0.5 % only with tens of them
  (`LAGSCOPE_BENCH_PAIRS`);
- recorded against unrecorded steps in one run (the monitor records every other step):
  each recorded step's time less the mean of its two unrecorded neighbours, in % of the
  run's median step (a difference: a ratio over the neighbours reads high on noisy steps,
  `neighbour_contrast`); the run's own conditions cancel. Each such run has a control
  beside it: a run without the monitor, read the same way on the same steps' parity,
  which gives what the design reads from the job's own noise. The row gives their median
  with its distribution-free interval (a shared machine's step times have heavy tails),
  and their mean with an interval that allows for the correlation of contrasts sharing a
  neighbour (lag-1 autocovariance). It holds what recording costs the job; the monitor's
  thread works for recorded steps and its CPU may land in either kind of step, which is
  why its own CPU is read directly besides.

The same in-run runs give the cost on the training thread's CPU clock: each recorded
step's CPU less its unrecorded neighbours', rank by rank (the wrappers, the hooks, the
hand-overs, and the collections the monitor's garbage brings forward). A CPU clock does not
count what other processes take, so it resolves microseconds where step times resolve
percent; with the monitor thread's CPU per rank-step it is what recording costs a rank's
CPU.

The monitor thread's CPU per rank-step is read on the thread's CPU clock (the sealer, which
packs and writes the recorded steps, its wakes included) over the steps it sealed, less
the job's own garbage collections that CPython ran on that thread
(`tests/bench/timed_jobs.py`; the figure with them is in the note), in monitored runs of
120 steps (the paired runs' 30 steps are mostly the sealer's first, shorter intervals;
their figure is in the note too), interleaved with as many that encode the batches on the
node as before 0.3.0 (`LAGSCOPE_SEAL_RECORDS=0`): robust to the noise of a shared machine,
where step times are not.

Busy: one CPU burner per core (`os.cpu_count()`) runs throughout. There the bench also
measures what the monitor does to yield: its longer seal interval on a saturated node
(paired runs with it on and off, on the monitor thread's CPU clock) and why its thread is
not given a lower priority (a helper thread that holds the interpreter lock, at nice 0
and at nice 19, beside a training-like loop: a preempted low-priority holder of the lock
keeps the training thread waiting).

`LAGSCOPE_BENCH_PAIRS` (default 4) and `LAGSCOPE_BENCH_IN_RUN_RUNS` (default 4) scale the
step-time designs, `LAGSCOPE_BENCH_THREAD_RUNS` (default 4) the monitor thread's CPU rows;
`LAGSCOPE_BENCH_TORCH_CONDITIONS` ("quiet,busy") picks the conditions.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def _training_thread_ns(function: Any, n: int) -> float:
    """CPU time of this thread per call: on a shared, loaded machine the wall clock counts
    the time other processes ran, this counts only what the calls cost the training
    thread (the monitor's own threads, like the sealer, are not on it)."""
    began = time.thread_time_ns()
    for _ in range(n):
        function()
    return (time.thread_time_ns() - began) / n


def _paired_cost_ns(plain: Any, monitored: Any, n: int, rounds: int = 21) -> float:
    """Least time per call with the monitor minus least without, the two loops run back to
    back in each round so that both see the same machine (the least is the cost with the
    least interference from the machine's other load)."""
    plain_ns, monitored_ns = [], []
    for _ in range(rounds):
        plain_ns.append(_training_thread_ns(plain, n))
        monitored_ns.append(_training_thread_ns(monitored, n))
    return min(monitored_ns) - min(plain_ns)


def _per_op_costs(tmp: Path) -> dict[str, float]:
    """Per-op costs with this process on one core, as a training process bound to its
    cores runs (unpinned, a thread moving between this machine's two cores adds ~0.3 us
    of cache misses to every number, and its spread)."""
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})
    try:
        return _pinned_per_op_costs(tmp)
    finally:
        os.sched_setaffinity(0, cores)


def _pinned_per_op_costs(tmp: Path) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    import lagscope.torch
    from tests.torch_jobs.harness import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        plain_module = torch.nn.Linear(4, 4)
        module = torch.nn.Linear(4, 4)
        x = torch.ones(4)
        t = torch.ones(4)
        monitor = lagscope.torch.monitor(
            modules=[module], job_id="bench", log_dir=tmp / "logs", gc_probe=False, mode="host"
        )
        ops_per_step = 100
        state = {"ops": 0}

        def count_step() -> None:
            # A step boundary every `ops_per_step` ops, as in training: the step's ops go to
            # the sealer thread and the buffer stays short.
            state["ops"] += 1
            if state["ops"] == ops_per_step:
                state["ops"] = 0
                monitor.step()

        def hooked_forward() -> None:
            module(x)
            count_step()

        def plain_forward() -> None:
            plain_module(x)
            state["ops"] += 0

        def reduce_recorded() -> None:
            dist.all_reduce(t)
            count_step()

        def reduce_unrecorded() -> None:
            monitor.active = False
            dist.all_reduce(t)
            monitor.active = True
            state["ops"] += 0

        def hooked_pair() -> None:
            module(x).sum().backward()
            count_step()
            count_step()

        def plain_pair() -> None:
            plain_module(x).sum().backward()
            state["ops"] += 0

        forward = _paired_cost_ns(plain_forward, hooked_forward, 5_000)
        # A forward and its backward: two recorded ops, the backward's start caught by the
        # wrapped backward call and its end by the last parameter's gradient hook.
        pair = _paired_cost_ns(plain_pair, hooked_pair, 2_000) / 2
        reduce = _paired_cost_ns(reduce_unrecorded, reduce_recorded, 500)
        monitor.close()
    finally:
        dist.destroy_process_group()
    return {
        "forward": forward,
        "forward_backward_per_op": pair,
        "all_reduce": reduce,
    }


#: Pairs of runs with and without the monitor, per job and condition (~5 s a run).
_PAIRS = int(os.environ.get("LAGSCOPE_BENCH_PAIRS", "4"))
#: Runs recording every other step (each with its control), per job and condition, and
#: their steps. 80 steps (~37 contrasts a run) gave the quiet jobs' medians 95 % intervals
#: 0.94 (1F1B) and 6.9 (DDP) points wide; 320 steps, 0.75 and 2.7 (2026-11-28): closer to
#: resolving 0.5 %, and still short of it on step times (the CPU clocks' rows resolve it).
#: Two such runs left the busy 1F1B mean's interval 1.1 points wide (2026-11-29): four.
_IN_RUN_RUNS = int(os.environ.get("LAGSCOPE_BENCH_IN_RUN_RUNS", "4"))
_IN_RUN_STEPS = 320
#: Steps of the saturated-node interval's paired runs (below).
_STRETCH_STEPS = 80
#: The monitor thread's CPU is read in runs this long: the sealer's pace (40 steps a seal,
#: 3 s at most) starts from a 0.2 s interval, so a 30-step run's window holds one short
#: seal and one full one and counts a wake per step several times as often as a training
#: job pays it.
_THREAD_STEPS = 120
#: ... in this many pairs of runs per job and condition. A rank's noisy steps may set off
#: a few prompt hand-overs (`producers/step_change.py`), which cost the DDP job's sealer
#: ~220 us each: with 2 pairs (8 rank-runs) the median moved from 11 to 21 us between
#: runs of the bench as half or fewer of the rank-runs had such a spell (2026-11-28).
_THREAD_RUNS = int(os.environ.get("LAGSCOPE_BENCH_THREAD_RUNS", "4"))
_PAIR_STEPS = 30
_CONDITIONS = tuple(os.environ.get("LAGSCOPE_BENCH_TORCH_CONDITIONS", "quiet,busy").split(","))
#: The emulated device: each block's forward waits 2 ms, its backward 4 ms, as a host waits
#: for its GPU (4 single-thread ranks fighting over 2 cores for real compute would make each
#: op's time depend on what the other ranks do at that moment).
_BLOCK_MS = 2.0
#: The DDP job at the 1F1B job's width (256, batch 32) instead of its own CPU-heavy defaults
#: (512, batch 64): its steps then wait on the emulated device as a GPU job's host does, and
#: 6 blocks in 0.25 MB buckets still give it 6 gradient buckets.
_DDP_KNOBS = {"layers": 6, "hidden": 256, "batch": 32, "bucket_mb": 0.25}

#: Two-sided 95 % quantiles of Student's t by degrees of freedom (normal beyond 30).
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26,
        10: 2.23, 11: 2.20, 12: 2.18, 13: 2.16, 14: 2.14, 15: 2.13, 16: 2.12, 17: 2.11,
        18: 2.10, 19: 2.09, 20: 2.09, 25: 2.06, 30: 2.04}  # fmt: skip


def _t95(df: int) -> float:
    if df > 30:
        return 1.96
    return _T95.get(df) or _T95[max(k for k in _T95 if k <= df)]


def _ci_text(low: float, high: float) -> str:
    """A 95 % interval as the table shows it (beside the target: the table has no notes)."""
    return f"95% CI {low:+.2f} to {high:+.2f}"


def _mean_ci(values: list[float]) -> tuple[float, float, float]:
    """Mean and its 95 % t-interval (independent values)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan"), float("nan")
    half = _t95(len(values) - 1) * statistics.stdev(values) / len(values) ** 0.5
    return mean, mean - half, mean + half


class _Burners:
    """One busy-looping process per core while the block runs (the "busy" condition)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.processes: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> _Burners:
        for _ in range(self.n):
            self.processes.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self.processes:
            process.kill()
        for process in self.processes:
            process.wait()


def _run_job(tmp: Path, job: str, *, monitor: bool, steps: int, every_other: bool = False,
             env: str = "") -> dict[str, Any]:  # fmt: skip
    """One run of `job`; what its ranks measured (tests/bench/timed_jobs.py)."""
    from tests.bench.timed_jobs import JOBS
    from tests.torch_jobs.harness import Knobs, launch, recorded_ops

    worker, defaults = JOBS[job]
    if job == "DDP":
        defaults = {**defaults, **_DDP_KNOBS}
    out = Path(tempfile.mkdtemp(dir=tmp))
    knobs = Knobs(**{**defaults, "log_dir": str(out / "logs"), "steps": steps,
                     "block_ms": _BLOCK_MS, "monitor": monitor, "gc_probe": False,
                     "sample_wait": 1 if every_other else 0, "env": env})  # fmt: skip
    launch(worker, knobs)
    ranks = [json.loads(f.read_text()) for f in sorted((out / "bench").glob("rank-*.json"))]
    # Step s's time runs from step s-1's optimizer step's end to its own; the mean over
    # the ranks, which a synchronous job keeps in step.
    per_step = [statistics.fmean(r["step_seconds"][s - 1] for r in ranks)
                for s in range(1, steps)]  # fmt: skip
    recorded = sorted({op["step"] for op in recorded_ops(out / "logs")}) if every_other else []
    shutil.rmtree(out, ignore_errors=True)
    return {
        "per_step": per_step,
        # [rank][step - 1]: the training thread's CPU seconds of each step
        "per_step_cpu": [r.get("step_cpu_seconds", []) for r in ranks],
        # after the first steps (the job's warm-up, DDP's re-bucketing)
        "median_step_s": statistics.median(per_step[3:]),
        "threads_us_per_step": [
            r["threads_cpu_s"] / r["sealed_steps"] * 1e6 for r in ranks if r["sealed_steps"]
        ],
        # the same, less the job's own garbage collections that ran on the monitor's thread
        "own_us_per_step": [
            (r["threads_cpu_s"] - r["threads_gc_s"]) / r["sealed_steps"] * 1e6
            for r in ranks
            if r["sealed_steps"]
        ],
        "steps_per_seal": [r["sealed_steps"] / r["seals"] for r in ranks if r["seals"]],
        # each starts (or re-arms) a spell of prompt hand-overs: more seals
        "step_changes_per_100": [
            100 * r.get("step_changes", 0) / r["sealed_steps"] for r in ranks if r["sealed_steps"]
        ],
        "recorded": recorded,
    }


def _paired(tmp: Path, job: str, pairs: int, a: dict, b: dict) -> list[tuple[dict, dict]]:
    """`pairs` pairs of runs with settings `a` and `b`, alternating which runs first."""
    out = []
    for pair in range(pairs):
        first, second = (a, b) if pair % 2 == 0 else (b, a)
        runs = {id(first): _run_job(tmp, job, **first), id(second): _run_job(tmp, job, **second)}
        out.append((runs[id(a)], runs[id(b)]))
    return out


def neighbour_contrast(
    values: list[float], recorded: set[int], *, skip: int, relative: bool = True
) -> list[float]:
    """Each recorded step's value (`values[s]` is step s's) less the mean of its two
    neighbours, where both were unrecorded (from step `skip` on): in % of the values'
    median when `relative`, else in millionths of their unit.

    A difference, not a ratio: a step over the mean of its neighbours averages above 1 when
    the neighbours vary (the mean of 1/Y exceeds 1/mean(Y)), by about half their squared
    coefficient of variation. The DDP job's steps here vary by 10 %, and that ratio read
    +1.3 % (95 % CI +0.1 to +2.4) on runs without any monitor, the difference +0.7 (CI
    -0.4 to +1.8; 630 steps of 4 runs, 2026-11-28)."""
    scale = statistics.median(values[skip:]) / 100 if relative else 1e-6
    return [(values[s] - (values[s - 1] + values[s + 1]) / 2) / scale
            for s in sorted(recorded)
            if skip <= s < len(values) - 1 and not {s - 1, s + 1} & recorded]  # fmt: skip


#: Steps of a run left out of its contrasts: the job's warm-up (and DDP's re-bucketing).
_WARM_UP_STEPS = 4


def _in_run_contrasts(run: dict[str, Any]) -> list[float]:
    """Each recorded step's time less the mean of its unrecorded neighbours (% of the run's
    median step)."""
    # per_step[i] is step i + 1's time.
    steps = [math.nan, *run["per_step"]]
    return neighbour_contrast(steps, set(run["recorded"]), skip=_WARM_UP_STEPS)


def _in_run_cpu_contrasts(run: dict[str, Any]) -> list[float]:
    """Each recorded step's training-thread CPU less the mean of its unrecorded neighbours'
    (us), rank by rank: what recording a step costs the thread that runs the job."""
    recorded = set(run["recorded"])
    return [c for cpu in run["per_step_cpu"]
            for c in neighbour_contrast([math.nan, *cpu], recorded, skip=_WARM_UP_STEPS,
                                        relative=False)]  # fmt: skip


def _alternate_steps(run: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    """`run` (without the monitor) as if it recorded the steps of the parity `like`
    recorded most: the control of the in-run contrast."""
    parity = statistics.mode(s % 2 for s in like["recorded"])
    return {**run, "recorded": list(range(parity or 2, len(run["per_step"]) + 1, 2))}


def _contrast_ci(series: list[list[float]]) -> tuple[float, float, float]:
    """Mean of every run's contrasts and its 95 % interval; neighbouring contrasts of a run
    share an unrecorded step, so the variance of the mean counts their lag-1 covariance."""
    values = [c for run in series for c in run]
    mean = statistics.fmean(values)
    gamma0 = statistics.fmean([(c - mean) ** 2 for c in values])
    lagged = [(a - mean) * (b - mean) for run in series for a, b in itertools.pairwise(run)]
    gamma1 = statistics.fmean(lagged) if lagged else 0.0
    half = 1.96 * ((gamma0 + 2 * max(gamma1, 0.0)) / len(values)) ** 0.5
    return mean, mean - half, mean + half


def _contrast_summary(
    series: list[list[float]],
) -> tuple[list[float], tuple[float, float, float], tuple[float, float, float]]:
    """Runs' contrasts pooled, their median with its interval (`_median_ci`) and their mean
    with its interval (`_contrast_ci`)."""
    pooled = [c for run in series for c in run]
    return pooled, _median_ci(pooled), _contrast_ci(series)


def _median_ci(values: list[float]) -> tuple[float, float, float]:
    """Median and its distribution-free 95 % interval (order statistics: the ranks between
    which the median lies with probability >= 0.95, from the binomial distribution). A
    shared machine's step times have heavy tails (another process takes a core for one
    step), which widen a mean's interval and not a median's."""
    ordered = sorted(values)
    n = len(ordered)
    # The largest k with P(Binomial(n, 1/2) < k) <= 0.025.
    k, below = 0, 0.0
    while k < n and below + math.comb(n, k) / 2**n <= 0.025:
        below += math.comb(n, k) / 2**n
        k += 1
    if k == 0:
        return statistics.median(ordered), float("nan"), float("nan")
    return statistics.median(ordered), ordered[k - 1], ordered[n - k]


def _job_rows(tmp: Path, job: str, condition: str, load: float) -> list[dict]:
    plain = {"monitor": False, "steps": _PAIR_STEPS}
    monitored = {"monitor": True, "steps": _PAIR_STEPS}
    pairs = _paired(tmp, job, _PAIRS, monitored, plain)
    ratios = [(m["median_step_s"] / p["median_step_s"] - 1) * 100 for m, p in pairs]
    mean, low, high = _mean_ci(ratios)
    in_run, controls = [], []
    for _ in range(_IN_RUN_RUNS):  # each beside a run without the monitor: the control
        in_run.append(_run_job(tmp, job, monitor=True, steps=_IN_RUN_STEPS, every_other=True))
        plain_run = _run_job(tmp, job, monitor=False, steps=_IN_RUN_STEPS)
        controls.append(_in_run_contrasts(_alternate_steps(plain_run, in_run[-1])))
    pooled, (c_median, m_low, m_high), (c_mean, c_low, c_high) = _contrast_summary(
        [_in_run_contrasts(run) for run in in_run]
    )
    control_pooled, (k_median, k_low, k_high), (k_mean, k_mean_low, k_mean_high) = (
        _contrast_summary(controls)
    )
    cpu_pooled = [c for run in in_run for c in _in_run_cpu_contrasts(run)]
    cpu_median, cpu_low, cpu_high = _median_ci(cpu_pooled)
    step_cpu = statistics.median(
        [c for run in in_run for cpu in run["per_step_cpu"] for c in cpu[3:]]
    )
    default = {"monitor": True, "steps": _THREAD_STEPS}
    batches = {**default, "env": "LAGSCOPE_SEAL_RECORDS=0"}
    long_pairs = _paired(tmp, job, _THREAD_RUNS, default, batches)
    long_runs = [run for run, _ in long_pairs]
    encoded = [t for _, run in long_pairs for t in run["own_us_per_step"]]
    encoded_per_seal = [s for _, run in long_pairs for s in run["steps_per_seal"]]
    threads = [t for run in long_runs for t in run["own_us_per_step"]]
    with_gc = [t for run in long_runs for t in run["threads_us_per_step"]]
    per_seal = [s for run in long_runs for s in run["steps_per_seal"]]
    changes = [c for run in long_runs for c in run["step_changes_per_100"]]
    short = [t for m, _ in pairs for t in m["threads_us_per_step"]]
    short_per_seal = [s for m, _ in pairs for s in m["steps_per_seal"]]
    base = statistics.median([p["median_step_s"] for _, p in pairs])
    # A 30-step run of 100 ms steps may end before its first full seal (3 s): its steps
    # are then written at close(), on the training thread, outside this reading.
    short_text = (
        f"in the {_PAIR_STEPS}-step paired runs {statistics.median(short):.1f} us "
        f"({min(short):.1f}-{max(short):.1f}) at {statistics.median(short_per_seal):.0f} "
        "steps per seal"
        if short
        else f"the {_PAIR_STEPS}-step paired runs end before their first full seal"
    )
    where = f"{condition}: 1-min load {load:.1f} on {os.cpu_count()} cores"
    return [
        {"benchmark": f"torch: {job} job median step, no monitor ({condition})",
         "value": base * 1e3, "unit": "ms", "target": "",
         "spread": [min(p["median_step_s"] for _, p in pairs) * 1e3,
                    max(p["median_step_s"] for _, p in pairs) * 1e3], "runs": len(pairs)},
        {"benchmark": f"torch: {job} job step-time overhead, paired runs ({condition})",
         "value": mean, "unit": "%", "target": f"< 0.5; {_ci_text(low, high)}",
         "ci95": [low, high],
         "note": f"mean of {len(ratios)} pairs' ratios, 95 % CI {low:+.2f} to {high:+.2f} %; "
                 f"pair by pair {min(ratios):+.2f} to {max(ratios):+.2f} %; {where}"},
        {"benchmark": f"torch: {job} job recorded step vs unrecorded neighbours ({condition})",
         "value": c_median, "unit": "%", "target": f"< 0.5; {_ci_text(m_low, m_high)}",
         "ci95": [m_low, m_high],
         "note": f"median of {len(pooled)} recorded steps in {len(in_run)} runs recording "
                 f"every other step, each less the mean of its neighbours, in % of the run's "
                 f"median step; 95 % CI {m_low:+.2f} to {m_high:+.2f} %; mean "
                 f"{c_mean:+.2f} % (CI {c_low:+.2f} to {c_high:+.2f}); without the monitor "
                 f"the same contrast reads {k_median:+.2f} % (next row)"},
        {"benchmark": f"torch: {job} job same contrast, no monitor ({condition})",
         "value": k_median, "unit": "%", "target": f"~0; {_ci_text(k_low, k_high)}",
         "ci95": [k_low, k_high],
         "note": f"the control of the row above: runs without the monitor, each beside one "
                 f"of its runs, their steps of the parity it recorded against their "
                 f"neighbours; median of {len(control_pooled)} steps, mean {k_mean:+.2f} % "
                 f"(CI {k_mean_low:+.2f} to {k_mean_high:+.2f}): what the design reads "
                 f"from the job's own noise and alternation"},
        {"benchmark": f"torch: {job} job training thread CPU, recorded step less unrecorded "
                      f"neighbours ({condition})",
         "value": cpu_median, "unit": "us",
         "target": f"{cpu_median / (base * 1e6) * 100:.3f} % of a step; "
                   f"{_ci_text(cpu_low, cpu_high)} us",
         "ci95": [cpu_low, cpu_high],
         "note": f"median of {len(cpu_pooled)} recorded rank-steps in {len(in_run)} runs "
                 f"recording every other step, on the training thread's CPU clock (its "
                 f"steps take {step_cpu * 1e6:.0f} us of CPU, median); with the monitor "
                 f"thread's CPU below, what recording costs a rank's CPU per step"},
        {"benchmark": f"torch: {job} job monitor thread CPU per rank-step ({condition})",
         "value": statistics.median(threads), "unit": "us", "target": "<= 20",
         "spread": [min(threads), max(threads)], "runs": len(threads),
         "note": f"seal records of version 2 (the default since 0.4.0: the log's reader "
                 f"encodes the batches); the sealer's thread CPU clock over the steps it "
                 f"sealed (wakes included, the job's garbage collections that ran on it left "
                 f"out: with them "
                 f"{statistics.median(with_gc):.1f} us, {min(with_gc):.1f}-{max(with_gc):.1f}), "
                 f"median of ranks x {len(long_runs)} runs of {_THREAD_STEPS} steps; "
                 f"{statistics.median(per_seal):.0f} steps per seal; "
                 f"{statistics.fmean(changes):.2f} step-time changes per 100 rank-steps "
                 f"(each a spell of prompt seals); "
                 f"= {statistics.median(threads) / (base * 1e6) * 100:.3f} % of a step; "
                 f"{short_text}"},
        {"benchmark": f"torch: {job} job monitor thread CPU per rank-step, batches encoded "
                      f"on the node ({condition})",
         "value": statistics.median(encoded), "unit": "us", "target": "",
         "spread": [min(encoded), max(encoded)], "runs": len(encoded),
         "note": f"as the row above, with LAGSCOPE_SEAL_RECORDS=0 (the sealer encodes the "
                 f"batches, as before 0.3.0, for a streamer older than 0.2.0), runs "
                 f"interleaved with the row above's; "
                 f"{statistics.median(encoded_per_seal):.0f} steps per seal"},
    ]  # fmt: skip


def _stretch_rows(tmp: Path, load: float) -> list[dict]:
    """Busy only: the saturated node's longer seal interval, on and off, in paired runs of
    the 1F1B job, on the monitor thread's CPU clock and on the step time. The runs (~12 s)
    hold two seals or more at the stretched interval (6 s at most)."""
    on = {"monitor": True, "steps": _STRETCH_STEPS}
    off = {"monitor": True, "steps": _STRETCH_STEPS, "env": "BENCH_STRETCH=1"}
    pairs = _paired(tmp, "1F1B", max(2, _PAIRS // 2), on, off)
    cpu_on = [t for a, _ in pairs for t in a["threads_us_per_step"]]
    cpu_off = [t for _, b in pairs for t in b["threads_us_per_step"]]
    ratios = [(a["median_step_s"] / b["median_step_s"] - 1) * 100 for a, b in pairs]
    mean, low, high = _mean_ci(ratios)
    seal_on = statistics.median([s for a, _ in pairs for s in a["steps_per_seal"]])
    seal_off = statistics.median([s for _, b in pairs for s in b["steps_per_seal"]])
    return [
        {"benchmark": "torch: 1F1B monitor thread CPU per rank-step, saturated-node interval "
                      "off -> on (busy)",
         "value": statistics.median(cpu_on), "unit": "us", "target": "",
         "spread": [min(cpu_on), max(cpu_on)], "runs": len(cpu_on),
         "note": f"off: {statistics.median(cpu_off):.1f} us ({min(cpu_off):.1f}-"
                 f"{max(cpu_off):.1f}); steps per seal {seal_off:.0f} -> {seal_on:.0f}; "
                 f"1-min load {load:.1f}"},
        {"benchmark": "torch: 1F1B step time, saturated-node interval on vs off (busy)",
         "value": mean, "unit": "%", "target": _ci_text(low, high), "ci95": [low, high],
         "note": f"{len(ratios)} pairs, 95 % CI {low:+.2f} to {high:+.2f} %"},
    ]  # fmt: skip


def _helper_thread_step_s(nice: int | None, seconds: float) -> float:
    """Mean "step" of a training-like loop (20 x 300 us of Python then a 1 ms device wait)
    beside a helper thread that runs 2 ms of Python every 100 ms at `nice` (None: none)."""
    stop = threading.Event()

    def spin(us: float) -> None:
        end = time.perf_counter() + us / 1e6
        while time.perf_counter() < end:
            pass

    def helper() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice or 0)
        while not stop.wait(0.1):
            spin(2000)

    thread = threading.Thread(target=helper, daemon=True)
    if nice is not None:
        thread.start()
    steps = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        began = time.perf_counter()
        for _ in range(20):
            spin(300)
            time.sleep(0.001)
        steps.append(time.perf_counter() - began)
    stop.set()
    if nice is not None:
        thread.join()
    return statistics.fmean(steps)


def _priority_row(load: float) -> dict:
    """Busy only: why the monitor's thread keeps the job's priority (a helper that holds the
    interpreter lock ~2 % of the time, 10x the sealer's share, to show the mechanism)."""
    ratios = []
    for round_ in range(6):
        order = (0, 19) if round_ % 2 == 0 else (19, 0)
        steps = {nice: _helper_thread_step_s(nice, 2.0) for nice in order}
        ratios.append((steps[19] / steps[0] - 1) * 100)
    mean, low, high = _mean_ci(ratios)
    return {"benchmark": "torch: a GIL-holding helper thread at nice 19 vs nice 0, training "
                         "loop step time (busy)",
            "value": mean, "unit": "%", "target": _ci_text(low, high), "ci95": [low, high],
            "note": f"{len(ratios)} paired rounds, 95 % CI {low:+.1f} to {high:+.1f} %: a "
                    "lower priority makes the job slower, not faster; 1-min load "
                    f"{load:.1f}"}  # fmt: skip


def run() -> list[dict]:
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        costs = _per_op_costs(tmp)
        rows += [
            {"benchmark": "torch: forward + backward, cost per recorded op (wrapper, both hooks)",
             "value": costs["forward_backward_per_op"] / 1e3, "unit": "us/op", "target": "< 2",
             "note": "the training thread pinned to one core"},
            {"benchmark": "torch: forward op alone (the wrapper)",
             "value": costs["forward"] / 1e3, "unit": "us/op", "target": "< 2"},
            {"benchmark": "torch: collective op cost (wrapper, scope, completion)",
             "value": costs["all_reduce"] / 1e3, "unit": "us/op", "target": "< 2"},
            *_sealer_rows(tmp),
        ]  # fmt: skip
        for condition in _CONDITIONS:
            with _Burners((os.cpu_count() or 1) if condition == "busy" else 0):
                if condition == "busy":
                    _wait_for_saturation()
                for job in ("1F1B", "DDP"):
                    rows += _job_rows(tmp, job, condition, os.getloadavg()[0])
                if condition == "busy":
                    rows += _stretch_rows(tmp, os.getloadavg()[0])
                    rows.append(_priority_row(os.getloadavg()[0]))
    return rows


#: The longest wait for the busy condition's load average to reach the core count.
_SATURATION_WAIT_S = 120.0


def _wait_for_saturation() -> None:
    """Wait until the 1-minute load average reaches the core count (at most
    `_SATURATION_WAIT_S`): the monitor stretches its seal interval only from there
    (`producers.timer._node_saturated`), and the load average follows the burners with a
    one-minute time constant (5 s of waiting left it at 1.4 on 2 cores)."""
    cores = os.cpu_count() or 1
    deadline = time.monotonic() + _SATURATION_WAIT_S
    while os.getloadavg()[0] < cores and time.monotonic() < deadline:
        time.sleep(1.0)


def _sealer_rows(tmp: Path) -> list[dict]:
    """The sealer's work alone, warm, on its thread clock: 20 steps of the 1F1B stage 0
    rank's 22 ops per seal (the steady part of the in-job figure, without wakes or the
    caches the job's own work evicts), encoding the batches itself or writing seal
    records; and the log reader's, which encodes the batches of seal records."""
    from lagscope.producers.log import KIND_SEAL, frame_record
    from lagscope.producers.seal_record import expand_seal
    from lagscope.producers.timer import OpTimer

    class Keep:
        """Frames the records as the log does, and keeps the seal records' payloads."""

        def __init__(self) -> None:
            self.seals: list[bytes] = []

        def append(self, kind: int, payload: bytes) -> None:
            frame_record(kind, payload)
            if kind == KIND_SEAL:
                self.seals.append(payload)

        def flush(self) -> None:
            pass

    names = ("input-wait", "forward-compute", "forward-send", "backward-recv",
             "backward-compute", "separate-grads-all-reduce", "optimizer")  # fmt: skip
    now = time.perf_counter_ns()
    seals = []
    for seal in range(200):
        ops = []
        for step in range(seal * 20, seal * 20 + 20):
            for i in range(22):
                ops.append(((i % 7, step, i // 7, 0), now + step * 10**8 + i, 1000))
            ops[-4], ops[-2] = ops[-2], ops[-4]  # a send that ends after later ops began
        seals.append(ops)
    per_step: dict[int, list[float]] = {}
    kept: dict[int, Keep] = {}
    for seal_version in (0, 1, 2):  # 0: the batches encoded by the sealer
        timer = OpTimer(job_id="bench", rank=0, dp_rank=0, pp_rank=0, mode="host",
                        log_dir=tmp / f"sealer-{seal_version}", gc_probe=False,
                        extra_optypes=names, seal_records=seal_version > 0,
                        seal_version=seal_version or None)  # fmt: skip
        codes = [timer.code_of(name) for name in names]
        keep = kept[seal_version] = Keep()
        writer, timer._writer = timer._writer, keep  # type: ignore[assignment]
        times = per_step[seal_version] = []
        for ops in seals:
            ops = [((codes[code], *head), start, duration)
                   for (code, *head), start, duration in ops]  # fmt: skip
            timer._current_step = ops[-1][0][1]
            began = time.thread_time_ns()
            timer._write_seal(ops)
            times.append((time.thread_time_ns() - began) / 20 / 1e3)
        timer._writer = writer
        timer.close()
    reader_per_step: dict[int, list[float]] = {1: [], 2: []}
    for version, times in reader_per_step.items():
        for payload in kept[version].seals:
            began = time.thread_time_ns()
            expand_seal(payload)
            times.append((time.thread_time_ns() - began) / 20 / 1e3)

    def row(benchmark: str, values: list[float], note: str) -> dict:
        return {"benchmark": benchmark, "value": statistics.median(values), "unit": "us",
                "target": "", "spread": [min(values), max(values)], "runs": len(values),
                "note": note}  # fmt: skip

    cold = "; in the job add the wakes, the write and the caches the training evicts"
    return [
        row("torch: sealer per rank-step, warm (22 ops, 20 per seal), encoding",
            per_step[0], "the batches' bytes + log record framing" + cold),
        row("torch: sealer per rank-step, warm (22 ops, 20 per seal), seal records v1",
            per_step[1], "the seal's columns + log record framing (0.3.0)" + cold),
        row("torch: sealer per rank-step, warm (22 ops, 20 per seal), seal records",
            per_step[2], "the seal's ops pickled + log record framing (version 2, the "
            "default since 0.4.0)" + cold),
        row("log reader: a seal record's batches per rank-step, warm (22 ops), v1",
            reader_per_step[1], "the encoding seal records move out of the training "
            "process, into the streamer or lagscope run; version 1 (0.3.0)"),
        row("log reader: a seal record's batches per rank-step, warm (22 ops)",
            reader_per_step[2], "the encoding seal records move out of the training "
            "process, into the streamer or lagscope run; version 2, its ops unpickled "
            "and checked"),
    ]  # fmt: skip
