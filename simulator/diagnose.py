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
  transfer times exceed 1.1 x the median of their op type.

Every piece of advice carries a predicted speed-up, obtained by re-simulating the measured
steps with the change applied.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lagscope.simulator import optypes as ot
from lagscope.simulator.engine import CompiledModel
from lagscope.simulator.fields import Bound, FieldErrors, check_fields
from lagscope.simulator.noise import noise_floor, persistent_excess, slow_in, stage_excess
from lagscope.simulator.online_episodes import HOST, worker_signals
from lagscope.simulator.prepare import PreparedTrace
from lagscope.simulator.verdict import of_the_slowdown
from lagscope.simulator.verdict import share as clamped_share
from lagscope.simulator.whatif import Variant, WhatIfAnalysis, WhatIfResult

COMPUTE_LABELS = (ot.FORWARD_COMPUTE, ot.BACKWARD_COMPUTE)


@dataclass(frozen=True, kw_only=True)
class DiagnosisSettings:
    """Thresholds and action costs of the diagnosis, checked on construction."""

    #: Below this slowdown nothing is wrong enough to name a cause.
    slowdown_threshold: float = 1.03
    #: M_W / M_S from which workers / the last stage are the cause.
    explains_share: float = 0.5
    #: Forward/backward correlation from which sequence-length imbalance is named.
    correlation_threshold: float = 0.85
    #: A forward compute this many times its stage's median is a pause outlier.
    gc_outlier_factor: float = 1.5
    #: A comm group whose median transfer exceeds this x that of the groups moving the same
    #: data (same op type and place in the step) is suspect.
    slow_group_factor: float = 1.1
    #: Costs (seconds of the whole job's time) of the escalating actions (ski rental).
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
}


@dataclass(frozen=True)
class Advice:
    action: str
    detail: str
    predicted_speedup: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Diagnosis:
    cause: str
    summary: str
    evidence: dict[str, Any]
    advice: tuple[Advice, ...] = ()
    escalation: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause,
            "summary": self.summary,
            "evidence": self.evidence,
            "advice": [a.as_dict() for a in self.advice],
            "escalation": self.escalation,
        }


# -- evidence ------------------------------------------------------------------------------


def forward_backward_correlation(prepared: PreparedTrace) -> float:
    """Correlation of forward and backward time of the same micro-batch on a middle stage.

    Times are centred on their worker-step mean first, so only the variation between the
    micro-batches of one step counts; drifts from step to step (clocks, other jobs) that
    move forward and backward together would otherwise look like sequence imbalance.
    """
    n_stages = prepared.n_stages
    stage = n_stages // 2 if n_stages > 2 else 0
    fwd = {
        n.seq: i
        for i, n in enumerate(prepared.model.nodes)
        if n.stage == stage and n.optype == ot.FORWARD_COMPUTE
    }
    bwd = {
        n.seq: i
        for i, n in enumerate(prepared.model.nodes)
        if n.stage == stage and n.optype == ot.BACKWARD_COMPUTE
    }
    pairs = sorted(set(fwd) & set(bwd))
    if len(pairs) < 2:
        return float("nan")
    f = prepared.duration[[fwd[k] for k in pairs]].astype(np.float64)
    b = prepared.duration[[bwd[k] for k in pairs]].astype(np.float64)
    f = (f - f.mean(axis=0, keepdims=True)).ravel()
    b = (b - b.mean(axis=0, keepdims=True)).ravel()
    if f.std() == 0 or b.std() == 0:
        return 0.0
    return float(np.corrcoef(f, b)[0, 1])


def forward_outlier_shares(prepared: PreparedTrace, factor: float) -> tuple[float, float]:
    """Share of forward and of backward computes above `factor` x their stage's median."""
    stage = prepared.model.node_stage()
    shares = []
    for optype in COMPUTE_LABELS:
        nodes = np.array([t == optype for t in prepared.node_optype])
        if not nodes.any():
            shares.append(0.0)
            continue
        outliers, total = 0, 0
        for s in np.unique(stage[nodes]):
            values = prepared.duration[nodes & (stage == s)]
            outliers += int((values > factor * np.median(values)).sum())
            total += values.size
        shares.append(outliers / max(total, 1))
    return shares[0], shares[1]


def without_gc_pauses(prepared: PreparedTrace) -> np.ndarray | None:
    """Costs with every recorded GC pause taken out of the computes it stalled, or None
    when no pause was recorded."""
    if prepared.gc_pause is None:
        return None
    compute = np.array([ot.is_compute(t) for t in prepared.node_optype])
    cost = prepared.cost.astype(np.float64).copy()
    cost[compute] = np.maximum(cost[compute] - prepared.gc_pause[compute], 0.0)
    return cost


def gc_pause_coincidence(prepared: PreparedTrace, factor: float) -> float:
    """Share of the slow computes' excess (time above `factor` x their stage's median of
    the op type) that recorded GC pauses inside them account for; NaN without pauses."""
    if prepared.gc_pause is None:
        return float("nan")
    stage = prepared.model.node_stage()
    optypes = np.array(prepared.node_optype)
    excess_total, paused_total = 0.0, 0.0
    for optype in COMPUTE_LABELS:
        for s in np.unique(stage[optypes == optype]):
            nodes = (optypes == optype) & (stage == s)
            values = prepared.duration[nodes].astype(np.float64)
            median = np.median(values)
            slow = values > factor * median
            excess = np.where(slow, values - median, 0.0)
            excess_total += float(excess.sum())
            paused_total += float(np.minimum(prepared.gc_pause[nodes], excess).sum())
    return paused_total / excess_total if excess_total > 0 else 0.0


