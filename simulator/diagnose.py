"""Root cause and advice: from a what-if result to what an on-call engineer should do.

The patterns follow the stragglers study (OSDI'25) and Falcon:

- individual slow workers: the top 3 % of workers explain most of the slowdown (M_W);
- last-stage imbalance: the last pipeline stage explains it (M_S);
- sequence-length imbalance: forward and backward times of the same micro-batch are
  correlated (both scale with the sum of squared document lengths), measured on a middle
  stage where no embedding/loss work blurs it;
- Python GC pauses: the pauses the timer's GC probe recorded lie inside the slow computes
  and, taken out, remove most of the slowdown (without the probe, GC is never named: an
  outlier pattern alone is too easily the job's own noise);
- slow communication: communication op types dominate the attribution, and some groups'
  transfer times exceed 1.1 x the median of their op type;
- a stalling host: a worker's launch delays, not its ops, keep the job waiting.

`diagnose` asks one detector per cause, in order, each testable alone (`DETECTORS`); the
first that names its cause makes the diagnosis, and the figures measured on the way are its
evidence (`simulator/evidence.py`). Every piece of advice carries a predicted speed-up,
obtained by re-simulating the measured steps with the change applied (`advice.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from lagscope.simulator import optypes as ot
from lagscope.simulator.advice import (
    Advice,
    advise_balanced_packing,
    advise_consolidation,
    advise_faster_input,
    advise_healthy_links,
    advise_move_layers,
    advise_planned_gc,
    advise_relieve_host,
    advise_removal,
    advise_resplit,
    advise_synchronised_gc,
    escalation,
    resimulated_step_time,
)
from lagscope.simulator.causes import Cause
from lagscope.simulator.engine import CompiledModel
from lagscope.simulator.evidence import (
    Escalation,
    Evidence,
    Finding,
    GcFacts,
    HostFacts,
    RunFigures,
    SlowGroup,
    VerifiedWorker,
    Worker,
    in_one_unit,
)
from lagscope.simulator.fields import Bound, FieldErrors, check_fields
from lagscope.simulator.measures import (
    COMPUTE_LABELS,
    forward_backward_correlation,
    forward_outlier_shares,
    gc_beyond_peers,
    gc_pause_coincidence,
    pausing_workers,
    slow_comm_groups,
    verified_slow_workers,
    without_gc_pauses,
)
from lagscope.simulator.noise import noise_floor, persistent_excess, slow_in, stage_excess
from lagscope.simulator.online_episodes import HOST, worker_signals
from lagscope.simulator.peers import peer_median
from lagscope.simulator.prepare import PreparedTrace
from lagscope.simulator.verdict import of_the_slowdown
from lagscope.simulator.verdict import share as clamped_share
from lagscope.simulator.whatif import Variant, WhatIfAnalysis, WhatIfResult


@dataclass(frozen=True, kw_only=True)
class DiagnosisSettings:
    """Thresholds and action costs of the diagnosis, checked on construction. Each says
    why it has its value and what it was measured on."""

    #: Below this slowdown nothing is wrong enough to name a cause (the reference
    #: analyzer's 3 % gate).
    slowdown_threshold: float = 1.03
    #: M_W / M_S from which workers / the last stage are the cause: they explain most of
    #: the slowdown.
    explains_share: float = 0.5
    #: Forward/backward correlation from which sequence-length imbalance is named: the
    #: generated jobs of unbalanced lengths read 0.95-0.99, balanced ones below 0.5.
    correlation_threshold: float = 0.85
    #: A forward compute this many times its stage's median is a pause outlier.
    gc_outlier_factor: float = 1.5
    #: A comm group whose median transfer exceeds this x that of the groups moving the same
    #: data (same op type and place in the step) is suspect.
    slow_group_factor: float = 1.1
    #: Costs (seconds of the whole job's time) of the escalating actions (ski rental, as
    #: Falcon prices them).
    resplit_cost_s: float = 60.0
    rearrange_cost_s: float = 600.0
    restart_cost_s: float = 1800.0
    #: Steps between planned garbage collections when GC pauses are the cause.
    planned_gc_interval_steps: int = 200
    #: Straggling is named only when S exceeds the job's own noise floor by this much (the
    #: reference's 3 % gate, measured from the floor instead of from 1).
    floor_margin: float = 0.03
    #: ... and by this share of the floor's own excess over 1, when that is more: the floor
    #: is estimated from the same jittering steps it describes, and its error grows with
    #: the jitter (a floor of 1.5 moved by several hundredths between halves of one run).
    floor_margin_of_excess: float = 0.2
    #: A worker is verified slow when its own work exceeds its peers' by this share in
    #: the median step; the last stage is heavier when its own work exceeds the median
    #: stage's by half of it.
    persistent_margin: float = 0.08
    #: A host stalls when its worker's launch delays are this many times its peers' in the
    #: median step: healthy 4-rank CPU jobs read 0.8-1.3, a host stalling as long as its
    #: ops take 3-5x (80 real runs).
    host_launch_ratio: float = 1.5
    #: ... unless the worker's own input wait is this share of its extra launch delays or
    #: more: a rank starved of input starts its next forward late too (on the same 80
    #: runs, no input straggler was named a slow host and every host straggler was).
    host_input_wait_share: float = 0.5
    #: Top-scoring workers (S_w) re-simulated one by one to verify which are slow alone:
    #: S_w lights up the crossings of each straggler's replica and stage (two per pair).
    verify_candidates: int = 8
    #: A candidate is verified when it alone explains this share of the slowdown at least
    #: (below, its excess is the noise of a worker on the critical path).
    verify_min_share: float = 0.15
    #: Communication is looked at as the cause only when it adds this share to the op
    #: types' attribution at least (less is within the ideal's own rounding).
    min_comm_excess: float = 0.01
    #: The costliest episode is the run's verdict when it cost at least this share of what
    #: the run's steps lost above their straggler-free time (`run_story.py`).
    dominant_episode_share: float = 0.5

    def __post_init__(self) -> None:
        problems = check_fields(self, _SETTINGS_BOUNDS)
        if problems:
            raise FieldErrors(problems)


_SETTINGS_BOUNDS = {
    "slowdown_threshold": Bound(gt=0),
    "explains_share": Bound(gt=0, le=2),
    "correlation_threshold": Bound(gt=0, le=1),
    "gc_outlier_factor": Bound(gt=1),
    "slow_group_factor": Bound(gt=1),
    "resplit_cost_s": Bound(ge=0),
    "rearrange_cost_s": Bound(ge=0),
    "restart_cost_s": Bound(ge=0),
    "planned_gc_interval_steps": Bound(integer=True, ge=1),
    "floor_margin": Bound(ge=0),
    "floor_margin_of_excess": Bound(ge=0),
    "persistent_margin": Bound(ge=0),
    "host_launch_ratio": Bound(gt=1),
    "host_input_wait_share": Bound(gt=0),
    "verify_candidates": Bound(integer=True, ge=1),
    "verify_min_share": Bound(ge=0, le=1),
    "min_comm_excess": Bound(ge=0),
    "dominant_episode_share": Bound(gt=0, le=1),
}


@dataclass(frozen=True)
class Diagnosis:
    """One cause, one sentence, the evidence it rests on, the advice and the ladder."""

    cause: Cause
    summary: str
    evidence: Evidence = field(default_factory=Evidence)
    advice: tuple[Advice, ...] = ()
    escalation: Escalation | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause,
            "summary": self.summary,
            "evidence": self.evidence.as_dict(),
            "advice": [a.as_dict() for a in self.advice],
            "escalation": self.escalation.as_dict() if self.escalation else {},
        }


# -- what every detector reads ----------------------------------------------------------------


@dataclass(frozen=True)
class _Structure:
    """Persistent structure of the steps: verified slow workers and a heavier last stage,
    which no noise floor hides."""

    unbalanced_sequences: bool
    mw_verified: bool
    workers_slow: bool
    last_stage_heavy: bool
    last_stage_structure: bool

    @property
    def any(self) -> bool:
        return self.workers_slow or self.last_stage_structure


@dataclass
class _Context:
    """The steps diagnosed, the settings, and the figures measured so far (the evidence of
    whichever detector names the cause)."""

    result: WhatIfResult
    prepared: PreparedTrace
    cfg: DiagnosisSettings
    wasted_gpu_s: float
    layers_per_stage: int | None
    figures: RunFigures
    structure: _Structure | None = None
    #: A slow host costing the job less than its ops' own excess: the diagnosis only if
    #: nothing in the ops is named (`detect_slow_host`).
    deferred: tuple[Cause, str, Finding, tuple[Advice, ...]] | None = None

    @property
    def compiled(self) -> CompiledModel:
        return self.prepared.model.compiled

    @property
    def base_time(self) -> float:
        return float(self.result.t_nodelay.mean())

    def made(
        self, cause: Cause, summary: str, finding: Finding | None = None,
        advice: tuple[Advice, ...] = (),
    ) -> Diagnosis:  # fmt: skip
        """The diagnosis naming `cause`, on the figures measured so far."""
        finding = finding or Finding()
        ladder = escalation(
            self.wasted_gpu_s, self.prepared.meta.world_size, self.cfg, cause,
            finding.refuted_actions,
        )  # fmt: skip
        return Diagnosis(cause, summary, Evidence(self.figures, finding), advice, ladder)

    def none(self, summary: str) -> Diagnosis:
        """No cause named in the ops: a deferred slow host, else `none`."""
        return self.made(*self.deferred) if self.deferred else self.made(Cause.NONE, summary)


def _measure(
    result: WhatIfResult,
    prepared: PreparedTrace,
    cfg: DiagnosisSettings,
    wasted_gpu_s: float | None,
    layers_per_stage: int | None,
) -> _Context:
    """The figures every diagnosis states: S, M_W, M_S, the op-type attribution, the
    sequence and pause checks, and the job's noise floor."""
    by_optype = result.by_optype.overall
    correlation = forward_backward_correlation(prepared)
    fwd_outliers, bwd_outliers = forward_outlier_shares(prepared, cfg.gc_outlier_factor)
    top = max(by_optype.items(), key=lambda kv: kv[1]) if by_optype else None
    figures = RunFigures(
        slowdown=result.slowdown,
        mw=result.mw.removed_share,
        mw_workers=tuple(Worker(d, s) for d, s in result.mw.workers),
        ms=result.ms.removed_share,
        fwd_bwd_correlation=correlation,
        forward_outlier_share=fwd_outliers,
        backward_outlier_share=bwd_outliers,
        top_optype=top,
        noise_floor=noise_floor(prepared, result.ideal_cost, prepared.model.compiled),
    )
    n_gpus = prepared.meta.world_size
    wasted = (
        wasted_gpu_s
        if wasted_gpu_s is not None
        else float((result.t_nodelay - result.t_ideal).clip(min=0).sum() * n_gpus)
    )
    return _Context(result, prepared, cfg, wasted, layers_per_stage, figures)


