"""What to do about a cause, with the speed-up each action would bring: every piece of
advice is predicted by re-simulating the measured steps with the change applied. And when
to escalate: Falcon's ski-rental ladder of each cause's actions, taken once the loss so far
reaches what the next action costs.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from lagscope.simulator import optypes as ot
from lagscope.simulator.causes import Cause
from lagscope.simulator.engine import CompiledModel
from lagscope.simulator.evidence import Escalation, LadderStep
from lagscope.simulator.measures import COMPUTE_LABELS, without_gc_pauses
from lagscope.simulator.prepare import PreparedTrace
from lagscope.simulator.whatif import Variant, WhatIfAnalysis

if TYPE_CHECKING:
    from lagscope.simulator.diagnose import DiagnosisSettings


@dataclass(frozen=True)
class Advice:
    """What to do about a diagnosis, and the speed-up the what-if predicts for it."""

    action: str
    detail: str
    predicted_speedup: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def advise_removal(who: str, speedup: float, look_at: str = "") -> Advice:
    """Restart without the named workers; `look_at`: what to check on them first."""
    detail = f"restart without {who} (spare node or smaller DP)"
    if look_at:
        detail += f"; first {look_at}"
    return Advice("remove the straggler", detail, speedup)


def advise_relieve_host(who: str, speedup: float) -> Advice:
    """A host that stalls between its worker's ops is relieved where it runs."""
    return Advice(
        "relieve the straggler's host",
        f"look at the host of {who}: other processes on its CPUs, CPU throttling, "
        f"Python work between ops (logging, metrics, data prepared outside the loader)",
        speedup,
    )


def advise_synchronised_gc(who: str, speedup: float, interval: int) -> Advice:
    """A worker whose own collections stall it (its peers do not pause then): collect on
    every rank at once, at planned steps, so that nobody waits for one rank's pauses."""
    return Advice(
        "planned garbage collection",
        f"{who} pauses for Python garbage collection while its peers do not: gc.freeze() "
        f"after setup, then gc.disable() and gc.collect() on every rank together every "
        f"{interval} steps (Megatron: --manual-gc --manual-gc-interval {interval})",
        speedup,
    )


def advise_faster_input(who: str, speedup: float) -> Advice:
    """An input-starved worker is fed faster where it runs."""
    return Advice(
        "speed up the straggler's input",
        f"the data loader of {who} keeps it waiting: more loader workers, prefetching, "
        f"or faster storage for its shard",
        speedup,
    )


#: The fix where a straggler runs, for the causes that have one, taken before the job is
#: rearranged around it: fewer micro-batches for the rank make neither its loader nor its
#: host faster.
FIX_IN_PLACE: dict[Cause, Callable[[str, float], Advice]] = {
    Cause.SLOW_HOST: advise_relieve_host,
    Cause.SLOW_INPUT: advise_faster_input,
}


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
    cause: Cause | str | None, settings: DiagnosisSettings, refuted: Collection[str] = ()
) -> list[tuple[str, float]]:
    """The actions of `cause`'s escalation ladder with their costs (seconds of the whole
    job's time), cheapest first. Slow workers (and an unknown cause) climb Falcon's ladder;
    the other causes' fixes are the diagnosis' own advice, so that the ladder never starts
    with a step that does not address the cause: a new layer split, a new packing of the
    sequences or a new GC setting takes a checkpoint restart, and the slow links cost a
    re-arrangement of the topology. Without a cause (none, unattributed) there is nothing
    to climb. Steps in `refuted` (the what-if predicts they would not speed the job up)
    are left out."""
    fixes: dict[Cause, list[tuple[str, float]]] = {
        Cause.SLOW_WORKERS: [
            ("re-split micro-batches", settings.resplit_cost_s),
            ("re-arrange topology", settings.rearrange_cost_s),
            ("checkpoint and restart without the straggler", settings.restart_cost_s),
        ],
        # An input-starved rank or a stalling host is fixed where it is (its loader, its
        # host) before the job is rearranged around it: re-splitting micro-batches gives
        # the rank fewer batches to wait for, not a faster loader.
        Cause.SLOW_INPUT: [
            ("speed up the straggler's input", settings.resplit_cost_s),
            ("checkpoint and restart without the straggler", settings.restart_cost_s),
        ],
        Cause.SLOW_HOST: [
            ("relieve the straggler's host", settings.resplit_cost_s),
            ("re-arrange topology", settings.rearrange_cost_s),
            ("checkpoint and restart without the straggler", settings.restart_cost_s),
        ],
        Cause.SLOW_COMMUNICATION: [("repair or avoid the slow links", settings.rearrange_cost_s)],
        Cause.LAST_STAGE_IMBALANCE: [("move layers off the last stage", settings.restart_cost_s)],
        Cause.SEQUENCE_IMBALANCE: [("balance sequence lengths", settings.restart_cost_s)],
        Cause.GC_PAUSES: [("planned garbage collection", settings.restart_cost_s)],
    }
    key = Cause(cause) if cause is not None else Cause.SLOW_WORKERS
    steps = [step for step in fixes.get(key, []) if step[0] not in refuted]
    return [("ignore", 0.0), *steps]


def escalation(
    wasted_gpu_s: float,
    n_gpus: int,
    settings: DiagnosisSettings,
    cause: Cause | str | None = None,
    refuted: Collection[str] = (),
) -> Escalation:
    """Falcon's ski-rental rule: take the next action of `cause`'s ladder
    (`escalation_ladder`) once the loss accumulated since the onset reaches that action's
    cost (all in seconds of the whole job's time)."""
    # Waste comes out negative when a step ran faster than its ideal (noise, or a step
    # shorter than the running estimate): no loss accumulated, nothing to escalate.
    loss_s = max(wasted_gpu_s / max(n_gpus, 1), 0.0) if np.isfinite(wasted_gpu_s) else 0.0
    ladder = escalation_ladder(cause, settings, refuted)
    current = [name for name, cost in ladder if loss_s >= cost][-1]
    upcoming = next(((name, cost) for name, cost in ladder if cost > loss_s), None)
    return Escalation(
        cause=Cause(cause) if cause is not None else None,
        accumulated_loss_s=loss_s,
        action=current,
        next_action=upcoming[0] if upcoming else None,
        next_action_at_loss_s=upcoming[1] if upcoming else None,
        ladder=tuple(LadderStep(name, cost) for name, cost in ladder),
    )
