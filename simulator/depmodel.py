"""Dependency model of one training step, inferred from a reference slice of the trace.

The model says, for every op name (optype, seq, stage), which ops must end before it can
start, and which ops form a communication group (they start together and end at the group
start plus their own transfer time). It is inferred once, from dp rank 0 in the first step,
and assumed to hold for every step and DP rank, following docs/whatif.md §3 rule by rule.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from lagscope.simulator import optypes as ot
from lagscope.simulator.trace import TraceError

if TYPE_CHECKING:
    from lagscope.simulator.engine import CompiledModel

#: Tolerance (s) when deciding whether a p2p op lies outside the compute span (no-op).
P2P_NOOP_TOLERANCE_S = 5e-5
#: Tolerance (s) when deciding which computes ended before a gradient bucket or an input
#: wait started: the hooks that launch them fire just around the compute's recorded end.
LAUNCH_TOLERANCE_S = 1e-3


@dataclass(frozen=True)
class OpName:
    """One op of one pipeline stage, shared by every (step, DP rank) instance."""

    stage: int
    optype: str
    seq: int

    def __str__(self) -> str:
        return f"{self.optype}_{self.seq}_{self.stage}"


@dataclass(frozen=True)
class CommGroup:
    """Ops that start together: the group starts when its last member is posted."""

    members: tuple[int, ...]
    #: A DP-synchronized group also waits for the same group on every DP rank.
    dp_synchronized: bool


@dataclass(frozen=True)
class DependencyModel:
    """What must end before each op of a step starts: the ops of one step (its nodes), their
    dependencies and collective groups, shared by every step of the job."""

    nodes: tuple[OpName, ...]
    #: deps[i] = node indices that must end before node i starts (sorted, unique).
    deps: tuple[tuple[int, ...], ...]
    groups: tuple[CommGroup, ...]
    #: group_of[i] = index into `groups`, or -1 for an op that is not communication.
    group_of: np.ndarray
    #: p2p ops recognised as no-ops (spurious records, or peers that do not exist).
    noop_nodes: frozenset[int]
    overlapped_dp: bool
    has_dp_comm: bool
    #: Topological level of every node (comm groups contracted); computed when absent.
    level: np.ndarray | None = None
    #: For every node, the op of its stage that the worker ran or waited on last before it
    #: (own work or a p2p transfer that began before it and ended last by its start, in the
    #: reference slice), -1 for none: the worker's order of work, which dependencies alone
    #: do not say (a 1F1B stage posts a backward's receive after the next forward, on
    #: which the receive does not depend). None in a model built without a slice.
    host_predecessor: np.ndarray | None = None
    #: For every DP collective, the worker's own-work op of its stage that began last at or
    #: before it in the reference slice, -1 for none: where that op still runs when the node
    #: starts, the worker launched the node from inside it (DDP launches a gradient
    #: bucket's all-reduce from the backward's hook), so no host time went before the
    #: node, and the node moves with that op. None in a model built without a slice.
    host_container: np.ndarray | None = None

    @property
    def n_nodes(self) -> int:
        return len(self.nodes)

    @property
    def n_edges(self) -> int:
        return sum(len(d) for d in self.deps)

    def node_stage(self) -> np.ndarray:
        """Stage of every node (read-only: it is shared by every caller)."""
        return self._node_stage

    def node_optypes(self) -> list[str]:
        """Op type of every node (shared by every caller: do not modify)."""
        return self._node_optypes

    # A streamed job asks for these for every step; the model never changes.
    @cached_property
    def _node_stage(self) -> np.ndarray:
        stages = np.fromiter((n.stage for n in self.nodes), dtype=np.int32, count=self.n_nodes)
        stages.flags.writeable = False
        return stages

    @cached_property
    def _node_optypes(self) -> list[str]:
        return [n.optype for n in self.nodes]

    def nodes_by_stage(
        self, optype: str | None, *, own_work_only: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The nodes of `optype` (None: of every op type; `own_work_only`: only those whose
        duration is the worker's own work) in stage order (stable), the position of each
        stage's first among them, and those stages: what sums a per-node quantity per stage
        with one `np.add.reduceat` (read-only: shared by every caller)."""
        key = (optype, own_work_only)
        found = self._nodes_by_stage.get(key)
        if found is None:
            chosen = np.ones(self.n_nodes, dtype=bool)
            if optype is not None:
                chosen &= np.array(self._node_optypes) == optype
            if own_work_only:
                chosen &= self.own_work_nodes
            mine = np.flatnonzero(chosen)
            nodes = mine[np.argsort(self._node_stage[mine], kind="stable")]
            ordered = self._node_stage[nodes]
            firsts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]][: nodes.size])
            found = (nodes, firsts, ordered[firsts])
            for array in found:
                array.flags.writeable = False
            self._nodes_by_stage[key] = found
        return found

    @cached_property
    def _nodes_by_stage(self) -> dict[tuple[str | None, bool], tuple[np.ndarray, ...]]:
        return {}

    @cached_property
    def on_one_clock(self) -> np.ndarray:
        """Nodes with dependencies, all of them on the node's own stage: their launch
        delays compare one worker's clock with itself (read-only: shared by every
        caller)."""
        stages = self._node_stage
        same = np.fromiter(
            (bool(deps) and bool((stages[list(deps)] == stages[node]).all())
             for node, deps in enumerate(self.deps)),
            dtype=bool, count=self.n_nodes,
        )  # fmt: skip
        same.flags.writeable = False
        return same

    @cached_property
    def own_work_nodes(self) -> np.ndarray:
        """Nodes whose duration is the worker's own work, not waiting for peers
        (read-only: it is shared by every caller)."""
        own = np.fromiter(map(ot.is_compute, self._node_optypes), dtype=bool, count=self.n_nodes)
        own.flags.writeable = False
        return own

    @cached_property
    def host_predecessor_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The nodes that have a host predecessor, and those predecessors (read-only:
        shared by every caller; empty where the model has none)."""
        return _rows_having(self.host_predecessor)

    @cached_property
    def host_container_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The nodes that have a host container, and those containers (read-only)."""
        return _rows_having(self.host_container)

    @cached_property
    def root_nodes(self) -> np.ndarray:
        """Nodes without dependencies: a worker's first ops of a step (read-only)."""
        roots = np.fromiter((not d for d in self.deps), dtype=bool, count=self.n_nodes)
        found = np.flatnonzero(roots)
        found.flags.writeable = False
        return found

    @cached_property
    def compiled_in_work_order(self) -> CompiledModel:
        """The model laid out for the engine with each node also after its host
        predecessor and container (`work_order_levels`): for simulations that anchor
        ops to them (`engine.Anchors`)."""
        from lagscope.simulator.engine import compile_model

        return compile_model(dataclasses.replace(self, level=work_order_levels(self)))

    @cached_property
    def compiled(self) -> CompiledModel:
        """The model laid out for the engine, once: the analysis and the diagnosis of one
        trace, and every step of a streamed job, simulate the same model."""
        # Imported here: the engine is built on this module.
        from lagscope.simulator.engine import compile_model

        return compile_model(self)


