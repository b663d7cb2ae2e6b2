"""The one story a run tells: its verdict built from its diagnosis and its episodes, and a
headline that keeps straggling apart from the job's own jitter.

The run's diagnosis (`diagnose` of its retained steps) judges the run as a whole; an
episode is a straggler that began (and maybe ended), diagnosed on its own steps. Where
they disagree, the more precise one speaks:

- the run names no cause (`none`, `unattributed`) while an episode names a worker: the
  episode (a straggler of 15 steps in a run of 60 is within a noisy run's floor, and is
  still a straggler);
- both name the same worker: the episode's cause and op (measured over the worker's own
  slow steps, not diluted by the rest of the run);
- the costliest episode cost at least half of what the run's steps lost above their
  straggler-free time: the episode;
- otherwise the run's own cause (a heavier last stage, slow links, GC, sequence
  imbalance, a worker slow all along), with the episodes listed beside it.

A healthy job's steps are not at S = 1: its op-to-op jitter alone gives its noise floor.
The headline says how much of S is that floor and what stragglers cost on top of it, so a
healthy job never reads as wasting a third of its GPU time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from lagscope.simulator.diagnose import Diagnosis
from lagscope.simulator.verdict import WORKER_CAUSES
from lagscope.simulator.whatif import WhatIfResult

#: The costliest episode is the run's verdict when it cost at least this share of what the
#: run's steps lost above their straggler-free time.
DOMINANT_SHARE = 0.5


def _first_named(diagnosis: Diagnosis) -> tuple[int, int] | None:
    evidence = diagnosis.evidence or {}
    named = evidence.get("named_workers") or evidence.get("verified_workers") or []
    return (int(named[0]["dp"]), int(named[0]["stage"])) if named else None


def _lost_s(diagnosis: Diagnosis) -> float:
    return float((diagnosis.evidence or {}).get("episode", {}).get("lost_s", 0.0))


def episode_brief(diagnosis: Diagnosis) -> dict[str, Any]:
    """What a run's verdict lists of one of its episodes."""
    episode = (diagnosis.evidence or {}).get("episode", {})
    return {
        "id": episode.get("id"),
        "cause": diagnosis.cause,
        "kind": episode.get("kind"),
        "onset": episode.get("onset"),
        "recovery": episode.get("recovery"),
        "workers": (diagnosis.evidence or {}).get("named_workers", []),
        "lost_s": episode.get("lost_s", 0.0),
        "summary": diagnosis.summary,
    }


def run_story(
    run: Diagnosis, episodes: Sequence[Diagnosis], rollup: WhatIfResult | None = None
) -> Diagnosis:
    """The run's verdict: `run` (the diagnosis of its retained steps) or its dominant
    episode, as the module docstring says; `episodes` costliest first. The evidence keeps
    both: the run's own under `run`, every episode under `episodes`.

    >>> from lagscope.simulator.diagnose import Diagnosis
    >>> healthy = Diagnosis("none", "no straggling beyond noise", {"slowdown": 1.2})
    >>> slow = Diagnosis("slow_input", "worker(s) (dp 1, pp 0) slow in input-wait",
    ...     {"named_workers": [{"dp": 1, "stage": 0}], "episode": {"id": 1, "lost_s": 2.0}})
    >>> run_story(healthy, [slow]).cause
    'slow_input'
    >>> run_story(healthy, []).cause
    'none'
    """
    briefs = [episode_brief(e) for e in episodes]
    run_brief = {
        "cause": run.cause,
        "summary": run.summary,
        "slowdown": (run.evidence or {}).get("slowdown"),
        "noise_floor": (run.evidence or {}).get("noise_floor"),
    }
    chosen = run
    dominant = next((e for e in episodes if e.cause != "none"), None)
    if dominant is not None:
        excess = (
            float(np.clip(rollup.t_nodelay - rollup.t_ideal, 0.0, None).sum())
            if rollup is not None
            else 0.0
        )
        if (
            run.cause in ("none", "unattributed")
            or (run.cause in WORKER_CAUSES and _first_named(run) == _first_named(dominant))
            or (excess > 0 and _lost_s(dominant) >= DOMINANT_SHARE * excess)
        ):
            chosen = dominant
    evidence = {**(chosen.evidence or {}), "episodes": briefs}
    if chosen is not run:
        evidence["run"] = run_brief
    # Whichever speaks, the run's slowdown and its noise floor stay where readers (the
    # alert on sustained slowdown, the summary) look for them.
    for name in ("slowdown", "noise_floor"):
        if run_brief[name] is not None:
            evidence[name] = run_brief[name]
    return dataclasses.replace(chosen, evidence=evidence)


def noise_headline(
    slowdown: float, noise_floor: float | None, straggler_gpu_s: float, gpu_s: float
) -> str:
    """S split into the job's own jitter and what stragglers cost on top of it.

    >>> print(noise_headline(1.49, 1.42, 0.0, 3600.0))
    slowdown S 1.490, of which the job's own jitter gives S 1.42 (its noise floor); stragglers cost nothing beyond it
    >>> print(noise_headline(1.31, 1.12, 540.0, 3600.0))
    slowdown S 1.310, of which the job's own jitter gives S 1.12 (its noise floor); stragglers cost 15.0% of its GPU time (0.15 GPU-h)
    """  # noqa: E501
    text = f"slowdown S {slowdown:.3f}"
    if noise_floor is not None and np.isfinite(noise_floor):
        text += f", of which the job's own jitter gives S {noise_floor:.2f} (its noise floor)"
    if straggler_gpu_s > 0 and gpu_s > 0:
        text += (
            f"; stragglers cost {straggler_gpu_s / gpu_s:.1%} of its GPU time "
            f"({straggler_gpu_s / 3600:,.2f} GPU-h)"
        )
    else:
        text += "; stragglers cost nothing beyond it"
    return text
