"""Honest pictures: a heatmap colour range chosen per trace and stated, labels with enough
decimals to tell cells apart, per-step charts that break where steps were not sampled."""

from __future__ import annotations

import re

import numpy as np

from lagscope.dashboards.colour_scale import colour_scale
from lagscope.dashboards.report import heatmap_svg, line_svg
from tests.conftest import analyzed_reference


def test_se_heatmap_cells_are_distinguishable_and_the_range_is_stated() -> None:
    """At the old fixed 1.0-1.5 range with two significant digits every SE cell read
    "1.1" in one shade."""
    worker_slowdown = analyzed_reference("SE")[1].worker_slowdown
    svg = heatmap_svg(worker_slowdown)
    fills = re.findall(r'<rect [^>]*fill="(rgb\([^"]+\))"', svg)
    labels = re.findall(r'font-size="10" fill="#[0-9a-f]+">([0-9.]+)</text>', svg)
    assert len(fills) == worker_slowdown.size
    assert len(set(fills)) == len(np.unique(np.round(worker_slowdown, 4)))
    assert len(set(labels)) >= 3, labels
    low, high = float(worker_slowdown.min()), float(worker_slowdown.max())
    assert f"colour from {low:.3f} (palest) to {high:.3f} (darkest)" in svg


def test_a_healthy_job_is_not_stretched_to_dark_red() -> None:
    scale = colour_scale(np.array([1.001, 1.002, 1.003]))
    assert scale.position(1.003) < 0.05


def test_the_per_step_chart_breaks_where_steps_were_not_sampled() -> None:
    steps = [*range(100, 110), *range(200, 210)]
    values = [1.1] * 10 + [1.2] * 10
    values[3] = float("nan")
    svg = line_svg(steps, values, [])
    runs = re.findall(r'<polyline class="step-run" points="([^"]+)"', svg)
    assert [len(run.split()) for run in runs] == [3, 6, 10]


def test_heatmap_outlines_verified_workers_and_marks_their_crossings() -> None:
    """A straggler at (dp 1, pp 1) and a heavier stage 2: (dp 1, pp 2) scores highest
    without being slow itself."""
    worker_slowdown = np.array([[1.0, 1.0, 1.0], [1.0, 1.3, 1.0], [1.1, 1.4, 1.1]])
    svg = heatmap_svg(worker_slowdown, [(1, 1)])
    cells = re.findall(r'data-kind="(\w+)"[^>]*><title>dp (\d), pp (\d)', svg)
    kinds = {(int(dp), int(pp)): kind for kind, dp, pp in cells}
    assert kinds[1, 1] == "verified" and kinds[1, 2] == "crossing"
    assert kinds[0, 1] == "crossing"  # the verified worker's stage
    assert kinds[0, 0] == "unverified" and kinds[2, 2] == "unverified"