def _structure(ctx: _Context) -> _Structure:
    """Verified slow workers and a heavier last stage (their speed-ups join the figures)."""
    if ctx.structure is not None:
        return ctx.structure
    result, prepared, cfg = ctx.result, ctx.prepared, ctx.cfg
    persistent = persistent_excess(prepared)
    stages = stage_excess(prepared)
    mw_verified = any(persistent[s, d] >= 1 + cfg.persistent_margin for d, s in result.mw.workers)
    # A verified straggler is not noise, however noisy the rest of the job: the floor gates
    # only what has no such evidence. A verified worker counts when it explains most of the
    # slowdown, or when removing it alone would speed the job up by the margin (its share
    # is small when the job's noise is large).
    mw_speedup = 1.0 - result.mw.t_removed / result.mw.t_original
    ms_speedup = 1.0 - result.ms.t_removed / result.ms.t_original
    ctx.figures = replace(
        ctx.figures, stage_excess=tuple(stages.tolist()), mw_speedup=mw_speedup,
        ms_speedup=ms_speedup,
    )  # fmt: skip
    many_stages = prepared.n_stages > 1
    # A last stage that computes more in the median step (an output head) is structure in
    # the same way: when it exceeds the median stage by a worker's margin (half of it, the
    # loss work of an ordinary last stage, hides under the floor) and explains most of the
    # slowdown or evening it out alone would speed the job up by the floor's margin.
    ctx.structure = _Structure(
        unbalanced_sequences=ctx.figures.fwd_bwd_correlation >= cfg.correlation_threshold,
        mw_verified=mw_verified,
        workers_slow=mw_verified
        and (result.mw.removed_share >= cfg.explains_share or mw_speedup >= cfg.floor_margin),
        last_stage_heavy=many_stages
        and bool(stages[-1] >= 1 + cfg.persistent_margin / 2)
        and result.ms.removed_share >= cfg.explains_share,
        last_stage_structure=many_stages
        and stages[-1] >= 1 + cfg.persistent_margin
        and (result.ms.removed_share >= cfg.explains_share or ms_speedup >= cfg.floor_margin),
    )
    return ctx.structure


