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

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from lagscope.simulator.causes import WORKER_CAUSES, Cause
from lagscope.simulator.diagnose import Diagnosis, DiagnosisSettings
from lagscope.simulator.evidence import EpisodeBrief, RunBrief, Worker
from lagscope.simulator.whatif import WhatIfResult


def _first_named(diagnosis: Diagnosis) -> Worker | None:
    named = diagnosis.evidence.named_workers
    return named[0] if named else None


def episode_brief(diagnosis: Diagnosis) -> EpisodeBrief:
    """What a run's verdict lists of one of its episodes."""
    facts = diagnosis.evidence.finding.episode
    return EpisodeBrief(
        id=facts.id if facts else None,
        cause=diagnosis.cause,
        kind=facts.kind if facts else None,
        onset=facts.onset if facts else None,
        recovery=facts.recovery if facts else None,
        workers=diagnosis.evidence.finding.named,
        lost_s=diagnosis.evidence.lost_s,
        summary=diagnosis.summary,
    )


def run_story(
    run: Diagnosis,
    episodes: Sequence[Diagnosis],
    rollup: WhatIfResult | None = None,
    *,
    settings: DiagnosisSettings | None = None,
) -> Diagnosis:
    """The run's verdict: `run` (the diagnosis of its retained steps) or its dominant
    episode, as the module docstring says; `episodes` costliest first. The evidence keeps
    both: the run's own under `run`, every episode under `episodes`.

    >>> from lagscope.simulator.causes import Cause
    >>> from lagscope.simulator.diagnose import Diagnosis
    >>> from lagscope.simulator.evidence import Evidence, Finding, Worker
    >>> healthy = Diagnosis(Cause.NONE, "no straggling beyond noise")
    >>> slow = Diagnosis(Cause.SLOW_INPUT, "worker(s) (dp 1, pp 0) slow in input-wait",
    ...     Evidence(finding=Finding(named=(Worker(1, 0),))))
    >>> run_story(healthy, [slow]).cause
    <Cause.SLOW_INPUT: 'slow_input'>
    >>> run_story(healthy, []).cause
    <Cause.NONE: 'none'>
    """
    cfg = settings or DiagnosisSettings()
    briefs = tuple(episode_brief(e) for e in episodes)
    chosen = run
    dominant = next((e for e in episodes if e.cause != Cause.NONE), None)
    steady = steady_cost(run, rollup)
    if dominant is not None:
        excess = (
            float(np.clip(rollup.t_nodelay - rollup.t_ideal, 0.0, None).sum())
            if rollup is not None
            else 0.0
        )
        facts = dominant.evidence.finding.episode
        lost = dominant.evidence.lost_s
        if steady is not None and facts is not None and rollup is not None:
            # Against the run's steady cause: while the episode is open, what each costs a
            # step of the episode's; once it closed, what each cost the run.
            if facts.recovery is None:
                episode_wins = lost / max(facts.steps, 1) > steady
            else:
                episode_wins = lost > steady * rollup.steps.size
        else:
            episode_wins = excess > 0 and lost >= cfg.dominant_episode_share * excess
        if (
            run.cause in (Cause.NONE, Cause.UNATTRIBUTED)
            or (run.cause in WORKER_CAUSES and _first_named(run) == _first_named(dominant))
            or episode_wins
        ):
            chosen = dominant
    run_brief = None
    if chosen is not run:
        run_brief = RunBrief(
            run.cause, run.summary, run.evidence.slowdown, run.evidence.noise_floor
        )
    evidence = replace(chosen.evidence, episodes=briefs, run=run_brief)
    summary = chosen.summary
    if dominant is not None and steady is not None and rollup is not None:
        # Both matter: the verdict names the other one too.
        paid = float(np.mean(rollup.t_actual))
        steady_part = f"{_steady_label(run)}, {steady / paid:.0%} of the run's step time"
        if chosen is run:
            summary = f"{summary}; and {_episode_label(dominant)}"
        else:
            summary = f"{summary}; and {steady_part}"
    return replace(chosen, summary=summary, evidence=evidence)


def steady_cost(run: Diagnosis, rollup: WhatIfResult | None) -> float | None:
    """Seconds a step the run's own steady cause costs (a heavier last stage: what
    evening it out saves; another cause of the job's make: the steps' whole excess over
    their straggler-free time); None where the run names no steady cause (none, or a
    worker: a straggler's episodes price it).

    >>> from lagscope.simulator.causes import Cause
    >>> steady_cost(Diagnosis(Cause.NONE, "no straggling beyond noise"), None) is None
    True
    """
    if rollup is None or run.cause in (Cause.NONE, Cause.UNATTRIBUTED, *WORKER_CAUSES):
        return None
    if run.cause == Cause.LAST_STAGE_IMBALANCE and rollup.ms is not None:
        return max(rollup.ms.t_original - rollup.ms.t_removed, 0.0)
    return float(np.clip(rollup.t_nodelay - rollup.t_ideal, 0.0, None).mean())


