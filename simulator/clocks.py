"""Per-worker clock offsets, estimated from the two ends of every transfer.

Each rank stamps its ops with its own clock, so a rank whose clock runs `o` seconds ahead
records every op `o` late. The what-if slowdown barely notices (it compares a step with
its own ideal), but every measured transfer time does: a pipeline transfer is "own end
minus the latest start of the group", and the group's starts come from two clocks.

Both ends of one transfer carry evidence about the difference of their clocks. A transfer
completes on both sides at (nearly) the same true time, so the difference of the recorded
ends measures `o_peer - o_self`; and neither side can finish before the other has started,
so for ends e and starts s (recorded)

    s_peer - e_self  <=  o_peer - o_self  <=  e_peer - s_self.

Pipeline send/recv pairs link the stages of one pipeline replica; DP-synchronized
collectives (all-gather, reduce-scatter, the clip-norm all-reduce, all of whose members end
together) link the replicas. Every worker pair that shares transfers becomes one edge: the
median of its end differences, weighted by how consistent they are, clipped to the
intersection of its bounds. The offsets are the weighted least-squares solution over the
whole graph with every edge's bounds enforced (an active set: a violated bound is pinned
and the system solved again): densely up to 512 workers, beyond that by conjugate gradients
over the edges (a 100,000-GPU job's 12,480 workers and 36,000 edges in 0.15 s; the dense
solution held 11 GB and had not finished after 3 minutes), its standard errors then bounded
from above. Offsets are relative to one reference worker per connected component (the
lowest (stage, dp) in it); workers that share no transfer cannot be compared and keep
offset 0 with an infinite uncertainty.

The estimate assumes one constant offset per worker over the analysed steps (drift within
a trace shows up as inconsistent bounds, which are then dropped for that edge) and that a
transfer's two ends complete together (true of NCCL and gloo p2p and of ring collectives;
an eager send that completes before its receive is posted would bias the edge).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import numpy as np

from lagscope.simulator.depmodel import DependencyModel
from lagscope.simulator.prepare import PreparedTrace
from lagscope.simulator.trace import Trace

#: Spread (s) below which an edge's end differences count as exact: keeps weights finite
#: when a generator or a coarse clock makes every difference identical.
MIN_EDGE_SPREAD_S = 1e-6
#: Slack (s) allowed on a bound before it counts as violated (float32 timestamps).
BOUND_SLACK_S = 1e-6
#: Weight of a pinned bound relative to the heaviest edge.
PINNED_WEIGHT_FACTOR = 1e6
#: Free workers up to which the offsets are solved densely, with exact standard errors (512
#: workers in 0.14 s). The dense solution grows with the cube: a 12,288-GPU job's 1,536
#: (dp x pp) workers took 2.0-2.2 s, 60 % of its `lagscope analyze`, against 13 ms on the
#: graph; a 99,840-GPU job's 12,480 held 11 GB and had not finished after 3 minutes.
DENSE_LIMIT = 512
#: The graph solver's stopping point: its residual relative to the right-hand side, in the
#: preconditioned norm. At 1e-12 a round of the active set could pin another bound than
#: the dense solution does (14 us apart on a graph of 800 workers with tight bounds); at
#: 1e-14 the two agree to 0.4 us or better, and the iterations cost little more.
CG_TOLERANCE = 1e-14
CG_MAX_ITERATIONS = 20_000


@dataclass(frozen=True)
class ClockEdge:
    """What the transfers between two workers say about `offset[v] - offset[u]`."""

    u: int
    v: int
    estimate_s: float
    standard_error_s: float
    lower_s: float
    upper_s: float
    n_transfers: int


@dataclass(frozen=True)
class ClockOffsets:
    """Estimated clock offset of every (stage, dp) worker: how far its clock runs ahead of
    its component's reference worker. Arrays are [stage, dp]."""

    offset_s: np.ndarray
    standard_error_s: np.ndarray
    #: Connected component of every worker; offsets compare only within one.
    component: np.ndarray
    worker_rank: np.ndarray
    edges: tuple[ClockEdge, ...]
    #: Whether `standard_error_s` is exact, or (beyond `DENSE_LIMIT` workers) an upper
    #: bound from each worker's best path to its reference.
    exact_errors: bool = True

    @property
    def n_transfers(self) -> int:
        return sum(e.n_transfers for e in self.edges)

    def largest(self) -> tuple[float, int, int]:
        """(offset, stage, dp) of the worker whose clock is furthest from its reference."""
        stage, dp = np.unravel_index(int(np.argmax(np.abs(self.offset_s))), self.offset_s.shape)
        return float(self.offset_s[stage, dp]), int(stage), int(dp)

    def as_dict(self) -> dict[str, Any]:
        """The `clock_offsets` entry of `lagscope analyze --json`."""
        n_stages, n_dp = self.offset_s.shape
        return {
            "method": "send/recv and collective end alignment, bounded least squares",
            "n_transfers": self.n_transfers,
            "n_components": int(np.unique(self.component).size),
            "standard_error": "exact" if self.exact_errors else "upper bound (best path)",
            "workers": [
                {
                    "stage": stage,
                    "dp": dp,
                    "rank": int(self.worker_rank[stage, dp]),
                    "offset_s": float(self.offset_s[stage, dp]),
                    "standard_error_s": _finite_or_none(self.standard_error_s[stage, dp]),
                    "component": int(self.component[stage, dp]),
                }
                for stage in range(n_stages)
                for dp in range(n_dp)
            ],
        }