# -- the detectors, in the order they are asked ----------------------------------------------


def detect_slow_host(ctx: _Context) -> Diagnosis | None:
    """A worker whose host stalls between its ops through the steps analysed: its ops take
    their usual time, the gaps before them do not. A stalling host leaves S (ops replayed
    without their launch delays) alone, so it is asked first. Named when the launch delays
    cost the job a margin of its ideal step, the worker's host gaps (`prepare.host_gaps`:
    not the work it did before an op) are persistently above its peers' (in the median
    step, as a straggler's own work must be) by a margin of the step, they are not the
    wait for its input (a rank
    starved of input also starts its next forward late), and replaying the job with only
    its launch delays explains most of what the launch delays add. Where the GC pauses
    recorded in those gaps (beyond its peers') explain most of them, its host stalls for
    its own garbage collections (a GPU's kernels keep their time): that is named. Where
    the ops' own excess over the ideal costs the job more than the stalls add, the other
    detectors are asked first and the stalls are named only if none of them names a
    cause."""
    result, prepared, cfg = ctx.result, ctx.prepared, ctx.cfg
    t_ideal = float(result.t_ideal.mean())
    launch_excess = float(np.mean(result.t_actual - result.t_nodelay))
    if t_ideal <= 0 or launch_excess < cfg.floor_margin * t_ideal:
        return None
    signals = worker_signals(prepared, [HOST, ot.INPUT_WAIT])  # [step, kind, stage, dp]
    own, waits = signals[:, 0], signals[:, 1]
    peers, peer_waits = peer_median(own), peer_median(waits)
    with np.errstate(all="ignore"):
        ratio = np.nanmedian(own / np.where(peers > 0, peers, np.nan), axis=0)
    if not np.isfinite(ratio).any():
        return None
    stage, dp = np.unravel_index(int(np.nanargmax(ratio)), ratio.shape)
    extra = float(np.median(own[:, stage, dp] - peers[:, stage, dp]))
    waited = float(np.median(waits[:, stage, dp] - peer_waits[:, stage, dp]))
    starved = waited >= cfg.host_input_wait_share * extra
    # Twice next to nothing is no stall: a healthy rank's gaps are a few ms, and one that
    # gets less of a busy machine's cores than its peers reads 2x theirs.
    small = extra < cfg.floor_margin * float(result.t_actual.mean())
    if ratio[stage, dp] < cfg.host_launch_ratio or extra <= 0 or starved or small:
        return None
    beyond = np.clip(own[:, stage, dp] - peers[:, stage, dp], 0.0, None)
    paused = gc_beyond_peers(prepared, (int(dp), int(stage)), HOST)
    gc_share = float(paused.sum() / beyond.sum()) if beyond.sum() > 0 else 0.0
    analysis = WhatIfAnalysis(prepared, result.ideal_cost, compiled=ctx.compiled)
    worker = Worker(int(dp), int(stage))
    (alone,) = analysis.run(
        [Variant("measured", swap=analysis.worker_rows([(worker.dp, worker.stage)]),
                 delay="swap")]
    )  # fmt: skip
    added = float(np.mean(alone - result.t_nodelay))
    share = added / launch_excess
    if share < cfg.explains_share:
        return None
    host = HostFacts(worker, float(ratio[stage, dp]), extra, share, result.launch_slowdown)
    finding = Finding(
        named=(worker,), verified=(VerifiedWorker(worker, share, {HOST: extra}),), host=host
    )
    speedup = float(result.t_actual.mean() / max(result.t_actual.mean() - added, 1e-12))
    who = worker.label()
    (more,), unit = in_one_unit(extra)
    summary = (
        f"the host of worker {who} stalls between its ops: {more} {unit} more per "
        f"step than its peers' ({ratio[stage, dp]:.1f}x), {clamped_share(share)} of the time "
        f"launch delays add to the job's steps (launch slowdown {result.launch_slowdown:.2f}); "
        f"its ops take their usual time"
    )
    if gc_share >= cfg.explains_share:
        # Its own collections hold back its launches (a GPU's kernels keep their time):
        # the stalls are garbage collection, which planned collections fix, not its CPU.
        summary += (
            f"; its recorded GC pauses (beyond its peers') explain {clamped_share(gc_share)} "
            "of the stalls: Python garbage collection"
        )
        planned = advise_synchronised_gc(who, speedup, cfg.planned_gc_interval_steps)
        return ctx.made(Cause.GC_PAUSES, summary, finding, (planned,))
    advice = (advise_relieve_host(who, speedup), advise_removal(who, speedup))
    if added < float(np.mean(result.t_nodelay - result.t_ideal)):
        # The ops themselves cost the job more (a rank collecting inside its forwards also
        # launches a little late): what is wrong in them is asked first.
        ctx.deferred = (Cause.SLOW_HOST, summary, finding, advice)
        return None
    return ctx.made(Cause.SLOW_HOST, summary, finding, advice)


