"""The colour scale of a worker heatmap: the PNG and the HTML report use the same one.

Colour is fixed, S_w 1.0 (palest) to 1.5 (darkest), the scale of the reference analyzer's
published heatmaps: the same shade means the same slowdown in every job and every episode.
A scale stretched from a job's lowest to its highest cell drew a uniformly slow job (SE:
every cell 1.12-1.20) as a dark "hot spot" and a healthy one's noise as red. What the fixed
scale cannot show, the spread inside a job, the labels carry: the job's own range is stated
beside the scale, and cells are labelled with as many decimals as that range needs for
neighbouring cells to read differently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: The fixed colour range of S_w, as in the reference analyzer's published figures.
FIXED_LOW, FIXED_HIGH = 1.0, 1.5
#: Label decimals are chosen for a range at least this wide: S_w differences below it are
#: noise, and four decimals of noise help nobody.
MIN_SPAN = 0.05
#: Cells over the job's range get about this many distinct labels.
LABEL_STEPS = 20


@dataclass(frozen=True)
class ColourScale:
    #: The job's own lowest and highest finite cell (NaN when it has none).
    job_low: float
    job_high: float
    decimals: int
    low: float = FIXED_LOW
    high: float = FIXED_HIGH

    def position(self, value: float) -> float:
        """0 at `low` (palest) to 1 at `high` (darkest), clamped."""
        return min(max((value - self.low) / (self.high - self.low), 0.0), 1.0)

    def label(self, value: float) -> str:
        return f"{value:.{self.decimals}f}"

    def fixed_text(self) -> str:
        return f"colour scale fixed at S_w {self.low:.1f} (palest) to {self.high:.1f} (darkest)"

    def job_text(self) -> str:
        """The job's own range, and how much of it lies off the fixed scale."""
        if not math.isfinite(self.job_low):
            return "this job has no S_w yet"
        text = f"this job's S_w: {self.label(self.job_low)} to {self.label(self.job_high)}"
        if self.job_high > self.high:
            text += f" (cells above {self.high:.1f} drawn darkest)"
        return text

    def describe(self) -> str:
        return f"{self.fixed_text()}; {self.job_text()}"


def colour_scale(values: np.ndarray) -> ColourScale:
    """The scale of one heatmap's finite `values`: fixed colours, the job's own range and
    the label decimals it needs.

    >>> colour_scale(np.array([1.118, 1.151, 1.204])).describe()
    "colour scale fixed at S_w 1.0 (palest) to 1.5 (darkest); this job's S_w: 1.118 to 1.204"
    >>> scale = colour_scale(np.array([1.001, 1.002]))  # a healthy job stays pale
    >>> round(scale.position(1.002), 3), scale.job_text()
    (0.004, "this job's S_w: 1.001 to 1.002")
    """
    finite = np.asarray(values, dtype=float)
    finite = finite[np.isfinite(finite)]
    if not finite.size:
        return ColourScale(math.nan, math.nan, 3)
    job_low, job_high = float(finite.min()), float(finite.max())
    span = max(job_high - job_low, MIN_SPAN)
    decimals = min(max(2, math.ceil(-math.log10(span / LABEL_STEPS))), 4)
    return ColourScale(job_low, job_high, decimals)
