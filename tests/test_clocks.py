"""Clock offsets: injected into generated jobs, recovered from the transfers, corrected."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lagscope.cli import main
from lagscope.producers.reference_format import write_meta, write_trace
from lagscope.simulator import clocks
from lagscope.simulator import optypes as ot
from lagscope.simulator.clocks import (
    ClockEdge,
    correct_trace,
    estimate_clock_offsets,
    shift_worker_clocks,
)
from lagscope.simulator.generate import JobSpec, SlowLink, SlowWorker, generate_job
from lagscope.simulator.prepare import apply_clock_offsets, prepare
from lagscope.simulator.timeline import trace_events

#: The acceptance bound: 10 % of the transfer time or 50 us, whichever is larger.
FLOOR_S = 50e-6

SPECS = {
    "1f1b": JobSpec(dp=4, pp=4, steps=20, seed=3),
    "interleaved": JobSpec(dp=2, pp=4, vpp=2, microbatches=8, steps=12, seed=4),
    "stragglers": JobSpec(
        dp=4,
        pp=4,
        steps=20,
        seed=5,
        stragglers=(
            SlowLink(stage=1, dp=2, factor=4.0),
            SlowWorker(dp=1, stage=2, factor=1.5, start_step=5),
        ),
    ),
    "slow-p2p": JobSpec(dp=2, pp=3, microbatches=6, steps=16, seed=6).model_copy(
        update={"cost": JobSpec().cost.model_copy(update={"p2p_s": 0.02})}
    ),
}


def injected_offsets(spec: JobSpec, seed: int, scale_s: float = 0.005) -> np.ndarray:
    """Offsets of up to +-`scale_s` for every (stage, dp) worker, worker (0, 0) at 0."""
    offsets = np.random.default_rng(seed).uniform(-scale_s, scale_s, size=(spec.pp, spec.dp))
    return offsets - offsets[0, 0]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_injected_offsets_are_recovered_within_the_bound(name):
    spec = SPECS[name]
    job = generate_job(spec)
    truth = injected_offsets(spec, seed=len(name))
    skewed = shift_worker_clocks(job.trace, truth)

    found = estimate_clock_offsets(prepare(skewed, job.meta))

    bound = max(FLOOR_S, 0.1 * spec.cost.p2p_s)
    error = np.abs(found.offset_s - truth)
    worst = np.unravel_index(int(np.argmax(error)), error.shape)
    assert error.max() <= bound, f"{name}: worker (stage, dp) {worst} off by {error.max():.2e} s"
    # One connected component: pipeline pairs join the stages, collectives the replicas.
    assert np.unique(found.component).size == 1
    assert np.all(np.isfinite(found.standard_error_s))


def test_a_job_with_true_clocks_gets_offsets_near_zero():
    job = generate_job(SPECS["1f1b"])
    found = estimate_clock_offsets(prepare(job.trace, job.meta))
    assert np.abs(found.offset_s).max() <= FLOOR_S


def test_replicas_linked_only_by_the_clip_norm_all_reduce():
    # dp 3 x pp 1 without DP collectives: the clip-norm all-reduce is the only transfer
    # the three workers share, and it is enough.
    spec = JobSpec(dp=3, pp=1, microbatches=2, steps=6, dp_comm=False)
    job = generate_job(spec)
    truth = np.array([[0.0, 0.004, -0.002]])
    found = estimate_clock_offsets(prepare(shift_worker_clocks(job.trace, truth), job.meta))
    assert {(e.u, e.v) for e in found.edges} == {(0, 1), (0, 2)}
    assert np.abs(found.offset_s - truth).max() <= FLOOR_S


def test_correcting_restores_pipeline_transfer_times():
    """The pipeline-comm inputs (transfer times) of a skewed trace are wrong by the
    offsets; the hook that prepares with the estimate gives the true ones back."""
    spec = SPECS["1f1b"]
    job = generate_job(spec)
    clean = prepare(job.trace, job.meta)
    skewed = prepare(shift_worker_clocks(job.trace, injected_offsets(spec, seed=9)), job.meta)
    p2p = np.isin(np.array(clean.node_optype), ot.P2P_OPTYPES)

    def p2p_error(prepared) -> float:
        return float(np.abs(prepared.cost[p2p] - clean.cost[p2p]).max())

    assert p2p_error(skewed) > 1e-3  # milliseconds of clock skew land in the transfers
    corrected = apply_clock_offsets(skewed, estimate_clock_offsets(skewed).offset_s)
    assert p2p_error(corrected) <= max(FLOOR_S, 0.1 * spec.cost.p2p_s)
    assert np.allclose(corrected.actual_step_time, clean.actual_step_time, atol=2e-4)


def test_correct_trace_undoes_the_skew():
    spec = SPECS["interleaved"]
    job = generate_job(spec)
    skewed = shift_worker_clocks(job.trace, injected_offsets(spec, seed=2))
    corrected = correct_trace(skewed, estimate_clock_offsets(prepare(skewed, job.meta)))
    assert np.abs(corrected.start_ts - job.trace.start_ts).max() <= FLOOR_S
    assert np.array_equal(corrected.duration, job.trace.duration)


def test_timeline_draws_sends_and_receives_on_one_clock():
    spec = SPECS["1f1b"]
    job = generate_job(spec)
    skewed = prepare(shift_worker_clocks(job.trace, injected_offsets(spec, seed=11)), job.meta)
    offsets = estimate_clock_offsets(skewed).offset_s
    ideal = np.zeros(skewed.model.n_nodes)

    def pair_end_gap(events: list[dict]) -> float:
        """Largest gap between the ends of a forward send and its receive, step 0, dp 0."""
        ends = {
            e["name"]: e["ts"] + e["dur"]
            for e in events
            if e.get("ph") == "X" and e["pid"] == 0 and e["args"]["step"] == 0
        }
        gaps = [
            abs(ends[str(skewed.model.nodes[a])] - ends[str(skewed.model.nodes[b])])
            for group in skewed.model.groups
            if len(group.members) == 2
            for a, b in [group.members]
        ]
        return max(gaps) * 1e-6

    assert pair_end_gap(trace_events(skewed, ideal, ideal)) > 1e-3
    corrected = trace_events(skewed, ideal, ideal, clock_offsets_s=offsets)
    assert pair_end_gap(corrected) <= 0.1 * spec.cost.p2p_s + FLOOR_S
    names = {e["args"]["name"] for e in corrected if e.get("ph") == "M"}
    assert "dp 0 (actual, clocks corrected)" in names


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_graph_solver_finds_what_the_dense_one_does(name):
    """Past `DENSE_LIMIT` workers the offsets come from conjugate gradients on the graph:
    the same offsets, and standard errors that bound the exact ones from above."""
    spec = SPECS[name]
    job = generate_job(spec)
    skewed = prepare(shift_worker_clocks(job.trace, injected_offsets(spec, seed=7)), job.meta)
    edges, n_workers = clocks._edges(skewed), spec.dp * spec.pp

    dense_offset, dense_error, _, dense_exact = clocks._solve(edges, n_workers)
    graph_offset, graph_error, _, graph_exact = clocks._solve(edges, n_workers, dense_limit=0)

    assert (dense_exact, graph_exact) == (True, False)
    assert np.abs(graph_offset - dense_offset).max() < 1e-9
    free = dense_error > 0
    assert np.all(graph_error[free] >= dense_error[free] * (1 - 1e-9))
    assert np.all(graph_error[free] <= 3 * dense_error[free])


def test_the_graph_solver_enforces_a_violated_bound_as_the_dense_one_does():
    # Around the triangle the estimates disagree by 1 s; least squares would spread that
    # over the three edges, but edge (0, 1) may not fall below 0.9 s: it is pinned there.
    edges = [
        ClockEdge(u=0, v=1, estimate_s=1.0, standard_error_s=0.01, lower_s=0.9,
                  upper_s=1.1, n_transfers=10),
        ClockEdge(u=1, v=2, estimate_s=1.0, standard_error_s=0.01, lower_s=-np.inf,
                  upper_s=np.inf, n_transfers=10),
        ClockEdge(u=0, v=2, estimate_s=1.0, standard_error_s=0.01, lower_s=-np.inf,
                  upper_s=np.inf, n_transfers=10),
    ]  # fmt: skip
    dense, _, _, _ = clocks._solve(edges, 3)
    graph, _, _, _ = clocks._solve(edges, 3, dense_limit=0)
    assert dense[1] - dense[0] == pytest.approx(0.9, abs=1e-5)
    assert np.abs(graph - dense).max() < 1e-9


def test_the_graph_solver_pins_the_bounds_the_dense_one_does():
    """Pipeline chains and DP stars of 480 workers, each edge's estimate off by a noise
    four times its bounds' half width: many bounds pinned, over several rounds."""
    rng = np.random.default_rng(0)
    dp, pp = 60, 8
    truth = rng.uniform(-0.005, 0.005, dp * pp)
    truth[0] = 0.0
    pairs = [(s * dp + d, (s + 1) * dp + d) for d in range(dp) for s in range(pp - 1)]
    pairs += [(s * dp, s * dp + d) for s in range(pp) for d in range(1, dp)]
    edges = []
    for u, v in pairs:
        true = truth[v] - truth[u]
        edges.append(ClockEdge(u=u, v=v, estimate_s=true + rng.normal(0, 2e-4),
                               standard_error_s=rng.uniform(1e-6, 1e-4), lower_s=true - 5e-5,
                               upper_s=true + 5e-5, n_transfers=10))  # fmt: skip

    dense, _, _, _ = clocks._solve(edges, dp * pp, dense_limit=dp * pp)
    graph, _, _, _ = clocks._solve(edges, dp * pp, dense_limit=0)

    assert np.abs(graph - dense).max() < clocks.BOUND_SLACK_S
    assert np.abs(graph - truth).max() < 2e-4


