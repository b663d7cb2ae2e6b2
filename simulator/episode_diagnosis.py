"""What to tell about a worker's episode, and its bounds once the run has moved on.

An episode found while the job runs (`online_episodes.py`) names one worker and one kind
of its own time; this module turns it into the diagnosis every output carries (cause,
one sentence, evidence, advice with a predicted speed-up, the escalation ladder) from what
the detector measured and what the episode cost (`episode_cost.py`), without another
simulation, so it is cheap to redo at every step.

Causes, by the kind that rose:

- `slow_workers`: a compute op type (forward, backward, optimizer): the worker's GPU (or
  its CPU, on a CPU job) computes slower;
- `slow_input`: `input-wait`: the worker waits for its next batch (its data loader, its
  storage), a problem re-splitting micro-batches does not fix;
- `slow_host`: `host`: the worker's host takes longer between its ops (launch delays)
  while its ops take their usual time: a busy or throttled CPU, Python work between ops,
  data prepared outside the loader;
- `gc_pauses`: any kind, when the GC probe recorded pauses inside the worker's ops of that
  kind (for `host`, inside its host gaps: a GPU's kernels keep their time while the host's
  collection holds back their launches), beyond its peers' in the same steps, that explain
  `explains_share` of its rise (`EpisodeCost.gc_share`): its collections stall it while
  its peers run (its heap grew, its collector fires at other steps than theirs), and
  planned collections on every rank at once are the fix, not its accelerator or its host.

Bounds: the detector opens an episode after seeing its first steps and closes it a few
steps after the worker recovered; with the steps on both sides in hand, `refined_bounds`
fits the worker's own series with `episodes.square_wave` near those bounds. The finished
run refines an episode this way; it never adds or drops one.
"""

from __future__ import annotations

import numpy as np

from lagscope.simulator import optypes as ot
from lagscope.simulator.advice import (
    FIX_IN_PLACE,
    Advice,
    advise_removal,
    advise_synchronised_gc,
    escalation,
)
from lagscope.simulator.causes import Cause
from lagscope.simulator.diagnose import Diagnosis, DiagnosisSettings
from lagscope.simulator.episode_cost import EpisodeCost
from lagscope.simulator.episodes import square_wave
from lagscope.simulator.evidence import (
    EpisodeFacts,
    Evidence,
    Finding,
    VerifiedWorker,
    Worker,
    in_one_unit,
)
from lagscope.simulator.online_episodes import (
    HOST,
    OnlineEpisodeSettings,
    WorkerEpisode,
    worker_signals,
)
from lagscope.simulator.prepare import PreparedTrace

#: The cause of an episode by the kind of own time that rose (compute: slow_workers).
CAUSE_OF_KIND = {ot.INPUT_WAIT: Cause.SLOW_INPUT, HOST: Cause.SLOW_HOST}


def cause_of(kind: str) -> Cause:
    """The cause an episode of `kind` names.

    >>> [str(cause_of(kind)) for kind in ("forward-compute", "input-wait", "host")]
    ['slow_workers', 'slow_input', 'slow_host']
    """
    return CAUSE_OF_KIND.get(kind, Cause.SLOW_WORKERS)


def episode_cause(kind: str, cost: EpisodeCost, settings: DiagnosisSettings | None = None) -> Cause:
    """The cause an episode of `kind` names with `cost` so far: garbage collection where
    the worker's own recorded pauses explain its rise, else by its kind (`cause_of`).

    >>> str(episode_cause("forward-compute", EpisodeCost(rise_s=0.4, gc_s=0.3)))
    'gc_pauses'
    >>> str(episode_cause("forward-compute", EpisodeCost(rise_s=0.4, gc_s=0.1)))
    'slow_workers'
    >>> str(episode_cause("host", EpisodeCost(rise_s=0.4, gc_s=0.3)))
    'gc_pauses'
    """
    cfg = settings or DiagnosisSettings()
    if cost.gc_share >= cfg.explains_share:
        return Cause.GC_PAUSES
    return cause_of(kind)


def costs_the_job(cost: EpisodeCost, settings: DiagnosisSettings | None = None) -> bool:
    """Whether an episode has cost the job enough over its steps so far to be named: by
    the run's own test for a slow worker (`diagnose.py`), it explains `explains_share` of
    the job's slowdown over those steps, or the job would have run `floor_margin` faster
    without it. A worker whose own time rose, beside a job that lost next to nothing to
    it, is the job's noise: on a shared 2-core machine a healthy 1F1B rank's input waits
    rose 4-5x for 8-10 steps and cost 1-2 % of those steps, 5-12 % of their slowdown;
    every straggler planted in a recorded job and found cost 5-63 % of its steps at the
    opening but one (a 2x forward that cost 0.6 %, 1.3 % in the end). Where the job
    measured its steps before the episode, the price must also stand clear of that noise
    (`EpisodeCost.within_noise`): it is kept as evidence meanwhile.

    >>> costs_the_job(EpisodeCost(lost_s=0.1, excess_s=1.0, measured_s=10.0, steps=8))
    False
    >>> costs_the_job(EpisodeCost(lost_s=0.6, excess_s=1.0, measured_s=10.0, steps=8))
    True
    >>> costs_the_job(EpisodeCost(lost_s=0.4, excess_s=4.0, measured_s=10.0, steps=8))
    True
    """
    cfg = settings or DiagnosisSettings()
    if cost.within_noise:
        return False
    return cost.share >= cfg.explains_share or cost.saved_share >= cfg.floor_margin


