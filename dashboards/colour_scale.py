"""The colour scale of a worker heatmap, chosen per trace: the PNG and the HTML report use
the same one.

A fixed 1.0-1.5 range hides the spread of most jobs (every SE cell read "1.1" in one flat
colour). The range runs from the lowest to the highest cell, but spans at least
`MIN_SPAN`, so that a healthy job's few per mille of noise stay pale rather than being
stretched to dark red. Cells are labelled with as many decimals as the range needs for
neighbouring shades to read differently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: The narrowest colour range: S_w differences below this are noise, and look it.
MIN_SPAN = 0.05
#: Cells over the range get about this many distinct labels.
LABEL_STEPS = 20


@dataclass(frozen=True)
class ColourScale:
    low: float
    high: float
    decimals: int

    def position(self, value: float) -> float:
        """0 at `low` (palest) to 1 at `high` (darkest)."""
        return min(max((value - self.low) / (self.high - self.low), 0.0), 1.0)

    def label(self, value: float) -> str:
        return f"{value:.{self.decimals}f}"

    def describe(self) -> str:
        return f"colour from {self.label(self.low)} (palest) to {self.label(self.high)} (darkest)"


def colour_scale(values: np.ndarray) -> ColourScale:
    """The scale for the finite `values` of one heatmap.

    >>> scale = colour_scale(np.array([1.081, 1.094, 1.112, 1.131]))
    >>> scale.describe()
    'colour from 1.081 (palest) to 1.131 (darkest)'
    >>> colour_scale(np.array([1.001, 1.002])).describe()  # a healthy job stays pale
    'colour from 1.001 (palest) to 1.051 (darkest)'
    """
    finite = np.asarray(values, dtype=float)
    finite = finite[np.isfinite(finite)]
    low = float(finite.min()) if finite.size else 1.0
    high = max(float(finite.max()) if finite.size else 1.0, low + MIN_SPAN)
    decimals = min(max(2, math.ceil(-math.log10((high - low) / LABEL_STEPS))), 4)
    return ColourScale(low, high, decimals)
