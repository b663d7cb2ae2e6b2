"""From a validated trace to dense per-op arrays the timeline engine can simulate.

Every op name of the dependency model has exactly one instance per (step, DP rank), so the
trace becomes arrays indexed [node, step, dp]. Here too the measured inputs of the what-if
analysis are derived (docs/whatif.md §2): the transfer time of communication ops (own end minus
the latest start of the group) and the launch delay of every op (start minus the latest end
of its dependencies).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import numpy as np

from lagscope.simulator import optypes as ot
from lagscope.simulator.depmodel import (
    LAUNCH_TOLERANCE_S,
    DependencyModel,
    infer_dependency_model,
)
from lagscope.simulator.trace import (
    JobMeta,
    Trace,
    TraceError,
    ids_and_index,
    small_ints_present,
)

#: Measured transfers and launch delays at or below this (s) are clock noise and become 0;
#: smaller negatives are kept, as the reference analyzer does (which clips every launch
#: delay; lagscope keeps those measured on one clock, `_launch_delays`).
NEGATIVE_CLIP_S = -0.01
#: An async send (isend) whose completion is seen more than this (s) after its peer's
#: receive completed was observed late (its Work waited at the end of the step), not
#: slow: the data had arrived. Its end becomes the receive's. The reference traces'
#: sends end at most 2.6 ms after their receives, so they are untouched.
LATE_SEND_S = 0.01


@dataclass(frozen=True)
class DroppedStep:
    """A step the analysis leaves out, and why."""

    step: int
    reason: str


@dataclass(frozen=True)
class PreparedTrace:
    """Dense inputs of the simulation. Arrays are [node, step, dp] unless noted."""

    model: DependencyModel
    meta: JobMeta
    steps: np.ndarray
    n_dp: int
    start: np.ndarray
    duration: np.ndarray
    #: What the simulator adds to an op's start (plain op) or group start (comm op):
    #: the duration of a plain op, the transfer time of a comm-group member.
    cost: np.ndarray
    launch_delay: np.ndarray
    #: Measured step time per step: max end - min start over all its rows.
    actual_step_time: np.ndarray
    #: Global rank of each (stage, dp) worker, [stage, dp]; -1 if unknown.
    worker_rank: np.ndarray
    dropped_steps: tuple[DroppedStep, ...] = field(default=())
    source: str = "<trace>"
    #: Seconds of recorded GC pause (the timer's GC probe) inside each op, [node, step,
    #: dp]; None when no pause was recorded (the probe off, or no collection ran).
    gc_pause: np.ndarray | None = None
    #: Seconds of recorded GC pause inside each op's host gap (`host_gaps`: before the op,
    #: while its host had yet to start it), [node, step, dp]; None where no pause fell in
    #: a gap. Where ops are timed on the device (CUDA events) a host's collection stalls
    #: its launches, not its kernels, and falls here.
    gc_gap_pause: np.ndarray | None = None
    #: When each worker ended its previous step (its last op's end), in seconds from this
    #: step's origin, [step, stage, dp]: negative when it ended before any worker began
    #: this step, positive when its peers began this step while it still ran the last
    #: (steps overlap). NaN where the previous step is not known (`with_entries`).
    entry: np.ndarray | None = None

    @property
    def n_steps(self) -> int:
        return int(self.steps.shape[0])

    @property
    def n_stages(self) -> int:
        return int(self.worker_rank.shape[0])

    @property
    def node_optype(self) -> list[str]:
        return self.model.node_optypes()

    def stage_sums(
        self, values: np.ndarray, optype: str | None = None, *, own_work_only: bool = False
    ) -> np.ndarray:
        """[step, stage, dp]: `values` ([node, step, dp]) summed over each worker's nodes of
        `optype` (None: every op type; `own_work_only`: only its own work). Summed in node
        order, as `np.add.at` would, at a fraction of its cost: a streamed step asks for
        these several times."""
        nodes, firsts, stages = self.model.nodes_by_stage(optype, own_work_only=own_work_only)
        out = np.zeros((self.n_steps, self.n_stages, self.n_dp))
        if nodes.size:
            sums = np.add.reduceat(values[nodes].astype(np.float64), firsts, axis=0)
            out[:, stages] = sums.transpose(1, 0, 2)
        return out

    def select_steps(self, keep: np.ndarray) -> PreparedTrace:
        """Keep some steps (a boolean mask or indices), with inputs already derived."""
        idx = np.flatnonzero(keep) if np.asarray(keep).dtype == bool else np.asarray(keep)
        return PreparedTrace(
            model=self.model,
            meta=self.meta,
            steps=self.steps[idx],
            n_dp=self.n_dp,
            start=self.start[:, idx],
            duration=self.duration[:, idx],
            cost=self.cost[:, idx],
            launch_delay=self.launch_delay[:, idx],
            actual_step_time=self.actual_step_time[idx],
            worker_rank=self.worker_rank,
            dropped_steps=self.dropped_steps,
            source=self.source,
            gc_pause=None if self.gc_pause is None else self.gc_pause[:, idx],
            gc_gap_pause=None if self.gc_gap_pause is None else self.gc_gap_pause[:, idx],
            entry=None if self.entry is None else self.entry[idx],
        )

    def select_dp(self, dp_ranks: np.ndarray) -> PreparedTrace:
        """Keep some DP ranks (renumbered 0..k-1 in the given order)."""
        dp_ranks = np.asarray(dp_ranks)
        return PreparedTrace(
            model=self.model,
            meta=self.meta,
            steps=self.steps,
            n_dp=int(dp_ranks.size),
            start=self.start[:, :, dp_ranks],
            duration=self.duration[:, :, dp_ranks],
            cost=self.cost[:, :, dp_ranks],
            launch_delay=self.launch_delay[:, :, dp_ranks],
            actual_step_time=self.actual_step_time,
            worker_rank=self.worker_rank[:, dp_ranks],
            dropped_steps=self.dropped_steps,
            source=self.source,
            gc_pause=None if self.gc_pause is None else self.gc_pause[:, :, dp_ranks],
            gc_gap_pause=None if self.gc_gap_pause is None else self.gc_gap_pause[:, :, dp_ranks],
            entry=None if self.entry is None else self.entry[:, :, dp_ranks],
        )

    @property
    def periods(self) -> np.ndarray:
        """[step] each step's period: from the moment the last worker ended the previous
        step to the moment the last one ended this one, what the job pays for a step
        when steps overlap; NaN where the previous step is not known."""
        if self.entry is None:
            return np.full(self.n_steps, np.nan)
        return self.actual_end() - self.entry.max(axis=(1, 2)).astype(np.float64)

    def actual_end(self) -> np.ndarray:
        """[step] when the step's last op ended, from its origin."""
        return (self.start + self.duration).max(axis=(0, 2)).astype(np.float64)

    def worker_ends(self) -> np.ndarray:
        """[step, stage, dp] when each worker's last op of the step ended, from the
        step's origin."""
        ends = np.full((self.n_steps, self.n_stages, self.n_dp), -np.inf)
        end = (self.start + self.duration).astype(np.float64)
        nodes, firsts, stages = self.model.nodes_by_stage(None)
        if nodes.size:
            ends[:, stages] = np.maximum.reduceat(end[nodes], firsts, axis=0).transpose(1, 0, 2)
        return ends