@dataclass
class _SliceOp:
    """One op of the step the model is inferred from, as the inference orders it."""

    node: int
    optype: str
    seq: int
    start: float
    end: float
    mc: int
    gmc: int

    @property
    def order(self) -> tuple[float, int, str]:
        return (self.start, self.seq, self.optype)


class _Builder:
    def __init__(self, n_stages: int, vpp: int, has_dp_comm: bool, overlapped_dp: bool):
        self.n_stages = n_stages
        self.vpp = vpp
        self.has_dp_comm = has_dp_comm
        self.overlapped_dp = overlapped_dp
        self.nodes: list[OpName] = []
        self.deps: list[set[int]] = []
        self.groups: list[CommGroup] = []
        self.noops: set[int] = set()
        # Per stage, per direction: the non-no-op sends and recvs in stream order.
        self.paired_sends: dict[tuple[int, str], list[int]] = {}
        self.paired_recvs: dict[tuple[int, str], list[int]] = {}

    def add_edge(self, before: _SliceOp | int, after: _SliceOp | int) -> None:
        b = before if isinstance(before, int) else before.node
        a = after if isinstance(after, int) else after.node
        self.deps[a].add(b)

    def chain(self, ops: list[_SliceOp]) -> None:
        for earlier, later in itertools.pairwise(ops):
            self.add_edge(earlier, later)

    def build_stage(self, stage: int, ops: list[_SliceOp]) -> None:
        by_type: dict[str, list[_SliceOp]] = defaultdict(list)
        for op in sorted(ops, key=lambda o: o.order):
            by_type[op.optype].append(op)

        computes = sorted(
            by_type[ot.FORWARD_COMPUTE] + by_type[ot.BACKWARD_COMPUTE], key=lambda o: o.order
        )
        self.chain(computes)
        self._input_edges(computes, by_type[ot.INPUT_WAIT])
        for p2p_type in ot.P2P_OPTYPES:
            self.chain(by_type[p2p_type])
        for direction in ("forward", "backward"):
            self._match_p2p(stage, direction, by_type)
        self._first_backward_rule(computes, by_type)
        if self.has_dp_comm:
            self._dp_edges(by_type)
        self._tail_chain(stage, computes, by_type)

    def _input_edges(self, computes: list[_SliceOp], waits: list[_SliceOp]) -> None:
        """An input wait (the data loader's next batch) follows the computes that ended
        before it and holds back the first forward compute that starts after it: a rank
        starved by its input pipeline is slow in its own op, not in a launch delay."""
        self.chain(waits)
        forwards = [c for c in computes if c.optype == ot.FORWARD_COMPUTE]
        for wait in waits:
            before = _latest_ended_before(computes, wait.start)
            if before is not None:
                self.add_edge(before, wait)
            after = next(
                (
                    f
                    for f in forwards
                    if f.start > wait.start and f.start >= wait.end - LAUNCH_TOLERANCE_S
                ),
                None,
            )
            if after is not None:
                self.add_edge(wait, after)

    def _match_p2p(self, stage: int, direction: str, by_type: dict[str, list[_SliceOp]]) -> None:
        compute = sorted(by_type[f"{direction}-compute"], key=lambda o: o.seq)
        sends = by_type[f"{direction}-send"]
        recvs = by_type[f"{direction}-recv"]
        if not compute:
            if sends or recvs:
                raise TraceError(
                    f"stage {stage}: {direction} p2p ops without any {direction}-compute"
                )
            self.paired_sends[stage, direction] = []
            self.paired_recvs[stage, direction] = []
            return
        latest_start = max(o.start for o in compute)
        earliest_end = min(o.end for o in compute)
        live_recvs = [r for r in recvs if r.start <= latest_start + P2P_NOOP_TOLERANCE_S]
        live_sends = [s for s in sends if s.end >= earliest_end - P2P_NOOP_TOLERANCE_S]
        live_nodes = {o.node for o in live_recvs} | {o.node for o in live_sends}
        self.noops.update(o.node for o in recvs + sends if o.node not in live_nodes)

        peer_offset = {"send": 1, "recv": -1} if direction == "forward" else {"send": -1, "recv": 1}
        paired: dict[str, list[int]] = {"send": [], "recv": []}
        for kind, live in (("send", live_sends), ("recv", live_recvs)):
            first_compute = self._match_offset(stage, direction, kind, len(live), len(compute))
            for k, op in enumerate(live):
                j = k + first_compute
                matched = compute[j]
                if kind == "send":
                    self.add_edge(matched, op)
                else:
                    self.add_edge(op, matched)
                    if j >= 1:
                        self.add_edge(compute[j - 1], op)
                peer_gmc = matched.gmc + peer_offset[kind]
                if not 0 <= peer_gmc < self.vpp * self.n_stages:
                    self.noops.add(op.node)
                else:
                    paired[kind].append(op.node)
        self.paired_sends[stage, direction] = paired["send"]
        self.paired_recvs[stage, direction] = paired["recv"]

    def _match_offset(self, stage: int, direction: str, kind: str, n_p2p: int, n_comp: int) -> int:
        if n_p2p in (0, n_comp):
            return 0
        if n_p2p == n_comp - 1 and stage in (0, self.n_stages - 1):
            return 1 if kind == "recv" else 0
        raise TraceError(
            f"stage {stage}: {n_p2p} {direction}-{kind} op(s) cannot be matched to "
            f"{n_comp} {direction}-compute op(s) (expected {n_comp}, or {n_comp - 1} on the "
            f"first/last stage, or none)"
        )

    def _first_backward_rule(
        self, computes: list[_SliceOp], by_type: dict[str, list[_SliceOp]]
    ) -> None:
        first_bwd = next(
            (i for i, op in enumerate(computes) if op.optype == ot.BACKWARD_COMPUTE), None
        )
        if first_bwd is None or first_bwd < 2:
            return
        anchor = computes[first_bwd - 2]
        for p2p_type in (ot.BACKWARD_RECV, ot.BACKWARD_SEND):
            first = next((o for o in by_type[p2p_type] if o.seq == 0), None)
            if first is not None:
                self.add_edge(anchor, first)

    def _dp_edges(self, by_type: dict[str, list[_SliceOp]]) -> None:
        gathers = by_type[ot.PARAMS_ALL_GATHER]
        scatters = by_type[ot.GRADS_REDUCE_SCATTER]
        self.chain(sorted(gathers + scatters, key=lambda o: o.order))
        forwards = by_type[ot.FORWARD_COMPUTE]
        for chunk in sorted({o.mc for o in gathers}):
            chunk_forwards = [o for o in forwards if o.mc == chunk]
            if not chunk_forwards:
                continue
            first_forward = min(chunk_forwards, key=lambda o: o.order)
            # The parameters gathered before the chunk's forward began (Megatron's
            # distributed optimizer); FSDP gathers each block's inside the forward and the
            # backward, from their hooks, which hold up nothing the model places before them.
            before = [
                o
                for o in gathers
                if o.mc == chunk and o.end <= first_forward.start + LAUNCH_TOLERANCE_S
            ]
            if before:
                self.add_edge(max(before, key=lambda o: o.seq), first_forward)
        if self.overlapped_dp:
            backwards = by_type[ot.BACKWARD_COMPUTE]
            for chunk in sorted({o.mc for o in scatters}):
                chunk_backwards = [o for o in backwards if o.mc == chunk]
                if chunk_backwards:
                    first_scatter = min(
                        (o for o in scatters if o.mc == chunk), key=lambda o: o.order
                    )
                    self.add_edge(max(chunk_backwards, key=lambda o: o.end), first_scatter)

    def _tail_chain(
        self, stage: int, computes: list[_SliceOp], by_type: dict[str, list[_SliceOp]]
    ) -> None:
        def first(optype: str) -> list[_SliceOp]:
            return by_type[optype][:1]

        last_compute = [max(computes, key=lambda o: o.end)] if computes else []
        gc_anchor = by_type[ot.GC][-1:]
        embedding = first(ot.EMBEDDING_GRADS_ALL_REDUCE) if stage in (0, self.n_stages - 1) else []
        head = last_compute + gc_anchor
        before_middle = head + first(ot.LAYERNORM_GRADS_ALL_REDUCE) + embedding
        after_middle = first(ot.OPTIMIZER_CLIP_MAIN_GRAD) + first(ot.OPTIMIZER)
        if self.has_dp_comm and self.overlapped_dp:
            scatters = by_type[ot.GRADS_REDUCE_SCATTER]
            layernorm = first(ot.LAYERNORM_GRADS_ALL_REDUCE)
            if scatters and layernorm:
                self.add_edge(scatters[-1], layernorm[0])
            buckets = by_type[ot.SEPARATE_GRADS_ALL_REDUCE]
            reductions = before_middle[len(head) :]
            if _reduced_first(buckets, reductions, computes):
                # Megatron-core's `finalize_model_grads` waits for the DP gradient sync
                # first and all-reduces the layernorm and embedding gradients after it: the
                # chain as the job ran it, or their launch delays hold the sync's wait.
                before_middle, after_middle = head, reductions + after_middle
            middle = buckets[:1]
            if len(buckets) > 1:
                middle = self._bucket_edges(computes, buckets, before_middle[-1:], after_middle[:1])
        elif self.has_dp_comm:
            middle = by_type[ot.GRADS_REDUCE_SCATTER]
        else:
            middle = []
        self.chain(before_middle + middle + after_middle)

    def _bucket_edges(
        self,
        computes: list[_SliceOp],
        buckets: list[_SliceOp],
        before: list[_SliceOp],
        after: list[_SliceOp],
    ) -> list[_SliceOp]:
        """Several gradient buckets, one all-reduce each (DDP): a bucket launched while
        backward computes still ran follows the latest compute that had ended (its
        gradients were ready then); the buckets launched after the last compute follow
        the tail before them, like a single all-reduce. Every bucket precedes what comes
        after (clip, optimizer). Buckets are not chained to one another: a bucket queued
        behind another already has the wait in its measured transfer time.

        Returns the tail's middle: the first late bucket (the chain links it)."""
        last_end = max((c.end for c in computes), default=-np.inf)
        late = [b for b in buckets if b.start >= last_end - LAUNCH_TOLERANCE_S]
        for bucket in buckets:
            if bucket in late[:1]:
                continue
            if bucket in late:
                predecessor = before[0] if before else None
            else:
                predecessor = _latest_ended_before(computes, bucket.start)
            if predecessor is not None:
                self.add_edge(predecessor, bucket)
            if after:
                self.add_edge(bucket, after[0])
        return late[:1]

    def build_groups(self, stage_ops: dict[int, list[_SliceOp]]) -> None:
        for stage in range(self.n_stages):
            for direction, step in (("forward", 1), ("backward", -1)):
                sends = self.paired_sends.get((stage, direction), [])
                peer = (stage + step) % self.n_stages
                recvs = self.paired_recvs.get((peer, direction), [])
                if len(sends) != len(recvs):
                    raise TraceError(
                        f"{direction}-send on stage {stage} has {len(sends)} op(s) to pair but "
                        f"{direction}-recv on stage {peer} has {len(recvs)}"
                    )
                for send, recv in zip(sends, recvs, strict=True):
                    self.groups.append(CommGroup((send, recv), dp_synchronized=False))
        for node in sorted(self.noops):
            self.groups.append(CommGroup((node,), dp_synchronized=False))
        if self.has_dp_comm:
            for ops in stage_ops.values():
                for op in ops:
                    if op.optype in ot.DP_OPTYPES:
                        self.groups.append(CommGroup((op.node,), dp_synchronized=True))

        def seq0(stage: int, optype: str) -> list[int]:
            return [o.node for o in stage_ops.get(stage, []) if o.optype == optype and o.seq == 0]

        ends = sorted({0, self.n_stages - 1})
        embedding = [n for s in ends for n in seq0(s, ot.EMBEDDING_GRADS_ALL_REDUCE)]
        if embedding:
            self.groups.append(CommGroup(tuple(embedding), dp_synchronized=False))
        clip = [n for s in range(self.n_stages) for n in seq0(s, ot.OPTIMIZER_CLIP_MAIN_GRAD)]
        if clip:
            self.groups.append(CommGroup(tuple(clip), dp_synchronized=True))


