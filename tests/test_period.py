"""Iteration times from collective calls without step ids (Falcon's ACF method)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lagscope.simulator.collective_gen import (
    CollectiveCalls,
    PipelineRankShape,
    generate_collective_calls,
)
from lagscope.simulator.period import acf_period, encode_calls, iteration_times, token_acf

SHAPES = {
    "dp-only": PipelineRankShape(pp_size=1, stage=0, microbatches=1, dp_buckets=2),
    "pp4-first-mb8": PipelineRankShape(pp_size=4, stage=0, microbatches=8, dp_buckets=3),
    "pp4-middle-mb16": PipelineRankShape(
        pp_size=4, stage=2, microbatches=16, dp_buckets=2, distributed_optimizer=False
    ),
    "pp8-last-mb32": PipelineRankShape(pp_size=8, stage=7, microbatches=32, dp_buckets=4),
    "pp16-middle-mb64": PipelineRankShape(pp_size=16, stage=5, microbatches=64, dp_buckets=2),
}
SLOW = (100, 150, 0.3)  # iterations 100-149 run 30 % slower


def generate(shape: PipelineRankShape, missing: float, seed: int) -> CollectiveCalls:
    rng = np.random.default_rng(seed)
    return generate_collective_calls(
        rng, shape, n_steps=240, jitter_cv=0.02, missing_fraction=missing, slow_steps=SLOW
    )


def true_period(shape: PipelineRankShape) -> int:
    complete = generate_collective_calls(np.random.default_rng(0), shape, n_steps=3)
    return int(np.count_nonzero(complete.true_step == 1))


@pytest.mark.parametrize("missing", [0.0, 0.01, 0.03])
@pytest.mark.parametrize("name", list(SHAPES))
def test_iteration_times_within_one_percent(name: str, missing: float) -> None:
    shape = SHAPES[name]
    calls = generate(shape, missing, seed=len(name) + int(missing * 100))
    found = iteration_times(calls.call_types, calls.sizes, calls.timestamps)

    assert found.period_calls == true_period(shape)
    if missing == 0.0:
        assert found.method == "acf" and found.acf_at_period == pytest.approx(1.0, abs=1e-3)

    # Boundaries are numbered exactly like the true iterations, gaps included.
    anchor_type, anchor_size = found.anchor
    is_anchor = (calls.call_types == anchor_type) & (calls.sizes == anchor_size)
    anchor_steps = calls.true_step[is_anchor]
    assert np.array_equal(np.diff(anchor_steps), np.diff(np.unique(anchor_steps)))
    numbering = anchor_steps - anchor_steps[0]
    assert found.boundary_times.size == numbering[-1] + 1
    assert np.all(np.isfinite(found.boundary_times[numbering]))
    assert np.isnan(found.boundary_times).sum() == numbering[-1] + 1 - numbering.size

    # Iteration times agree with the true start-to-start durations within 1 %, over the
    # whole capture and over the normal and the slow stretch separately.
    starts = calls.true_step_starts
    durations = np.diff(starts)
    first, last = anchor_steps[0], anchor_steps[-1]
    true_mean = (starts[last] - starts[first]) / (last - first)
    assert found.mean_iteration_time == pytest.approx(true_mean, rel=0.01)
    step_of_iteration = first + np.arange(found.iteration_times.size)
    for low, high in ((20, SLOW[0] - 1), (SLOW[0] + 1, SLOW[1] - 1), (SLOW[1] + 1, 220)):
        stretch = (step_of_iteration >= low) & (step_of_iteration < high)
        measured = found.iteration_times[stretch]
        measured = measured[np.isfinite(measured)]
        assert measured.size >= 0.8 * (high - low)
        assert measured.mean() == pytest.approx(durations[low:high].mean(), rel=0.01)


@settings(max_examples=20, deadline=None)
@given(
    pp_size=st.sampled_from([1, 2, 4, 8]),
    stage_fraction=st.floats(0.0, 0.999),
    microbatches=st.sampled_from([1, 2, 4, 8, 16, 32]),
    dp_buckets=st.integers(1, 4),
    distributed_optimizer=st.booleans(),
    missing=st.sampled_from([0.0, 0.005, 0.02]),
    jitter_cv=st.floats(0.01, 0.03),
    seed=st.integers(0, 2**16),
)
def test_any_pipeline_shape(
    pp_size: int,
    stage_fraction: float,
    microbatches: int,
    dp_buckets: int,
    distributed_optimizer: bool,
    missing: float,
    jitter_cv: float,
    seed: int,
) -> None:
    shape = PipelineRankShape(
        pp_size=pp_size,
        stage=int(stage_fraction * pp_size),
        microbatches=microbatches,
        dp_buckets=dp_buckets,
        distributed_optimizer=distributed_optimizer,
    )
    calls = generate_collective_calls(
        np.random.default_rng(seed),
        shape,
        n_steps=120,
        jitter_cv=jitter_cv,
        missing_fraction=missing,
    )
    found = iteration_times(calls.call_types, calls.sizes, calls.timestamps)
    assert found.period_calls == true_period(shape)
    anchor_type, anchor_size = found.anchor
    steps = calls.true_step[(calls.call_types == anchor_type) & (calls.sizes == anchor_size)]
    assert found.boundary_times.size == steps[-1] - steps[0] + 1
    starts = calls.true_step_starts
    true_mean = (starts[steps[-1]] - starts[steps[0]]) / (steps[-1] - steps[0])
    assert found.mean_iteration_time == pytest.approx(true_mean, rel=0.01)


def test_a_missing_anchor_is_a_gap_not_a_slow_iteration() -> None:
    calls = generate(SHAPES["pp4-first-mb8"], 0.0, seed=1)
    # Drop every once-per-iteration call of iteration 12, so no anchor can mark it.
    in_step = np.flatnonzero(calls.true_step == 12)
    pairs = list(zip(calls.call_types[in_step], calls.sizes[in_step], strict=True))
    once = [i for i, pair in zip(in_step, pairs, strict=True) if pairs.count(pair) == 1]
    keep = np.ones(calls.call_types.size, dtype=bool)
    keep[once] = False
    found = iteration_times(calls.call_types[keep], calls.sizes[keep], calls.timestamps[keep])
    anchor_type, anchor_size = found.anchor
    is_anchor = (calls.call_types[keep] == anchor_type) & (calls.sizes[keep] == anchor_size)
    gap = 12 - int(calls.true_step[keep][is_anchor][0])
    assert np.isnan(found.boundary_times[gap])
    assert np.isnan(found.iteration_times[[gap - 1, gap]]).all()
    assert np.isfinite(found.iteration_times[: gap - 1]).all()
    assert np.nanmax(found.iteration_times) < 1.5 * np.nanmedian(found.iteration_times)
    assert found.boundary_times.size >= 230


def test_acf_peaks_at_the_period_of_a_periodic_sequence() -> None:
    pattern = np.array([0, 1, 1, 2, 1, 3, 3])
    tokens = np.tile(pattern, 50)
    acf = token_acf(tokens)
    assert acf[0] == pytest.approx(1.0)
    assert acf[7] == pytest.approx(1.0) and acf[14] == pytest.approx(1.0)
    assert acf[1:7].max() < 0.95
    assert acf_period(tokens) == 7
    # brute-force check of the FFT against the definition, at a few lags
    n, centred = tokens.size, np.eye(4)[tokens] - np.eye(4)[tokens].mean(axis=0)
    for lag in (1, 3, 7, 20):
        direct = (centred[:-lag] * centred[lag:]).sum() / (n - lag)
        assert acf[lag] == pytest.approx(direct / ((centred * centred).sum() / n))


def test_acf_finds_no_period_in_noise() -> None:
    tokens = np.random.default_rng(0).integers(0, 6, size=2000)
    assert acf_period(tokens) is None


def test_steady_phase_repetition_is_not_taken_for_the_iteration() -> None:
    # 200 micro-batches on the first of two stages: forward-send/backward-recv alternate
    # for almost the whole iteration, so the ACF at lag 2 is close to 1.
    shape = PipelineRankShape(pp_size=2, stage=0, microbatches=200, dp_buckets=1)
    calls = generate(shape, 0.0, seed=5)
    tokens, _ = encode_calls(calls.call_types, calls.sizes)
    assert token_acf(tokens, 4)[2] >= 0.95
    found = iteration_times(calls.call_types, calls.sizes, calls.timestamps)
    assert found.period_calls == true_period(shape)


def test_encode_calls_distinguishes_type_and_size() -> None:
    tokens, vocabulary = encode_calls(
        np.array(["a", "a", "b", "a"]), np.array([1, 2, 1, 1], dtype=np.int64)
    )
    assert tokens[0] == tokens[3] and len(set(tokens.tolist())) == 3
    assert sorted(vocabulary) == [("a", 1), ("a", 2), ("b", 1)]


def test_too_short_a_capture_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least two calls"):
        iteration_times(np.array(["a"]), np.array([1]), np.array([0.0]))
    one_iteration = np.array(["a", "b", "b", "c"])
    with pytest.raises(ValueError, match="fewer than two iterations"):
        iteration_times(one_iteration, np.ones(4, dtype=np.int64), np.arange(4.0))
    with pytest.raises(ValueError, match="one entry per call"):
        iteration_times(one_iteration, np.ones(4, dtype=np.int64), np.arange(3.0))