def concat_steps(parts: list[PreparedTrace]) -> PreparedTrace:
    """Steps prepared separately (same model and DP ranks) as one prepared trace."""
    first = parts[0]
    for part in parts[1:]:
        if part.model.nodes != first.model.nodes or part.n_dp != first.n_dp:
            raise TraceError(
                f"{part.source}: cannot join steps with different dependency models or DP sizes"
            )

    def joined(name: str) -> np.ndarray:
        return np.concatenate([getattr(p, name) for p in parts], axis=1)

    def joined_entries() -> np.ndarray | None:
        if all(p.entry is None for p in parts):
            return None
        return np.concatenate(
            [
                np.full((p.n_steps, p.n_stages, p.n_dp), np.nan, np.float32)
                if p.entry is None
                else p.entry
                for p in parts
            ]
        )

    def joined_pauses(name: str) -> np.ndarray | None:
        # A part without pauses had none recorded: zeros beside the parts that had some.
        if all(getattr(p, name) is None for p in parts):
            return None
        return np.concatenate(
            [
                np.zeros_like(p.duration) if getattr(p, name) is None else getattr(p, name)
                for p in parts
            ],
            axis=1,
        )

    return PreparedTrace(
        model=first.model,
        meta=first.meta,
        steps=np.concatenate([p.steps for p in parts]),
        n_dp=first.n_dp,
        start=joined("start"),
        duration=joined("duration"),
        cost=joined("cost"),
        launch_delay=joined("launch_delay"),
        actual_step_time=np.concatenate([p.actual_step_time for p in parts]),
        worker_rank=first.worker_rank,
        dropped_steps=tuple(d for p in parts for d in p.dropped_steps),
        source=first.source,
        gc_pause=joined_pauses("gc_pause"),
        gc_gap_pause=joined_pauses("gc_gap_pause"),
        entry=joined_entries(),
    )


