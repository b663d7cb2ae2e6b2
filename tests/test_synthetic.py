"""What the real traces never exercise: interleaved schedules, p2p no-ops, pp = 1, dp = 1,
overlapped DP, and analysis accuracy against the generator's ground truth."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lagscope.simulator import optypes as ot
from lagscope.simulator.engine import compile_model, simulate
from lagscope.simulator.generate import (
    CostModel,
    JobSpec,
    LastStageImbalance,
    SlowWorker,
    compute_schedule,
    generate_job,
)
from lagscope.simulator.prepare import prepare
from lagscope.simulator.trace import Trace
from lagscope.simulator.whatif import analyze

BALANCED = CostModel(first_stage_extra=0.0, last_stage_extra=0.0, noise_cv=0.01)

SHAPES = {
    "interleaved vpp=2": dict(pp=4, vpp=2, microbatches=8),
    "pp=1": dict(pp=1, dp=4),
    "dp=1": dict(pp=4, dp=1),
    "overlapped DP": dict(pp=4, overlapped_dp=True),
    "interleaved + overlapped": dict(pp=2, vpp=3, microbatches=4, overlapped_dp=True),
    "no DP comm": dict(pp=2, dp=2, dp_comm=False),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_inference_recovers_the_generated_model(shape):
    job = generate_job(JobSpec(steps=4, **SHAPES[shape]))
    prepared = prepare(job.trace, job.meta)
    assert prepared.model.nodes == job.model.nodes
    assert prepared.model.deps == job.model.deps
    assert prepared.model.groups == job.model.groups
    result = analyze(prepared)
    assert result.simulation_error < 1e-5


def test_interleaved_schedule_has_type2_noops():
    job = generate_job(JobSpec(pp=4, vpp=2, microbatches=8, steps=2))
    noops = [job.model.nodes[i] for i in sorted(job.model.noop_nodes)]
    # Stage 0's first chunk receives nothing and the last stage's last chunk sends nothing.
    assert {(n.stage, n.optype) for n in noops} == {
        (0, ot.FORWARD_RECV),
        (0, ot.BACKWARD_SEND),
        (3, ot.FORWARD_SEND),
        (3, ot.BACKWARD_RECV),
    }
    assert sum(1 for n in noops if n.stage == 0 and n.optype == ot.FORWARD_RECV) == 8


def test_1f1b_schedule_order():
    assert compute_schedule(pp=4, vpp=1, microbatches=4, stage=2) == [
        ("F", 0, 0),
        ("F", 0, 1),
        ("B", 0, 0),
        ("F", 0, 2),
        ("B", 0, 1),
        ("F", 0, 3),
        ("B", 0, 2),
        ("B", 0, 3),
    ]
    last = compute_schedule(pp=4, vpp=1, microbatches=3, stage=3)
    assert [d for d, _, _ in last] == ["F", "B", "F", "B", "F", "B"]


def test_type1_noop_spurious_recv_at_step_edge():
    """A recv recorded after the stage's last forward compute is a no-op, not matched."""
    job = generate_job(JobSpec(pp=2, dp=2, microbatches=4, steps=3, cost=BALANCED))
    t = job.trace
    recv = t.optype_names.index(ot.FORWARD_RECV)
    last_recvs = np.flatnonzero((t.optype == recv) & (t.seq_id == 3))
    optimizer = t.optype_names.index(ot.OPTIMIZER)
    rows = np.concatenate([np.arange(t.n_rows), last_recvs])
    columns = t.select(rows).columns()
    extra = slice(t.n_rows, None)
    columns["seq_id"][extra] = 4
    # Recorded just before the optimizer starts: after every forward compute.
    opt_start = {
        (int(s), int(d), int(g)): float(v)
        for s, d, g, v, o in zip(t.step, t.dp_rank, t.stage, t.start_ts, t.optype, strict=True)
        if o == optimizer
    }
    columns["start_ts"][extra] = [
        opt_start[int(s), int(d), int(g)] - 1e-3
        for s, d, g in zip(
            columns["step"][extra], columns["dp_rank"][extra], columns["stage"][extra], strict=True
        )
    ]
    columns["duration"][extra] = 1e-4
    trace = Trace.from_columns(columns, source="type1")
    prepared = prepare(trace, job.meta)
    noops = [prepared.model.nodes[i] for i in prepared.model.noop_nodes]
    assert [(n.stage, n.optype, n.seq) for n in noops] == [(1, ot.FORWARD_RECV, 4)]
    result = analyze(prepared)
    assert result.simulation_error < 1e-5
    assert result.slowdown == pytest.approx(
        analyze(prepare(job.trace, job.meta)).slowdown, rel=1e-3
    )


