"""Plain-data views of a what-if result: the JSON document and the summary table, which
ends with the verdict of `simulator/verdict.py`. Pure functions (no I/O): the CLI, the
stream app and the report share them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from lagscope.simulator.verdict import (
    ABOVE_S,
    MEANINGS,
    escalation_text,
    percent,
    share,
    verdict_of,
)
from lagscope.simulator.whatif import Attribution, Explained, WhatIfResult

if TYPE_CHECKING:
    from lagscope.simulator.diagnose import Diagnosis


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


@dataclass(frozen=True)
class Others:
    """The members of a ranked family that a list leaves out: how many, and where their
    values lie. At 1,560 DP ranks a top-5 list of near-equal values reads as five slow
    ranks; beside the others' range it reads as one rank that stands out, or none.

    >>> Others.of([1.06, 1.07, 1.065]).text("DP ranks")
    'the other 3 DP ranks: S 1.060-1.070, median 1.065'
    >>> Others.of([]) is None
    True
    """

    count: int
    low: float
    median: float
    high: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Others | None:
        """The others' figures (NaNs left out of the range); None when none is left out."""
        array = np.asarray(list(values), dtype=np.float64)
        if array.size == 0:
            return None
        finite = array[np.isfinite(array)]
        if finite.size == 0:
            return cls(int(array.size), float("nan"), float("nan"), float("nan"))
        return cls(int(array.size), float(finite.min()), float(np.median(finite)),
                   float(finite.max()))  # fmt: skip

    def text(self, noun: str, symbol: str = "S") -> str:
        if not np.isfinite(self.median):
            return f"the other {self.count:,} {noun}: no {symbol}"
        return (
            f"the other {self.count:,} {noun}: {symbol} {self.low:.3f}-{self.high:.3f}, "
            f"median {self.median:.3f}"
        )


def others_after(att: Attribution, top: int) -> Others | None:
    """The groups of `att` after its `top` highest."""
    return Others.of(value for _, value in att.ranked()[top:])


def _with_meaning(line: str, symbol: str) -> str:
    return f"{line}   - {symbol}: {MEANINGS[symbol]}"


def _attribution_line(
    title: str, att: Attribution, slowdown: float, top: int, prefix: str, noun: str
) -> str:
    """A family's top groups by S_X, then where the others lie; a group above S itself
    says why beside it."""
    ranked = att.ranked()[:top]
    line = f"{title:<20}" + "   ".join(f"{n} {v:.3f}" for n, v in ranked)
    if (others := others_after(att, top)) is not None:
        line += f"   ({others.text(noun)})"
    if ranked and ranked[0][1] > slowdown + 5e-4:
        line += f"   ({prefix}{ranked[0][0]} is {ABOVE_S})"
    return line


def verdict_lines(diagnosis: Diagnosis) -> list[str]:
    """The verdict (`simulator/verdict.py`), its action, the advice and the escalation, in
    the summary's columns: the one story every output of an analysis tells."""
    story = verdict_of(diagnosis)
    lines = [
        f"verdict             {story.line()}",
        f"action              {story.action_line()}",
    ]
    lines += [
        f"advice              {a.action} (predicted speed-up {a.predicted_speedup:.3f}x): "
        f"{a.detail}"
        for a in diagnosis.advice
    ]
    if diagnosis.escalation:
        lines.append(f"escalation          {escalation_text(diagnosis.escalation)}")
    return lines


def summary_lines(
    result: WhatIfResult, diagnosis: Diagnosis | None = None, *, top: int = 5
) -> list[str]:
    """The human summary `lagscope analyze` prints: the numbers, each symbol with one
    sentence of meaning, shares written as shares, then the verdict of `diagnosis` (the
    numbers alone name no cause: the diagnosis checks them against the job's noise)."""
    by_score = np.argsort(-result.worker_slowdown, axis=None, kind="stable")
    worst_workers = by_score[:3]
    other_workers = Others.of(result.worker_slowdown.flat[by_score[3:]])
    n_dp = result.worker_slowdown.shape[1]
    lines = [
        f"steps analysed      {result.steps.size}"
        + (f"  ({len(result.dropped_steps)} dropped)" if result.dropped_steps else ""),
        f"mean step time      actual {result.t_actual.mean():.3f} s   "
        f"simulated {result.t_nodelay.mean():.3f} s   ideal {result.t_ideal.mean():.3f} s",
        _with_meaning(
            f"slowdown S          {result.slowdown:.4f}   (waste {percent(result.waste, 1)} "
            f"of GPU time)",
            "S",
        ),
        f"launch slowdown     {result.launch_slowdown:.4f}",
        _with_meaning(
            "M_W (top workers)   "
            + ", ".join(f"(dp {dp}, pp {st})" for dp, st in result.mw.workers[:6])
            + (f" and {len(result.mw.workers) - 6:,} more" if len(result.mw.workers) > 6 else "")
            + f": {share(result.mw.removed_share, 'M_W', 1)}",
            "M_W",
        ),
        _with_meaning(f"M_S (last stage)    {share(result.ms.removed_share, 'M_S', 1)}", "M_S"),
        _with_meaning(
            "worker score S_w    "
            + "   ".join(
                f"(dp {i % n_dp}, pp {i // n_dp}) {result.worker_slowdown.flat[i]:.3f}"
                for i in worst_workers.tolist()
            )
            + (f"   ({other_workers.text('workers', 'S_w')})" if other_workers else ""),
            "S_w",
        ),
    ]
    if result.decomposed:
        for title, att, prefix, noun in (
            ("by op type", result.by_optype, "", "op types"),
            ("by stage", result.by_stage, "pp ", "stages"),
            ("by DP rank", result.by_dp_rank, "dp ", "DP ranks"),
        ):
            lines.append(_attribution_line(title, att, result.slowdown, top, prefix, noun))
    worst = np.argsort(-result.step_slowdown)[:3]
    lines.append(
        "slowest steps       "
        + "   ".join(f"{int(result.steps[i])}: S={result.step_slowdown[i]:.3f}" for i in worst)
    )
    for dropped in result.dropped_steps:
        lines.append(f"dropped step {dropped.step}: {dropped.reason}")
    if diagnosis is not None:
        lines += verdict_lines(diagnosis)
    return lines