@pytest.mark.parametrize(
    ("dense_limit", "errors"), [(None, "exact"), (8, "upper bound (best path)")]
)
def test_analyze_reports_the_estimate(dense_limit, errors, monkeypatch, tmp_path, capsys):
    """`lagscope analyze --json` on skewed clocks; with `dense_limit` 8 the job's 16
    workers are past it, and the graph solver answers (as for a 100,000-GPU job)."""
    spec = SPECS["stragglers"]
    if dense_limit is not None:
        monkeypatch.setattr(clocks, "DENSE_LIMIT", dense_limit)
    job = generate_job(spec)
    truth = injected_offsets(spec, seed=4)
    write_trace(shift_worker_clocks(job.trace, truth), tmp_path / "trace.parquet")
    write_meta(job.meta, tmp_path / "meta.yaml")
    out = tmp_path / "analysis.json"
    trace, meta = str(tmp_path / "trace.parquet"), str(tmp_path / "meta.yaml")

    assert main(["analyze", "--trace", trace, "--meta", meta, "--json", str(out)]) == 0

    assert "clock offsets       largest" in capsys.readouterr().out
    document = json.loads(out.read_text())["clock_offsets"]
    assert document["standard_error"] == errors
    assert len(document["workers"]) == spec.dp * spec.pp
    for worker in document["workers"]:
        expected = truth[worker["stage"], worker["dp"]]
        assert worker["offset_s"] == pytest.approx(expected, abs=0.1 * spec.cost.p2p_s)
        assert worker["standard_error_s"] is not None


@pytest.mark.parametrize("distinct_sizes", [4, 200])
def test_group_medians_are_numpys_median_of_each_group(distinct_sizes: int) -> None:
    """The edges' medians, by partitioning rows of one size (a few sizes) or by one full
    sort (many): each group's np.median, ties and NaN included."""
    rng = np.random.default_rng(distinct_sizes)
    sizes = rng.choice(rng.integers(1, 300, size=distinct_sizes), size=400)
    group = np.repeat(np.arange(sizes.size), sizes)
    rng.shuffle(group)
    values = np.round(rng.normal(size=group.size), 2)  # ties
    values[rng.integers(0, values.size, size=5)] = np.nan
    first = np.append(0, np.cumsum(sizes)[:-1])
    expected = np.array([np.median(values[group == g]) for g in range(sizes.size)])
    assert np.array_equal(clocks._medians(values, group, first), expected, equal_nan=True)