def rise_is_shared(
    steps: np.ndarray, values: np.ndarray, episode: WorkerEpisode, *, baseline_steps: int = 40
) -> bool:
    """Whether the episode's worker rose together with half or more of the job's workers
    (`values`: [step, stage, dp], the episode's kind, over `steps`): a machine whose
    ranks share loaded cores slows several of them at once, and none of them is a
    straggler. A worker counts as rising with it when its own median over the episode's
    steps rose over its median before by at least half the episode worker's rise (a busy
    straggler that takes its peers' cores raises them by far less than itself).

    >>> from lagscope.simulator.online_episodes import WorkerEpisode
    >>> steps = np.arange(40)
    >>> values = np.full((40, 1, 4), 0.01)
    >>> values[20:, 0, 3] = values[20:, 0, 2] = 0.02      # two of four ranks, together
    >>> episode = WorkerEpisode(1, 3, 0, "forward-compute", 20, 28, None, 0.01, 0.02, 2.0,
    ...     1.0, 39)
    >>> rise_is_shared(steps, values, episode)
    True
    >>> values[20:, 0, 2] = 0.011                          # one rank alone
    >>> rise_is_shared(steps, values, episode)
    False
    >>> rise_is_shared(steps, values[:, :, 2:], WorkerEpisode(1, 1, 0, "forward-compute",
    ...     20, 28, None, 0.01, 0.02, 2.0, 1.0, 39))           # one of two, alone
    False
    """
    before = np.flatnonzero(steps < episode.onset)[-baseline_steps:]
    inside = np.flatnonzero(steps >= episode.onset)
    if before.size < 2 or inside.size < 2:
        return False
    with np.errstate(divide="ignore", invalid="ignore"):
        rise = np.median(values[inside], axis=0) / np.median(values[before], axis=0)
    rise = np.nan_to_num(rise, nan=1.0, posinf=1.0)
    own = rise[episode.stage, episode.dp]
    if own <= 1.0 or rise.size < 2:
        return False
    along = rise - 1.0 >= 0.5 * (own - 1.0)
    others = int(along.sum()) - 1
    return others >= 1 and (others + 1) * 2 >= rise.size


def episode_diagnosis(
    episode: WorkerEpisode,
    cost: EpisodeCost,
    *,
    n_gpus: int,
    settings: DiagnosisSettings | None = None,
    resplit: Advice | None = None,
) -> Diagnosis:
    """The diagnosis of a worker's episode as it stands (`cost`: over its steps so far;
    `resplit`: the re-split of micro-batches its steps were re-simulated with, if any).

    >>> episode = WorkerEpisode(3, 1, 0, "host", 15, 19, None, 0.05, 0.2, 4.1, 1.0, 22)
    >>> d = episode_diagnosis(episode, EpisodeCost(lost_s=1.2, excess_s=1.5,
    ...     measured_s=2.8, steps=8), n_gpus=4)
    >>> str(d.cause), d.summary
    ('slow_host', "the host of worker (dp 1, pp 0) stalls between its ops since step 15 (ongoing): 50.0 -> 200.0 ms per step (4.0x its own level before), 4.1x its peers'; its ops take their usual time; costs the job 80% of its slowdown over these steps, 1.20 s (4.8 GPU-s)")
    """  # noqa: E501
    cfg = settings or DiagnosisSettings()
    worker = Worker(episode.dp, episode.stage)
    who = worker.label()
    cause = episode_cause(episode.kind, cost, cfg)
    summary = _summary(episode, cause, cost, n_gpus)
    facts = EpisodeFacts(
        id=episode.episode_id,
        kind=episode.kind,
        onset=episode.onset,
        recovery=episode.recovery,
        first_seen=episode.first_seen,
        level_before_s=episode.level_before,
        level_inside_s=episode.level_inside,
        ratio_inside=episode.ratio_inside,
        ratio_before=episode.ratio_before,
        lost_s=cost.price_s,
        share=cost.share,
        steps=cost.steps,
        standing=episode.standing,
        model_lost_s=cost.lost_s,
        job_lost_s=cost.job_lost_s if cost.measured_known else None,
        model_explains=cost.explained,
        step_share=cost.saved_share,
    )
    refuted = ("re-split micro-batches",) if cause == Cause.SLOW_WORKERS and resplit is None else ()
    finding = Finding(
        named=(worker,),
        verified=(VerifiedWorker(worker, cost.share, {episode.kind: episode.extra_s}),),
        episode=facts,
        refuted_actions=refuted,
    )
    advice = _advice(cause, who, cost, resplit, cfg)
    ladder = escalation(cost.price_s * n_gpus, n_gpus, cfg, cause, refuted)
    return Diagnosis(cause, summary, Evidence(finding=finding), advice, ladder)