def detect_no_slowdown(ctx: _Context) -> Diagnosis | None:
    """S below the threshold: nothing is wrong enough to name."""
    if ctx.result.slowdown >= ctx.cfg.slowdown_threshold:
        return None
    return ctx.none(
        f"no significant straggling (S = {ctx.result.slowdown:.3f}; this job's noise floor "
        f"is S {ctx.figures.noise_floor:.2f})"
    )


def detect_gc_pauses(ctx: _Context) -> Diagnosis | None:
    """GC pauses are fluctuations, which the noise floor counts as noise: named on the GC
    probe's own evidence whatever the floor, when the recorded pauses lie inside the slow
    computes and taking them out removes most of the slowdown."""
    result, prepared, cfg = ctx.result, ctx.prepared, ctx.cfg
    cost = without_gc_pauses(prepared)
    if cost is None:
        ctx.figures = replace(ctx.figures, gc=GcFacts(recorded=False))
        return None
    tori, tideal = float(result.t_nodelay.mean()), float(result.t_ideal.mean())
    t_without = resimulated_step_time(prepared, cost, ctx.compiled)
    explained = (tori - t_without) / (tori - tideal) if tori > tideal else 0.0
    coincidence = gc_pause_coincidence(prepared, cfg.gc_outlier_factor)
    facts = GcFacts(
        recorded=True,
        pause_per_step_s=float(prepared.gc_pause.sum(axis=(0, 2)).mean()),
        explained=explained,
        coincidence=coincidence,
    )
    ctx.figures = replace(ctx.figures, gc=facts)
    if explained < cfg.explains_share or coincidence < cfg.explains_share:
        return None
    summary = (
        f"recorded GC pauses explain {of_the_slowdown(explained)} and "
        f"{clamped_share(coincidence)} of the slow computes' excess: Python garbage collection"
    )
    # A job that collects everywhere is the job's; pauses that one rank or a few hold are
    # theirs (a heap that grew there), and the on-call needs to know which.
    pausing, held = pausing_workers(prepared, cfg.explains_share)
    finding = None
    if pausing:
        workers = tuple(Worker(dp, stage) for dp, stage in pausing)
        summary += f", {held:.0%} of the pauses on {', '.join(w.label() for w in workers)}"
        finding = Finding(named=workers)
    planned = advise_planned_gc(prepared, ctx.base_time, ctx.compiled,
                                cfg.planned_gc_interval_steps)  # fmt: skip
    return ctx.made(Cause.GC_PAUSES, summary, finding, advice=(planned,) if planned else ())


