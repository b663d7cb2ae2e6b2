"""Iteration time without step ids: error of the ACF method against the generator's truth,
for several 1F1B pipeline shapes with and without missing calls, and its speed."""

from __future__ import annotations

import time

import numpy as np

from lagscope.simulator.collective_gen import PipelineRankShape, generate_collective_calls
from lagscope.simulator.period import iteration_times

SHAPES = {
    "dp-only": PipelineRankShape(pp_size=1, stage=0, microbatches=1, dp_buckets=2),
    "pp4 first, 8 mb": PipelineRankShape(pp_size=4, stage=0, microbatches=8, dp_buckets=3),
    "pp8 last, 32 mb": PipelineRankShape(pp_size=8, stage=7, microbatches=32, dp_buckets=4),
    "pp16 middle, 64 mb": PipelineRankShape(pp_size=16, stage=5, microbatches=64, dp_buckets=2),
}
MISSING = (0.0, 0.01, 0.03)
STEPS = 300


def run() -> list[dict]:
    rows: list[dict] = []
    worst_error, worst_step_error, calls_per_s = 0.0, 0.0, []
    for number, shape in enumerate(SHAPES.values()):
        for missing in MISSING:
            rng = np.random.default_rng(1000 + number)
            calls = generate_collective_calls(
                rng, shape, n_steps=STEPS, jitter_cv=0.02, missing_fraction=missing
            )
            started = time.perf_counter()
            found = iteration_times(calls.call_types, calls.sizes, calls.timestamps)
            calls_per_s.append(calls.call_types.size / (time.perf_counter() - started))
            anchor_type, anchor_size = found.anchor
            is_anchor = (calls.call_types == anchor_type) & (calls.sizes == anchor_size)
            steps = calls.true_step[is_anchor]
            starts = calls.true_step_starts
            true_mean = (starts[steps[-1]] - starts[steps[0]]) / (steps[-1] - steps[0])
            worst_error = max(worst_error, abs(found.mean_iteration_time / true_mean - 1.0))
            # per iteration, against the true start-to-start duration of the same iteration
            durations = np.diff(starts)[steps[0] : steps[0] + found.iteration_times.size]
            known = np.isfinite(found.iteration_times)
            relative = np.abs(found.iteration_times[known] / durations[known] - 1.0)
            worst_step_error = max(worst_step_error, float(np.median(relative)))
    rows.append(
        {
            "benchmark": "ACF iteration time: worst error of the mean "
            f"({len(SHAPES)} shapes x missing {', '.join(f'{m:.0%}' for m in MISSING)})",
            "value": float(worst_error),
            "unit": "fraction",
            "target": "<= 0.01",
        }
    )
    rows.append(
        {
            "benchmark": "ACF iteration time: worst median per-iteration deviation from "
            "start-to-start durations",
            "value": float(worst_step_error),
            "unit": "fraction",
            # anchor-to-anchor and start-to-start differ by the jitter of the anchor's
            # offset within the iteration (2 % per op here), not by an estimation error
            "target": "informational",
        }
    )
    rows.append(
        {
            "benchmark": "ACF iteration time: calls processed per second (slowest case)",
            "value": round(min(calls_per_s)),
            "unit": "calls/s",
            "target": ">= 100000",
        }
    )
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