def with_entries(
    prepared: PreparedTrace, previous: PreparedTrace | None, previous_origin_s: float
) -> PreparedTrace:
    """`prepared` (one step) with when each worker ended `previous` (the step before it,
    with the same DP ranks), whose origin was `previous_origin_s` seconds before this
    step's: what makes its period known (`PreparedTrace.periods`). Without `previous`
    the entries stay unknown.

    >>> from lagscope.simulator.generate import JobSpec, generate_job
    >>> job = generate_job(JobSpec(dp=2, pp=2, microbatches=4, steps=2, seed=1))
    >>> steps = prepare(job.trace, job.meta)
    >>> first, second = steps.select_steps([0]), steps.select_steps([1])
    >>> later = with_entries(second, first, float(first.actual_step_time[0]) + 0.01)
    >>> round(float(later.periods[0] - second.actual_step_time[0]), 6)
    0.01
    """
    if previous is None or previous.n_dp != prepared.n_dp or prepared.n_steps != 1:
        return prepared
    entry = previous.worker_ends()[-1:] - previous_origin_s
    return dataclasses.replace(prepared, entry=entry.astype(np.float32))


def prepare(
    trace: Trace,
    meta: JobMeta,
    *,
    skip_incomplete_steps: bool = False,
    model: DependencyModel | None = None,
) -> PreparedTrace:
    """Validate the trace's structure, infer the dependency model, derive inputs.

    With `model` (inferred earlier, e.g. from a job's first step), the trace is mapped
    onto it instead: streaming analyses infer once per job, not once per step.

    Over 60 lines for its one constructor call of 17 fields; every stage before it is a
    call of its own (rows to cells, incomplete steps, late sends, transfers, delays).
    """
    trace, pauses = _split_side_rows(trace)
    if trace.n_rows == 0:
        raise TraceError(f"{trace.source}: the trace has no rows (other than GC pauses)")
    src = trace.source
    step_ids, step_idx = ids_and_index(trace.step)
    n_dp = int(trace.dp_rank.max()) + 1
    n_stages = int(trace.stage.max()) + 1
    _check_layout(trace, meta, n_dp, n_stages)

    # Times from each step's first op: steps are compared, not their wall-clock times.
    origin = np.full(step_ids.size, np.inf, dtype=np.float32)
    np.minimum.at(origin, step_idx, trace.start_ts)
    start = (trace.start_ts - origin[step_idx]).astype(np.float32)
    end = (start + trace.duration).astype(np.float32)
    if model is None:
        model = _infer_from_first_step(trace, meta, step_ids[0], start, end, n_dp, n_stages)
    else:
        _check_model_stages(model, n_stages, src)
    n_steps = step_ids.size
    flat, missing = _cells_of_rows(trace, model, step_idx, n_steps, n_dp)
    dropped = _incomplete_steps(missing, model, step_ids, src, skip_incomplete_steps)
    d_start, d_duration, d_end = (
        _dense(values, flat, (model.n_nodes, n_steps, n_dp))
        for values in (start, trace.duration, end)
    )
    step_span = np.full(n_steps, -np.inf, dtype=np.float32)
    np.maximum.at(step_span, step_idx, end)
    worker_rank = np.full((n_stages, n_dp), -1, dtype=np.int64)
    worker_rank[trace.stage, trace.dp_rank] = trace.rank

    d_end = _settle_late_sends(model, d_end)
    # A collective's or transfer's cost is its transfer time, every other op's its duration.
    transfer = _transfer_times(model, d_start, d_end)
    is_member = model.group_of >= 0
    cost = np.where(is_member[:, None, None], transfer, d_duration).astype(np.float32)
    prepared = PreparedTrace(
        model=model,
        meta=meta,
        steps=step_ids,
        n_dp=n_dp,
        start=d_start,
        duration=d_duration,
        cost=cost,
        launch_delay=_launch_delays(model, d_start, d_end),
        actual_step_time=step_span.astype(np.float64),
        worker_rank=worker_rank,
        dropped_steps=tuple(dropped),
        source=src,
        gc_pause=None
        if pauses is None
        else _pause_overlap(model, pauses, step_ids, origin, d_start, d_end),
    )
    if pauses is not None:
        gap_start = d_start - host_gaps(prepared).astype(np.float32)
        in_gaps = _pause_overlap(model, pauses, step_ids, origin, gap_start, d_start)
        # Kept only where a pause fell in a gap: a large job's steps hold one more array
        # of their size otherwise.
        if in_gaps.any():
            prepared = dataclasses.replace(prepared, gc_gap_pause=in_gaps)
    if dropped:
        # Inputs of kept steps do not depend on other steps, so drop after deriving them.
        keep = ~np.isin(step_ids, [d.step for d in dropped])
        prepared = prepared.select_steps(keep)
    return prepared


