"""What a worker's extra time costs the job: its steps replayed with that worker's time
of one kind (an op type, or its host gaps) at its usual level, against the steps as the
job ran them. Every model price lagscope gives an episode comes from here.

An op type's extra lives in the worker's op durations: the steps are replayed from their
durations alone (the what-if's T_nd), without the job's launch delays, which on a large
job hold waits the model does not describe (the reference AR trace's layernorm
all-reduce waits 4.6 s at a near-global barrier for its slow worker) and would stay put
while the worker sped up.

A host's extra lives in its launch delays. Replaying a step with them reproduces it;
replaying it with one worker's host gaps shortened gives the step without its stalls,
but only if everything that waited on that worker moves with it. Three things the
dependency model alone does not say decide that:

- **The worker's order of work.** A worker runs its ops one after another: an op launched
  after the worker waited on another one (a blocking send to a stalled peer, its own
  backward) waits on it again when it moves. Each op with a host predecessor
  (`DependencyModel.host_predecessor`) starts no earlier than that predecessor's end
  plus its own host gap (`prepare.host_gaps`), instead of at a fixed launch delay that
  holds the old wait.
- **Ops launched from inside another.** DDP launches a gradient bucket's all-reduce from
  the backward's hook: the bucket starts at the same share of its backward
  (`prepare.launched_inside`), wherever the backward runs and however long it takes.
- **Steps that overlap.** A worker that stalls after its last op of a step ends it late,
  while its peers already began the next one: the step's span from its earliest op counts
  that stall once in the step it ends and again in the step it starts late. Where the
  previous step's end is known (`PreparedTrace.entry`), a step is replayed from the moment
  the last worker ended the previous one, its first ops from when their own worker did
  (plus their own host gaps), and the step's time is its period, what the job pays for it
  (`PreparedTrace.periods`). Without the extra, the workers enter a step together.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lagscope.simulator.engine import Anchors, CompiledModel, simulate
from lagscope.simulator.online_episodes import HOST
from lagscope.simulator.prepare import (
    LAUNCH_TOLERANCE_S,
    PreparedTrace,
    host_gaps,
    launched_inside,
    own_gaps_of_roots,
)


@dataclass(frozen=True)
class StepTimes:
    """[step] each: a step as the job ran it (its period where the previous step's end is
    known, else its span) and as it would have run without the worker's extra."""

    measured: np.ndarray
    without: np.ndarray

    @property
    def lost(self) -> np.ndarray:
        return np.maximum(self.measured - self.without, 0.0)


def step_times_without(
    prepared: PreparedTrace,
    worker: tuple[int, int],
    kind: str,
    scale: np.ndarray,
    compiled: CompiledModel | None = None,
) -> StepTimes:
    """The steps of `prepared` as measured and with `worker`'s (dp, stage) time of `kind`
    (an op type, or `host`: its host gaps) scaled by `scale` ([step], 1 where it stays).
    An op type's steps are replayed from their durations alone (the what-if's T_nd); a
    host's with its launch delays, as the module says.

    >>> from lagscope.simulator.generate import JobSpec, generate_job
    >>> from lagscope.simulator.prepare import prepare
    >>> job = generate_job(JobSpec(dp=2, pp=2, microbatches=4, steps=3, seed=1))
    >>> prepared = prepare(job.trace, job.meta)
    >>> times = step_times_without(prepared, (1, 0), "host", np.ones(3))
    >>> bool(np.allclose(times.measured, prepared.actual_step_time, atol=1e-5))
    True
    >>> bool(np.allclose(times.without, times.measured))
    True
    >>> half = step_times_without(prepared, (1, 0), "forward-compute", np.full(3, 0.5))
    >>> bool((half.without <= half.measured + 1e-9).all() and (half.without < half.measured).any())
    True
    """
    dp, stage = worker
    n_nodes, n_steps, n_dp = prepared.cost.shape
    cost = prepared.cost.astype(np.float64)
    scale = np.asarray(scale, dtype=np.float64)
    mine = prepared.model.node_stage() == stage
    offsets = np.arange(0, 2 * n_steps * n_dp, n_dp, dtype=np.int64)
    if kind != HOST:
        # Durations, without the job's launch delays: on a large job those hold waits the
        # model does not describe (the reference AR trace's layernorm all-reduce waits
        # 4.6 s at a near-global barrier for the slow worker), which would stay in place.
        usual_cost = cost.copy()
        rows = mine & (np.array(prepared.node_optype) == kind)
        usual_cost[rows, :, dp] *= scale[None, :]
        both = np.concatenate([cost.reshape(n_nodes, -1), usual_cost.reshape(n_nodes, -1)], 1)
        times = simulate(compiled or prepared.model.compiled, both, None, offsets).step_time
        return StepTimes(times[:n_steps], times[n_steps:])
    compiled = compiled or prepared.model.compiled_in_work_order
    measured = _Inputs.of(prepared, cost)
    usual = measured.copy()
    # The worker's gaps, scaled: the delays and the order-of-work anchors that hold them.
    shrink = 1.0 - scale
    gaps = host_gaps(prepared)[mine, :, dp].astype(np.float64)
    usual.delay[mine, :, dp] -= gaps * shrink[None, :]
    held = usual.anchor_is_gap[mine, :, dp]
    usual.anchor_offset[mine, :, dp] -= np.where(held, gaps * shrink[None, :], 0.0)
    if measured.period_known.any():
        roots = prepared.model.root_nodes
        # Each first op from when the last worker ended the previous step (all of them
        # together, without the extra) plus its worker's own host gap.
        own = np.maximum(own_gaps_of_roots(prepared), 0.0)
        worker_of_root = prepared.model.node_stage()[roots]
        known = measured.period_known[:, None]
        for i, root in enumerate(roots):
            gap = own[i]
            if worker_of_root[i] == stage:
                gap = gap.copy()
                gap[:, dp] *= scale
            usual.delay[root] = np.where(known, gap, usual.delay[root])
    times = simulate(
        compiled,
        np.concatenate([cost.reshape(n_nodes, -1)] * 2, axis=1),
        np.concatenate(
            [measured.delay.reshape(n_nodes, -1), usual.delay.reshape(n_nodes, -1)], axis=1
        ),
        offsets,
        anchors=_joined_anchors(measured, usual),
        # Every step's earliest op starts at 0 (its origin, or before it the previous
        # step's end): a step's time is its latest end.
        from_zero=True,
    ).step_time
    return StepTimes(times[:n_steps], times[n_steps:])