def _finite_or_none(value: float) -> float | None:
    return float(value) if np.isfinite(value) else None


def estimate_clock_offsets(prepared: PreparedTrace) -> ClockOffsets:
    """Estimate every worker's clock offset from the transfers of `prepared`.

    >>> from lagscope.simulator.generate import JobSpec, generate_job
    >>> from lagscope.simulator.prepare import prepare
    >>> job = generate_job(JobSpec(dp=2, pp=2, microbatches=4, steps=4))
    >>> offsets = np.array([[0.0, 0.003], [-0.002, 0.001]])  # [stage, dp]
    >>> skewed = shift_worker_clocks(job.trace, offsets)
    >>> found = estimate_clock_offsets(prepare(skewed, job.meta))
    >>> bool(np.abs(found.offset_s - offsets).max() < 1e-4)
    True
    """
    n_workers = prepared.n_stages * prepared.n_dp
    edges = _edges(prepared)
    offset, error, component, exact = _solve(edges, n_workers)
    shape = (prepared.n_stages, prepared.n_dp)
    return ClockOffsets(
        offset_s=offset.reshape(shape),
        standard_error_s=error.reshape(shape),
        component=component.reshape(shape),
        worker_rank=prepared.worker_rank,
        edges=tuple(edges),
        exact_errors=exact,
    )


def shift_worker_clocks(trace: Trace, shift_s: np.ndarray) -> Trace:
    """`trace` as recorded by clocks running `shift_s[stage, dp]` seconds ahead.

    Each step keeps its earliest start where it was (traces hold times relative to the
    step), so shifting by an offset and then by its negation gives the trace back.
    """
    shift = np.asarray(shift_s, dtype=np.float64)[trace.stage, trace.dp_rank]
    shifted = trace.start_ts.astype(np.float64) + shift
    step_ids, step_idx = np.unique(trace.step, return_inverse=True)
    old_origin = np.full(step_ids.size, np.inf)
    new_origin = np.full(step_ids.size, np.inf)
    np.minimum.at(old_origin, step_idx, trace.start_ts.astype(np.float64))
    np.minimum.at(new_origin, step_idx, shifted)
    columns = trace.columns()
    columns["start_ts"] = (shifted - new_origin[step_idx] + old_origin[step_idx]).astype(np.float32)
    return Trace.from_columns(columns, source=trace.source, allow_unknown_optypes=True)


def correct_trace(trace: Trace, offsets: ClockOffsets) -> Trace:
    """`trace` with every worker's clock set back by its estimated offset."""
    return shift_worker_clocks(trace, -offsets.offset_s)


# -- evidence --------------------------------------------------------------------------


def _links(model: DependencyModel, n_dp: int) -> tuple[np.ndarray, ...]:
    """Every pair of ends that completes together: (node a, dp a, node b, dp b) arrays."""
    firsts, first_dps, others, other_dps = [], [], [], []
    all_dp = np.arange(n_dp)
    for group in model.groups:
        members = [m for m in group.members if m not in model.noop_nodes]
        if group.dp_synchronized and members:
            # One instance spans every DP rank: link each member end to the first one's.
            node, dp = np.repeat(members, n_dp)[1:], np.tile(all_dp, len(members))[1:]
            first_dp = np.zeros(node.size, np.int64)
        elif not group.dp_synchronized and len(members) > 1:
            node, dp = np.tile(members[1:], n_dp), np.repeat(all_dp, len(members) - 1)
            first_dp = dp
        else:
            continue
        firsts.append(np.full(node.size, members[0]))
        first_dps.append(first_dp)
        others.append(node)
        other_dps.append(dp)
    if not firsts:
        return (np.zeros(0, np.int64),) * 4
    return tuple(
        np.concatenate(parts).astype(np.int64) for parts in (firsts, first_dps, others, other_dps)
    )