def _check_model_stages(model: DependencyModel, n_stages: int, src: str) -> None:
    """A dependency model inferred earlier must have the trace's stages."""
    modelled = int(model.node_stage().max(initial=0)) + 1
    if modelled != n_stages:
        raise TraceError(
            f"{src}: the trace has {n_stages} stage(s) but the job's dependency model {modelled}"
        )


def _cells_of_rows(
    trace: Trace, model: DependencyModel, step_idx: np.ndarray, n_steps: int, n_dp: int
) -> tuple[np.ndarray, np.ndarray]:
    """The flat [node, step, dp] cell of every row, and [node, step, dp] True where no
    row was recorded; an op recorded twice is an error."""
    node_of_row = _node_of_each_row(trace, model, trace.source)
    flat = (node_of_row * n_steps + step_idx) * n_dp + trace.dp_rank
    counts = np.bincount(flat, minlength=model.n_nodes * n_steps * n_dp)
    if counts.max() > 1:
        row = int(np.flatnonzero(counts[flat] > 1)[0])
        raise TraceError(f"{trace.source}: op {trace.describe_row(row)} is recorded more than once")
    return flat, (counts == 0).reshape(model.n_nodes, n_steps, n_dp)


def _dense(values: np.ndarray, flat: np.ndarray, shape: tuple[int, int, int]) -> np.ndarray:
    """Row values laid out on the [node, step, dp] grid (0 where nothing was recorded)."""
    out = np.zeros(shape[0] * shape[1] * shape[2], dtype=np.float32)
    out[flat] = values
    return out.reshape(shape)


def _node_of_each_row(trace: Trace, model: DependencyModel, src: str) -> np.ndarray:
    """The dependency-model node of every row, through a sorted (stage, optype, seq) key;
    a row whose op the model does not hold is an error."""
    names = trace.optype_names
    code_of = {name: code for code, name in enumerate(names)}
    max_seq = int(max(trace.seq_id.max(), max((n.seq for n in model.nodes), default=0))) + 1
    node_key = np.array(
        [
            (n.stage * (len(names) + 1) + code_of.get(n.optype, len(names))) * max_seq + n.seq
            for n in model.nodes
        ],
        dtype=np.int64,
    )
    row_key = (trace.stage.astype(np.int64) * (len(names) + 1) + trace.optype) * max_seq
    row_key += trace.seq_id
    by_key = np.argsort(node_key)
    sorted_keys = node_key[by_key]
    position = np.minimum(np.searchsorted(sorted_keys, row_key), sorted_keys.size - 1)
    unknown = sorted_keys[position] != row_key
    if unknown.any():
        row = int(np.flatnonzero(unknown)[0])
        raise TraceError(
            f"{src}: op {trace.describe_row(row)} does not occur on dp 0 in the first step "
            f"the dependency model was inferred from; every worker must run the same ops in "
            f"every step ({int(unknown.sum())} such row(s))"
        )
    return by_key[position]