@pytest.mark.parametrize("factor", [1.2, 1.5, 2.0])
def test_single_slow_worker_matches_ground_truth(factor):
    job = generate_job(
        JobSpec(
            dp=8,
            pp=4,
            microbatches=8,
            steps=6,
            cost=BALANCED,
            stragglers=(SlowWorker(dp=2, stage=1, factor=factor),),
            seed=3,
        )
    )
    result = analyze(prepare(job.trace, job.meta))
    assert result.slowdown == pytest.approx(job.truth.slowdown, rel=0.03)
    assert result.mw.workers == ((2, 1),)
    assert result.mw.removed_share >= 0.9


def test_last_stage_imbalance_is_explained_by_the_last_stage():
    job = generate_job(
        JobSpec(
            dp=2,
            pp=4,
            microbatches=8,
            steps=6,
            cost=BALANCED,
            stragglers=(LastStageImbalance(factor=1.4),),
        )
    )
    result = analyze(prepare(job.trace, job.meta))
    assert result.ms.removed_share >= 0.9
    assert result.by_stage.ranked()[0][0] == "3"


def test_engine_group_and_dp_sync_semantics():
    """Hand-computed: a -> (b, c) pair; b's group waits for the later member; d is a
    DP-synchronized singleton that waits for the slowest DP rank of its segment."""
    from lagscope.simulator.depmodel import CommGroup, DependencyModel, OpName

    nodes = tuple(OpName(0, t, 0) for t in ("a", "b", "c", "d"))
    model = DependencyModel(
        nodes=nodes,
        deps=((), (0,), (), (1, 2)),
        groups=(CommGroup((1, 2), False), CommGroup((3,), True)),
        group_of=np.array([-1, 0, 0, 1]),
        noop_nodes=frozenset(),
        overlapped_dp=False,
        has_dp_comm=True,
    )
    cost = np.array([[1.0, 3.0], [0.5, 0.5], [0.2, 0.2], [0.1, 0.1]])
    delay = np.array([[0.0, 0.0], [0.0, 0.0], [0.7, 0.0], [0.0, 0.0]])
    out = simulate(compile_model(model), cost, delay, np.array([0]), record_timeline=True)
    end = out.timeline.end
    # Column 0: a ends 1.0; c posted at 0.7; group starts at 1.0; b ends 1.5, c 1.2.
    np.testing.assert_allclose(end[:, 0], [1.0, 1.5, 1.2, 3.6])
    # Column 1: a ends 3.0; group starts 3.0; b ends 3.5; d (synced) starts at 3.5 too.
    np.testing.assert_allclose(end[:, 1], [3.0, 3.5, 3.2, 3.6])
    assert out.step_time[0] == pytest.approx(3.6)
    split = simulate(compile_model(model), cost, delay, np.array([0, 1]))
    np.testing.assert_allclose(split.step_time, [1.6, 3.6])


def test_an_op_launched_before_its_same_clock_dependency_ended_replays_exactly():
    """A launch delay measured on one worker's clock is kept however negative (a DDP
    bucket launched from a hook while the backward op before it in the model still ran):
    before, one at or below -10 ms became 0, as clock noise, and its step replayed late
    (17 % in a real DDP run on a busy machine). Across clocks the noise floor stays."""
    job = generate_job(JobSpec(dp=2, pp=2, steps=6, seed=11))
    prepared = prepare(job.trace, job.meta)
    model = prepared.model
    stages = model.node_stage()
    same = [i for i, deps in enumerate(model.deps)
            if deps and all(stages[d] == stages[i] for d in deps)]  # fmt: skip
    node = next(i for i in same if float(prepared.launch_delay[i, 3, 0]) < 0.005)
    name = model.nodes[node]
    trace = job.trace
    code = trace.optype_names.index(name.optype)
    row = np.flatnonzero((trace.stage == name.stage) & (trace.optype == code)
                         & (trace.seq_id == name.seq) & (trace.step == 3)
                         & (trace.dp_rank == 0))  # fmt: skip
    assert row.size == 1
    early = 0.03 + float(prepared.launch_delay[node, 3, 0])
    start = trace.start_ts.copy()
    start[row] -= early
    # `_end`: the cached end times, made again from the moved starts
    moved = prepare(dataclasses.replace(trace, start_ts=start, _end=None), job.meta)

    assert float(moved.launch_delay[node, 3, 0]) == pytest.approx(-0.03, abs=1e-4)
    n = model.n_nodes
    replayed = simulate(compile_model(moved.model), moved.cost.reshape(n, -1),
                        moved.launch_delay.reshape(n, -1),
                        np.arange(0, 6 * moved.n_dp, moved.n_dp)).step_time  # fmt: skip
    np.testing.assert_allclose(replayed, moved.actual_step_time, rtol=1e-5)