def _rows_having(links: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The nodes whose link (a per-node node index, -1 for none) is set, and their
    linked nodes; read-only, empty where the model has no such links."""
    rows = np.flatnonzero(links >= 0) if links is not None else np.empty(0, np.int64)
    found = (rows, links[rows] if links is not None else rows.copy())
    for array in found:
        array.flags.writeable = False
    return found


def _reduced_first(
    buckets: list[_SliceOp], reductions: list[_SliceOp], computes: list[_SliceOp]
) -> bool:
    """Whether the slice ran its DP gradient sync (the buckets launched after the last
    compute) before its other end-of-step all-reduces (layernorm, embedding)."""
    last_end = max((c.end for c in computes), default=-np.inf)
    late = [b for b in buckets if b.start >= last_end - LAUNCH_TOLERANCE_S]
    return bool(late and reductions and min(r.start for r in reductions) >= late[0].start)


def _latest_ended_before(ops: list[_SliceOp], time: float) -> _SliceOp | None:
    """The op that began before `time` and ended last at or before it (within
    `LAUNCH_TOLERANCE_S`: sub-millisecond ops on a CPU can end inside the tolerance of an
    op that follows them, never of one that precedes them)."""
    ended = [o for o in ops if o.start < time and o.end <= time + LAUNCH_TOLERANCE_S]
    return max(ended, key=lambda o: o.end) if ended else None


def _host_predecessors(stage_ops: dict[int, list[_SliceOp]], n_nodes: int) -> np.ndarray:
    """`DependencyModel.host_predecessor` from the slice's ops of each stage: for each op,
    `_latest_ended_before` among the stage's own-work and p2p ops (the op itself left
    out). A p2p op ends where the worker's wait for it returned (gloo) or on its stream
    (CUDA events); a collective's end can be stamped by another thread's callback at any
    time, a host stall included, so it is no predecessor."""
    found = np.full(n_nodes, -1, dtype=np.int64)
    for ops in stage_ops.values():
        candidates = [o for o in ops if ot.is_compute(o.optype) or o.optype in ot.P2P_OPTYPES]
        if not candidates:
            continue
        before_node = np.array([o.node for o in candidates])
        before_start = np.array([o.start for o in candidates])
        before_end = np.array([o.end for o in candidates])
        node = np.array([o.node for o in ops])
        start = np.array([o.start for o in ops])[:, None]
        ended = (
            (before_start < start)
            & (before_end <= start + LAUNCH_TOLERANCE_S)
            & (before_node[None, :] != node[:, None])
        )
        latest = np.where(ended, before_end, -np.inf).argmax(axis=1)
        has = ended.any(axis=1)
        found[node[has]] = before_node[latest[has]]
    found.flags.writeable = False
    return found


def _host_containers(stage_ops: dict[int, list[_SliceOp]], n_nodes: int) -> np.ndarray:
    """`DependencyModel.host_container` from the slice's ops of each stage: for each DP
    collective, the stage's own-work op that began last at or before it. Only DP
    collectives: they are what a framework launches from a compute's hooks (DDP's buckets
    from the backward); a pipeline transfer found inside a compute was posted by a host
    that had launched the compute's kernels and moved on, its launch delay its own."""
    found = np.full(n_nodes, -1, dtype=np.int64)
    for all_ops in stage_ops.values():
        own = [o for o in all_ops if ot.is_compute(o.optype)]
        ops = [o for o in all_ops if o.optype in ot.DP_OPTYPES]
        if not own or not ops:
            continue
        own_node = np.array([o.node for o in own])
        own_start = np.array([o.start for o in own])
        node = np.array([o.node for o in ops])
        began = (own_start[None, :] <= np.array([o.start for o in ops])[:, None]) & (
            own_node[None, :] != node[:, None]
        )
        latest = np.where(began, own_start, -np.inf).argmax(axis=1)
        has = began.any(axis=1)
        found[node[has]] = own_node[latest[has]]
    found.flags.writeable = False
    return found


