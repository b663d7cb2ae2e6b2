"""Change-point detection: accuracy on generated fail-slow series, spikes, restarts."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from lagscope.simulator.bocd import (
    BocdBank,
    BocdConfig,
    ChangePoint,
    relative_change,
    sliding_window_changepoints,
)
from lagscope.simulator.series_gen import (
    FailSlowSeries,
    SeriesGenConfig,
    generate_fail_slow_set,
    score_series,
    stack_series,
)

N_SERIES = 200
TOLERANCE = 3


def run_bank(matrix: np.ndarray, config: BocdConfig | None = None) -> list[ChangePoint]:
    bank = BocdBank(matrix.shape[1], config)
    events: list[ChangePoint] = []
    for row in matrix:
        events.extend(bank.update(row))
    return events


@pytest.fixture(scope="module")
def generated() -> tuple[list[FailSlowSeries], list[list[tuple[int, str]]], BocdConfig]:
    series = generate_fail_slow_set(N_SERIES, seed=20260415)
    config = BocdConfig()
    detected: list[list[tuple[int, str]]] = [[] for _ in series]
    for event in run_bank(stack_series(series), config):
        detected[event.series].append((event.index, event.kind))
    return series, detected, config


def test_generator_covers_the_brief() -> None:
    series = generate_fail_slow_set(60, seed=3)
    config = SeriesGenConfig()
    episodes = [e for s in series for e in s.episodes]
    assert any(not s.episodes for s in series)
    assert all(0.05 <= e.slowdown <= 0.90 for e in episodes)
    durations = [(e.end - e.start) * s.base_iteration_s / 60 for s in series for e in s.episodes]
    assert min(durations) >= config.episode_minutes[0] - 0.2
    assert max(durations) <= config.episode_minutes[1] + 0.2
    assert all(1.0 <= s.base_iteration_s <= 10.0 and 0.01 <= s.jitter_cv <= 0.05 for s in series)
    assert sum(s.spike_indices.size for s in series) > 0
    for s in series:
        assert np.all(np.diff(s.spike_indices) > 1), "spikes must be single-step"
    again = generate_fail_slow_set(60, seed=3)
    assert all(np.array_equal(a.values, b.values) for a, b in zip(series, again, strict=True))


def test_bocd_finds_onsets_and_recoveries_and_beats_the_baseline(generated, capsys) -> None:
    series, detected, config = generated
    threshold = config.min_relative_change
    scores = [
        score_series(s, d, min_relative_change=threshold, tolerance=TOLERANCE)
        for s, d in zip(series, detected, strict=True)
    ]
    baseline_scores = [
        score_series(
            s,
            [
                (index, kind)
                for index, kind, *_ in sliding_window_changepoints(s.values, 20, threshold)
            ],
            min_relative_change=threshold,
            tolerance=TOLERANCE,
        )
        for s in series
    ]
    accuracy = np.mean([score.correct for score in scores])
    baseline_accuracy = np.mean([score.correct for score in baseline_scores])
    errors = np.array([e for score in scores for e in score.location_errors])
    with capsys.disabled():
        print(
            f"\nBOCD per-series accuracy {accuracy:.3f}, sliding-window baseline "
            f"{baseline_accuracy:.3f} ({N_SERIES} series); onset/recovery location error: "
            f"mean |e| {np.abs(errors).mean():.2f}, max |e| {np.abs(errors).max()} "
            f"over {errors.size} changes"
        )
    assert errors.size > N_SERIES  # the generated set really has changes to find
    assert accuracy >= 0.99
    assert np.abs(errors).max() <= TOLERANCE
    assert accuracy > baseline_accuracy


def test_no_change_point_on_series_without_episode(generated) -> None:
    series, detected, _ = generated
    clean = [d for s, d in zip(series, detected, strict=True) if not s.episodes]
    assert len(clean) >= N_SERIES // 10
    assert all(d == [] for d in clean)


def test_onset_is_located_within_three_observations(generated) -> None:
    series, detected, _ = generated
    for s, found in zip(series, detected, strict=True):
        for episode in s.episodes:
            if episode.slowdown < 0.125:
                continue  # near the 10 % verification threshold either outcome is right
            onsets = [index for index, kind in found if kind == "onset"]
            assert min(abs(index - episode.start) for index in onsets) <= TOLERANCE


def step_series(levels: list[tuple[int, float]], cv: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    values = np.concatenate([np.full(n, level) for n, level in levels])
    return values * (1.0 + cv * rng.standard_normal(values.size))


def test_onset_and_recovery_carry_means_probability_and_position() -> None:
    values = step_series([(300, 2.0), (200, 3.0), (300, 2.0)], cv=0.02, seed=1)
    events = run_bank(values[:, None])
    assert [(e.kind, e.index) for e in events] == [("onset", 300), ("recovery", 500)]
    onset, recovery = events
    assert onset.before_mean == pytest.approx(2.0, rel=0.01)
    assert onset.after_mean == pytest.approx(3.0, rel=0.01)
    assert recovery.before_mean == pytest.approx(3.0, rel=0.01)
    assert recovery.after_mean == pytest.approx(2.0, rel=0.01)
    for event in events:
        assert 0.5 <= event.probability <= 1.0
        # declared once the new regime has lasted min_regime_length, within the lag bound
        assert 8 <= event.detected_at - event.index <= BocdConfig().max_detection_lag + 2


def test_lone_spikes_never_make_a_change_point() -> None:
    values = step_series([(2000, 5.0)], cv=0.03, seed=2)
    values[[100, 400, 401 + 2, 900, 1500, 1999]] *= [3.0, 8.0, 0.3, 2.0, 4.0, 5.0]
    assert run_bank(values[:, None]) == []


def test_spike_inside_a_new_regime_does_not_move_its_onset() -> None:
    values = step_series([(300, 2.0), (300, 2.6)], cv=0.02, seed=3)
    values[[296, 303]] *= 4.0
    events = run_bank(values[:, None])
    assert [(e.kind, e.index) for e in events] == [("onset", 300)]


def test_verification_rejects_changes_below_the_threshold() -> None:
    values = step_series([(300, 2.0), (300, 2.1)], cv=0.01, seed=4)  # a clear 5 % step
    assert run_bank(values[:, None]) == []
    lenient = run_bank(values[:, None], BocdConfig(min_relative_change=0.03))
    assert [(e.kind, abs(e.index - 300) <= TOLERANCE) for e in lenient] == [("onset", True)]


def test_missing_observation_leaves_the_series_untouched() -> None:
    values = step_series([(60, 2.0)], cv=0.02, seed=5)
    bank = BocdBank(2)
    for value in values[:50]:
        bank.update(np.array([value, value]))
    before = bank.state_dict()
    bank.update(np.array([np.nan, 2.0]))
    after = bank.state_dict()
    for name in ("log_run_prob", "mean", "beta", "history_values", "obs_count"):
        np.testing.assert_array_equal(before[name][0], after[name][0])
        assert not np.array_equal(before[name][1], after[name][1])


def test_missing_steps_keep_step_indices() -> None:
    values = step_series([(300, 2.0), (300, 3.0)], cv=0.02, seed=6)
    with_gaps = np.full(2 * values.size, np.nan)
    with_gaps[::2] = values  # the series reports every other step
    events = run_bank(with_gaps[:, None])
    assert [(e.kind, e.index) for e in events] == [("onset", 600)]


def test_restored_bank_continues_exactly_like_an_uninterrupted_one() -> None:
    series = generate_fail_slow_set(12, seed=11)
    matrix = stack_series(series)[:2500]
    matrix[::7, 3] = np.nan
    uninterrupted = run_bank(matrix)

    bank = BocdBank(matrix.shape[1])
    resumed: list[ChangePoint] = []
    cut = 1234
    for row in matrix[:cut]:
        resumed.extend(bank.update(row))
    buffer = io.BytesIO()
    np.savez(buffer, **bank.state_dict())  # what a restart really goes through
    buffer.seek(0)
    with np.load(buffer) as saved:
        bank = BocdBank.from_state(dict(saved))
    for row in matrix[cut:]:
        resumed.extend(bank.update(row))
    assert len(uninterrupted) > 5
    assert resumed == uninterrupted


def test_state_is_bounded_by_series_times_run_length() -> None:
    config = BocdConfig(max_run_length=64, max_detection_lag=30)
    bank = BocdBank(3, config)
    rng = np.random.default_rng(0)
    for _ in range(500):
        bank.update(1.0 + 0.01 * rng.random(3))
    sizes = {name: np.asarray(value).size for name, value in bank.state_dict().items()}
    assert sizes["log_run_prob"] == 3 * 64
    assert max(sizes.values()) <= 3 * max(64, config.history_length)


def test_config_rejects_a_detection_lag_beyond_the_run_lengths() -> None:
    with pytest.raises(ValidationError):
        BocdConfig(max_run_length=40, max_detection_lag=39)
    with pytest.raises(ValueError, match="expected 2 values"):
        BocdBank(2).update(np.ones(3))


def test_relative_change_is_symmetric() -> None:
    assert relative_change(2.0, 2.2) == pytest.approx(0.1)
    assert relative_change(2.2, 2.0) == pytest.approx(0.1)


def test_baseline_finds_a_clean_step() -> None:
    values = step_series([(100, 1.0), (100, 1.5)], cv=0.0, seed=0)
    [(index, kind, before, after)] = sliding_window_changepoints(values, 10, 0.1)
    assert (index, kind, before, after) == (100, "onset", 1.0, 1.5)


def test_constant_warmup_then_a_step() -> None:
    values = np.concatenate([np.full(100, 3.0), np.full(100, 3.6)])  # no jitter at all
    events = run_bank(values[:, None])
    assert [(e.kind, e.index) for e in events] == [("onset", 100)]
    assert events[0].before_mean == 3.0 and events[0].after_mean == 3.6


@settings(max_examples=15, deadline=None)
@given(scale=st.floats(min_value=1e-3, max_value=1e3), seed=st.integers(0, 2**16))
def test_detections_do_not_depend_on_the_time_unit(scale: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    slowdown = rng.uniform(0.15, 0.9)
    values = step_series([(150, 1.0), (120, 1.0 + slowdown), (150, 1.0)], cv=0.03, seed=seed)
    reference = run_bank(values[:, None])
    rescaled = run_bank(scale * values[:, None])
    assert [(e.kind, e.index) for e in rescaled] == [(e.kind, e.index) for e in reference]
    assert [e.kind for e in reference] == ["onset", "recovery"]
    assert abs(reference[0].index - 150) <= TOLERANCE
    assert abs(reference[1].index - 270) <= TOLERANCE
