"""Change-point detection: update throughput of a BOCD bank, and accuracy versus a
sliding-window baseline on generated fail-slow series.

Throughput is measured on stationary series after the warm-up (the steady state of a
running job): one update call advances every series of the bank by one step.
"""

from __future__ import annotations

import time

import numpy as np

from lagscope.simulator.bocd import BocdBank, BocdConfig, sliding_window_changepoints
from lagscope.simulator.series_gen import generate_fail_slow_set, score_series, stack_series

SERIES_COUNTS = (1, 1_000, 10_000)
RUN_LENGTHS = (100, 500)
ACCURACY_SERIES = 300
ACCURACY_SEED = 7
BASELINE_WINDOW = 20


def _updates_per_second(n_series: int, max_run_length: int) -> float:
    config = BocdConfig(max_run_length=max_run_length)
    bank = BocdBank(n_series, config)
    rng = np.random.default_rng(0)
    for _ in range(config.warmup + 2):
        bank.update(2.0 * (1.0 + 0.02 * rng.standard_normal(n_series)))
    budget_s = 2.0
    calls = 0
    started = time.perf_counter()
    while True:
        bank.update(2.0 * (1.0 + 0.02 * rng.standard_normal(n_series)))
        calls += 1
        elapsed = time.perf_counter() - started
        if elapsed >= budget_s or (calls >= 2000 and elapsed >= 0.5):
            return calls / elapsed


def _accuracy() -> tuple[float, float, float, int]:
    series = generate_fail_slow_set(ACCURACY_SERIES, seed=ACCURACY_SEED)
    config = BocdConfig()
    detected: list[list[tuple[int, str]]] = [[] for _ in series]
    bank = BocdBank(len(series), config)
    for row in stack_series(series):
        for event in bank.update(row):
            detected[event.series].append((event.index, event.kind))
    threshold = config.min_relative_change
    scores = [
        score_series(s, found, min_relative_change=threshold)
        for s, found in zip(series, detected, strict=True)
    ]
    baseline = [
        score_series(
            s,
            [
                (i, k)
                for i, k, *_ in sliding_window_changepoints(s.values, BASELINE_WINDOW, threshold)
            ],
            min_relative_change=threshold,
        )
        for s in series
    ]
    errors = np.abs([e for score in scores for e in score.location_errors])
    return (
        float(np.mean([s.correct for s in scores])),
        float(np.mean([s.correct for s in baseline])),
        float(errors.mean()),
        int(errors.max()),
    )


def run() -> list[dict]:
    rows: list[dict] = []
    for max_run_length in RUN_LENGTHS:
        for n_series in SERIES_COUNTS:
            rate = _updates_per_second(n_series, max_run_length)
            rows.append(
                {
                    "benchmark": f"bocd update, {n_series} series, R={max_run_length}",
                    "value": round(rate, 1),
                    "unit": "updates/s",
                    "target": ">= 1/s (one training step per second)",
                    "series_updates_per_s": round(rate * n_series),
                }
            )
    accuracy, baseline_accuracy, mean_error, max_error = _accuracy()
    rows += [
        {
            "benchmark": f"bocd per-series accuracy ({ACCURACY_SERIES} fail-slow series)",
            "value": accuracy,
            "unit": "fraction",
            "target": ">= 0.99",
        },
        {
            "benchmark": f"sliding-window baseline accuracy (window {BASELINE_WINDOW})",
            "value": baseline_accuracy,
            "unit": "fraction",
            "target": "below bocd",
        },
        {
            "benchmark": "bocd change location error, mean",
            "value": mean_error,
            "unit": "observations",
            "target": "<= 3",
        },
        {
            "benchmark": "bocd change location error, max",
            "value": max_error,
            "unit": "observations",
            "target": "<= 3",
        },
    ]
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
