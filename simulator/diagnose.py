"""Root cause and advice: from a what-if result to what an on-call engineer should do.

The patterns follow the stragglers study (OSDI'25) and Falcon:

- individual slow workers: the top 3 % of workers explain most of the slowdown (M_W);
- last-stage imbalance: the last pipeline stage explains it (M_S);
- sequence-length imbalance: forward and backward times of the same micro-batch are
  correlated (both scale with the sum of squared document lengths), measured on a middle
  stage where no embedding/loss work blurs it;
- Python GC pauses: forward computes with outliers that backward computes do not have
  (automatic GC runs during forward, when activations are allocated), scattered over ranks;
- slow communication: communication op types dominate the attribution, and some groups'
  transfer times exceed 1.1 x the median of their op type.

Every piece of advice carries a predicted speed-up, obtained by re-simulating the measured
steps with the change applied.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from simulator import optypes as ot
from simulator.engine import CompiledModel, compile_model
from simulator.prepare import PreparedTrace
from simulator.whatif import Variant, WhatIfAnalysis, WhatIfResult

COMPUTE_LABELS = (ot.FORWARD_COMPUTE, ot.BACKWARD_COMPUTE)


class DiagnosisSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Below this slowdown nothing is wrong enough to name a cause.
    slowdown_threshold: float = Field(default=1.03, gt=0)
    #: M_W / M_S from which workers / the last stage are the cause.
    explains_share: float = Field(default=0.5, gt=0, le=2)
    #: Forward/backward correlation from which sequence-length imbalance is named.
    correlation_threshold: float = Field(default=0.85, gt=0, le=1)
    #: A forward compute this many times its stage's median is a pause outlier.
    gc_outlier_factor: float = Field(default=1.5, gt=1)
    #: A comm group whose median transfer exceeds this x its op type's median is suspect.
    slow_group_factor: float = Field(default=1.1, gt=1)
    #: Costs (seconds of the whole job's time) of the escalating actions (ski rental).
    resplit_cost_s: float = Field(default=60.0, ge=0)
    rearrange_cost_s: float = Field(default=600.0, ge=0)
    restart_cost_s: float = Field(default=1800.0, ge=0)
    #: Steps between planned garbage collections when GC pauses are the cause.
    planned_gc_interval_steps: int = Field(default=200, ge=1)


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


def slow_comm_groups(prepared: PreparedTrace, factor: float) -> list[dict[str, Any]]:
    """Comm groups whose median transfer exceeds `factor` x their op type's median."""
    suspects = []
    optypes = prepared.node_optype
    medians: dict[str, float] = {}
    for group in prepared.model.groups:
        optype = optypes[group.members[0]]
        if optype not in medians:
            nodes = [i for i, t in enumerate(optypes) if t == optype]
            medians[optype] = float(np.median(prepared.cost[nodes]))
        base = medians[optype]
        per_dp = np.median(prepared.cost[list(group.members)], axis=(0, 1))
        candidates = [int(dp) for dp in np.flatnonzero(per_dp > factor * base)] if base > 0 else []
        if group.dp_synchronized and candidates:
            candidates = [-1]  # the whole DP group is slow, not one rank
        for dp in candidates:
            value = (
                float(np.median(prepared.cost[list(group.members)]))
                if dp < 0
                else float(per_dp[dp])
            )
            suspects.append(
                {
                    "ops": [str(prepared.model.nodes[m]) for m in group.members],
                    "dp": None if dp < 0 else dp,
                    "transfer_s": value,
                    "optype_median_s": base,
                    "ratio": value / base,
                }
            )
    suspects.sort(key=lambda s: -s["ratio"])
    return suspects


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


def advise_resplit(
    prepared: PreparedTrace, base_time: float, compiled: CompiledModel
) -> Advice | None:
    """Give slow pipeline replicas fewer micro-batches (the global batch is unchanged)."""
    if prepared.n_dp < 2:
        return None
    compute = _compute_mask(prepared)
    stage = prepared.model.node_stage()
    per_worker = np.zeros((prepared.n_stages, prepared.n_dp))
    np.add.at(per_worker, stage[compute], prepared.duration[compute].mean(axis=1))
    n_mb = max(
        1,
        int(
            sum(1 for n in prepared.model.nodes if n.stage == 0 and n.optype == ot.FORWARD_COMPUTE)
        ),
    )
    per_mb = per_worker.max(axis=0) / n_mb
    counts = balanced_microbatches(per_mb, n_mb * prepared.n_dp)
    if np.all(counts == n_mb):
        return None
    scale = counts / n_mb
    cost = prepared.cost.astype(np.float64).copy()
    cost[compute] *= scale[None, None, :]
    predicted = base_time / resimulated_step_time(prepared, cost, compiled)
    changed = {int(r): int(c) for r, c in enumerate(counts) if c != n_mb}
    return Advice(
        "re-split micro-batches",
        f"give DP ranks {changed} micro-batches instead of {n_mb} each (global batch unchanged)",
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
    prepared: PreparedTrace, base_time: float, compiled: CompiledModel, factor: float, interval: int
) -> Advice:
    """Disable automatic GC and collect every `interval` steps on all ranks at once."""
    forward = np.array([t == ot.FORWARD_COMPUTE for t in prepared.node_optype])
    stage = prepared.model.node_stage()
    cost = prepared.cost.astype(np.float64).copy()
    pauses = []
    for s in np.unique(stage[forward]):
        nodes = forward & (stage == s)
        values = cost[nodes]
        median = np.median(values)
        outliers = values > factor * median
        pauses.append((values - median)[outliers])
        cost[nodes] = np.where(outliers, median, values)
    pause = float(np.concatenate(pauses).mean()) if any(p.size for p in pauses) else 0.0
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