def _incomplete_steps(
    missing: np.ndarray,
    model: DependencyModel,
    step_ids: np.ndarray,
    src: str,
    skip_incomplete_steps: bool,
) -> list[DroppedStep]:
    """The steps to drop, each with what it lacks (`missing`: [node, step, dp] op
    instances not recorded); an error when they may not be skipped, or are all steps."""
    if not missing.any():
        return []
    bad_steps = np.flatnonzero(missing.any(axis=(0, 2)))
    if not skip_incomplete_steps:
        node, s, dp = (int(v[0]) for v in np.nonzero(missing))
        raise TraceError(
            f"{src}: incomplete step: op {model.nodes[node]} is missing on "
            f"(step {int(step_ids[s])}, dp {dp}, stage {model.nodes[node].stage}); "
            f"{int(missing.sum())} op instance(s) missing in {bad_steps.size} step(s) "
            f"(use --skip-incomplete-steps to analyse the complete steps only)"
        )
    dropped = []
    for s in bad_steps:
        lacking = np.argwhere(missing[:, s, :])
        workers = sorted({(int(dp), model.nodes[n].stage) for n, dp in lacking})
        shown = ", ".join(f"(dp {d}, stage {st})" for d, st in workers[:6])
        more = f" and {len(workers) - 6} more" if len(workers) > 6 else ""
        dropped.append(
            DroppedStep(
                int(step_ids[s]), f"{lacking.shape[0]} op(s) missing on worker(s) {shown}{more}"
            )
        )
    if bad_steps.size == step_ids.size:
        raise TraceError(f"{src}: no complete step to analyse")
    return dropped


def _settle_late_sends(model: DependencyModel, end: np.ndarray) -> np.ndarray:
    """Ends with every late-observed send ended with its peer receive (`LATE_SEND_S`)."""
    pairs = [
        g.members
        for g in model.groups
        if len(g.members) == 2 and model.nodes[g.members[0]].optype.endswith("-send")
    ]
    if not pairs:
        return end
    sends, recvs = (np.array(side, dtype=np.int64) for side in zip(*pairs, strict=True))
    late = end[sends] - end[recvs] > LATE_SEND_S
    if not late.any():
        return end
    settled = end.copy()
    settled[sends] = np.where(late, end[recvs], end[sends])
    return settled


def _split_side_rows(trace: Trace) -> tuple[Trace, Trace | None]:
    """The trace without its side measurements (GC pauses), and those rows (or None)."""
    side_codes = [c for c, name in enumerate(trace.optype_names) if name in ot.SIDE_OPTYPES]
    if not side_codes:
        return trace, None
    side = np.isin(trace.optype, side_codes)
    if not side.any():
        return trace, None
    return trace.select(~side), trace.select(side)


#: Pauses x nodes compared at once when finding which ops a pause falls in.
_PAUSE_CHUNK_CELLS = 4_000_000


