"""The running comm median: a band around the median (`simulator/window_median.py`)
against the whole window kept sorted (what the worker did before), side by side.

One comm op type of a large retained window (256 steps x 384 values, the processor's
defaults), 1,200 steps, three ways the values move: steady; drifting (every step a little
higher, so the median leaves any band); and a jump (3x for 300 steps and back, as a
straggler's waits do). Interleaved rounds, the least per-step time of each.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import numpy as np

from lagscope.simulator.window_median import WindowMedian, replace_sorted

WINDOW_STEPS, VALUES_PER_STEP, STEPS, ROUNDS = 256, 384, 1_200, 3


def _middle(ordered: np.ndarray) -> float:
    middle = ordered.size // 2
    if ordered.size % 2:
        return float(ordered[middle])
    return (float(ordered[middle - 1]) + float(ordered[middle])) / 2


def _sorted_window(steps: list[np.ndarray]) -> float:
    window: deque[np.ndarray] = deque(maxlen=WINDOW_STEPS)
    merged = np.zeros(0, dtype=np.float32)
    for values in steps:
        gone = window[0] if len(window) == WINDOW_STEPS else values[:0]
        window.append(values)
        merged = replace_sorted(merged, gone, values)
        _middle(merged)
    return _middle(merged)


def _band(steps: list[np.ndarray]) -> float:
    median = WindowMedian(WINDOW_STEPS)
    for values in steps:
        median.add(values)
        median.value()
    return median.value()


def _per_step_us(function: Callable[[list[np.ndarray]], float], steps: list[np.ndarray]) -> float:
    began = time.perf_counter()
    function(steps)
    return (time.perf_counter() - began) / len(steps) * 1e6


def run() -> list[dict]:
    rng = np.random.default_rng(3)
    shapes: dict[str, Callable[[int], np.ndarray]] = {
        "steady": lambda _: rng.lognormal(0.0, 0.3, VALUES_PER_STEP),
        "drifting": lambda step: rng.lognormal(0.0, 0.3, VALUES_PER_STEP) + 0.01 * step,
        "a 3x jump for 300 steps": lambda step: (
            rng.lognormal(0.0, 0.3, VALUES_PER_STEP) * (3.0 if 300 <= step < 600 else 1.0)
        ),
    }
    rows = []
    for shape, values_at in shapes.items():
        steps = [np.sort(values_at(step).astype(np.float32)) for step in range(STEPS)]
        if _band(steps) != _sorted_window(steps):
            raise RuntimeError(f"the band's median differs from the sorted window's ({shape})")
        sorted_us, band_us = [], []
        for _ in range(ROUNDS):
            sorted_us.append(_per_step_us(_sorted_window, steps))
            band_us.append(_per_step_us(_band, steps))
        rows.append(
            {
                "benchmark": f"running comm median per step, {shape} "
                f"({WINDOW_STEPS} x {VALUES_PER_STEP} window): band",
                "value": min(band_us),
                "unit": "us",
                "target": "",
                "note": f"whole window kept sorted: {min(sorted_us):.0f} us "
                f"({min(sorted_us) / min(band_us):.1f}x); least of {ROUNDS} interleaved rounds",
            }
        )
    return rows
