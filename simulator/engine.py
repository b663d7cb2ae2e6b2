"""Timeline engine: simulates many step instances of one dependency model at once.

A *column* is one pipeline replica (one DP rank) in one step of one what-if variant; the
engine advances every column together, level by level through the dependency graph, so a
whole analysis (the original step, the ideal one, and every attribution) is a few hundred
vectorized numpy operations rather than a Python loop per op and variant.

Columns are grouped into *segments* (one segment = the DP ranks of one step of one
variant): a DP-synchronized collective starts when its last member on any column of the
segment is posted.

Semantics (WHATIF.md §A5): an op starts at the latest end of its dependencies plus its
launch delay. A plain op ends at start + cost. A communication op is posted at its start;
its group starts (G) when every member is posted, and each member ends at G + its own cost.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simulator.depmodel import DependencyModel, topological_levels


@dataclass(frozen=True)
class _Level:
    #: Nodes of this level: plain ops first, then comm members sorted by group.
    ops: np.ndarray
    #: (n_ops, k) indices into the end buffer; padded with the sentinels.
    deps: np.ndarray
    n_plain: int
    #: reduceat offsets of each group's members within the comm part.
    group_offsets: np.ndarray
    #: group (local index) of each comm member.
    member_group: np.ndarray
    synced: np.ndarray
    any_synced: bool


@dataclass(frozen=True)
class CompiledModel:
    """A dependency model laid out for level-synchronous simulation."""

    n_nodes: int
    levels: tuple[_Level, ...]

    @property
    def zero_row(self) -> int:
        return self.n_nodes

    @property
    def void_row(self) -> int:
        return self.n_nodes + 1


def compile_model(model: DependencyModel) -> CompiledModel:
    n = model.n_nodes
    zero_row, void_row = n, n + 1
    level_of = topological_levels(model)
    levels = []
    for level in range(int(level_of.max()) + 1 if n else 0):
        nodes = np.flatnonzero(level_of == level)
        plain = [int(v) for v in nodes if model.group_of[v] < 0]
        group_ids = sorted({int(model.group_of[v]) for v in nodes if model.group_of[v] >= 0})
        members = [m for g in group_ids for m in model.groups[g].members]
        sizes = [len(model.groups[g].members) for g in group_ids]
        ops = np.array(plain + members, dtype=np.int64)
        width = max(1, max(len(model.deps[v]) for v in ops))
        deps = np.full((ops.size, width), void_row, dtype=np.int64)
        for i, v in enumerate(ops):
            d = model.deps[v]
            if d:
                deps[i, : len(d)] = d
            else:
                deps[i, :] = zero_row
        synced = np.array([model.groups[g].dp_synchronized for g in group_ids], dtype=bool)
        levels.append(
            _Level(
                ops=ops,
                deps=deps,
                n_plain=len(plain),
                group_offsets=np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64),
                member_group=np.repeat(np.arange(len(sizes)), sizes),
                synced=synced,
                any_synced=bool(synced.any()),
            )
        )
    return CompiledModel(n_nodes=n, levels=tuple(levels))


@dataclass(frozen=True)
class Timeline:
    """Simulated start and end of every node in every column ([node, column])."""

    start: np.ndarray
    end: np.ndarray


@dataclass(frozen=True)
class SimulationResult:
    #: Step time of every segment: max end - min start over its columns.
    step_time: np.ndarray
    timeline: Timeline | None = None


def simulate(
    compiled: CompiledModel,
    cost: np.ndarray,
    delay: np.ndarray | None,
    segment_offsets: np.ndarray,
    *,
    record_timeline: bool = False,
) -> SimulationResult:
    """Simulate every column of `cost` ([node, column]); `delay` is launch delay or None.

    `segment_offsets` are the first columns of each segment, ascending, starting at 0.
    """
    n, n_cols = cost.shape
    if n != compiled.n_nodes:
        raise ValueError(f"cost has {n} rows, the model has {compiled.n_nodes} nodes")
    segment_of_col = np.repeat(
        np.arange(segment_offsets.size), np.diff(np.append(segment_offsets, n_cols))
    )
    end = np.empty((n + 2, n_cols), dtype=np.float64)
    end[compiled.zero_row] = 0.0
    end[compiled.void_row] = -np.inf
    starts = np.empty((n, n_cols), dtype=np.float64) if record_timeline else None
    earliest = np.full(n_cols, np.inf)

    for level in compiled.levels:
        gathered = end[level.deps]
        start = gathered[:, 0] if gathered.shape[1] == 1 else gathered.max(axis=1)
        if delay is not None:
            start += delay[level.ops]
        np.minimum(earliest, start.min(axis=0), out=earliest)
        if starts is not None:
            starts[level.ops] = start
        p = level.n_plain
        if p:
            plain = level.ops[:p]
            end[plain] = start[:p] + cost[plain]
        if p < level.ops.size:
            group_start = np.maximum.reduceat(start[p:], level.group_offsets, axis=0)
            if level.any_synced:
                synced_start = np.maximum.reduceat(
                    group_start[level.synced], segment_offsets, axis=1
                )
                group_start[level.synced] = synced_start[:, segment_of_col]
            members = level.ops[p:]
            end[members] = group_start[level.member_group] + cost[members]

    latest = end[:n].max(axis=0)
    step_time = np.maximum.reduceat(latest, segment_offsets) - np.minimum.reduceat(
        earliest, segment_offsets
    )
    timeline = Timeline(start=starts, end=end[:n].copy()) if starts is not None else None
    return SimulationResult(step_time=step_time, timeline=timeline)
