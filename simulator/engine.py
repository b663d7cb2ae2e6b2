"""Timeline engine: simulates many step instances of one dependency model at once.

A *column* is one pipeline replica (one DP rank) in one step of one what-if variant; the
engine advances every column together, level by level through the dependency graph, so a
whole analysis (the original step, the ideal one, and every attribution) is a few hundred
vectorized numpy operations rather than a Python loop per op and variant.

Columns are grouped into *segments* (one segment = the DP ranks of one step of one
variant): a DP-synchronized collective starts when its last member on any column of the
segment is posted.

Semantics (docs/whatif.md §4): an op starts at the latest end of its dependencies plus its
launch delay. A plain op ends at start + cost. A communication op is posted at its start;
its group starts (G) when every member is posted, and each member ends at G + its own cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from lagscope.simulator.depmodel import DependencyModel, topological_levels


@dataclass(frozen=True)
class _Level:
    """The ops the engine computes together: each depends only on earlier levels."""

    #: Nodes of this level: plain ops first, then comm members sorted by group.
    ops: np.ndarray
    #: The level's rows in the end buffer, `first` to `first + ops.size` (the engine's
    #: order, `CompiledModel.order`): contiguous, so a level writes its ends in place
    #: instead of scattering them.
    first: int
    #: Dependency slots: deps[j] holds, for every op, its j-th dependency's row in the end
    #: buffer (padded with the sentinel rows), so max over slots = latest dependency end.
    deps: tuple[np.ndarray, ...]
    n_plain: int
    #: Row of each group's first member within the comm part; None when every group of
    #: the level is a singleton (its start is then just the member's start).
    group_first: np.ndarray | None
    #: For the k-th further member of the groups (k = 1, 2, ...): which groups have one
    #: (None: all) and its row within the comm part. A group starts at the latest post of
    #: its members; a maximum per member slot is one pass over contiguous rows, where
    #: `np.maximum.reduceat` along rows is some 30x slower.
    group_rest: tuple[tuple[np.ndarray | None, np.ndarray], ...]
    #: group (local index) of each comm member; None when every group is a singleton.
    member_group: np.ndarray | None
    synced: np.ndarray
    any_synced: bool


@dataclass(frozen=True)
class CompiledModel:
    """A dependency model laid out for level-synchronous simulation."""

    n_nodes: int
    levels: tuple[_Level, ...]
    #: The node at each row of the end buffer: the levels' nodes one after the other.
    order: np.ndarray

    @property
    def zero_row(self) -> int:
        return self.n_nodes

    @property
    def void_row(self) -> int:
        return self.n_nodes + 1

    @cached_property
    def row_of_node(self) -> np.ndarray:
        """Each node's row in the end buffer (the inverse of `order`)."""
        row_of = np.empty(self.n_nodes, dtype=np.int64)
        row_of[self.order] = np.arange(self.n_nodes)
        return row_of