def detect_within_noise(ctx: _Context) -> Diagnosis | None:
    """S within the job's noise floor, and no structure (verified workers, a heavier last
    stage) or sequence imbalance beneath it: the slowdown is the job's own noise."""
    structure = _structure(ctx)
    floor = ctx.figures.noise_floor or 0.0
    margin = max(ctx.cfg.floor_margin, ctx.cfg.floor_margin_of_excess * (floor - 1.0))
    if ctx.result.slowdown >= floor + margin or structure.unbalanced_sequences or structure.any:
        return None
    return ctx.none(
        f"no straggling beyond noise: S {ctx.result.slowdown:.2f} is this job's floor "
        f"(its op-to-op fluctuations alone give S {floor:.2f})"
    )


def detect_workers_explaining_most(ctx: _Context) -> Diagnosis | None:
    """Verified slow workers that M_W's top workers explain most of the slowdown with."""
    structure = _structure(ctx)
    if structure.mw_verified and ctx.result.mw.removed_share >= ctx.cfg.explains_share:
        return _slow_workers(ctx)
    return None


def detect_sequence_imbalance(ctx: _Context) -> Diagnosis | None:
    """Forward and backward of the same micro-batch move together: unbalanced sequences."""
    if not _structure(ctx).unbalanced_sequences:
        return None
    summary = (
        f"forward and backward times of the same micro-batch correlate "
        f"({ctx.figures.fwd_bwd_correlation:.2f}): sequence lengths are unbalanced"
    )
    packing = advise_balanced_packing(ctx.prepared, ctx.base_time, ctx.compiled)
    return ctx.made(Cause.SEQUENCE_IMBALANCE, summary, advice=(packing,))