def slow_comm_groups(prepared: PreparedTrace, factor: float) -> list[dict[str, Any]]:
    """Comm groups whose median transfer exceeds `factor` x the median of the transfers
    that move the same data: the same op type at the same place in the step (its `seq`:
    the same gradient bucket, the same micro-batch's activations), on every stage and DP
    rank. Gradient buckets of one op type differ in size by design; the largest is no slow
    link for being slower than the smallest.

    A DP collective is one transfer of the whole group, so the group is compared with the
    other groups moving the same data (the other stages' DP groups), never with itself: a
    job whose only DP group moves a bucket (plain DDP) has nothing to compare it with, and
    its ranks' medians around the group's are the job's noise. A pipeline link is compared
    rank by rank."""
    suspects = []
    nodes_of = prepared.model.nodes
    cost = prepared.cost
    groups = prepared.model.groups
    keys = [(nodes_of[g.members[0]].optype, nodes_of[g.members[0]].seq) for g in groups]
    # Each DP group's median transfer, by the data it moves.
    synced_medians: dict[tuple[str, int], dict[int, float]] = {}
    for index, group in enumerate(groups):
        if group.dp_synchronized:
            median = float(np.median(cost[list(group.members)]))
            synced_medians.setdefault(keys[index], {})[index] = median
    medians: dict[tuple[str, int], float] = {}
    for index, group in enumerate(groups):
        key = keys[index]
        members = list(group.members)
        if group.dp_synchronized:
            same_data = synced_medians[key]
            others = [m for i, m in same_data.items() if i != index]
            if not others:
                continue
            base = float(np.median(others))
            value = same_data[index]
            if base > 0 and value > factor * base:
                suspects.append(_slow_group(prepared, members, None, value, base))
            continue
        if key not in medians:
            same = [i for i, n in enumerate(nodes_of) if (n.optype, n.seq) == key]
            medians[key] = float(np.median(cost[same]))
        base = medians[key]
        per_dp = np.median(cost[members], axis=(0, 1))
        if base > 0:
            for dp in np.flatnonzero(per_dp > factor * base).tolist():
                suspects.append(_slow_group(prepared, members, dp, float(per_dp[dp]), base))
    suspects.sort(key=lambda s: -s["ratio"])
    return suspects


def _slow_group(
    prepared: PreparedTrace, members: list[int], dp: int | None, value: float, base: float
) -> dict[str, Any]:
    return {
        "ops": [str(prepared.model.nodes[m]) for m in members],
        "dp": dp,
        "transfer_s": value,
        "optype_median_s": base,
        "ratio": value / base,
    }


# -- re-simulation -------------------------------------------------------------------------


def resimulated_step_time(
    prepared: PreparedTrace, cost: np.ndarray, compiled: CompiledModel | None = None
) -> float:
    """Mean simulated step time (no launch delays) with `cost` ([node, step, dp])."""
    changed = dataclasses.replace(prepared, cost=cost.astype(np.float32))
    analysis = WhatIfAnalysis(
        changed, ideal={t: 0.0 for t in set(prepared.node_optype)}, compiled=compiled
    )
    return float(analysis.run([Variant("measured")])[0].mean())


def balanced_microbatches(time_per_microbatch: np.ndarray, total: int) -> np.ndarray:
    """Integer micro-batch counts per DP rank, summing to `total`, that minimise the
    slowest rank's time (max_r m_r * t_r). Greedy on a heap is exact for this objective:
    each next micro-batch goes where it finishes earliest."""
    t = np.asarray(time_per_microbatch, dtype=np.float64)
    counts = np.zeros(t.size, dtype=np.int64)
    heap = [(t[r], r) for r in range(t.size)]
    heapq.heapify(heap)
    for _ in range(total):
        finish, r = heapq.heappop(heap)
        counts[r] += 1
        heapq.heappush(heap, (finish + t[r], r))
    return counts


def _compute_mask(prepared: PreparedTrace) -> np.ndarray:
    return np.isin(np.array(prepared.node_optype), COMPUTE_LABELS)


def resplit_costs(
    prepared: PreparedTrace, cost: np.ndarray
) -> tuple[np.ndarray, dict[int, int], int]:
    """Costs after giving slow pipeline replicas fewer micro-batches: each replica's compute
    scales with its new micro-batch count (the global batch is unchanged). Returns the new
    costs, the changed counts {dp: count} and the current count per replica."""
    compute = _compute_mask(prepared)
    stage = prepared.model.node_stage()
    per_worker = np.zeros((prepared.n_stages, prepared.n_dp))
    np.add.at(per_worker, stage[compute], cost[compute].mean(axis=1))
    n_mb = max(
        1, sum(1 for n in prepared.model.nodes if n.stage == 0 and n.optype == ot.FORWARD_COMPUTE)
    )
    counts = balanced_microbatches(per_worker.max(axis=0) / n_mb, n_mb * prepared.n_dp)
    scaled = cost.astype(np.float64).copy()
    scaled[compute] *= (counts / n_mb)[None, None, :]
    return scaled, {int(r): int(c) for r, c in enumerate(counts) if c != n_mb}, n_mb