def compile_model(model: DependencyModel) -> CompiledModel:
    n = model.n_nodes
    zero_row, void_row = n, n + 1
    level_of = topological_levels(model)
    by_level = np.argsort(level_of, kind="stable")
    bounds = np.searchsorted(level_of[by_level], np.arange(int(level_of.max()) + 2 if n else 1))
    group_of = model.group_of.tolist()
    level_ops = []
    for level in range(bounds.size - 1):
        nodes = by_level[bounds[level] : bounds[level + 1]].tolist()
        plain = [v for v in nodes if group_of[v] < 0]
        group_ids = sorted({group_of[v] for v in nodes if group_of[v] >= 0})
        level_ops.append((plain, group_ids))
    order: list[int] = []
    for plain, group_ids in level_ops:
        order.extend(plain)
        order.extend(m for g in group_ids for m in model.groups[g].members)
    row_of = np.empty(n + 2, dtype=np.int64)
    row_of[np.array(order, dtype=np.int64)] = np.arange(n)
    row_of[zero_row], row_of[void_row] = zero_row, void_row
    levels = []
    first_row = 0
    for plain, group_ids in level_ops:
        members = [m for g in group_ids for m in model.groups[g].members]
        sizes = [len(model.groups[g].members) for g in group_ids]
        ops = plain + members
        width = max(1, max(len(model.deps[v]) for v in ops))
        slots = []
        for j in range(width):
            slot = [
                model.deps[v][j]
                if j < len(model.deps[v])
                else (void_row if model.deps[v] else zero_row)
                for v in ops
            ]
            slots.append(row_of[np.array(slot, dtype=np.int64)])
        synced = np.array([model.groups[g].dp_synchronized for g in group_ids], dtype=bool)
        all_singletons = all(size == 1 for size in sizes)
        first = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
        size = np.array(sizes, dtype=np.int64)
        rest = []
        for k in range(1, max(sizes, default=1)):
            having = np.flatnonzero(size > k)
            rest.append((None if having.size == size.size else having, first[having] + k))
        levels.append(
            _Level(
                ops=np.array(ops, dtype=np.int64),
                first=first_row,
                deps=tuple(slots),
                n_plain=len(plain),
                group_first=None if all_singletons else first,
                group_rest=tuple(rest),
                member_group=None if all_singletons else np.repeat(np.arange(len(sizes)), sizes),
                synced=synced,
                any_synced=bool(synced.any()),
            )
        )
        first_row += len(ops)
    return CompiledModel(n_nodes=n, levels=tuple(levels), order=np.array(order, dtype=np.int64))


@dataclass(frozen=True)
class Timeline:
    """Simulated start and end of every node in every column ([node, column])."""

    start: np.ndarray
    end: np.ndarray


@dataclass(frozen=True)
class Anchors:
    """Starts the dependency model does not give: `node[i]` starts no earlier than
    `after[i]` ends plus `offset[i, column]` (-inf: not in that column). A worker runs its
    ops one after another: an op it launched after waiting on another (a blocking send)
    waits for it again when that one moves, and an op it launched from inside another (a
    gradient bucket from the backward's hook) moves with that one. Each `after[i]` must lie
    at an earlier level than `node[i]`; a node has one anchor at most."""

    node: np.ndarray
    after: np.ndarray
    offset: np.ndarray


@dataclass(frozen=True)
class SimulationResult:
    """What one simulation of the model gives: each segment's step time, and the
    ops' times when asked for."""

    #: Step time of every segment: max end - min start over its columns.
    step_time: np.ndarray
    timeline: Timeline | None = None