def _summary(episode: WorkerEpisode, cause: Cause, cost: EpisodeCost, n_gpus: int) -> str:
    """Who, since when, how much slower than before and than its peers, and the cost."""
    who = Worker(episode.dp, episode.stage).label()
    until = f"to step {episode.recovery - 1}" if episode.recovery is not None else "(ongoing)"
    (before, inside), unit = in_one_unit(episode.level_before, episode.level_inside)
    how = (
        f"{before} -> {inside} {unit} per step "
        f"({_times(episode.level_inside, episode.level_before)} its own level before), "
        f"{episode.ratio_inside:.1f}x its peers'"
    )
    if episode.standing:
        how = (
            f"{inside} {unit} per step, {episode.ratio_inside:.1f}x its peers' {before} "
            f"{unit}, with no quicker level of its own before"
        )
    costs = (
        f"costs the job {cost.share:.0%} of its slowdown over these steps, "
        f"{cost.price_s:.2f} s ({cost.price_s * n_gpus:,.1f} GPU-s)"
    )
    if cost.contradicted:
        explains = cost.explained
        costs += ", as the job's own step times measured it" + (
            f" (the model explains {explains:.0%} of it)" if explains is not None else ""
        )
    if cost.price_estimated_s > 0:
        costs += (
            f", {cost.price_estimated_s:.2f} s of it estimated for its first "
            f"{cost.estimated_steps} step(s), no longer held when it was found"
        )
    if cause == Cause.SLOW_HOST:
        return (
            f"the host of worker {who} stalls between its ops since step {episode.onset} "
            f"{until}: {how}; its ops take their usual time; {costs}"
        )
    gc = (
        f"its recorded GC pauses (beyond its peers') explain {cost.gc_share:.0%} of the "
        "rise: Python garbage collection"
    )
    if cause == Cause.GC_PAUSES and episode.kind == HOST:
        return (
            f"the host of worker {who} stalls between its ops since step {episode.onset} "
            f"{until}: {how}; {gc}; {costs}"
        )
    if cause == Cause.GC_PAUSES:
        return (
            f"worker(s) {who} slow in {episode.kind} since step {episode.onset} {until}: "
            f"{how}; {gc}; {costs}"
        )
    return (
        f"worker(s) {who} slow in {episode.kind} since step {episode.onset} {until}: {how}; {costs}"
    )


def _times(value: float, level: float) -> str:
    """ "2.0x", or "x100+" where the level before was next to nothing (an input wait)."""
    if level <= 0 or value / level >= 100:
        return "x100+"
    return f"{value / level:.1f}x"


def _advice(
    cause: Cause, who: str, cost: EpisodeCost, resplit: Advice | None, cfg: DiagnosisSettings
) -> tuple[Advice, ...]:
    speedup = cost.speedup
    if cause == Cause.GC_PAUSES:
        return (advise_synchronised_gc(who, speedup, cfg.planned_gc_interval_steps),)
    fix_in_place = FIX_IN_PLACE.get(cause)
    if fix_in_place is not None:
        return (fix_in_place(who, speedup), advise_removal(who, speedup))
    remove = advise_removal(
        who,
        speedup,
        "look at its accelerator: thermal or power throttling, memory errors, a noisy neighbour",
    )
    return (resplit, remove) if resplit is not None else (remove,)


def refined_bounds(
    episode: WorkerEpisode, prepared: PreparedTrace, settings: OnlineEpisodeSettings
) -> tuple[int, int | None]:
    """The episode's (onset, recovery) fitted on the worker's own series of its kind over
    `prepared` (the steps kept around it), each within the settings' slack of the live
    bounds; the live bounds where the fit finds no raised stretch there. An episode still
    open takes the fit's recovery, if it finds one. A standing episode keeps its live
    bounds: the fit needs the worker's own quicker level around the stretch, and where it
    has none (slow from the first step) it cuts the slow level's noise into a recovery."""
    if episode.standing:
        return episode.onset, episode.recovery
    steps = prepared.steps
    series = worker_signals(prepared, [episode.kind])[:, 0, episode.stage, episode.dp]
    live_onset = int(np.searchsorted(steps, episode.onset))
    if live_onset >= steps.size or steps[live_onset] != episode.onset:
        return episode.onset, episode.recovery
    fitted = square_wave(
        series,
        max(0, live_onset - settings.refine_onset_slack_steps),
        min(steps.size - 1, live_onset + settings.refine_onset_slack_steps),
        settings.refit,
    )
    if fitted is None:
        return episode.onset, episode.recovery
    onset, end = fitted
    recovery = episode.recovery
    if end is None:
        return int(steps[onset]), recovery
    if episode.recovery is None:
        # Still open when the input ended, yet the worker's series came back (the fit
        # asks for steps at the old level after it): a recovery noisier than the live
        # rule's run of steps below the middle, placed by the whole series.
        return int(steps[onset]), int(steps[end])
    live_end = int(np.searchsorted(steps, episode.recovery))
    if abs(end - live_end) <= settings.refine_recovery_slack_steps:
        recovery = int(steps[end])
    return int(steps[onset]), recovery