def advise_resplit(
    prepared: PreparedTrace, base_time: float, compiled: CompiledModel
) -> Advice | None:
    """Give slow pipeline replicas fewer micro-batches (the global batch is unchanged)."""
    if prepared.n_dp < 2:
        return None
    cost, changed, n_mb = resplit_costs(prepared, prepared.cost)
    if not changed:
        return None
    predicted = base_time / resimulated_step_time(prepared, cost, compiled)
    return Advice(
        "re-split micro-batches",
        f"give DP ranks {changed} micro-batches instead of {n_mb} each (global batch unchanged)",
        predicted,
    )


def verified_slow_workers(
    result: WhatIfResult,
    prepared: PreparedTrace,
    compiled: CompiledModel,
    *,
    candidates: int = 8,
    min_share: float = 0.15,
) -> list[tuple[tuple[int, int], float]]:
    """Workers that are slow on their own, best first, with the share of the slowdown each
    explains alone (ideal job + only that worker as measured).

    The worker score S_w = min(S_dp, S_stage) also lights up "ghosts": with stragglers at
    (dp a, stage x) and (dp b, stage y), the crossings (a, y) and (b, x) score as high.
    Re-simulating each top-scoring candidate alone tells them apart.
    """
    order = np.argsort(-result.worker_slowdown, axis=None, kind="stable")[:candidates]
    n_dp = result.worker_slowdown.shape[1]
    workers = [(int(i % n_dp), int(i // n_dp)) for i in order]
    analysis = WhatIfAnalysis(prepared, result.ideal_cost, compiled=compiled)
    times = analysis.run([Variant("ideal", swap=analysis.worker_rows([w])) for w in workers])
    excess = float(result.t_nodelay.mean() - result.t_ideal.mean())
    if excess <= 0:
        return []
    shares = [
        (w, float(t.mean() - result.t_ideal.mean()) / excess)
        for w, t in zip(workers, times, strict=True)
    ]
    return sorted((ws for ws in shares if ws[1] >= min_share), key=lambda ws: -ws[1])


def _verified_removal(
    result: WhatIfResult,
    prepared: PreparedTrace,
    compiled: CompiledModel,
    explains_share: float = 0.5,
    persistent_margin: float = 0.08,
    max_workers: int | None = None,
) -> tuple[list[tuple[tuple[int, int], float]], float, float]:
    """The fewest verified slow workers (best first, at most `max_workers`) whose removal
    explains `explains_share` of the slowdown (all of them if no prefix does), that share,
    and the mean step time without them. Verified: slow alone in a re-simulation, and
    slower than its peers in the median step (not in a few noisy ones)."""
    persistent = persistent_excess(prepared)
    suspects = [
        (w, share)
        for w, share in verified_slow_workers(result, prepared, compiled)
        if persistent[w[1], w[0]] >= 1 + persistent_margin
    ][:max_workers]
    if not suspects:
        return [], result.mw.removed_share, result.mw.t_removed
    analysis = WhatIfAnalysis(prepared, result.ideal_cost, compiled=compiled)
    prefixes = [
        Variant("measured", swap=analysis.worker_rows([w for w, _ in suspects[:k]]))
        for k in range(1, len(suspects) + 1)
    ]
    removed = [float(t.mean()) for t in analysis.run(prefixes)]
    tori, tideal = float(result.t_nodelay.mean()), float(result.t_ideal.mean())
    shares = [(tori - r) / (tori - tideal) if tori > tideal else 0.0 for r in removed]
    k = next((i for i, share in enumerate(shares) if share >= explains_share), len(shares) - 1)
    return suspects[: k + 1], shares[k], removed[k]


def _gc_explains(
    result: WhatIfResult,
    prepared: PreparedTrace,
    compiled: CompiledModel,
    evidence: dict[str, Any],
    cfg: DiagnosisSettings,
) -> bool:
    """GC is the cause only with the probe's own evidence: the recorded pauses lie inside
    the slow computes, and taking them out removes most of the slowdown."""
    cost = without_gc_pauses(prepared)
    if cost is None:
        evidence["gc_recorded"] = False
        return False
    tori, tideal = float(result.t_nodelay.mean()), float(result.t_ideal.mean())
    t_without = resimulated_step_time(prepared, cost, compiled)
    explained = (tori - t_without) / (tori - tideal) if tori > tideal else 0.0
    coincidence = gc_pause_coincidence(prepared, cfg.gc_outlier_factor)
    evidence.update(
        gc_recorded=True,
        gc_pause_per_step_s=float(prepared.gc_pause.sum(axis=(0, 2)).mean()),
        gc_explained=explained,
        gc_coincidence=coincidence,
    )
    return explained >= cfg.explains_share and coincidence >= cfg.explains_share


def _slow_host(
    result: WhatIfResult,
    prepared: PreparedTrace,
    compiled: CompiledModel,
    evidence: dict[str, Any],
    cfg: DiagnosisSettings,
) -> tuple[str, tuple[Advice, ...]] | None:
    """A worker whose host stalls between its ops through the steps analysed: its ops take
    their usual time, the gaps before them (their launch delays) do not. Named when the
    launch delays cost the job a margin of its ideal step, the worker's own launch delays
    are persistently above its peers' by half (in the median step, as a straggler's
    own work must be), they are not the wait for its input (a rank starved of input also
    starts its next forward late), and replaying the job with only its launch delays
    explains most of what the launch delays add."""
    t_ideal = float(result.t_ideal.mean())
    launch_excess = float(np.mean(result.t_actual - result.t_nodelay))
    if t_ideal <= 0 or launch_excess < cfg.floor_margin * t_ideal:
        return None
    signals = worker_signals(prepared, [HOST, ot.INPUT_WAIT])  # [step, kind, stage, dp]
    own, waits = signals[:, 0], signals[:, 1]
    peers, peer_waits = _peers_median(own), _peers_median(waits)
    with np.errstate(all="ignore"):
        ratio = np.nanmedian(own / np.where(peers > 0, peers, np.nan), axis=0)
    if not np.isfinite(ratio).any():
        return None
    stage, dp = np.unravel_index(int(np.nanargmax(ratio)), ratio.shape)
    extra = float(np.median(own[:, stage, dp] - peers[:, stage, dp]))
    waited = float(np.median(waits[:, stage, dp] - peer_waits[:, stage, dp]))
    if ratio[stage, dp] < 1.5 or extra <= 0 or waited >= 0.5 * extra:
        return None
    analysis = WhatIfAnalysis(prepared, result.ideal_cost, compiled=compiled)
    (alone,) = analysis.run(
        [Variant("measured", swap=analysis.worker_rows([(int(dp), int(stage))]), delay="swap")]
    )
    added = float(np.mean(alone - result.t_nodelay))
    share = added / launch_excess
    if share < cfg.explains_share:
        return None
    who = f"(dp {dp}, pp {stage})"
    evidence["slow_host"] = {
        "dp": int(dp), "stage": int(stage), "launch_ratio": float(ratio[stage, dp]),
        "extra_s": extra, "share_of_launch_delays": share,
        "launch_slowdown": result.launch_slowdown,
    }  # fmt: skip
    evidence["named_workers"] = [{"dp": int(dp), "stage": int(stage)}]
    evidence["verified_workers"] = [
        {"dp": int(dp), "stage": int(stage), "share": share, "slow_in": {HOST: extra}}
    ]
    speedup = float(result.t_actual.mean() / max(result.t_actual.mean() - added, 1e-12))
    summary = (
        f"the host of worker {who} stalls between its ops: {extra * 1e3:.1f} ms more per "
        f"step than its peers' ({ratio[stage, dp]:.1f}x), {clamped_share(share)} of the time "
        f"launch delays add to the job's steps (launch slowdown {result.launch_slowdown:.2f}); "
        f"its ops take their usual time"
    )
    advice = (
        Advice(
            "relieve the straggler's host",
            f"look at the host of {who}: other processes on its CPUs, CPU throttling, Python "
            f"work between ops (logging, metrics, data prepared outside the loader)",
            speedup,
        ),
        Advice("remove the straggler", f"restart without {who} (spare node or smaller DP)",
               speedup),
    )  # fmt: skip
    return summary, advice


def _peers_median(values: np.ndarray) -> np.ndarray:
    """[step, stage, dp]: the median of each worker's peers in each step: the other DP
    ranks of its stage, else the other stages."""
    n_stages, n_dp = values.shape[1], values.shape[2]
    out = np.full_like(values, np.nan)
    for stage in range(n_stages):
        for dp in range(n_dp):
            if n_dp > 1:
                others = np.delete(values[:, stage, :], dp, axis=1)
            elif n_stages > 1:
                others = np.delete(values[:, :, 0], stage, axis=1)
            else:
                continue
            out[:, stage, dp] = np.median(others, axis=1)
    return out


def _few_verified_workers(
    result: WhatIfResult,
    prepared: PreparedTrace,
    compiled: CompiledModel,
    evidence: dict[str, Any],
    cfg: DiagnosisSettings,
) -> bool:
    """A handful of individually slow workers that M_W's top-3 % selection missed (it can
    pick ghosts). Many slow workers are not "individual" stragglers."""
    suspects, share, _ = _verified_removal(
        result, prepared, compiled, cfg.explains_share, cfg.persistent_margin
    )
    n_workers = result.worker_slowdown.size
    return (
        bool(suspects) and len(suspects) <= max(2, n_workers // 8) and (share >= cfg.explains_share)
    )


def _slow_workers(
    result: WhatIfResult,
    prepared: PreparedTrace,
    compiled: CompiledModel,
    base_time: float,
    evidence: dict[str, Any],
    advice: list[Advice],
    cfg: DiagnosisSettings,
) -> tuple[str, str]:
    # Below the job's noise floor the slowdown is its noise: removing more workers until
    # half of it is explained names healthy ones whose noise sits on the critical path.
    # The best verified worker alone carries the evidence there.
    noisy = result.slowdown < evidence.get("noise_floor", 0.0)
    suspects, share, removed = _verified_removal(
        result, prepared, compiled, cfg.explains_share, cfg.persistent_margin,
        max_workers=1 if noisy else None,
    )  # fmt: skip
    evidence["verified_workers"] = [
        {"dp": d, "stage": s, "share": part, "slow_in": slow_in(prepared, (d, s))}
        for (d, s), part in suspects
    ]
    evidence["verified_workers_share"] = share
    persistent = persistent_excess(prepared)
    mw_verified = tuple(
        w for w in result.mw.workers if persistent[w[1], w[0]] >= 1 + cfg.persistent_margin
    )
    if suspects and (share >= result.mw.removed_share or not mw_verified):
        named, explained, t_removed = tuple(w for w, _ in suspects), share, removed
    else:
        named, explained = mw_verified, result.mw.removed_share
        t_removed = result.mw.t_removed
    evidence["named_workers"] = [{"dp": d, "stage": s} for d, s in named]
    workers = ", ".join(f"(dp {d}, pp {s})" for d, s in named)
    where = slow_in(prepared, named[0])
    slow_part = f" (slow in {next(iter(where))})" if where else ""
    resplit = advise_resplit(prepared, base_time, compiled)
    if resplit and resplit.predicted_speedup > 1.0:
        advice.append(resplit)
    elif resplit:
        # Fewer micro-batches for the slow replica would not speed this job up (its
        # straggler sits where the pipeline waits on it anyway): not advice, and not the
        # first step on the ladder.
        evidence["refuted_actions"] = [resplit.action]
    consolidate = advise_consolidation(prepared, named, base_time, compiled)
    if consolidate:
        advice.append(consolidate)
    advice.append(
        Advice(
            "remove the straggler",
            f"restart without {workers} (spare node or smaller DP)",
            base_time / t_removed,
        )
    )
    return (
        "slow_workers",
        f"worker(s) {workers} explain {of_the_slowdown(explained)}{slow_part}",
    )


def consolidated_placement(
    workers: tuple[tuple[int, int], ...], n_stages: int, n_dp: int
) -> dict[tuple[int, int], tuple[int, int]]:
    """Moves (dp, stage) -> (dp, stage) that gather slow workers into as few pipeline
    replicas as possible. A worker keeps its stage (its layers); it swaps places with a
    healthy worker of the same stage in the target replica."""
    by_stage: dict[int, list[int]] = {}
    for dp, stage in workers:
        by_stage.setdefault(stage, []).append(dp)
    # Replicas needed = the most slow workers any one stage has; fill the replicas that
    # already hold the most slow workers first.
    needed = max(len(v) for v in by_stage.values())
    load = {dp: sum(1 for d, _ in workers if d == dp) for dp in range(n_dp)}
    targets = sorted(range(n_dp), key=lambda dp: (-load[dp], dp))[:needed]
    moves: dict[tuple[int, int], tuple[int, int]] = {}
    for stage, dps in by_stage.items():
        free = [t for t in targets if t not in dps]
        for dp in dps:
            if dp not in targets:
                moves[dp, stage] = (free.pop(0), stage)
    return moves


def advise_consolidation(
    prepared: PreparedTrace,
    workers: tuple[tuple[int, int], ...],
    base_time: float,
    compiled: CompiledModel,
) -> Advice | None:
    """Slow workers spread over pipeline replicas each hold their replica back; gathered
    into the fewest replicas, only those lag, and a re-split gives them fewer
    micro-batches. Advised only when that beats re-splitting without moving anyone."""
    moves = consolidated_placement(workers, prepared.n_stages, prepared.n_dp)
    if not moves or prepared.n_dp < 2:
        return None
    stage = prepared.model.node_stage()
    cost = prepared.cost.astype(np.float64).copy()
    for (dp, s), (to_dp, _) in moves.items():
        nodes = np.flatnonzero(stage == s)
        cost[nodes, :, dp], cost[nodes, :, to_dp] = (
            cost[nodes, :, to_dp].copy(),
            cost[nodes, :, dp].copy(),
        )
    consolidated, changed, n_mb = resplit_costs(prepared, cost)
    predicted = base_time / resimulated_step_time(prepared, consolidated, compiled)
    alone, _, _ = resplit_costs(prepared, prepared.cost)
    if predicted <= base_time / resimulated_step_time(prepared, alone, compiled):
        return None
    shown = ", ".join(f"(dp {d}, pp {s}) -> dp {t}" for (d, s), (t, _) in moves.items())
    return Advice(
        "consolidate stragglers",
        f"swap ranks so the slow workers share pipeline replicas ({shown}), then give DP "
        f"ranks {changed} micro-batches instead of {n_mb} each",
        predicted,
    )


def advise_move_layers(
    prepared: PreparedTrace, base_time: float, compiled: CompiledModel, layers_per_stage: int | None
) -> Advice | None:
    """Move work off the last stage onto the others until stage compute is even."""
    if prepared.n_stages < 2:
        return None
    compute = _compute_mask(prepared)
    stage = prepared.model.node_stage()
    per_stage = np.array(
        [
            prepared.duration[compute & (stage == s)].sum(axis=0).mean()
            for s in range(prepared.n_stages)
        ]
    )
    last = prepared.n_stages - 1
    target = per_stage.mean()
    if per_stage[last] <= target * 1.02:
        return None
    moved = 1 - target / per_stage[last]  # share of the last stage's compute to move
    if layers_per_stage:
        layers = max(1, round(moved * layers_per_stage))
        moved = layers / layers_per_stage
        what = f"move {layers} of its {layers_per_stage} layers"
    else:
        what = f"move about {moved:.0%} of its layers"
    others = per_stage[:last].sum()
    cost = prepared.cost.astype(np.float64).copy()
    cost[compute & (stage == last)] *= 1 - moved
    cost[compute & (stage < last)] *= 1 + moved * per_stage[last] / others
    predicted = base_time / resimulated_step_time(prepared, cost, compiled)
    return Advice(
        "move layers off the last stage",
        f"the last stage computes {per_stage[last] / target:.2f}x the stage mean: "
        f"{what} to the other stages",
        predicted,
    )


def advise_planned_gc(
    prepared: PreparedTrace, base_time: float, compiled: CompiledModel, interval: int
) -> Advice | None:
    """Disable automatic GC and collect every `interval` steps on all ranks at once: the
    recorded pauses leave the computes, one pause per `interval` steps is paid instead."""
    cost = without_gc_pauses(prepared)
    if cost is None:
        return None
    paused = prepared.gc_pause[prepared.gc_pause > 0]
    pause = float(paused.mean()) if paused.size else 0.0
    without = resimulated_step_time(prepared, cost, compiled) + pause / interval
    return Advice(
        "planned garbage collection",
        f"gc.disable() and gc.collect() on every rank together every {interval} steps "
        f"(Megatron: --manual-gc --manual-gc-interval {interval}); pauses average "
        f"{pause * 1e3:.0f} ms",
        base_time / without,
    )


def advise_healthy_links(
    prepared: PreparedTrace, base_time: float, compiled: CompiledModel, factor: float
) -> Advice:
    """Fix (or route around) the groups whose transfers are slower than their op type's."""
    optypes = prepared.node_optype
    cost = prepared.cost.astype(np.float64).copy()
    medians: dict[str, float] = {}
    fixed = 0
    for group in prepared.model.groups:
        members = list(group.members)
        optype = optypes[members[0]]
        if optype not in medians:
            medians[optype] = float(
                np.median(prepared.cost[[i for i, t in enumerate(optypes) if t == optype]])
            )
        slow = cost[members] > factor * medians[optype]
        fixed += int(slow.any(axis=(0, 1)).sum())
        cost[members] = np.where(slow, medians[optype], cost[members])
    predicted = base_time / resimulated_step_time(prepared, cost, compiled)
    return Advice(
        "repair or avoid the slow links",
        f"inspect the NICs / switch ports behind the {fixed} slow group instance(s) "
        f"listed in the evidence, or re-arrange the topology around them",
        predicted,
    )


def advise_balanced_packing(
    prepared: PreparedTrace, base_time: float, compiled: CompiledModel
) -> Advice:
    """Micro-batches of equal cost: every compute of a worker takes its step's mean."""
    stage = prepared.model.node_stage()
    cost = prepared.cost.astype(np.float64).copy()
    for optype in COMPUTE_LABELS:
        for s in range(prepared.n_stages):
            nodes = np.array([t == optype for t in prepared.node_optype]) & (stage == s)
            if nodes.any():
                cost[nodes] = cost[nodes].mean(axis=0, keepdims=True)
    predicted = base_time / resimulated_step_time(prepared, cost, compiled)
    return Advice(
        "balance sequence lengths",
        "pack micro-batches by the sum of squared document lengths (attention cost) "
        "instead of by token count, so every micro-batch costs the same",
        predicted,
    )


def escalation_ladder(
    cause: str | None, settings: DiagnosisSettings, refuted: Collection[str] = ()
) -> list[tuple[str, float]]:
    """The actions of `cause`'s escalation ladder with their costs (seconds of the whole
    job's time), cheapest first. Slow workers (and an unknown cause) climb Falcon's ladder;
    the other causes' fixes are the diagnosis' own advice, so that the ladder never starts
    with a step that does not address the cause: a new layer split, a new packing of the
    sequences or a new GC setting takes a checkpoint restart, and the slow links cost a
    re-arrangement of the topology. Without a cause (none, unattributed) there is nothing
    to climb. Steps in `refuted` (the what-if predicts they would not speed the job up)
    are left out."""
    fixes: dict[str, list[tuple[str, float]]] = {
        "slow_workers": [
            ("re-split micro-batches", settings.resplit_cost_s),
            ("re-arrange topology", settings.rearrange_cost_s),
            ("checkpoint and restart without the straggler", settings.restart_cost_s),
        ],
        # An input-starved rank or a stalling host is fixed where it is (its loader, its
        # host) before the job is rearranged around it: re-splitting micro-batches gives
        # the rank fewer batches to wait for, not a faster loader.
        "slow_input": [
            ("speed up the straggler's input", settings.resplit_cost_s),
            ("checkpoint and restart without the straggler", settings.restart_cost_s),
        ],
        "slow_host": [
            ("relieve the straggler's host", settings.resplit_cost_s),
            ("re-arrange topology", settings.rearrange_cost_s),
            ("checkpoint and restart without the straggler", settings.restart_cost_s),
        ],
        "slow_communication": [("repair or avoid the slow links", settings.rearrange_cost_s)],
        "last_stage_imbalance": [("move layers off the last stage", settings.restart_cost_s)],
        "sequence_imbalance": [("balance sequence lengths", settings.restart_cost_s)],
        "gc_pauses": [("planned garbage collection", settings.restart_cost_s)],
    }
    steps = [step for step in fixes.get(cause or "slow_workers", []) if step[0] not in refuted]
    return [("ignore", 0.0), *steps]


def escalation(
    wasted_gpu_s: float,
    n_gpus: int,
    settings: DiagnosisSettings,
    cause: str | None = None,
    refuted: Collection[str] = (),
) -> dict[str, Any]:
    """Falcon's ski-rental rule: take the next action of `cause`'s ladder
    (`escalation_ladder`) once the loss accumulated since the onset reaches that action's
    cost (all in seconds of the whole job's time)."""
    # Waste comes out negative when a step ran faster than its ideal (noise, or a step
    # shorter than the running estimate): no loss accumulated, nothing to escalate.
    loss_s = max(wasted_gpu_s / max(n_gpus, 1), 0.0) if np.isfinite(wasted_gpu_s) else 0.0
    ladder = escalation_ladder(cause, settings, refuted)
    current = [name for name, cost in ladder if loss_s >= cost][-1]
    upcoming = next(((name, cost) for name, cost in ladder if cost > loss_s), None)
    return {
        "cause": cause,
        "accumulated_loss_s": loss_s,
        "action": current,
        "next_action": upcoming[0] if upcoming else None,
        "next_action_at_loss_s": upcoming[1] if upcoming else None,
        "ladder": [{"action": name, "at_loss_s": cost} for name, cost in ladder],
    }


# -- diagnosis -----------------------------------------------------------------------------


def diagnose(
    result: WhatIfResult,
    prepared: PreparedTrace,
    *,
    settings: DiagnosisSettings | None = None,
    wasted_gpu_s: float | None = None,
    layers_per_stage: int | None = None,
) -> Diagnosis:
    """Name the likely root cause of `result`'s slowdown, with evidence and advice."""
    cfg = settings or DiagnosisSettings()
    compiled = prepared.model.compiled
    base_time = float(result.t_nodelay.mean())
    correlation = forward_backward_correlation(prepared)
    fwd_outliers, bwd_outliers = forward_outlier_shares(prepared, cfg.gc_outlier_factor)
    by_optype = result.by_optype.overall
    comm_excess = max(
        (
            v - 1
            for k, v in by_optype.items()
            if k not in COMPUTE_LABELS and k not in (ot.OPTIMIZER, ot.GC)
        ),
        default=0.0,
    )
    compute_excess = max((by_optype.get(k, 1.0) - 1 for k in COMPUTE_LABELS), default=0.0)
    evidence: dict[str, Any] = {
        "slowdown": result.slowdown,
        "mw": result.mw.removed_share,
        "mw_workers": [{"dp": d, "stage": s} for d, s in result.mw.workers],
        "ms": result.ms.removed_share,
        "fwd_bwd_correlation": correlation,
        "forward_outlier_share": fwd_outliers,
        "backward_outlier_share": bwd_outliers,
        "top_optype": max(by_optype.items(), key=lambda kv: kv[1]) if by_optype else None,
    }
    n_gpus = prepared.meta.world_size
    wasted = (
        wasted_gpu_s
        if wasted_gpu_s is not None
        else float((result.t_nodelay - result.t_ideal).clip(min=0).sum() * n_gpus)
    )

    def ladder(cause: str) -> dict[str, Any]:
        """The escalation ladder of the cause named (never another cause's)."""
        return escalation(wasted, n_gpus, cfg, cause, evidence.get("refuted_actions", ()))

    floor = noise_floor(prepared, result.ideal_cost, compiled)
    evidence["noise_floor"] = floor
    # A stalling host leaves S (ops replayed without their launch delays) alone: it is
    # named from the launch delays, before S is judged.
    host = _slow_host(result, prepared, compiled, evidence, cfg)
    if host is not None:
        summary, host_advice = host
        return Diagnosis("slow_host", summary, evidence, host_advice, ladder("slow_host"))
    if result.slowdown < cfg.slowdown_threshold:
        return Diagnosis(
            "none",
            f"no significant straggling (S = {result.slowdown:.3f}; this job's noise floor "
            f"is S {floor:.2f})",
            evidence,
            (),
            ladder("none"),
        )
    # GC pauses and unbalanced sequence lengths are fluctuations, which the noise floor
    # counts as noise: they are named on evidence of their own (the recorded pauses, the
    # forward/backward correlation of micro-batches) whatever the floor.
    advice: list[Advice] = []
    if _gc_explains(result, prepared, compiled, evidence, cfg):
        cause = "gc_pauses"
        summary = (
            f"recorded GC pauses explain {of_the_slowdown(evidence['gc_explained'])} and "
            f"{clamped_share(evidence['gc_coincidence'])} of the slow computes' excess: "
            f"Python garbage collection"
        )
        planned = advise_planned_gc(prepared, base_time, compiled, cfg.planned_gc_interval_steps)
        if planned:
            advice.append(planned)
        return Diagnosis(cause, summary, evidence, tuple(advice), ladder(cause))
    unbalanced_sequences = correlation >= cfg.correlation_threshold
    persistent = persistent_excess(prepared)
    stages = stage_excess(prepared)
    evidence["stage_excess"] = stages.tolist()
    mw_verified = any(persistent[s, d] >= 1 + cfg.persistent_margin for d, s in result.mw.workers)
    last_stage_heavier = bool(stages[-1] >= 1 + cfg.persistent_margin / 2)
    # A verified straggler is not noise, however noisy the rest of the job: the floor gates
    # only what has no such evidence (a permanently heavier stage must also clear the
    # floor to matter). A verified
    # worker counts when it explains most of the slowdown, or when removing it alone would
    # speed the job up by the margin (its share is small when the job's noise is large).
    mw_speedup = 1.0 - result.mw.t_removed / result.mw.t_original
    evidence["mw_speedup"] = mw_speedup
    workers_slow = mw_verified and (
        result.mw.removed_share >= cfg.explains_share or mw_speedup >= cfg.floor_margin
    )
    # A last stage that computes more in the median step (an output head) is structure in
    # the same way, however noisy the rest of the job: when it exceeds the median stage by a
    # worker's margin (half of it, the loss work of an ordinary last stage, hides under the
    # floor) and explains most of the slowdown or evening it out alone would speed the job
    # up by the floor's margin (its share is small when the job's noise is large).
    ms_speedup = 1.0 - result.ms.t_removed / result.ms.t_original
    evidence["ms_speedup"] = ms_speedup
    last_stage_heavy = (
        prepared.n_stages > 1
        and last_stage_heavier
        and result.ms.removed_share >= cfg.explains_share
    )
    last_stage_structure = (
        prepared.n_stages > 1
        and stages[-1] >= 1 + cfg.persistent_margin
        and (result.ms.removed_share >= cfg.explains_share or ms_speedup >= cfg.floor_margin)
    )
    structure = workers_slow or last_stage_structure
    margin = max(cfg.floor_margin, cfg.floor_margin_of_excess * (floor - 1.0))
    if result.slowdown < floor + margin and not (unbalanced_sequences or structure):
        return Diagnosis(
            "none",
            f"no straggling beyond noise: S {result.slowdown:.2f} is this job's floor "
            f"(its op-to-op fluctuations alone give S {floor:.2f})",
            evidence,
            (),
            ladder("none"),
        )

    if mw_verified and result.mw.removed_share >= cfg.explains_share:
        cause, summary = _slow_workers(result, prepared, compiled, base_time, evidence, advice, cfg)
    elif unbalanced_sequences:
        cause = "sequence_imbalance"
        summary = (
            f"forward and backward times of the same micro-batch correlate "
            f"({correlation:.2f}): sequence lengths are unbalanced"
        )
        advice.append(advise_balanced_packing(prepared, base_time, compiled))
    elif comm_excess > compute_excess and comm_excess > 0.01 and not structure:
        groups = slow_comm_groups(prepared, cfg.slow_group_factor)
        evidence["slow_groups"] = groups[:10]
        if not groups:
            # Communication carries the slowdown, yet no link is slower than the others
            # moving the same data: what is left is the what-if's one ideal per op type over
            # transfers of different sizes (gradient buckets), nothing to repair.
            return Diagnosis(
                "none",
                f"no straggling beyond noise: S {result.slowdown:.2f} against this job's "
                f"floor of {floor:.2f} (its op-to-op fluctuations alone), the rest in "
                f"communication with no link slower than the others moving the same data",
                evidence,
                (),
                ladder("none"),
            )
        cause = "slow_communication"
        summary = (
            f"communication dominates the slowdown ({evidence['top_optype'][0]}); "
            f"{len(groups)} group(s) transfer over {cfg.slow_group_factor}x the median of "
            f"those moving the same data"
        )
        advice.append(advise_healthy_links(prepared, base_time, compiled, cfg.slow_group_factor))
    elif workers_slow:
        cause, summary = _slow_workers(result, prepared, compiled, base_time, evidence, advice, cfg)
    elif last_stage_heavy or last_stage_structure:
        cause = "last_stage_imbalance"
        summary = (
            f"the last stage (pp {prepared.n_stages - 1}) explains "
            f"{of_the_slowdown(result.ms.removed_share, 'M_S')}"
        )
        move = advise_move_layers(prepared, base_time, compiled, layers_per_stage)
        if move:
            advice.append(move)
    elif _few_verified_workers(result, prepared, compiled, evidence, cfg):
        cause, summary = _slow_workers(result, prepared, compiled, base_time, evidence, advice, cfg)
    else:
        cause = "unattributed"
        top = evidence["top_optype"]
        summary = (
            f"slowdown spread over many workers; {top[0]} contributes most"
            if top
            else "slowdown spread over many workers"
        )
    return Diagnosis(cause, summary, evidence, tuple(advice), ladder(cause))