@dataclass
class _Inputs:
    """One variant's launch delays and anchors, [node, step, dp] each."""

    delay: np.ndarray
    anchor_after: np.ndarray
    anchor_offset: np.ndarray
    #: Where the anchor holds the op's host gap (its order of work), not a share of a
    #: container's duration.
    anchor_is_gap: np.ndarray
    period_known: np.ndarray

    def copy(self) -> _Inputs:
        return _Inputs(
            self.delay.copy(),
            self.anchor_after,
            self.anchor_offset.copy(),
            self.anchor_is_gap,
            self.period_known,
        )

    @classmethod
    def of(cls, prepared: PreparedTrace, cost: np.ndarray) -> _Inputs:
        """The inputs that replay `prepared` as it ran; with `cost` ([node, step, dp]:
        its costs, or some of them changed), the ops launched from inside another keep
        their share of that one's changed duration. The host gaps are the measured
        step's: a worker's own time, whatever the others did."""
        model = prepared.model
        delay = prepared.launch_delay.astype(np.float64)
        after = np.full(model.n_nodes, -1, dtype=np.int64)
        offset = np.full(delay.shape, -np.inf)
        is_gap = np.zeros(delay.shape, dtype=bool)
        # The order of work: start = max(ready, predecessor's end) + own gap, exactly the
        # measured start wherever the predecessor ended before the op began. Its end as
        # the engine replays the measured step: a send seen complete late ends with its
        # receive there.
        rows, before = model.host_predecessor_rows
        if rows.size:
            n_nodes, n_steps, n_dp = cost.shape
            replayed = simulate(
                model.compiled,
                prepared.cost.astype(np.float64).reshape(n_nodes, -1),
                delay.reshape(n_nodes, -1),
                np.arange(0, n_steps * n_dp, n_dp, dtype=np.int64),
                record_timeline=True,
            ).timeline
            assert replayed is not None
            start = replayed.start.reshape(cost.shape)
            end = replayed.end.reshape(cost.shape)
            since = start[rows] - end[before]
            ordered = since >= -LAUNCH_TOLERANCE_S
            gap = np.minimum(np.maximum(delay[rows], 0.0), np.maximum(since, 0.0))
            delay[rows] = np.where(ordered, gap, delay[rows])
            offset[rows] = np.where(ordered, gap, -np.inf)
            is_gap[rows] = ordered
            after[rows] = before
        # Launched from inside a running op: at the same share of it, whatever its deps.
        # Such a node anchors to its container in every step; where its predecessor is
        # another op, its other steps keep their launch delays.
        (nodes, steps, dps), passed = launched_inside(prepared)
        if nodes.size:
            containers = model.host_container[nodes]
            # At the same share of the container however long it takes (a hook fires up
            # to its end: past it, the same time after it).
            lasted = prepared.duration[containers, steps, dps].astype(np.float64)
            takes = cost[containers, steps, dps]
            within = np.minimum(passed, lasted) * takes / np.maximum(lasted, 1e-12)
            after_end = np.maximum(passed - lasted, 0.0)
            owners = np.unique(nodes)
            other = owners[(after[owners] >= 0) & (after[owners] != model.host_container[owners])]
            delay[other] = prepared.launch_delay[other]
            offset[other] = -np.inf
            is_gap[other] = False
            after[owners] = model.host_container[owners]
            delay[nodes, steps, dps] = -np.inf
            offset[nodes, steps, dps] = within + after_end - takes
            is_gap[nodes, steps, dps] = False
        period_known = np.zeros(prepared.n_steps, dtype=bool)
        if prepared.entry is not None:
            period_known = ~np.isnan(prepared.entry).any(axis=(1, 2))
            if period_known.any():
                # Time 0 is when the last worker ended the previous step.
                roots = model.root_nodes
                previous_end = np.nan_to_num(prepared.entry.max(axis=(1, 2)).astype(np.float64))
                shifted = prepared.start[roots].astype(np.float64) - previous_end[None, :, None]
                delay[roots] = np.where(period_known[None, :, None], shifted, delay[roots])
        return cls(delay, after, offset, is_gap, period_known)


def _joined_anchors(measured: _Inputs, usual: _Inputs) -> Anchors | None:
    """Both variants' anchors as one `Anchors` over their side-by-side columns."""
    nodes = np.flatnonzero(measured.anchor_after >= 0)
    if not nodes.size:
        return None
    offsets = np.concatenate(
        [
            measured.anchor_offset[nodes].reshape(nodes.size, -1),
            usual.anchor_offset[nodes].reshape(nodes.size, -1),
        ],
        axis=1,
    )
    return Anchors(nodes, measured.anchor_after[nodes], offsets)