#: Past this many distinct group sizes, one full sort costs less than a partition a size.
_MEDIAN_ROW_SIZES = 64


def _medians(values: np.ndarray, group: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Median of every group of `values` (group ids ascending from 0, `first` the offset of
    each group once sorted by it), as np.median computes it: NaN where a group has one.

    >>> _medians(np.array([5.0, 1.0, 9.0, 2.0, 4.0]), np.array([0, 1, 0, 1, 0]),
    ...          np.array([0, 3]))
    array([5. , 1.5])
    """
    count = np.diff(np.append(first, values.size))
    sizes = np.unique(count)
    if sizes.size > _MEDIAN_ROW_SIZES:
        return _sorted_medians(values, group, first, count)
    # A stable sort by group keeps each group's values together; small ids sort in linear
    # time. Groups of one size are then rows of one array, whose two middle values a
    # partition finds without sorting them (a job's edges come in a few sizes: their
    # links x its steps).
    ids = group.astype(np.int16 if first.size < 2**15 else np.int64)
    grouped = values[np.argsort(ids, kind="stable")]
    median = np.empty(first.size)
    for size in sizes.tolist():
        members = np.flatnonzero(count == size)
        rows = grouped[first[members, None] + np.arange(size)]
        middle = np.partition(rows, ((size - 1) // 2, size // 2), axis=1)
        values_at = (middle[:, (size - 1) // 2] + middle[:, size // 2]) / 2
        median[members] = np.where(np.isnan(rows).any(axis=1), np.nan, values_at)
    return median


def _sorted_medians(
    values: np.ndarray, group: np.ndarray, first: np.ndarray, count: np.ndarray
) -> np.ndarray:
    """`_medians` by sorting every value: for groups of many different sizes."""
    by_value = np.argsort(values)
    ids = group[by_value].astype(np.int16 if first.size < 2**15 else np.int64)
    ordered = values[by_value[np.argsort(ids, kind="stable")]]
    median = (ordered[first + (count - 1) // 2] + ordered[first + count // 2]) / 2
    # NaN sorts last, so a group holds one exactly when its last value is NaN.
    return np.where(np.isnan(ordered[first + count - 1]), np.nan, median)


def _edges(prepared: PreparedTrace) -> list[ClockEdge]:
    """One edge per worker pair that shares transfers, oriented u < v."""
    n_dp, n_steps = prepared.n_dp, prepared.n_steps
    n_workers = prepared.n_stages * n_dp
    stage = prepared.model.node_stage()
    start = prepared.start.astype(np.float64)
    end = start + prepared.duration.astype(np.float64)
    a, dp_a, b, dp_b = _links(prepared.model, n_dp)
    u, v = stage[a] * n_dp + dp_a, stage[b] * n_dp + dp_b
    keep = u != v
    a, dp_a, b, dp_b, u, v = (x[keep] for x in (a, dp_a, b, dp_b, u, v))
    if not a.size or not n_steps:
        return []
    diff = end[b, :, dp_b] - end[a, :, dp_a]  # [link, step]
    lower = start[b, :, dp_b] - end[a, :, dp_a]
    upper = end[b, :, dp_b] - start[a, :, dp_a]
    flip = (u > v)[:, None]
    diff, lower, upper = (
        np.where(flip, -diff, diff),
        np.where(flip, -upper, lower),
        np.where(flip, -lower, upper),
    )
    pairs, edge_of_link, links = np.unique(
        np.minimum(u, v) * n_workers + np.maximum(u, v), return_inverse=True, return_counts=True
    )
    n_transfers = links * n_steps
    first = np.append(0, np.cumsum(n_transfers)[:-1])
    edge_of_value = np.repeat(edge_of_link, n_steps)
    median = _medians(diff.ravel(), edge_of_value, first)
    deviation = _medians(np.abs(diff.ravel() - median[edge_of_value]), edge_of_value, first)
    lowest = np.full(pairs.size, -np.inf)
    np.maximum.at(lowest, edge_of_link, lower.max(axis=1))
    highest = np.full(pairs.size, np.inf)
    np.minimum.at(highest, edge_of_link, upper.min(axis=1))

    edges = []
    for i, pair in enumerate(pairs.tolist()):
        low, high = float(lowest[i]), float(highest[i])
        if low > high:
            # Drifting clocks or ends that do not complete together: the median still
            # measures the typical difference, the bounds no longer hold as hard limits.
            low, high = -np.inf, np.inf
        spread = max(1.4826 * float(deviation[i]), MIN_EDGE_SPREAD_S)
        edges.append(
            ClockEdge(
                u=pair // n_workers,
                v=pair % n_workers,
                estimate_s=min(max(float(median[i]), low), high),
                # Standard error of a median: 1.25 x that of a mean.
                standard_error_s=1.2533 * spread / np.sqrt(int(n_transfers[i])),
                lower_s=low,
                upper_s=high,
                n_transfers=int(n_transfers[i]),
            )
        )
    return edges


# -- solution --------------------------------------------------------------------------


def _components(edges: list[ClockEdge], n_workers: int) -> np.ndarray:
    parent = np.arange(n_workers)

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = int(parent[i])
        return i

    for e in edges:
        a, b = root(e.u), root(e.v)
        if a != b:
            parent[max(a, b)] = min(a, b)
    return np.array([root(i) for i in range(n_workers)])


def _solve(
    edges: list[ClockEdge], n_workers: int, dense_limit: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """Bounded weighted least squares; returns (offset, standard error, component, whether
    the standard errors are exact).

    Up to `dense_limit` (default `DENSE_LIMIT`) free workers the system is solved densely,
    with exact standard errors; beyond, by conjugate gradients on the graph (its normal
    matrix is the edges' weighted Laplacian, one product per pass over the edges), with
    each worker's standard error bounded by its best path to the reference (below)."""
    component = _components(edges, n_workers)
    offset = np.zeros(n_workers)
    error = np.full(n_workers, np.inf)
    # The reference worker of each component (its lowest index, which is also its root)
    # is fixed at 0, which removes the one free constant per component.
    references = np.flatnonzero(component == np.arange(n_workers))
    error[references] = 0.0
    free = np.setdiff1d(np.arange(n_workers), references)
    if not edges or free.size == 0:
        return offset, error, component, True
    u = np.array([e.u for e in edges])
    v = np.array([e.v for e in edges])
    target = np.array([e.estimate_s for e in edges])
    weight = 1.0 / np.array([e.standard_error_s for e in edges]) ** 2
    lower = np.array([e.lower_s for e in edges])
    upper = np.array([e.upper_s for e in edges])
    if free.size <= (DENSE_LIMIT if dense_limit is None else dense_limit):
        system: _DenseSystem | _GraphSystem = _DenseSystem(u, v, free, n_workers)
    else:
        system = _GraphSystem(u, v, references, n_workers)

    pinned = np.full(len(edges), np.nan)
    solution = None
    for _ in range(len(edges) + 1):
        goal = np.where(np.isnan(pinned), target, pinned)
        w = np.where(np.isnan(pinned), weight, PINNED_WEIGHT_FACTOR * weight.max())
        solution = system.solve(goal, w, solution)
        difference = system.differences(solution)
        too_low = difference < lower - BOUND_SLACK_S
        too_high = difference > upper + BOUND_SLACK_S
        newly = np.isnan(pinned) & (too_low | too_high)
        if not newly.any():
            break
        pinned[newly] = np.where(too_low[newly], lower[newly], upper[newly])
    offset[free] = system.offsets(solution)[free]
    error[free] = system.standard_errors(weight)[free]
    return offset, error, component, isinstance(system, _DenseSystem)


class _DenseSystem:
    """The edges as a dense incidence matrix over the free workers: exact, O(workers^2)
    memory and O(edges x workers^2) time."""

    def __init__(self, u: np.ndarray, v: np.ndarray, free: np.ndarray, n_workers: int) -> None:
        column = np.full(n_workers, -1)
        column[free] = np.arange(free.size)
        self.free = free
        self.n_workers = n_workers
        self.incidence = np.zeros((u.size, free.size))
        rows = np.arange(u.size)
        self.incidence[rows[column[v] >= 0], column[v][column[v] >= 0]] = 1.0
        self.incidence[rows[column[u] >= 0], column[u][column[u] >= 0]] = -1.0

    def solve(self, goal: np.ndarray, w: np.ndarray, _: np.ndarray | None) -> np.ndarray:
        root_w = np.sqrt(w)
        return np.linalg.lstsq(self.incidence * root_w[:, None], goal * root_w, rcond=None)[0]

    def differences(self, solution: np.ndarray) -> np.ndarray:
        return self.incidence @ solution

    def offsets(self, solution: np.ndarray) -> np.ndarray:
        every = np.zeros(self.n_workers)
        every[self.free] = solution
        return every

    def standard_errors(self, weight: np.ndarray) -> np.ndarray:
        normal = (self.incidence * weight[:, None]).T @ self.incidence
        every = np.zeros(self.n_workers)
        every[self.free] = np.sqrt(np.clip(np.diag(np.linalg.pinv(normal)), 0.0, None))
        return every


class _GraphSystem:
    """The edges as a graph: the normal equations (the weighted Laplacian with every
    component's reference held at 0) solved by conjugate gradients with Jacobi
    preconditioning, O(edges) memory and time per iteration."""

    def __init__(
        self, u: np.ndarray, v: np.ndarray, references: np.ndarray, n_workers: int
    ) -> None:
        self.u, self.v, self.n_workers = u, v, n_workers
        self.held = np.zeros(n_workers, dtype=bool)
        self.held[references] = True

    def differences(self, offsets: np.ndarray) -> np.ndarray:
        return offsets[self.v] - offsets[self.u]

    def _gather(self, per_edge: np.ndarray) -> np.ndarray:
        """The transposed incidence times `per_edge`, zero at the held workers."""
        n = self.n_workers
        summed = np.bincount(self.v, per_edge, n) - np.bincount(self.u, per_edge, n)
        summed[self.held] = 0.0
        return summed

    def solve(self, goal: np.ndarray, w: np.ndarray, start: np.ndarray | None) -> np.ndarray:
        n = self.n_workers
        diagonal = np.bincount(self.u, w, n) + np.bincount(self.v, w, n)
        diagonal[self.held | (diagonal == 0)] = np.inf  # held workers never move
        inverse_diagonal = 1.0 / diagonal
        x = np.zeros(n) if start is None else start.copy()
        b = self._gather(w * goal)
        r = b - self._gather(w * self.differences(x))
        z = inverse_diagonal * r
        p = z.copy()
        rz = float(r @ z)
        # In the preconditioned norm: a pinned bound's edge weighs a million times an
        # estimate's, and in the plain norm its rows would hide the rest of the residual.
        tolerance = CG_TOLERANCE**2 * float(b @ (inverse_diagonal * b))
        for _ in range(CG_MAX_ITERATIONS):
            if rz <= tolerance:
                break
            q = self._gather(w * self.differences(p))
            step = rz / float(p @ q)
            x += step * p
            r -= step * q
            z = inverse_diagonal * r
            rz, previous = float(r @ z), rz
            p = z + (rz / previous) * p
        return x

    def offsets(self, solution: np.ndarray) -> np.ndarray:
        return solution

    def standard_errors(self, weight: np.ndarray) -> np.ndarray:
        """Each worker's standard error bounded from above by its best single path.

        The exact variance is the effective resistance between the worker and its
        reference in the network whose edges have resistance 1 / weight (the variance of
        their estimates); dropping edges never lowers a resistance, so the least
        resistance of one path (Dijkstra) bounds it. Pipeline chains and DP collectives
        give each worker a few near-equal paths, so the bound is the exact error times
        about the square root of their number."""
        n = self.n_workers
        resistance = 1.0 / weight
        ends = np.concatenate([self.u, self.v])
        others = np.concatenate([self.v, self.u])
        edge_resistance = np.concatenate([resistance, resistance])
        order = np.argsort(ends, kind="stable")
        first = np.searchsorted(ends[order], np.arange(n + 1))
        neighbours, costs = others[order].tolist(), edge_resistance[order].tolist()
        starts = first.tolist()
        best = [np.inf] * n
        queue = [(0.0, int(r)) for r in np.flatnonzero(self.held)]
        for _, worker in queue:
            best[worker] = 0.0
        heapq.heapify(queue)
        while queue:
            distance, worker = heapq.heappop(queue)
            if distance > best[worker]:
                continue
            for k in range(starts[worker], starts[worker + 1]):
                through = distance + costs[k]
                if through < best[neighbours[k]]:
                    best[neighbours[k]] = through
                    heapq.heappush(queue, (through, neighbours[k]))
        return np.sqrt(np.array(best))