def escalation(wasted_gpu_s: float, n_gpus: int, settings: DiagnosisSettings) -> dict[str, Any]:
    """Falcon's ski-rental rule: take the next action once the loss accumulated since the
    onset reaches that action's cost (all in seconds of the whole job's time)."""
    loss_s = wasted_gpu_s / max(n_gpus, 1)
    ladder = [
        ("ignore", 0.0),
        ("re-split micro-batches", settings.resplit_cost_s),
        ("re-arrange topology", settings.rearrange_cost_s),
        ("checkpoint and restart without the straggler", settings.restart_cost_s),
    ]
    current = [name for name, cost in ladder if loss_s >= cost][-1]
    upcoming = next(((name, cost) for name, cost in ladder if cost > loss_s), None)
    return {
        "accumulated_loss_s": loss_s,
        "action": current,
        "next_action": upcoming[0] if upcoming else None,
        "next_action_at_loss_s": upcoming[1] if upcoming else None,
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
    compiled = compile_model(prepared.model)
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
    ladder = escalation(wasted, n_gpus, cfg)

    if result.slowdown < cfg.slowdown_threshold:
        return Diagnosis(
            "none", f"no significant straggling (S = {result.slowdown:.3f})", evidence, (), ladder
        )

    advice: list[Advice] = []
    if comm_excess > compute_excess and comm_excess > 0.01:
        groups = slow_comm_groups(prepared, cfg.slow_group_factor)
        evidence["slow_groups"] = groups[:10]
        cause = "slow_communication"
        summary = (
            f"communication dominates the slowdown ({evidence['top_optype'][0]}); "
            f"{len(groups)} group(s) transfer over {cfg.slow_group_factor}x their "
            f"op type's median"
        )
        advice.append(advise_healthy_links(prepared, base_time, compiled, cfg.slow_group_factor))
    elif result.mw.removed_share >= cfg.explains_share:
        workers = ", ".join(f"(dp {d}, pp {s})" for d, s in result.mw.workers)
        cause = "slow_workers"
        summary = f"worker(s) {workers} explain {result.mw.removed_share:.0%} of the slowdown"
        resplit = advise_resplit(prepared, base_time, compiled)
        if resplit:
            advice.append(resplit)
        advice.append(
            Advice(
                "remove the straggler",
                f"restart without {workers} (spare node or smaller DP)",
                base_time / result.mw.t_removed,
            )
        )
    elif correlation >= cfg.correlation_threshold:
        cause = "sequence_imbalance"
        summary = (
            f"forward and backward times of the same micro-batch correlate "
            f"({correlation:.2f}): sequence lengths are unbalanced"
        )
        advice.append(advise_balanced_packing(prepared, base_time, compiled))
    elif result.ms.removed_share >= cfg.explains_share and prepared.n_stages > 1:
        cause = "last_stage_imbalance"
        summary = f"the last stage explains {result.ms.removed_share:.0%} of the slowdown"
        move = advise_move_layers(prepared, base_time, compiled, layers_per_stage)
        if move:
            advice.append(move)
    elif fwd_outliers > 2 * max(bwd_outliers, 0.005):
        cause = "gc_pauses"
        summary = (
            f"{fwd_outliers:.1%} of forward computes are pause outliers, backward "
            f"{bwd_outliers:.1%}: Python garbage collection"
        )
        advice.append(
            advise_planned_gc(
                prepared, base_time, compiled, cfg.gc_outlier_factor, cfg.planned_gc_interval_steps
            )
        )
    else:
        cause = "unattributed"
        top = evidence["top_optype"]
        summary = (
            f"slowdown spread over many workers; {top[0]} contributes most"
            if top
            else "slowdown spread over many workers"
        )
    return Diagnosis(cause, summary, evidence, tuple(advice), ladder)