def detect_slow_links(ctx: _Context) -> Diagnosis | None:
    """Communication carries the slowdown (more than the computes, and no structure): the
    links slower than those moving the same data; `none` when there are none (what is left
    is one ideal per op type over transfers of different sizes: nothing to repair)."""
    by_optype = ctx.result.by_optype.overall
    comm_excess = max(
        (v - 1 for k, v in by_optype.items()
         if k not in COMPUTE_LABELS and k not in (ot.OPTIMIZER, ot.GC)),
        default=0.0,
    )  # fmt: skip
    compute_excess = max((by_optype.get(k, 1.0) - 1 for k in COMPUTE_LABELS), default=0.0)
    carries = comm_excess > compute_excess and comm_excess > ctx.cfg.min_comm_excess
    if not carries or _structure(ctx).any:
        return None
    cfg = ctx.cfg
    groups = slow_comm_groups(ctx.prepared, cfg.slow_group_factor)
    ctx.figures = replace(ctx.figures, slow_groups=tuple(_group(g) for g in groups[:10]))
    floor = ctx.figures.noise_floor or 0.0
    if not groups:
        return ctx.none(
            f"no straggling beyond noise: S {ctx.result.slowdown:.2f} against this job's "
            f"floor of {floor:.2f} (its op-to-op fluctuations alone), the rest in "
            f"communication with no link slower than the others moving the same data"
        )
    top = ctx.figures.top_optype
    summary = (
        f"communication dominates the slowdown ({top[0] if top else 'comm'}); "
        f"{len(groups)} group(s) transfer over {cfg.slow_group_factor}x the median of "
        f"those moving the same data"
    )
    links = advise_healthy_links(ctx.prepared, ctx.base_time, ctx.compiled,
                                 cfg.slow_group_factor)  # fmt: skip
    return ctx.made(Cause.SLOW_COMMUNICATION, summary, advice=(links,))