# The engine's hot loop, one function on purpose (its docstring says why).
def simulate(  # noqa: C901, PLR0915
    compiled: CompiledModel,
    cost: np.ndarray,
    delay: np.ndarray | None,
    segment_offsets: np.ndarray,
    *,
    record_timeline: bool = False,
    in_engine_order: bool = False,
    anchors: Anchors | None = None,
    from_zero: bool = False,
) -> SimulationResult:
    """Simulate every column of `cost` ([node, column]); `delay` is launch delay or None.

    `segment_offsets` are the first columns of each segment, ascending, starting at 0.
    `in_engine_order`: the rows of `cost` and `delay` are in the engine's order
    (`CompiledModel.order`), not the nodes'. Either way a level then reads its costs as
    one contiguous block instead of gathering them (most of a pass' time on the AR trace);
    a caller that fills its buffers itself (`simulator/whatif.py`) writes them in this
    order rather than have them reordered here.

    `anchors` (node order) adds starts the model does not give (`Anchors`).
    `from_zero`: a step's time runs from 0, not from its earliest start (launch delays
    measured from the moment the previous step ended: a step's period).

    One function on purpose (about 80 lines): it is the engine's hot loop, one pass per
    dependency level over every column, and it reads as the paper's recurrence (start =
    latest dependency end + launch delay; a group starts when its last member posts).
    """
    if cost.shape[0] != compiled.n_nodes:
        raise ValueError(f"cost has {cost.shape[0]} rows, the model has {compiled.n_nodes} nodes")
    if not in_engine_order:
        cost = np.take(cost, compiled.order, axis=0)
        delay = None if delay is None else np.take(delay, compiled.order, axis=0)
    n, n_cols = cost.shape
    segment_of_col = np.repeat(
        np.arange(segment_offsets.size), np.diff(np.append(segment_offsets, n_cols))
    )
    end = np.empty((n + 2, n_cols), dtype=np.float64)
    end[compiled.zero_row] = 0.0
    end[compiled.void_row] = -np.inf
    starts = np.empty((n, n_cols), dtype=np.float64) if record_timeline else None
    # Without launch delays every op starts at or after 0, and ops without dependencies
    # start exactly at 0, so the step's earliest start is 0.
    earliest = np.full(n_cols, np.inf) if delay is not None and not from_zero else np.zeros(n_cols)
    anchored = _anchor_rows(compiled, anchors)
    # A level's dependency ends are gathered into these rather than into new arrays: a
    # wide pass' gathers are past malloc's mmap threshold, and a fresh mapping per level
    # costs its page faults.
    widest = max((level.ops.size for level in compiled.levels), default=0)
    start_buffer = np.empty((widest, n_cols), dtype=np.float64)
    dep_buffer = np.empty((widest, n_cols), dtype=np.float64)

    for level in compiled.levels:
        size = level.ops.size
        rows = slice(level.first, level.first + size)
        start = start_buffer[:size]
        np.take(end, level.deps[0], axis=0, out=start, mode="clip")
        for slot in level.deps[1:]:
            dep_end = dep_buffer[:size]
            np.take(end, slot, axis=0, out=dep_end, mode="clip")
            np.maximum(start, dep_end, out=start)
        if delay is not None:
            start += delay[rows]
        if anchored is not None:
            lo, hi = np.searchsorted(anchored[0], (level.first, level.first + size))
            if hi > lo:
                local = anchored[0][lo:hi] - level.first
                start[local] = np.maximum(
                    start[local], end[anchored[1][lo:hi]] + anchored[2][lo:hi]
                )
        if delay is not None and not from_zero:
            np.minimum(earliest, start.min(axis=0), out=earliest)
        if starts is not None:
            starts[rows] = start
        p, comm_first = level.n_plain, level.first + level.n_plain
        if p:
            np.add(start[:p], cost[level.first : comm_first], out=end[level.first : comm_first])
        if p < size:
            if level.group_first is None:
                group_start = start[p:]
            else:
                posted = start[p:]
                group_start = posted[level.group_first]
                for having, member_rows in level.group_rest:
                    if having is None:
                        np.maximum(group_start, posted[member_rows], out=group_start)
                    else:
                        group_start[having] = np.maximum(group_start[having], posted[member_rows])
            if level.any_synced:
                synced_start = np.maximum.reduceat(
                    group_start[level.synced], segment_offsets, axis=1
                )
                group_start[level.synced] = synced_start[:, segment_of_col]
            if level.member_group is not None:
                group_start = group_start[level.member_group]
            np.add(group_start, cost[comm_first : rows.stop], out=end[comm_first : rows.stop])

    latest = end[:n].max(axis=0)
    step_time = np.maximum.reduceat(latest, segment_offsets) - np.minimum.reduceat(
        earliest, segment_offsets
    )
    timeline = None
    if starts is not None:
        # Back in the nodes' order.
        row_of = compiled.row_of_node
        timeline = Timeline(start=starts[row_of], end=end[:n][row_of])
    return SimulationResult(step_time=step_time, timeline=timeline)


def _anchor_rows(
    compiled: CompiledModel, anchors: Anchors | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """`anchors` in the engine's rows, sorted by the anchored node's row: each level then
    takes its own as one contiguous slice."""
    if anchors is None or not anchors.node.size:
        return None
    row_of = compiled.row_of_node
    rows, after = row_of[anchors.node], row_of[anchors.after]
    firsts = np.array([level.first for level in compiled.levels])
    level_first = firsts[np.searchsorted(firsts, rows, side="right") - 1]
    # One at an earlier level has ended when the node's level runs; any other is left out.
    keep = np.flatnonzero(after < level_first)
    order = keep[np.argsort(rows[keep], kind="stable")]
    return rows[order], after[order], np.asarray(anchors.offset, dtype=np.float64)[order]
