"""Op patterns of real PyTorch jobs: DDP's gradient buckets (one all-reduce per bucket,
launched while backward still runs) and the data loader's input wait."""

from __future__ import annotations

import numpy as np

from lagscope.simulator import optypes as ot
from lagscope.simulator.prepare import prepare
from lagscope.simulator.trace import JobMeta, Trace
from lagscope.simulator.whatif import analyze

META = JobMeta(dp_size=2, pp_size=1, world_size=2)


def _append_ops(
    columns: dict[str, list], dp: int, step: int, rows: list, *, start_shift: float
) -> None:
    """A single-stage rank's (op type, seq, start, end) `rows` of `step` as trace columns,
    its starts moved by `start_shift`."""
    for optype, seq, start, end in rows:
        columns["dp_rank"].append(dp)
        columns["stage"].append(0)
        columns["rank"].append(dp)
        columns["step"].append(step)
        columns["optype"].append(optype)
        columns["start_ts"].append(start + start_shift)
        columns["duration"].append(end - start)
        columns["seq_id"].append(seq)


def ddp_step_rows(
    step: int, dp: int, input_s: float, compute_scale: float
) -> list[tuple[str, int, float, float]]:
    """(optype, seq, start, end) of one DDP step on one rank: an input wait, two
    micro-batches (gradient accumulation), three buckets launched during the last
    backward, and the optimizer once the buckets are done."""
    f, b = 0.010 * compute_scale, 0.020 * compute_scale
    t = 0.0
    rows = [(ot.INPUT_WAIT, 0, t, t + input_s)]
    t += input_s + 0.0005
    for mb in range(2):
        rows.append((ot.FORWARD_COMPUTE, mb, t, t + f))
        t += f + 0.0005
        rows.append((ot.BACKWARD_COMPUTE, mb, t, t + b))
        backward_start = t
        t += b + 0.0005
    # Buckets 0 and 1 while the last backward runs; bucket 2 when it ends.
    launches = [backward_start + 0.4 * b, backward_start + 0.7 * b, backward_start + b]
    done = t
    for k, launch in enumerate(launches):
        done = max(done, launch) + 0.004
        rows.append((ot.SEPARATE_GRADS_ALL_REDUCE, k, launch, done))
    rows.append((ot.OPTIMIZER, 0, done + 0.0005, done + 0.0035))
    return rows


def ddp_trace(steps: int = 4, slow_input_dp: int | None = None) -> Trace:
    columns: dict[str, list] = {k: [] for k in ("dp_rank", "stage", "rank", "step", "optype",
                                                "start_ts", "duration", "seq_id")}  # fmt: skip
    for step in range(steps):
        per_dp = {
            dp: ddp_step_rows(step, dp, 0.030 if dp == slow_input_dp else 0.001, 1.0)
            for dp in range(2)
        }
        # The buckets are collectives: they end together, when the later rank joins.
        for k in range(3):
            ends = [next(r for r in per_dp[dp] if r[:2] == (ot.SEPARATE_GRADS_ALL_REDUCE, k))[3]
                    for dp in range(2)]  # fmt: skip
            for dp in range(2):
                rows = per_dp[dp]
                i = next(
                    i for i, r in enumerate(rows) if r[:2] == (ot.SEPARATE_GRADS_ALL_REDUCE, k)
                )
                rows[i] = (*rows[i][:3], max(ends))
        for dp in range(2):
            rows = per_dp[dp]
            last = max(r[3] for r in rows if r[0] == ot.SEPARATE_GRADS_ALL_REDUCE)
            rows[-1] = (ot.OPTIMIZER, 0, last + 0.0005, last + 0.0035)
            _append_ops(columns, dp, step, rows, start_shift=0.05 * step)
    return Trace.from_columns(columns, source="<ddp>")


def test_every_gradient_bucket_is_linked_and_the_step_is_reproduced():
    prepared = prepare(ddp_trace(), META)
    model = prepared.model
    deps = {
        str(model.nodes[i]): {str(model.nodes[d]) for d in model.deps[i]}
        for i in range(model.n_nodes)
    }
    # Buckets launched during the last backward follow the compute that had ended.
    assert deps["separate-grads-all-reduce_0_0"] == {"forward-compute_1_0"}
    assert deps["separate-grads-all-reduce_1_0"] == {"forward-compute_1_0"}
    # The bucket launched at the end follows the last backward; the optimizer waits for all.
    assert deps["separate-grads-all-reduce_2_0"] == {"backward-compute_1_0"}
    assert {f"separate-grads-all-reduce_{k}_0" for k in range(3)} <= deps["optimizer_0_0"]
    # The input wait holds back the first forward.
    assert "input-wait_0_0" in deps["forward-compute_0_0"]
    result = analyze(prepared)
    assert np.all(result.discrepancy < 0.05), result.discrepancy
    assert np.all(result.trusted)


def test_a_rank_starved_by_its_input_is_an_input_straggler():
    prepared = prepare(ddp_trace(slow_input_dp=1), META)
    result = analyze(prepared)
    ranked = result.by_optype.ranked()
    assert ranked[0][0] == ot.INPUT_WAIT, ranked
    assert result.by_dp_rank.ranked()[0][0] == "1"
    # Not smeared into launch delay: the replay without launch delays has the wait.
    assert np.all(result.discrepancy < 0.05)


