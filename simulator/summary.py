"""Plain-data views of a what-if result: the JSON document, a one-line verdict and the
summary table. Pure functions (no I/O): the CLI, the stream app and the report share them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lagscope.simulator.whatif import Attribution, Explained, WhatIfResult

#: A group explaining at least this share of the slowdown is named as the cause.
EXPLAINS_SHARE = 0.5


def _attribution_dict(att: Attribution | None, gated: bool) -> dict[str, float] | None:
    if att is None or not gated:
        return None
    return {name: value for name, value in att.ranked()}


def _attribution_per_step(
    att: Attribution | None, gated: bool, steps: np.ndarray
) -> dict[str, dict[str, float]] | None:
    if att is None or not gated:
        return None
    return {
        str(int(step)): {name: float(series[i]) for name, series in att.per_step.items()}
        for i, step in enumerate(steps)
    }


def _explained_dict(ex: Explained, key: str) -> dict[str, Any]:
    return {
        key: ex.removed_share,
        "rem": ex.removed_share,
        "add": ex.added_share,
        "tori": ex.t_original,
        "tideal": ex.t_ideal,
        "trem": ex.t_removed,
        "tadd": ex.t_added,
        "workers": [{"dp": dp, "stage": stage} for dp, stage in ex.workers],
    }


def result_to_dict(result: WhatIfResult, *, always_decompose: bool = False) -> dict[str, Any]:
    """The `--json` document of `lagscope analyze`."""
    blocking = always_decompose or result.decomposed
    launch = always_decompose or result.launch_slowdown >= result.decompose_threshold
    return {
        "slowdown": result.slowdown,
        "launch_slowdown": result.launch_slowdown,
        "waste": result.waste,
        "simulation_error_s": result.simulation_error,
        "decompose_threshold": result.decompose_threshold,
        "by_optype": _attribution_dict(result.by_optype, blocking),
        "by_dp_rank": _attribution_dict(result.by_dp_rank, blocking),
        "by_stage": _attribution_dict(result.by_stage, blocking),
        "launch_by_optype": _attribution_dict(result.launch_by_optype, launch),
        "launch_by_dp_rank": _attribution_dict(result.launch_by_dp_rank, launch),
        "launch_by_stage": _attribution_dict(result.launch_by_stage, launch),
        "by_optype_per_step": _attribution_per_step(result.by_optype, blocking, result.steps),
        "by_dp_rank_per_step": _attribution_per_step(result.by_dp_rank, blocking, result.steps),
        "by_stage_per_step": _attribution_per_step(result.by_stage, blocking, result.steps),
        "mw": _explained_dict(result.mw, "Mw"),
        "ms": _explained_dict(result.ms, "Ms"),
        "worker_slowdown": [
            {"dp": dp, "stage": stage, "slowdown": float(result.worker_slowdown[stage, dp])}
            for stage in range(result.worker_slowdown.shape[0])
            for dp in range(result.worker_slowdown.shape[1])
        ],
        "steps": {
            str(int(step)): {
                "actual": float(result.t_actual[i]),
                "simulated": float(result.t_nodelay[i]),
                "ideal": float(result.t_ideal[i]),
                "slowdown": float(result.step_slowdown[i]),
                "launch_slowdown": float(result.launch_step_slowdown[i]),
            }
            for i, step in enumerate(result.steps)
        },
        "ideal_cost_s": result.ideal_cost,
        "dropped_steps": [{"step": d.step, "reason": d.reason} for d in result.dropped_steps],
    }


def _workers_phrase(workers: tuple[tuple[int, int], ...]) -> str:
    listed = ", ".join(f"(dp {dp}, pp {stage})" for dp, stage in workers[:4])
    more = f" and {len(workers) - 4} more" if len(workers) > 4 else ""
    noun = "one worker" if len(workers) == 1 else f"{len(workers)} workers"
    return f"{noun} {listed}{more}"


def verdict(result: WhatIfResult) -> str:
    """One line an on-call engineer can act on."""
    s = result.slowdown
    if not result.decomposed:
        return (
            f"no significant straggling: S = {s:.3f} is below the "
            f"{result.decompose_threshold:.2f} threshold"
        )
    mw, ms = result.mw.removed_share, result.ms.removed_share
    n_stages = result.worker_slowdown.shape[0]
    if mw >= EXPLAINS_SHARE:
        verb = "explains" if len(result.mw.workers) == 1 else "explain"
        return f"{_workers_phrase(result.mw.workers)} {verb} {mw:.0%} of the slowdown"
    if ms >= EXPLAINS_SHARE and n_stages > 1:
        return (
            f"the last pipeline stage (pp {n_stages - 1}) explains {ms:.0%} of the slowdown: "
            f"stage imbalance, consider moving layers off it"
        )
    top_name, top_value = result.by_optype.ranked()[0]
    return (
        f"slowdown is spread over many workers (top-3% workers explain {mw:.0%}); "
        f"{top_name} contributes most (S = {top_value:.3f} with only it straggling)"
    )


def summary_lines(result: WhatIfResult, *, top: int = 5) -> list[str]:
    """The human summary `lagscope analyze` prints."""
    lines = [
        f"steps analysed      {result.steps.size}"
        + (f"  ({len(result.dropped_steps)} dropped)" if result.dropped_steps else ""),
        f"mean step time      actual {result.t_actual.mean():.3f} s   "
        f"simulated {result.t_nodelay.mean():.3f} s   ideal {result.t_ideal.mean():.3f} s",
        f"slowdown S          {result.slowdown:.4f}   (waste {result.waste:.1%} of GPU time)",
        f"launch slowdown     {result.launch_slowdown:.4f}",
        f"M_W (top workers)   {result.mw.removed_share:.1%}   "
        + ", ".join(f"(dp {dp}, pp {st})" for dp, st in result.mw.workers[:6]),
        f"M_S (last stage)    {result.ms.removed_share:.1%}",
    ]
    if result.decomposed:
        for title, att in (
            ("by op type", result.by_optype),
            ("by stage", result.by_stage),
            ("by DP rank", result.by_dp_rank),
        ):
            ranked = att.ranked()[:top]
            lines.append(f"{title:<20}" + "   ".join(f"{n} {v:.3f}" for n, v in ranked))
    worst = np.argsort(-result.step_slowdown)[:3]
    lines.append(
        "slowest steps       "
        + "   ".join(f"{int(result.steps[i])}: S={result.step_slowdown[i]:.3f}" for i in worst)
    )
    for dropped in result.dropped_steps:
        lines.append(f"dropped step {dropped.step}: {dropped.reason}")
    lines.append(f"verdict             {verdict(result)}")
    return lines