def infer_dependency_model(
    stage: np.ndarray,
    optype: list[str],
    seq: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    mc: np.ndarray,
    gmc: np.ndarray,
    *,
    n_stages: int,
    vpp: int,
    has_dp_comm: bool,
    overlapped_dp: bool,
) -> DependencyModel:
    """Infer the model from the rows of one reference slice (one DP rank, one step).

    Node i of the model is row i of the slice, so callers map rows to nodes directly.
    """
    builder = _Builder(n_stages, vpp, has_dp_comm, overlapped_dp)
    stage_ops: dict[int, list[_SliceOp]] = defaultdict(list)
    for i in range(len(optype)):
        builder.nodes.append(OpName(int(stage[i]), optype[i], int(seq[i])))
        builder.deps.append(set())
        stage_ops[int(stage[i])].append(
            _SliceOp(
                i, optype[i], int(seq[i]), float(start[i]), float(end[i]), int(mc[i]), int(gmc[i])
            )
        )
    for s in sorted(stage_ops):
        builder.build_stage(s, stage_ops[s])
    builder.build_groups(stage_ops)

    group_of = np.full(len(builder.nodes), -1, dtype=np.int64)
    for g, group in enumerate(builder.groups):
        for member in group.members:
            if group_of[member] != -1:
                raise TraceError(f"op {builder.nodes[member]} belongs to two comm groups")
            group_of[member] = g
    model = DependencyModel(
        nodes=tuple(builder.nodes),
        deps=tuple(tuple(sorted(d)) for d in builder.deps),
        groups=tuple(builder.groups),
        group_of=group_of,
        noop_nodes=frozenset(builder.noops),
        overlapped_dp=overlapped_dp,
        has_dp_comm=has_dp_comm,
        host_predecessor=_host_predecessors(stage_ops, len(builder.nodes)),
        host_container=_host_containers(stage_ops, len(builder.nodes)),
    )
    # Raises on a cycle, naming the ops in it.
    return dataclasses.replace(model, level=topological_levels(model))