def _steady_label(run: Diagnosis) -> str:
    """A few words for a run's steady cause."""
    if run.cause == Cause.LAST_STAGE_IMBALANCE:
        stage = run.evidence.finding.stage
        return f"the last stage{f' (pp {stage})' if stage is not None else ''} is heavier"
    return str(run.cause).replace("_", " ")


def _episode_label(episode: Diagnosis) -> str:
    """A few words for an episode: who, what, when, and what it cost its steps.

    >>> from lagscope.simulator.evidence import EpisodeFacts, Evidence, Finding, Worker
    >>> facts = EpisodeFacts(1, "host", 15, 31, 19, 0.001, 0.02, 9.0, 1.0, 0.3, 0.8, 16,
    ...     step_share=0.31)
    >>> slow = Diagnosis(Cause.SLOW_HOST, "...",
    ...     Evidence(finding=Finding(named=(Worker(1, 0),), episode=facts)))
    >>> _episode_label(slow)
    'the host of worker (dp 1, pp 0) stalled, 31% of steps 15-30'
    """
    facts = episode.evidence.finding.episode
    who = _first_named(episode)
    worker = f"worker {who.label()}" if who is not None else "a worker"
    if facts is None:
        return f"{worker}: {episode.cause}"
    if episode.cause == Cause.GC_PAUSES:
        what = f"{worker} paused for garbage collection"
    elif facts.kind == "host":
        what = f"the host of {worker} stalled"
    elif facts.kind == "input-wait":
        what = f"{worker} waited for its input"
    else:
        what = f"{worker} was slow in {facts.kind}"
    steps = (
        f"{facts.onset}-{facts.recovery - 1}" if facts.recovery is not None else f"{facts.onset} on"
    )
    return f"{what}, {facts.step_share:.0%} of steps {steps}"


def noise_headline(
    slowdown: float, noise_floor: float | None, straggler_gpu_s: float, gpu_s: float
) -> str:
    """S split into the job's own jitter and what stragglers cost on top of it.

    Without a straggler episode, what lies above the jitter is the job's steady state
    (a heavier stage, a slow node from the start): the verdict names it, so the headline
    says so rather than "stragglers cost nothing" beside a verdict that costs 15 %.

    >>> print(noise_headline(1.49, 1.42, 0.0, 3600.0))
    slowdown S 1.490, of which the job's own jitter gives S 1.42 (its noise floor); no straggler episode: the rest is the job's steady state (see the verdict)
    >>> print(noise_headline(1.02, 1.04, 0.0, 3600.0))
    slowdown S 1.020, within the job's own jitter (its noise floor, S 1.04); no straggler episode
    >>> print(noise_headline(1.31, 1.12, 540.0, 3600.0))
    slowdown S 1.310, of which the job's own jitter gives S 1.12 (its noise floor); stragglers cost 15.0% of its GPU time (0.15 GPU-h)

    The floor is estimated from the op-to-op fluctuations, and on a noisy job it can come
    out above S itself; "of which" would then read as more than the whole:

    >>> print(noise_headline(1.24, 1.46, 2.0, 27.0))
    slowdown S 1.240 (the job's op-to-op jitter alone gives S 1.46, its noise floor); stragglers' episodes cost 7.4% of its GPU time (2.0 GPU-s)

    A run that holds a straggler's episode is not "within its jitter": the episode was
    measured against the job's own steps.
    """  # noqa: E501
    text = f"slowdown S {slowdown:.3f}"
    floor_known = noise_floor is not None and np.isfinite(noise_floor)
    within_floor = floor_known and noise_floor >= slowdown
    if within_floor and straggler_gpu_s > 0:
        text += f" (the job's op-to-op jitter alone gives S {noise_floor:.2f}, its noise floor)"
    elif within_floor:
        text += f", within the job's own jitter (its noise floor, S {noise_floor:.2f})"
    elif floor_known:
        text += f", of which the job's own jitter gives S {noise_floor:.2f} (its noise floor)"
    if straggler_gpu_s > 0 and gpu_s > 0:
        # Within the floor, what stragglers cost is their episodes': the run as a whole
        # has nothing above its jitter.
        whose = "stragglers' episodes" if within_floor else "stragglers"
        share = straggler_gpu_s / gpu_s
        text += f"; {whose} cost {share:.1%} of its GPU time ({gpu_time(straggler_gpu_s)})"
    elif floor_known and not within_floor:
        text += "; no straggler episode: the rest is the job's steady state (see the verdict)"
    else:
        text += "; no straggler episode"
    return text


def gpu_time(gpu_s: float) -> str:
    """GPU time in GPU-hours, or GPU-seconds where hours would print as 0.00.

    >>> gpu_time(540.0), gpu_time(1.04), gpu_time(0.0)
    ('0.15 GPU-h', '1.0 GPU-s', '0.0 GPU-s')
    """
    return f"{gpu_s / 3600:,.2f} GPU-h" if gpu_s >= 18.0 else f"{gpu_s:.1f} GPU-s"
