"""The in-run contrast of the monitor's benchmarks (`tests/bench/torch_bench.py`): a step
recorded between two unrecorded ones, against them, reads what recording costs and
nothing of the steps' own noise."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from tests.bench.torch_bench import neighbour_contrast

#: Step times of 80 ms that vary by 10 %, as the DDP job's on this machine.
_STEP_S, _CV = 0.080, 0.10


def _steps(
    n: int, seed: int, recorded_cost: float = 0.0, cv: float = _CV
) -> tuple[list[float], set[int]]:
    """`n` noisy steps; every even one recorded and `recorded_cost` (a share) longer."""
    rng = np.random.default_rng(seed)
    values = rng.normal(_STEP_S, cv * _STEP_S, n)
    recorded = set(range(0, n, 2))
    values[sorted(recorded)] *= 1 + recorded_cost
    return values.tolist(), recorded


@pytest.mark.parametrize("cv", [_CV, 0.30])
def test_noise_alone_reads_no_cost_however_much_the_steps_vary(cv: float) -> None:
    """A ratio over the neighbours would read about half the squared variation (4.5 % at
    30 %); the difference reads nothing but its own noise."""
    values, recorded = _steps(200_000, seed=1, cv=cv)
    contrasts = neighbour_contrast(values, recorded, skip=4)
    # Each contrast varies by sqrt(1.5) x cv of the median step: 4 standard errors.
    bound = 4 * math.sqrt(1.5) * cv * 100 / math.sqrt(len(contrasts))
    assert len(contrasts) > 90_000
    assert abs(statistics.fmean(contrasts)) < bound < 0.5 * cv**2 * 100


def test_a_recorded_step_cost_is_read_in_percent_of_the_median_step() -> None:
    values, recorded = _steps(40_000, seed=2, recorded_cost=0.01)
    assert math.isclose(
        statistics.fmean(neighbour_contrast(values, recorded, skip=4)), 1.0, abs_tol=0.2
    )


def test_only_steps_between_two_unrecorded_ones_count() -> None:
    values = [1.0, 1.0, 2.0, 1.0, 3.0, 3.0, 1.0, 1.0]
    # Step 2 counts; 4 and 5 are neighbours; 7 has no next step; 0 and 1 are warm-up.
    assert neighbour_contrast(values, {0, 2, 4, 5, 7}, skip=2, relative=False) == [1e6]