def _tail_model(order: list[str]) -> dict[str, set[str]]:
    """The dependencies of a one-stage slice (a forward, a backward, then the end-of-step
    ops one after another in `order`), by op name."""
    from lagscope.simulator.depmodel import infer_dependency_model

    optypes = [ot.FORWARD_COMPUTE, ot.BACKWARD_COMPUTE, *order]
    start = np.arange(len(optypes)) * 0.01
    model = infer_dependency_model(
        np.zeros(len(optypes), dtype=np.int64), optypes, np.zeros(len(optypes), dtype=np.int64),
        start, start + 0.008, np.zeros(len(optypes), dtype=np.int64),
        np.zeros(len(optypes), dtype=np.int64), n_stages=1, vpp=1, has_dp_comm=True,
        overlapped_dp=True,
    )  # fmt: skip
    return {
        model.nodes[i].optype: {model.nodes[d].optype for d in model.deps[i]}
        for i in range(model.n_nodes)
    }


def test_megatron_reduces_its_gradients_before_the_layernorm_and_embedding():
    """megatron-core's finalize_model_grads waits for the DP gradient sync, then
    all-reduces the layernorm and embedding gradients: the chain as the job ran it, so
    the layernorm's launch delay does not hold the sync's wait for a slow peer (it read
    as host time of every healthy rank of a Megatron job whose one rank stalled)."""
    tail = [ot.SEPARATE_GRADS_ALL_REDUCE, ot.LAYERNORM_GRADS_ALL_REDUCE,
            ot.EMBEDDING_GRADS_ALL_REDUCE, ot.OPTIMIZER_CLIP_MAIN_GRAD, ot.OPTIMIZER]  # fmt: skip
    deps = _tail_model(tail)
    assert deps[ot.SEPARATE_GRADS_ALL_REDUCE] == {ot.BACKWARD_COMPUTE}
    assert deps[ot.LAYERNORM_GRADS_ALL_REDUCE] == {ot.SEPARATE_GRADS_ALL_REDUCE}
    assert deps[ot.EMBEDDING_GRADS_ALL_REDUCE] == {ot.LAYERNORM_GRADS_ALL_REDUCE}
    assert deps[ot.OPTIMIZER_CLIP_MAIN_GRAD] == {ot.EMBEDDING_GRADS_ALL_REDUCE}
    # The reference analyzer's order (layernorm first) keeps its chain.
    reference = _tail_model([tail[1], tail[2], tail[0], *tail[3:]])
    assert reference[ot.LAYERNORM_GRADS_ALL_REDUCE] == {ot.BACKWARD_COMPUTE}
    assert reference[ot.SEPARATE_GRADS_ALL_REDUCE] == {ot.EMBEDDING_GRADS_ALL_REDUCE}


def test_fsdp_gathers_inside_its_forward_and_backward_hold_up_nothing_before_them():
    """FSDP2 all-gathers each block's parameters from its hooks, inside the forward and
    again inside the backward, and reduce-scatters its gradients inside the backward:
    the model ordered the chunk's last gather (one of the backward's) before the forward,
    a cycle no step of an FSDP2 job could be analysed with. The forward now waits only for
    gathers launched before it; a forward's own time leaves out the gathers it waited on."""
    from lagscope.simulator.depmodel import infer_dependency_model
    from lagscope.simulator.prepare import own_durations

    ms = 1e-3
    rows = [  # (optype, seq, start, end) of one FSDP2 step on one rank
        (ot.FORWARD_COMPUTE, 0, 0.0, 17 * ms),
        (ot.PARAMS_ALL_GATHER, 0, 0.5 * ms, 7 * ms),
        (ot.PARAMS_ALL_GATHER, 1, 7.5 * ms, 11 * ms),
        (ot.BACKWARD_COMPUTE, 0, 17.5 * ms, 47 * ms),
        (ot.PARAMS_ALL_GATHER, 2, 18 * ms, 23 * ms),
        (ot.GRADS_REDUCE_SCATTER, 0, 28 * ms, 31 * ms),
        (ot.GRADS_REDUCE_SCATTER, 1, 36 * ms, 39 * ms),
        (ot.OPTIMIZER, 0, 47.5 * ms, 48 * ms),
    ]
    optypes = [r[0] for r in rows]
    zeros = np.zeros(len(rows), dtype=np.int64)
    model = infer_dependency_model(
        zeros, optypes, np.array([r[1] for r in rows]), np.array([r[2] for r in rows]),
        np.array([r[3] for r in rows]), zeros, zeros, n_stages=1, vpp=1, has_dp_comm=True,
        overlapped_dp=False,
    )  # fmt: skip
    assert model.compiled.n_nodes == len(rows)  # levelled: no cycle
    forward = optypes.index(ot.FORWARD_COMPUTE)
    assert not [d for d in model.deps[forward] if optypes[d] == ot.PARAMS_ALL_GATHER]
    # A two-rank trace of it: each forward is its own 10 ms of work, whatever it waited.
    columns: dict[str, list] = {k: [] for k in ("dp_rank", "stage", "rank", "step", "optype",
                                                "start_ts", "duration", "seq_id")}  # fmt: skip
    for step in range(2):
        for dp in range(2):
            _append_ops(columns, dp, step, rows, start_shift=0.1 * step)
    prepared = prepare(Trace.from_columns(columns, source="<fsdp>"), META)
    own = own_durations(prepared)
    node = prepared.node_optype.index(ot.FORWARD_COMPUTE)
    np.testing.assert_allclose(own[node], 17 * ms - 6.5 * ms - 3.5 * ms, atol=1e-6)
