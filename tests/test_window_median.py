"""The windowed median: exact after every step, whatever the values do."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lagscope.simulator.window_median import WindowMedian, replace_sorted

# Few distinct values: repeats (in the window, in what leaves, in what comes) are the
# hard case of a sorted multiset, and of a band whose bounds are tied values.
_few = st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 7.25])
_values = st.lists(_few, max_size=30)


@given(_values, st.data(), _values)
def test_the_window_is_the_sorted_multiset_after_the_swap(held, data, new):
    held = sorted(held)
    # What leaves is a sub-multiset of what the window holds, as the evicted step is.
    leaves = data.draw(st.lists(st.booleans(), min_size=len(held), max_size=len(held)))
    leaving = [value for value, out in zip(held, leaves, strict=True) if out]
    remaining = [value for value, out in zip(held, leaves, strict=True) if not out]
    got = replace_sorted(np.array(held), np.array(leaving), np.array(sorted(new)))
    assert got.tolist() == sorted(remaining + new)


def _sorted_window_median(window: np.ndarray) -> float:
    """What the running comm ideal read before: the middle of the sorted window, the mean
    of an even count's two middle values taken in float64 (np.median takes it in the
    values' own float32)."""
    ordered = np.sort(window)
    middle = ordered.size // 2
    if ordered.size % 2:
        return float(ordered[middle])
    return (float(ordered[middle - 1]) + float(ordered[middle])) / 2


def _check(window_steps: int, steps: list[np.ndarray]) -> WindowMedian:
    median = WindowMedian(window_steps)
    for index, values in enumerate(steps):
        median.add(np.sort(values))
        window = np.concatenate(steps[max(0, index + 1 - window_steps) : index + 1])
        assert median.value() == _sorted_window_median(window), index
        assert median.below + median.band.size + median.above == window.size
    return median


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 6),
    st.lists(st.lists(_few, min_size=1, max_size=12), min_size=1, max_size=40),
)
def test_the_median_is_exact_after_every_step_with_ties(window_steps, steps):
    _check(window_steps, [np.array(s, dtype=np.float32) for s in steps])


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 20), st.integers(0, 2**32 - 1), st.sampled_from([-1.0, 0.0, 0.5, 3.0]))
def test_the_median_is_exact_while_the_values_drift(window_steps, seed, drift):
    """A level that moves by `drift` a step takes the median out of any band; steps of
    different sizes (a comm op type whose count varies) too."""
    rng = np.random.default_rng(seed)
    steps = [
        (rng.lognormal(0.0, 0.3, rng.integers(1, 40)) + drift * step).astype(np.float32)
        for step in range(60)
    ]
    _check(window_steps, steps)


def test_a_steady_window_is_rebuilt_rarely_and_a_drifting_one_widens():
    rng = np.random.default_rng(7)
    steady = _check(64, [rng.normal(1.0, 0.1, 96).astype(np.float32) for _ in range(400)])
    assert steady.rebuilds <= 3, steady.rebuilds
    assert steady.band.size < steady.size / 4
    drifting = _check(64, [rng.normal(step, 0.1, 96).astype(np.float32) for step in range(400)])
    assert drifting.band.size > steady.band.size
