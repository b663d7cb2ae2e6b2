"""The answers change exactly as they should when the input is transformed."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lagscope.simulator.prepare import prepare
from lagscope.simulator.trace import TRACE_ARRAYS, Trace
from lagscope.simulator.whatif import analyze
from tests.conftest import analyzed_reference, load_reference

HYPOTHESIS = settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def rebuild(trace: Trace, **changes) -> Trace:
    columns = {k: changes.get(k, getattr(trace, k)) for k in TRACE_ARRAYS}
    return Trace.from_columns({**columns, "optype_names": trace.optype_names}, source="t")


def headline(result) -> np.ndarray:
    return np.array(
        [
            result.slowdown,
            result.launch_slowdown,
            result.mw.removed_share,
            result.ms.removed_share,
            *sorted(result.by_optype.overall.values()),
        ]
    )


@HYPOTHESIS
@given(seed=st.integers(0, 2**32 - 1))
def test_row_order_does_not_matter(reference_dir, seed):
    trace, meta = load_reference("ST")
    order = np.random.default_rng(seed).permutation(trace.n_rows)
    shuffled = trace.select(order)
    np.testing.assert_allclose(
        headline(analyze(prepare(shuffled, meta))), headline(analyzed_reference("ST")[1]), rtol=1e-9
    )


@HYPOTHESIS
@given(seed=st.integers(0, 2**32 - 1))
def test_dp_relabelling_permutes_dp_attribution(reference_dir, seed):
    trace, meta = load_reference("SE")
    _, base = analyzed_reference("SE")
    perm = np.random.default_rng(seed).permutation(meta.dp_size)
    relabelled = rebuild(trace, dp_rank=perm[trace.dp_rank])
    result = analyze(prepare(relabelled, meta))
    assert result.slowdown == pytest.approx(base.slowdown, rel=1e-9)
    for dp in range(meta.dp_size):
        assert result.by_dp_rank.overall[str(perm[dp])] == pytest.approx(
            base.by_dp_rank.overall[str(dp)], rel=1e-9
        )
    np.testing.assert_allclose(result.worker_slowdown[:, perm], base.worker_slowdown, rtol=1e-9)


@HYPOTHESIS
@given(scale=st.floats(0.5, 4.0), shift=st.floats(0.0, 1000.0))
def test_clock_scale_and_shift(reference_dir, scale, shift):
    """Times in other units or with a per-step offset: ratios unchanged, times scaled."""
    trace, meta = load_reference("ST")
    _, base = analyzed_reference("ST")
    step_offset = shift * (1 + (trace.step % 7))
    moved = rebuild(
        trace,
        start_ts=(trace.start_ts.astype(np.float64) * scale + step_offset).astype(np.float32),
        duration=(trace.duration.astype(np.float64) * scale).astype(np.float32),
    )
    result = analyze(prepare(moved, meta))
    # float32 start times at offsets up to ~8000 s carry ~0.5 ms of rounding.
    assert result.slowdown == pytest.approx(base.slowdown, rel=2e-3)
    assert result.by_stage.overall["3"] == pytest.approx(base.by_stage.overall["3"], rel=2e-3)
    np.testing.assert_allclose(result.t_ideal, base.t_ideal * scale, rtol=2e-3)


@HYPOTHESIS
@given(data=st.data())
def test_step_subset(reference_dir, data):
    """Per-step simulated times do not depend on other steps; the ideal does."""
    prepared, base = analyzed_reference("AR")
    keep = np.array(
        data.draw(st.lists(st.booleans(), min_size=prepared.n_steps, max_size=prepared.n_steps))
    )
    if not keep.any():
        keep[0] = True
    subset = analyze(prepared.select_steps(keep))
    np.testing.assert_allclose(subset.t_nodelay, base.t_nodelay[keep], rtol=1e-12)
    np.testing.assert_allclose(subset.t_actual, base.t_actual[keep], rtol=1e-12)
    assert subset.slowdown == pytest.approx(subset.t_nodelay.mean() / subset.t_ideal.mean())


def test_duplicated_dp_replicas_keep_job_level_answers(reference_dir):
    """Doubling the DP size with exact copies of every replica leaves means, medians, the
    slowdown, stage and op-type attribution unchanged."""
    trace, meta = load_reference("ST")
    _, base = analyzed_reference("ST")
    rows = np.concatenate([np.arange(trace.n_rows)] * 2)
    copy = np.repeat([0, 1], trace.n_rows)
    doubled = trace.select(rows)
    doubled = rebuild(
        doubled, dp_rank=doubled.dp_rank + copy * meta.dp_size, rank=doubled.rank + copy * 1000
    )
    meta2 = dataclasses.replace(meta, dp_size=4, world_size=16)
    result = analyze(prepare(doubled, meta2))
    assert result.slowdown == pytest.approx(base.slowdown, rel=1e-9)
    assert result.ms.removed_share == pytest.approx(base.ms.removed_share, rel=1e-9)
    for group, value in base.by_stage.overall.items():
        assert result.by_stage.overall[group] == pytest.approx(value, rel=1e-9)
    for group, value in base.by_optype.overall.items():
        assert result.by_optype.overall[group] == pytest.approx(value, rel=1e-9)