def topological_levels(model: DependencyModel) -> np.ndarray:
    """Level of every node after contracting each comm group to one unit.

    A unit's level is one more than the deepest level among its members' dependencies, so
    all members of a group share a level and every dependency sits on an earlier level.
    Raises `TraceError` naming the ops on a cycle.
    """
    if model.level is not None:
        return model.level
    level, stuck = _unit_levels(model, [])
    if level is None:
        names = ", ".join(str(model.nodes[m]) for m in stuck[:12])
        more = f" and {len(stuck) - 12} more" if len(stuck) > 12 else ""
        raise TraceError(f"dependency model has a cycle; ops that can never start: {names}{more}")
    return level


def work_order_levels(model: DependencyModel) -> np.ndarray:
    """`topological_levels` with every node also after its host predecessor and its host
    container (`DependencyModel.host_predecessor`, `host_container`), so that the engine
    has ended them when it starts the node (`engine.Anchors`). An ordering that would
    close a cycle (a bucket launched before the backward it follows in the model ended) is
    left out."""
    extra = [
        (int(before), int(node))
        for links in (model.host_predecessor_rows, model.host_container_rows)
        for node, before in zip(*links, strict=True)
    ]
    while True:
        level, stuck = _unit_levels(model, extra)
        if level is not None:
            return level
        on_cycle = set(stuck)
        kept = [(b, n) for b, n in extra if not (b in on_cycle and n in on_cycle)]
        if len(kept) == len(extra):
            return topological_levels(model)  # the cycle is the model's own: it says so
        extra = kept


