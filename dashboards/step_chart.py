"""The geometry of the report's per-step slowdown chart (the `line` macro of
templates/charts.html.j2 draws it).

Both axes are real axes: ticks at round values, labelled, spaced so no two labels overlap.
Recorded traces often sample steps in bursts far apart (SE: steps 16-39, 403-437 and
808-838); drawn to scale such a run is three slivers on an empty axis. The step axis is
therefore cut where the steps jump by far more than their usual spacing: each burst gets
its share of the width, the cuts are marked on the axis, and a change point inside a cut
is drawn on it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from lagscope.dashboards.worker_grid import nice_step, text_width

WIDTH, HEIGHT = 900, 280
LEFT, RIGHT, TOP, BOTTOM = 62, 890, 16, 236
AXIS_FONT = 11
#: The width of a cut in the step axis, and the least width of a burst of steps (px).
CUT_PX, MIN_BURST_PX = 24, 48
#: A jump in step ids cuts the axis when it is this many times the usual spacing and this
#: share of the whole range.
CUT_SPACINGS, CUT_SHARE = 8, 0.05


def bursts(steps: np.ndarray) -> list[tuple[float, float]]:
    """The first and last step of each burst of the sorted `steps`.

    >>> bursts(np.array([16, 17, 20, 23, 403, 406, 407, 808]))
    [(16.0, 23.0), (403.0, 407.0), (808.0, 808.0)]
    >>> bursts(np.arange(0, 100, 10))  # sampled every 10 steps: one burst
    [(0.0, 90.0)]
    """
    xs = np.asarray(steps, dtype=float)
    if xs.size < 2:
        return [(float(xs[0]), float(xs[0]))] if xs.size else []
    jumps = np.diff(xs)
    spacing = float(np.median(jumps))
    cut = (jumps > CUT_SPACINGS * spacing) & (jumps > CUT_SHARE * (xs[-1] - xs[0]))
    starts = np.concatenate([[0], np.flatnonzero(cut) + 1])
    ends = np.concatenate([np.flatnonzero(cut), [xs.size - 1]])
    return [(float(xs[a]), float(xs[b])) for a, b in zip(starts, ends, strict=True)]


class StepAxis:
    """Step id to x pixel over the bursts, each burst a stretch of the axis in proportion
    to its steps (at least MIN_BURST_PX), cuts of CUT_PX between them."""

    def __init__(self, spans: list[tuple[float, float]], left: float, right: float) -> None:
        self.spans = spans
        usable = right - left - CUT_PX * (len(spans) - 1)
        lengths = [b - a for a, b in spans]
        total = sum(lengths)
        # Each burst's least width first; the rest in proportion to its steps.
        spare = usable - MIN_BURST_PX * len(spans)
        self.px_per_step = spare / total if total > 0 else 0.0
        self.stretches: list[tuple[float, float]] = []
        x = left
        for length in lengths:
            width = MIN_BURST_PX + length * self.px_per_step
            self.stretches.append((x, x + width))
            x += width + CUT_PX

    def x(self, step: float) -> float:
        for i, ((a, b), (x0, x1)) in enumerate(zip(self.spans, self.stretches, strict=True)):
            if step <= b or i == len(self.spans) - 1:
                if step < a:  # in the cut before this burst (or before the first)
                    return x0 - CUT_PX / 2 if i else x0
                if b == a:
                    return (x0 + x1) / 2
                pad = MIN_BURST_PX / 2
                return x0 + pad + (min(step, b) - a) / (b - a) * (x1 - x0 - 2 * pad)
        raise AssertionError("unreachable")

    def cuts(self) -> list[float]:
        """The middle of each cut."""
        ends = [x1 for _, x1 in self.stretches[:-1]]
        return [end + CUT_PX / 2 for end in ends]


def _step_ticks(axis: StepAxis) -> list[tuple[float, int]]:
    """(x, step) of labelled ticks: round step ids inside each burst, at least a label and
    a space apart; a burst too short for a round id is labelled at its first step."""
    widest = max(text_width(f"{int(b)}", AXIS_FONT) for _, b in axis.spans)
    px_per_step = axis.px_per_step or 1.0
    every = max(1, int(nice_step((widest + 14) / px_per_step)))  # step ids are whole
    ticks = []
    for a, b in axis.spans:
        first = math.ceil(a / every) * every
        inside = list(np.arange(first, b + 1e-9, every)) if first <= b else []
        ticks += [(axis.x(float(s)), int(s)) for s in inside] or [(axis.x(a), int(a))]
    kept: list[tuple[float, int]] = []
    for x, step in sorted(ticks):
        half = text_width(str(step), AXIS_FONT) / 2
        if not kept or x - half >= kept[-1][0] + text_width(str(kept[-1][1]), AXIS_FONT) / 2 + 6:
            kept.append((x, step))
    return kept


def _value_ticks(low: float, high: float) -> tuple[list[float], int]:
    """Round ticks covering [low, high], four to eight of them, and their decimals."""
    step = nice_step((high - low) / 6)
    first, last = math.floor(low / step), math.ceil(high / step)
    decimals = max(2, -math.floor(math.log10(step)))
    return [round(i * step, 10) for i in range(first, last + 1)], decimals


def _thinned(run: list[tuple[float, float]], limit: int) -> list[tuple[float, float]]:
    """A run of points (pixels) with at most about `limit` of them: per pixel column the
    first, lowest, highest and last point, so no spike is lost."""
    if len(run) <= limit:
        return run
    points = np.array(run)
    columns = np.floor(points[:, 0]).astype(int)  # non-decreasing: the run is in step order
    starts = np.flatnonzero(np.diff(columns, prepend=columns[0] - 1))
    ends = np.append(starts[1:], len(run)) - 1
    kept = {*starts.tolist(), *ends.tolist()}
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        ys = points[a : b + 1, 1]
        kept |= {a + int(ys.argmin()), a + int(ys.argmax())}
    return [run[i] for i in sorted(kept)]


def line_view(
    steps: list[int], values: list[float], changes: list[dict[str, Any]]
) -> dict[str, Any]:
    """The geometry of the per-step slowdown chart, change points as dashed lines."""
    view: dict[str, Any] = {
        "width": WIDTH,
        "height": HEIGHT,
        "left": LEFT,
        "right": RIGHT,
        "top": TOP,
        "bottom": BOTTOM,
        "has_steps": bool(steps),
    }
    if not steps:
        return view
    xs = np.asarray(steps, dtype=float)
    ys = np.asarray(values, dtype=float)
    order = np.argsort(xs, kind="stable")
    xs, ys = xs[order], ys[order]
    spans = bursts(xs)
    if len(spans) * (MIN_BURST_PX + CUT_PX) > (RIGHT - LEFT) / 2:
        spans = [(float(xs[0]), float(xs[-1]))]  # too many bursts to cut: one to scale
    axis = StepAxis(spans, LEFT, RIGHT)
    finite = ys[np.isfinite(ys)]
    low = min(1.0, float(finite.min())) if finite.size else 1.0
    high = max(1.05, float(finite.max())) if finite.size else 1.05
    value_ticks, decimals = _value_ticks(low, high)
    y0, y1 = value_ticks[0], value_ticks[-1]

    def py(y: float) -> float:
        return TOP + (y1 - y) / (y1 - y0) * (BOTTOM - TOP)

    view["value_ticks"] = [
        {
            "y": f"{py(t):.1f}",
            "label_y": f"{py(t) + AXIS_FONT * 0.35:.1f}",
            "label": f"{t:.{decimals}f}",
        }
        for t in value_ticks
    ]
    view["step_ticks"] = [{"x": f"{x:.1f}", "label": str(step)} for x, step in _step_ticks(axis)]
    view["tick_label_y"] = BOTTOM + AXIS_FONT + 6
    view["cuts"] = [round(x, 1) for x in axis.cuts()]
    view["axis_title_y"] = HEIGHT - 8
    view["changes"] = [
        {
            "x": f"{axis.x(float(change['step'])):.1f}",
            "colour": "#d62728" if change["kind"] == "onset" else "#2ca02c",
            "label": f"{change['kind']} at step {change['step']} ({change['series']})",
        }
        for change in changes
    ]
    runs = [
        _thinned([(axis.x(x), py(y)) for x, y in run], 4 * WIDTH) for run in sampled_runs(xs, ys)
    ]
    view["runs"] = [" ".join(f"{x:.1f},{y:.1f}" for x, y in run) for run in runs if len(run) > 1]
    view["points"] = [
        {"x": f"{run[0][0]:.1f}", "y": f"{run[0][1]:.1f}"} for run in runs if len(run) == 1
    ]
    return view


def sampled_runs(xs: np.ndarray, ys: np.ndarray) -> list[list[tuple[float, float]]]:
    """The points of a per-step series cut where steps were not sampled: a step without a
    value, or a jump in step ids wider than the series' usual spacing. A line drawn across
    such a gap would show values nobody measured.

    >>> [[x for x, _ in run] for run in sampled_runs(
    ...     np.array([1, 2, 3, 10, 11, 12]), np.array([1.0, 1.1, np.nan, 1.2, 1.0, 1.1]))]
    [[1.0, 2.0], [10.0, 11.0, 12.0]]
    """
    order = np.argsort(xs, kind="stable")
    xs, ys = np.asarray(xs, dtype=float)[order], np.asarray(ys, dtype=float)[order]
    spacing = float(np.median(np.diff(xs))) if xs.size > 1 else 1.0
    runs: list[list[tuple[float, float]]] = []
    current: list[tuple[float, float]] = []
    previous_x: float | None = None
    for x, y in zip(xs.tolist(), ys.tolist(), strict=True):
        gap = previous_x is not None and x - previous_x > 1.5 * spacing
        if not math.isfinite(y) or gap:
            if current:
                runs.append(current)
            current = []
        if math.isfinite(y):
            current.append((x, y))
        previous_x = x
    if current:
        runs.append(current)
    return runs
