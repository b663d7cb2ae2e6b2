"""The measurements a diagnosis rests on, each a question about the steps diagnosed:
do forward and backward of one micro-batch move together (sequence lengths), which computes
are pause outliers and what recorded GC pauses account for, which links transfer slower
than those moving the same data, which workers are slow on their own (re-simulated one by
one), and each worker's peers.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lagscope.simulator import optypes as ot
from lagscope.simulator.engine import CompiledModel
from lagscope.simulator.online_episodes import HOST
from lagscope.simulator.peers import peer_median, peers_of
from lagscope.simulator.prepare import PreparedTrace
from lagscope.simulator.whatif import Variant, WhatIfAnalysis, WhatIfResult

COMPUTE_LABELS = (ot.FORWARD_COMPUTE, ot.BACKWARD_COMPUTE)


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
    compute = prepared.model.own_work_nodes
    cost = prepared.cost.astype(np.float64).copy()
    cost[compute] = np.maximum(cost[compute] - prepared.gc_pause[compute], 0.0)
    return cost


#: Chance the named workers may have paused that often by luck, over all workers.
_PAUSING_BY_CHANCE = 0.01


def pausing_workers(prepared: PreparedTrace, share: float) -> tuple[list[tuple[int, int]], float]:
    """Workers (dp, stage) that paused for GC longer than their peers (the other DP ranks
    of their stage; with one DP rank the other stages) in at least `share` of the steps,
    most paused first, and the share of all recorded pauses they hold; at most a quarter
    of the workers (at least one), each far more often than the other workers do (their
    rate could give it by chance with odds under 1 % over all workers: a Chernoff bound):
    one rank whose heap grew, not a job that collects everywhere, where over a few steps
    one rank pauses more than the rest by luck. ([], 0.0) when there are none.

    >>> from lagscope.simulator.generate import GcPauses, JobSpec, generate_job
    >>> from lagscope.simulator.prepare import prepare
    >>> def job(*pauses):
    ...     spec = JobSpec(dp=4, pp=2, microbatches=4, steps=6, seed=1, stragglers=pauses)
    ...     made = generate_job(spec)
    ...     return prepare(made.trace, made.meta)
    >>> pausing_workers(job(GcPauses(probability=1.0, pause_s=0.05, dp=1, stage=0)), 0.5)
    ([(1, 0)], 1.0)
    >>> pausing_workers(job(GcPauses(probability=0.2, pause_s=0.05)), 0.5)
    ([], 0.0)
    """
    if prepared.gc_pause is None:
        return [], 0.0
    pauses = prepared.stage_sums(prepared.gc_pause)  # [step, stage, dp]
    total = float(pauses.sum())
    if total <= 0 or pauses.shape[1] * pauses.shape[2] < 2:
        return [], 0.0
    beyond = (pauses > peer_median(pauses)).mean(axis=0).ravel()  # [worker]
    held = pauses.sum(axis=0).ravel()
    frequent = np.flatnonzero(beyond >= share)
    if not frequent.size or frequent.size > max(1, held.size // 4):
        return [], 0.0
    others = np.delete(beyond, frequent)
    chance = _chance_at_least(beyond[frequent], float(others.mean()), prepared.n_steps)
    frequent = frequent[chance * held.size < _PAUSING_BY_CHANCE]
    if not frequent.size:
        return [], 0.0
    frequent = frequent[np.argsort(-held[frequent], kind="stable")]
    stages, dps = np.unravel_index(frequent, pauses.shape[1:])
    named = [(int(d), int(s)) for d, s in zip(dps, stages, strict=True)]
    return named, float(held[frequent].sum() / total)


def _chance_at_least(rates: np.ndarray, base: float, n: int) -> np.ndarray:
    """Chernoff bound on the chance of a rate of at least `rates` in `n` trials of rate
    `base`: exp(-n KL(rate || base)); 1 where the rate is not above it."""
    rates = np.clip(rates, 1e-12, 1.0)
    base = min(max(base, 1e-12), 1.0 - 1e-12)
    with np.errstate(divide="ignore", invalid="ignore"):
        kl = rates * np.log(rates / base) + np.where(
            rates < 1.0, (1.0 - rates) * np.log((1.0 - rates) / (1.0 - base)), 0.0
        )
    return np.where(rates > base, np.exp(-n * kl), 1.0)


def gc_beyond_peers(prepared: PreparedTrace, worker: tuple[int, int], kind: str) -> np.ndarray:
    """[step]: seconds of recorded GC pause inside `worker`'s (dp, stage) ops of `kind`,
    or for `host` inside the host gaps before its ops (`PreparedTrace.gc_gap_pause`: a
    pause its host took between ops, as where ops are timed on the GPU), beyond the median
    of its peers' (the other DP ranks of its stage; with one DP rank the other stages);
    zeros without the GC probe.

    >>> from lagscope.simulator.generate import GcPauses, JobSpec, generate_job
    >>> from lagscope.simulator.prepare import prepare
    >>> job = generate_job(JobSpec(dp=2, pp=1, microbatches=2, steps=3, seed=1,
    ...     stragglers=(GcPauses(probability=1.0, pause_s=0.01, dp=1, stage=0),)))
    >>> [round(float(s), 3) for s in gc_beyond_peers(prepare(job.trace, job.meta), (1, 0),
    ...                                              "forward-compute")]
    [0.02, 0.02, 0.02]
    """
    recorded, optype = (prepared.gc_gap_pause, None) if kind == HOST else (prepared.gc_pause, kind)
    if recorded is None:
        return np.zeros(prepared.n_steps)
    dp, stage = worker
    pauses = prepared.stage_sums(recorded, optype)  # [step, stage, dp]
    peers = peers_of(pauses, worker)
    if peers is None:
        return pauses[:, stage, dp]
    return np.maximum(pauses[:, stage, dp] - np.median(peers, axis=1), 0.0)


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


def verified_slow_workers(
    result: WhatIfResult,
    prepared: PreparedTrace,
    compiled: CompiledModel,
    *,
    candidates: int,
    min_share: float,
    eligible: np.ndarray | None = None,
) -> list[tuple[tuple[int, int], float]]:
    """Workers that are slow on their own, best first, with the share of the slowdown each
    explains alone (ideal job + only that worker as measured).

    The worker score S_w = min(S_dp, S_stage) also lights up "ghosts": with stragglers at
    (dp a, stage x) and (dp b, stage y), the crossings (a, y) and (b, x) score as high.
    Re-simulating each top-scoring candidate alone tells them apart. `eligible` ([stage,
    dp], bool): of the top-scoring candidates, only these are re-simulated and returned
    (a caller that needs more evidence than the re-simulation, such as a worker slower
    than its peers in the median step, spares the simulation of those without it).
    """
    order = np.argsort(-result.worker_slowdown, axis=None, kind="stable")[:candidates]
    n_dp = result.worker_slowdown.shape[1]
    workers = [(int(i % n_dp), int(i // n_dp)) for i in order]
    if eligible is not None:
        workers = [(dp, stage) for dp, stage in workers if eligible[stage, dp]]
    excess = float(result.t_nodelay.mean() - result.t_ideal.mean())
    if excess <= 0 or not workers:
        return []
    analysis = WhatIfAnalysis(prepared, result.ideal_cost, compiled=compiled)
    times = analysis.run([Variant("ideal", swap=analysis.worker_rows([w])) for w in workers])
    shares = [
        (w, float(t.mean() - result.t_ideal.mean()) / excess)
        for w, t in zip(workers, times, strict=True)
    ]
    return sorted((ws for ws in shares if ws[1] >= min_share), key=lambda ws: -ws[1])