def _longest_chains(deps: list[set[int]], alive: list[bool]) -> tuple[list[int], list[int], int]:
    """Kahn's order over the `alive` units: each unit's level (its longest chain of
    dependencies), the dependencies each still waits for (> 0: on or after a cycle), and
    how many units were ordered."""
    successors: list[list[int]] = [[] for _ in deps]
    for u, before in enumerate(deps):
        for d in before:
            successors[d].append(u)
    remaining = [len(d) for d in deps]
    level = [0] * len(deps)
    ready = [u for u, is_alive in enumerate(alive) if is_alive and remaining[u] == 0]
    done = 0
    while ready:
        u = ready.pop()
        done += 1
        for v in successors[u]:
            if level[u] + 1 > level[v]:
                level[v] = level[u] + 1
            remaining[v] -= 1
            if remaining[v] == 0:
                ready.append(v)
    return level, remaining, done


def _unit_levels(
    model: DependencyModel, extra: list[tuple[int, int]]
) -> tuple[np.ndarray | None, list[int]]:
    """Node levels (comm groups contracted) over the model's edges and `extra` ones
    (before, node); None and the nodes that can never start where there is a cycle."""
    n = model.n_nodes
    unit_of = list(range(n))
    members: list[list[int]] = [[i] for i in range(n)]
    for g, group in enumerate(model.groups):
        for m in group.members:
            unit_of[m] = n + g
        members.append(list(group.members))
    n_units = n + len(model.groups)
    alive = [bool(members[u]) and (u >= n or unit_of[u] == u) for u in range(n_units)]
    unit_deps: list[set[int]] = [set() for _ in range(n_units)]
    for u in range(n_units):
        if alive[u]:
            for m in members[u]:
                unit_deps[u].update(unit_of[d] for d in model.deps[m])
            if u in unit_deps[u]:
                raise TraceError(
                    "dependency cycle inside one comm group: "
                    + ", ".join(str(model.nodes[m]) for m in members[u])
                )
    for before, node in extra:
        if unit_of[before] != unit_of[node]:
            unit_deps[unit_of[node]].add(unit_of[before])
    level, remaining, done = _longest_chains(unit_deps, alive)
    if done != sum(alive):
        stuck = [m for u in range(n_units) if alive[u] and remaining[u] > 0 for m in members[u]]
        return None, stuck
    return np.array([level[unit_of[i]] for i in range(n)], dtype=np.int64), []
