"""A job's own noise: how slow its steps are from fluctuations alone, and which workers
are slower than their peers persistently rather than now and then.

A healthy job is not at S = 1: every op jitters, and the step waits for the slowest of
many jittering ops (DP collectives, the clip barrier, the pipeline), so a replay with the
measured costs runs longer than one with the mean costs. On a shared CPU box that floor
reads S 1.03-1.12 and drifts with the machine's load. A straggler, a heavy stage or slow
links are *persistent* structure on top of it; only that structure is diagnosed.

- **Noise floor.** Every op's cost is split into its worker's persistent level for that op
  (the median over the analysed steps) and a fluctuation (cost / level). The noise-only
  job puts the fluctuations on the ideal costs: ideal x fluctuation, no persistent
  difference between workers or stages left. Replayed, the steps give the slowdown the
  fluctuations alone cause, as a ratio of mean step times like S itself: a shared
  machine's load bursts (every op of some steps slower, comm most) raise the floor as
  they raise S. A straggler shorter than half the run is a fluctuation here too; it is
  found by its episode, and a persistent one is structure that no floor hides.
- **Persistent excess.** A worker's own work per step (its computes, optimizer and input
  wait: time nobody else makes it wait) over the median of its group's, itself included
  (its stage's DP ranks; all workers when there is one DP rank: `peers.relative_to_group`),
  median over steps.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lagscope.simulator.engine import CompiledModel
from lagscope.simulator.medians import median_along
from lagscope.simulator.peers import relative_to_group
from lagscope.simulator.prepare import PreparedTrace
from lagscope.simulator.whatif import Variant, WhatIfAnalysis


def own_work_mask(prepared: PreparedTrace) -> np.ndarray:
    """Nodes whose duration is the worker's own work, not waiting for peers (read-only)."""
    return prepared.model.own_work_nodes


def own_work(prepared: PreparedTrace, optype: str | None = None) -> np.ndarray:
    """Own work of every worker in every step, [step, stage, dp] (seconds); only that of
    `optype` when given."""
    return prepared.stage_sums(prepared.duration, optype, own_work_only=True)


def series_names(n_stages: int, n_dp: int) -> list[str]:
    """Names of the series `step_series` returns, in its column order."""
    return (
        ["step_time"]
        + [f"stage/{s}" for s in range(n_stages)]
        + [f"dp/{d}" for d in range(n_dp)]
        + [f"worker/{d}.{s}" for s in range(n_stages) for d in range(n_dp)]
    )


def step_series(prepared: PreparedTrace) -> np.ndarray:
    """[step, series] in `series_names` order: the measured step time, then each step's own
    work per stage (its slowest DP rank), per DP rank (its whole pipeline) and per worker,
    each over the step's median of its kind. Relative series move when one worker or stage
    changes against the others, not when the whole machine slows down (a shared box's
    load), which only the step time sees."""
    work = own_work(prepared)  # [step, stage, dp]

    def relative(values: np.ndarray) -> np.ndarray:
        median = median_along(values, axis=1)
        return values / np.where(median > 0, median, np.nan)

    return np.concatenate(
        [
            prepared.actual_step_time.astype(np.float64)[:, None],
            relative(work.max(axis=2)),
            relative(work.sum(axis=1)),
            relative(work.reshape(work.shape[0], -1)),
        ],
        axis=1,
    )


def persistent_excess(prepared: PreparedTrace) -> np.ndarray:
    """[stage, dp]: median over steps of the worker's own work relative to its peers'."""
    return np.nanmedian(relative_to_group(own_work(prepared)), axis=0)


def stage_excess(prepared: PreparedTrace) -> np.ndarray:
    """[stage]: median over steps of the stage's own work (its slowest DP rank) over the
    median stage's; 1 everywhere with one stage."""
    per_stage = own_work(prepared).max(axis=2)  # [step, stage]
    median = np.median(per_stage, axis=1, keepdims=True)
    return np.nanmedian(per_stage / np.where(median > 0, median, np.nan), axis=0)


def noise_floor(prepared: PreparedTrace, ideal: dict[str, float], compiled: CompiledModel) -> float:
    """The slowdown the job's fluctuations alone cause (ratio of mean step times, as S)."""
    level = np.median(prepared.cost, axis=1, keepdims=True).astype(np.float64)
    fluctuation = np.where(level > 0, prepared.cost / np.where(level > 0, level, 1.0), 1.0)
    ideal_cost = np.array([ideal[t] for t in prepared.node_optype], dtype=np.float64)
    noisy = dataclasses.replace(
        prepared, cost=(ideal_cost[:, None, None] * fluctuation).astype(np.float32)
    )
    analysis = WhatIfAnalysis(noisy, ideal, compiled=compiled)
    t_noise, t_ideal = analysis.run([Variant("measured"), Variant("ideal")])
    return float(t_noise.mean() / t_ideal.mean())


def slow_in(prepared: PreparedTrace, worker: tuple[int, int]) -> dict[str, float]:
    """Where a worker's own work exceeds its peers': extra seconds per step by op type
    (input-wait, forward-compute, ...), largest first; only positive excesses."""
    dp, stage = worker
    optypes = np.array(prepared.node_optype)
    on_stage = prepared.model.node_stage() == stage
    own = own_work_mask(prepared)
    out: dict[str, float] = {}
    for optype in sorted(set(optypes[own & on_stage].tolist())):
        nodes = own & on_stage & (optypes == optype)
        per_dp = prepared.duration[nodes].astype(np.float64).sum(axis=0)  # [step, dp]
        others = np.delete(per_dp, dp, axis=1) if prepared.n_dp > 1 else per_dp
        excess = float(np.median(per_dp[:, dp] - np.median(others, axis=1)))
        if excess > 0:
            out[optype] = excess
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