def detect_slow_workers(ctx: _Context) -> Diagnosis | None:
    """Verified slow workers whose removal alone would speed the job up past the margin."""
    return _slow_workers(ctx) if _structure(ctx).workers_slow else None


def detect_last_stage(ctx: _Context) -> Diagnosis | None:
    """The last stage computes more than the median stage and explains the slowdown."""
    structure = _structure(ctx)
    if not (structure.last_stage_heavy or structure.last_stage_structure):
        return None
    last = ctx.prepared.n_stages - 1
    summary = (
        f"the last stage (pp {last}) explains {of_the_slowdown(ctx.result.ms.removed_share, 'M_S')}"
    )
    move = advise_move_layers(ctx.prepared, ctx.base_time, ctx.compiled, ctx.layers_per_stage)
    return ctx.made(
        Cause.LAST_STAGE_IMBALANCE, summary, Finding(stage=last), (move,) if move else ()
    )


def detect_few_slow_workers(ctx: _Context) -> Diagnosis | None:
    """A handful of individually slow workers that M_W's top-3 % selection missed (it can
    pick ghosts). Many slow workers are not "individual" stragglers."""
    suspects, share, _ = _verified_removal(ctx)
    n_workers = ctx.result.worker_slowdown.size
    if suspects and len(suspects) <= max(2, n_workers // 8) and share >= ctx.cfg.explains_share:
        return _slow_workers(ctx)
    return None


def detect_unattributed(ctx: _Context) -> Diagnosis:
    """Slower, with no cause standing out: spread over many workers."""
    top = ctx.figures.top_optype
    summary = (
        f"slowdown spread over many workers; {top[0]} contributes most"
        if top
        else "slowdown spread over many workers"
    )
    return ctx.made(*ctx.deferred) if ctx.deferred else ctx.made(Cause.UNATTRIBUTED, summary)


#: The detectors in the order they are asked: the first to name its cause diagnoses.
DETECTORS: tuple[Callable[[_Context], Diagnosis | None], ...] = (
    detect_slow_host,
    detect_no_slowdown,
    detect_gc_pauses,
    detect_within_noise,
    detect_workers_explaining_most,
    detect_sequence_imbalance,
    detect_slow_links,
    detect_slow_workers,
    detect_last_stage,
    detect_few_slow_workers,
)


def diagnose(
    result: WhatIfResult,
    prepared: PreparedTrace,
    *,
    settings: DiagnosisSettings | None = None,
    wasted_gpu_s: float | None = None,
    layers_per_stage: int | None = None,
) -> Diagnosis:
    """Name the likely root cause of `result`'s slowdown, with evidence and advice."""
    ctx = _measure(result, prepared, settings or DiagnosisSettings(), wasted_gpu_s,
                   layers_per_stage)  # fmt: skip
    for detect in DETECTORS:
        found = detect(ctx)
        if found is not None:
            return found
    return detect_unattributed(ctx)


# -- slow workers -----------------------------------------------------------------------------


def _group(found: dict[str, Any]) -> SlowGroup:
    return SlowGroup(tuple(found["ops"]), found["dp"], found["transfer_s"],
                     found["optype_median_s"], found["ratio"])  # fmt: skip


def _verified_removal(
    ctx: _Context, max_workers: int | None = None
) -> tuple[list[tuple[tuple[int, int], float]], float, float]:
    """The fewest verified slow workers (best first, at most `max_workers`) whose removal
    explains `explains_share` of the slowdown (all of them if no prefix does), that share,
    and the mean step time without them. Verified: slow alone in a re-simulation, and
    slower than its peers in the median step (not in a few noisy ones)."""
    result, prepared, cfg = ctx.result, ctx.prepared, ctx.cfg
    suspects = verified_slow_workers(
        result,
        prepared,
        ctx.compiled,
        candidates=cfg.verify_candidates,
        min_share=cfg.verify_min_share,
        eligible=persistent_excess(prepared) >= 1 + cfg.persistent_margin,
    )[:max_workers]
    if not suspects:
        return [], result.mw.removed_share, result.mw.t_removed
    analysis = WhatIfAnalysis(prepared, result.ideal_cost, compiled=ctx.compiled)
    prefixes = [
        Variant("measured", swap=analysis.worker_rows([w for w, _ in suspects[:k]]))
        for k in range(1, len(suspects) + 1)
    ]
    removed = [float(t.mean()) for t in analysis.run(prefixes)]
    tori, tideal = float(result.t_nodelay.mean()), float(result.t_ideal.mean())
    shares = [(tori - r) / (tori - tideal) if tori > tideal else 0.0 for r in removed]
    k = next((i for i, s in enumerate(shares) if s >= cfg.explains_share), len(shares) - 1)
    return suspects[: k + 1], shares[k], removed[k]


def _slow_workers(ctx: _Context) -> Diagnosis:
    """The verified slow workers that explain the most, what each is slow in, and the
    advice: a faster loader for a worker starved of input (`slow_input`); else re-split
    micro-batches where that would help and consolidate stragglers into few replicas;
    then remove the straggler."""
    result, prepared, cfg = ctx.result, ctx.prepared, ctx.cfg
    # Below the job's noise floor the slowdown is its noise: removing more workers until
    # half of it is explained names healthy ones whose noise sits on the critical path.
    # The best verified worker alone carries the evidence there.
    noisy = result.slowdown < (ctx.figures.noise_floor or 0.0)
    suspects, share, removed = _verified_removal(ctx, max_workers=1 if noisy else None)
    verified = tuple(
        VerifiedWorker(Worker(d, s), part, slow_in(prepared, (d, s))) for (d, s), part in suspects
    )
    persistent = persistent_excess(prepared)
    mw_verified = tuple(
        w for w in result.mw.workers if persistent[w[1], w[0]] >= 1 + cfg.persistent_margin
    )
    if suspects and (share >= result.mw.removed_share or not mw_verified):
        named, explained, t_removed = tuple(w for w, _ in suspects), share, removed
    else:
        named, explained = mw_verified, result.mw.removed_share
        t_removed = result.mw.t_removed
    workers = ", ".join(f"(dp {d}, pp {s})" for d, s in named)
    where = slow_in(prepared, named[0])
    slow_part = f" (slow in {next(iter(where))})" if where else ""
    # A worker whose own excess is mostly its wait for input is starved of data: its
    # loader is the fix, and the job is not rearranged around it first.
    starved = next(iter(where), None) == ot.INPUT_WAIT
    cause = Cause.SLOW_INPUT if starved else Cause.SLOW_WORKERS
    speedup = ctx.base_time / t_removed
    if starved:
        advice = [advise_faster_input(workers, speedup)]
        refuted: tuple[str, ...] = ()
    else:
        advice, refuted = _rearranging_advice(ctx, named)
    advice.append(advise_removal(workers, speedup))
    finding = Finding(
        named=tuple(Worker(d, s) for d, s in named),
        verified=verified,
        verified_share=share,
        refuted_actions=refuted,
    )
    summary = f"worker(s) {workers} explain {of_the_slowdown(explained)}{slow_part}"
    return ctx.made(cause, summary, finding, tuple(advice))


def _rearranging_advice(
    ctx: _Context, named: tuple[tuple[int, int], ...]
) -> tuple[list[Advice], tuple[str, ...]]:
    """Re-split micro-batches where that would help, consolidate stragglers into few
    replicas; and the actions refuted (predicted not to speed the job up)."""
    advice: list[Advice] = []
    refuted: tuple[str, ...] = ()
    resplit = advise_resplit(ctx.prepared, ctx.base_time, ctx.compiled)
    if resplit and resplit.predicted_speedup > 1.0:
        advice.append(resplit)
    elif resplit:
        # Fewer micro-batches for the slow replica would not speed this job up (its
        # straggler sits where the pipeline waits on it anyway): not advice, and not the
        # first step on the ladder.
        refuted = (resplit.action,)
    consolidate = advise_consolidation(ctx.prepared, named, ctx.base_time, ctx.compiled)
    if consolidate:
        advice.append(consolidate)
    return advice, refuted
