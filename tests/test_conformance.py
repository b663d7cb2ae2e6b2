"""lagscope's batch analysis reproduces the reference analyzer on the three real traces."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import REFERENCE_NAMES, analyzed_reference, assert_same_result

RTOL = 1e-3
#: Nodes / edges / comm groups of each trace's dependency model (docs/whatif.md §3.9).
MODEL_SIZES = {"ST": (106, 165, 34), "SE": (78, 121, 22), "AR": (666, 1229, 202)}


def expected(reference_dir, kind: str, name: str) -> dict:
    return json.loads((reference_dir / f"{kind}-{name}.json").read_text())


def assert_close(actual: float, wanted: float, what: str) -> None:
    assert actual == pytest.approx(wanted, rel=RTOL), f"{what}: {actual} != {wanted}"


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_dependency_model_size(reference_dir, name):
    prepared, _ = analyzed_reference(name)
    model = prepared.model
    assert (model.n_nodes, model.n_edges, len(model.groups)) == MODEL_SIZES[name]


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_headline_figures(reference_dir, name):
    _, result = analyzed_reference(name)
    ref = expected(reference_dir, "result", name)
    assert_close(result.slowdown, ref["blocking_slowdown"], "slowdown")
    assert_close(result.launch_slowdown, ref["launch_slowdown"], "launch_slowdown")
    assert result.waste == pytest.approx(1 - 1 / ref["blocking_slowdown"], rel=RTOL)


@pytest.mark.parametrize("name", REFERENCE_NAMES)
@pytest.mark.parametrize("kind", ["optype", "dp_rank", "stage"])
def test_attribution(reference_dir, name, kind):
    _, result = analyzed_reference(name)
    wanted = expected(reference_dir, "result", name)[f"blocking_decompose_by_{kind}"]
    got = {"optype": result.by_optype, "dp_rank": result.by_dp_rank, "stage": result.by_stage}[
        kind
    ].overall
    assert set(got) == set(wanted)
    for group, value in wanted.items():
        assert_close(got[group], value, f"{kind} {group}")
    # The reference reports groups in descending order of slowdown.
    ranked = [g for g, _ in getattr(result, f"by_{kind}").ranked()]
    assert [wanted[g] for g in ranked] == sorted(wanted.values(), reverse=True)


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_per_step_times_and_attribution(reference_dir, name):
    _, result = analyzed_reference(name)
    ref = expected(reference_dir, "result", name)
    steps = [str(int(s)) for s in result.steps]
    assert steps == list(ref["step_t_base"])
    np.testing.assert_allclose(result.t_actual, [ref["step_t_base"][s] for s in steps], rtol=RTOL)
    np.testing.assert_allclose(
        result.t_nodelay, [ref["step_t_nodelay"][s] for s in steps], rtol=RTOL
    )
    np.testing.assert_allclose(result.t_ideal, [ref["step_t_noblk"][s] for s in steps], rtol=RTOL)
    per_step = ref["blocking_decompose_by_optype_per_step"]
    for i, step in enumerate(steps):
        for label, value in per_step[step].items():
            assert_close(result.by_optype.per_step[label][i], value, f"step {step} {label}")


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_mw_ms(reference_dir, name):
    _, result = analyzed_reference(name)
    for kind, explained in (("mw", result.mw), ("ms", result.ms)):
        ref = expected(reference_dir, kind, name)
        assert_close(explained.removed_share, ref["rem"], f"{kind} rem")
        assert_close(explained.added_share, ref["add"], f"{kind} add")
        for field, attr in (
            ("tori", "t_original"),
            ("tideal", "t_ideal"),
            ("trem", "t_removed"),
            ("tadd", "t_added"),
        ):
            assert_close(getattr(explained, attr), ref[field], f"{kind} {field}")


def test_top_workers_match_the_paper(reference_dir):
    assert analyzed_reference("AR")[1].mw.workers == ((0, 0),)
    assert analyzed_reference("SE")[1].mw.workers == ((8, 1), (27, 1))
    assert analyzed_reference("ST")[1].mw.workers == ((1, 3),)


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_simulation_reproduces_measured_step_times(reference_dir, name):
    _, result = analyzed_reference(name)
    assert result.simulation_error < 1e-4
    assert result.launch_by_optype is None  # launch slowdown is below the gate on all three


@pytest.mark.parametrize("name", REFERENCE_NAMES)
def test_each_step_in_one_pass_equals_one_step_at_a_time(reference_dir, name):
    """A stream analyses a backlog at once: each step's numbers must not depend on it."""
    from lagscope.simulator.whatif import analyze, analyze_each_step, ideal_costs

    prepared, whole = analyzed_reference(name)
    # Running ideals, as a stream has them: each step's from the steps up to it.
    ideals = [ideal_costs(prepared.select_steps(np.arange(i + 1))) for i in range(prepared.n_steps)]
    # A threshold that gates the launch attribution on for some steps and off for others.
    threshold = float(np.median(whole.launch_step_slowdown))
    # Small passes too: packing variants into passes differently must not change a bit.
    for cells in (1_500_000, 20_000):
        batch = analyze_each_step(
            prepared, ideals, max_cells_per_pass=cells, decompose_threshold=threshold
        )
        assert len(batch) == prepared.n_steps
        for i, got in enumerate(batch):
            want = analyze(
                prepared.select_steps([i]),
                ideal=ideals[i],
                explain=False,
                decompose_threshold=threshold,
            )
            assert_same_result(got, want, f"{name} step {i}")
        gated = {r.launch_by_optype is not None for r in batch}
        assert gated == {True, False}


@pytest.mark.parametrize("name", REFERENCE_NAMES)
@pytest.mark.parametrize("gate", ["some steps", "whole trace", "none"])
def test_each_step_read_off_the_whole_trace_equals_each_step_simulated(reference_dir, name, gate):
    """A recorded trace's story reads its steps off the whole trace's analysis: the same
    numbers as simulating each step with the whole trace's ideals, whichever steps pass
    the launch gate (some of them only: their launch attribution is simulated apart)."""
    from lagscope.simulator.whatif import analyze, analyze_each_step, each_step_of

    prepared, whole = analyzed_reference(name)
    threshold = {
        "some steps": float(np.median(whole.launch_step_slowdown)),
        "whole trace": 0.0,
        "none": np.inf,
    }[gate]
    whole = analyze(prepared, decompose_threshold=threshold)
    read = each_step_of(whole, prepared)
    simulated = analyze_each_step(
        prepared, [whole.ideal_cost] * prepared.n_steps, decompose_threshold=threshold
    )
    assert len(read) == len(simulated) == prepared.n_steps
    for i, (got, want) in enumerate(zip(read, simulated, strict=True)):
        assert_same_result(got, want, f"{name} step {i}")
        assert got.launch_by_dp_rank is None or (
            got.launch_by_dp_rank.overall == want.launch_by_dp_rank.overall
        )
    gated = {r.launch_by_optype is not None for r in read}
    assert gated == {"some steps": {True, False}, "whole trace": {True}, "none": {False}}[gate]