def _pause_overlap(
    model: DependencyModel,
    pauses: Trace,
    step_ids: np.ndarray,
    origin: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
) -> np.ndarray:
    """Seconds of GC pause inside every op instance's interval `start`-`end` ([node, step,
    dp]: the op itself, or the host gap before it), [node, step, dp].

    A pause counts toward every op of its worker whose interval it overlaps (a pause
    outside them counts toward none); pauses of steps or workers without ops are dropped.
    """
    _, n_steps, n_dp = start.shape
    out = np.zeros_like(start)
    s_idx = np.minimum(np.searchsorted(step_ids, pauses.step), n_steps - 1)
    known = (step_ids[s_idx] == pauses.step) & (pauses.dp_rank < n_dp)
    node_stage = model.node_stage()
    for stage in np.unique(pauses.stage[known]):
        nodes = np.flatnonzero(node_stage == stage)
        rows = np.flatnonzero(known & (pauses.stage == stage))
        if not nodes.size:
            continue
        chunk = max(1, _PAUSE_CHUNK_CELLS // nodes.size)
        for first in range(0, rows.size, chunk):
            part = rows[first : first + chunk]
            steps, dps = s_idx[part], pauses.dp_rank[part]
            p_start = (pauses.start_ts[part] - origin[steps]).astype(np.float32)
            p_end = p_start + pauses.duration[part]
            op_start = start[nodes][:, steps, dps]
            op_end = end[nodes][:, steps, dps]
            overlap = np.minimum(op_end, p_end) - np.maximum(op_start, p_start)
            np.add.at(
                out,
                (nodes[:, None], steps[None, :], dps[None, :]),
                np.clip(overlap, 0.0, None),
            )
    return out


def _infer_from_first_step(
    trace: Trace,
    meta: JobMeta,
    first_step: int,
    start: np.ndarray,
    end: np.ndarray,
    n_dp: int,
    n_stages: int,
) -> DependencyModel:
    """The dependency model of the reference slice: dp rank 0 in the first step."""
    src = trace.source
    ref = np.flatnonzero((trace.dp_rank == 0) & (trace.step == first_step))
    ref = ref[np.lexsort((trace.seq_id[ref], trace.optype[ref], trace.stage[ref]))]
    key = _op_key(trace, ref)
    if np.any(key[1:] == key[:-1]):
        dup = ref[1:][key[1:] == key[:-1]][0]
        raise TraceError(f"{src}: op {trace.describe_row(int(dup))} is recorded more than once")
    names = trace.optype_names
    overlapped = ot.SEPARATE_GRADS_ALL_REDUCE in {names[c] for c in np.unique(trace.optype)}
    return infer_dependency_model(
        trace.stage[ref],
        [names[c] for c in trace.optype[ref]],
        trace.seq_id[ref],
        start[ref],
        end[ref],
        trace.mc[ref],
        trace.gmc[ref],
        n_stages=n_stages,
        vpp=meta.vpp_size,
        has_dp_comm=n_dp * meta.dsp_size > 1,
        overlapped_dp=overlapped,
    )


def _op_key(trace: Trace, rows: np.ndarray) -> np.ndarray:
    n_codes = len(trace.optype_names)
    max_seq = int(trace.seq_id.max()) + 1
    return (
        trace.stage[rows].astype(np.int64) * n_codes + trace.optype[rows]
    ) * max_seq + trace.seq_id[rows]


def _check_layout(trace: Trace, meta: JobMeta, n_dp: int, n_stages: int) -> None:
    src = trace.source
    for name, n, size in (("dp_rank", n_dp, meta.dp_size), ("stage", n_stages, meta.pp_size)):
        present = small_ints_present(getattr(trace, name))
        if present.size != n:
            absent = sorted(set(range(n)) - set(present.tolist()))
            raise TraceError(f"{src}: {name} values {absent[:8]} have no ops (found 0..{n - 1})")
        if n > size:
            raise TraceError(
                f"{src}: trace has {name} up to {n - 1} but the job metadata says "
                f"{'dp_size' if name == 'dp_rank' else 'pp_size'}={size}"
            )
    chunked = trace.mc >= 0
    if chunked.any() and int(trace.mc[chunked].max()) >= meta.vpp_size:
        row = int(np.flatnonzero(trace.mc >= meta.vpp_size)[0])
        raise TraceError(
            f"{src}: op {trace.describe_row(row)} has model chunk {int(trace.mc[row])} but "
            f"the job metadata says vpp_size={meta.vpp_size}"
        )


def _group_starts(
    model: DependencyModel, start: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Latest member start of every group instance, [member-sorted rows] layout.

    Returns (members sorted by group, group index per member, group start [group, ...]).
    """
    members = np.array([m for g in model.groups for m in g.members], dtype=np.int64)
    sizes = np.array([len(g.members) for g in model.groups], dtype=np.int64)
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    group_start = np.maximum.reduceat(start[members], offsets, axis=0)
    synced = np.array([g.dp_synchronized for g in model.groups], dtype=bool)
    if synced.any():
        group_start[synced] = group_start[synced].max(axis=-1, keepdims=True)
    return members, np.repeat(np.arange(len(sizes)), sizes), group_start


def _transfer_times(model: DependencyModel, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    transfer = np.zeros_like(start)
    if not model.groups:
        return transfer
    members, group_idx, group_start = _group_starts(model, start)
    values = end[members] - group_start[group_idx]
    transfer[members] = np.where(values <= NEGATIVE_CLIP_S, 0.0, values)
    return transfer


@functools.lru_cache(maxsize=16)
def _padded_deps(deps: tuple[tuple[int, ...], ...]) -> tuple[np.ndarray, np.ndarray]:
    """Dependencies as a [node, max deps] index array (-1 = none) and a has-deps mask;
    cached because a streamed job prepares every step against the same model."""
    width = max((len(d) for d in deps), default=0)
    padded = np.array([list(d) + [-1] * (width - len(d)) for d in deps], dtype=np.int64)
    return padded.reshape(len(deps), width), np.array([len(d) > 0 for d in deps])


def _launch_delays(model: DependencyModel, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Each op's start less its latest dependency's end. A negative delay of an op that
    depends on ops of another stage (another clock) at or below NEGATIVE_CLIP_S is clock
    noise and becomes 0; on one clock it is what was measured and is kept: a DDP gradient
    bucket launched from a hook while the backward op that the model puts before it still
    ran (by 16-22 ms on a busy machine, where a 0 replayed that step 17 % slow)."""
    padded, has_deps = _padded_deps(model.deps)
    ready = np.zeros_like(start)
    if padded.shape[1]:
        with_sentinel = np.concatenate([end, np.full((1, *end.shape[1:]), -np.inf, end.dtype)])
        latest = with_sentinel[padded].max(axis=1)
        ready = np.where(has_deps[:, None, None], latest, 0.0).astype(np.float32)
    delay = start - ready
    one_clock = model.on_one_clock.reshape(-1, *([1] * (delay.ndim - 1)))
    noise = (delay <= NEGATIVE_CLIP_S) & ~one_clock
    return np.where(noise, 0.0, delay).astype(np.float32)


def host_gaps(prepared: PreparedTrace) -> np.ndarray:
    """[node, step, dp] seconds the worker's host took to start each op: its launch delay
    (clipped at 0) less any part of it in which the worker still ran, or waited on, the op
    that precedes it in its order of work (`DependencyModel.host_predecessor`). A 1F1B
    stage posts a backward's receive after its next forward: the receive's launch delay
    holds that forward, and a forward straggler would read as a slow host too; a stage
    that waits on its sends at the end of a step launches its gradient all-reduce after
    that wait, which a slow peer lengthens. Where a step ran the two in another order, the
    launch delay stands.

    >>> from lagscope.simulator.generate import JobSpec, generate_job
    >>> job = generate_job(JobSpec(dp=2, pp=2, microbatches=4, steps=2, seed=1))
    >>> prepared = prepare(job.trace, job.meta)
    >>> gaps = host_gaps(prepared)
    >>> bool((gaps >= 0).all() and (gaps <= np.clip(prepared.launch_delay, 0, None)).all())
    True
    """
    gaps = np.maximum(prepared.launch_delay, 0.0)
    if prepared.entry is not None:
        roots = prepared.model.root_nodes
        own = own_gaps_of_roots(prepared)
        gaps[roots] = np.where(np.isnan(own), gaps[roots], np.maximum(own, 0.0))
    rows, before = prepared.model.host_predecessor_rows
    if rows.size:
        # np.take: a streamed job asks for these every step, and it gathers rows faster.
        since = np.take(prepared.start, rows, axis=0)
        since -= np.take(prepared.start, before, axis=0)
        since -= np.take(prepared.duration, before, axis=0)
        # The predecessor still ran past the op's start: this step ran them in another order.
        np.putmask(since, since < -LAUNCH_TOLERANCE_S, np.inf)
        np.maximum(since, 0.0, out=since)
        gaps[rows] = np.minimum(np.take(gaps, rows, axis=0), since, out=since)
    inside, _ = launched_inside(prepared)
    gaps[inside[0], inside[1], inside[2]] = 0.0
    return gaps


def own_gaps_of_roots(prepared: PreparedTrace) -> np.ndarray:
    """[root, step, dp] seconds from the moment each worker ended its previous step to the
    start of each of its first ops (`DependencyModel.root_nodes`): the host time before
    them, where a launch delay from the step's origin would also count the time the
    worker still ran its previous step while its peers began this one. NaN where the
    previous step is not known."""
    roots = prepared.model.root_nodes
    stages = prepared.model.node_stage()[roots]
    entry = (
        np.full((prepared.n_steps, prepared.n_stages, prepared.n_dp), np.nan)
        if prepared.entry is None
        else prepared.entry.astype(np.float64)
    )
    # [root, step, dp]: each root's worker's entry.
    return prepared.start[roots].astype(np.float64) - entry[:, stages].transpose(1, 0, 2)


def own_durations(prepared: PreparedTrace) -> np.ndarray:
    """[node, step, dp] each op's duration less the parameter all-gathers it launched and
    waited for inside it (`launched_inside`: FSDP gathers each block's parameters from its
    hooks, in the forward and the backward, which then wait for them): the work the worker
    did itself. A rank that waits on a slow peer's gathers grows in its forward as much
    as the slow peer does, and is no straggler.

    >>> from lagscope.simulator.generate import JobSpec, generate_job
    >>> job = generate_job(JobSpec(dp=2, pp=2, microbatches=4, steps=2, seed=1))
    >>> prepared = prepare(job.trace, job.meta)
    >>> bool((own_durations(prepared) == prepared.duration).all())  # nothing nested
    True
    """
    (nodes, steps, dps), passed = launched_inside(prepared)
    gathers = np.array(prepared.node_optype)[nodes] == ot.PARAMS_ALL_GATHER
    if not gathers.any():
        return prepared.duration
    nodes, steps, dps, passed = nodes[gathers], steps[gathers], dps[gathers], passed[gathers]
    containers = prepared.model.host_container[nodes]
    left = prepared.duration[containers, steps, dps] - passed
    waited = np.clip(np.minimum(prepared.duration[nodes, steps, dps], left), 0.0, None)
    own = prepared.duration.astype(np.float64).copy()
    np.subtract.at(own, (containers, steps, dps), waited)
    return np.maximum(own, 0.0).astype(prepared.duration.dtype)


def launched_inside(prepared: PreparedTrace) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """The ops a worker launched while its own op that began before them still ran
    (`DependencyModel.host_container`: DDP's gradient buckets launched from the
    backward's hooks), as [node, step, dp] indices, and for each the seconds of its
    container that had passed at its start."""
    rows, container = prepared.model.host_container_rows
    if not rows.size:
        empty = np.empty(0, np.int64)
        return (empty, empty, empty), np.empty(0)
    start = np.take(prepared.start, rows, axis=0)
    began = np.take(prepared.start, container, axis=0)
    lasted = np.take(prepared.duration, container, axis=0)
    passed = start - began
    # A hook fires up to the op's last instant: the last bucket of a backward is launched
    # as it ends, a little after its end is stamped.
    inside = (passed >= 0) & (passed <= lasted + LAUNCH_TOLERANCE_S)
    where = np.nonzero(inside)
    return (rows[where[0]], where[1], where[2]), passed[where].astype(np.float64)


def apply_clock_offsets(prepared: PreparedTrace, offset_s: np.ndarray) -> PreparedTrace:
    """`prepared` with every worker's clock set back by `offset_s[stage, dp]` (seconds its
    clock runs ahead, e.g. `simulator.clocks.estimate_clock_offsets(...).offset_s`), and
    the inputs that compare two clocks derived again: transfer times (pipeline-comm
    attribution) and launch delays. Each step is re-based on its earliest op."""
    stages = prepared.model.node_stage()
    shift = np.asarray(offset_s, dtype=np.float64)[stages][:, None, :]
    start = prepared.start.astype(np.float64) - shift
    start -= start.min(axis=(0, 2), keepdims=True)
    start = start.astype(np.float32)
    end = (start + prepared.duration).astype(np.float32)
    model = prepared.model
    is_member = model.group_of >= 0
    transfer = _transfer_times(model, start, end)
    return dataclasses.replace(
        prepared,
        start=start,
        cost=np.where(is_member[:, None, None], transfer, prepared.duration).astype(np.float32),
        launch_delay=_launch_delays(model, start, end),
        actual_step_time=end.max(axis=(0, 2)).astype(np.float64),
    )
