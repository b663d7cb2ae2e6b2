"""The exact median of a sliding window of steps' values, read after every step.

The running comm ideal of a job (`stream_app/step_compute.py`) is, per comm op type, the
median of the op type's costs over the job's retained steps: up to 256 steps of up to 384
values each. Keeping the whole window sorted costs a pass over its ~98,000 values per step
(masks and copies, ~60 µs), as much as the engine pass of a streaming worker's per-step
compute on the AR trace.

Only the ranks around the median are kept sorted here: a band of the window's values from
`low` to `high` (every value equal to either included), and the counts of the values below
and above it. A step's values in and out move the counts or the band, so an update costs a
pass over the band, not the window. When the median's ranks leave the band (the values
drifted), the band is rebuilt from the window's steps, around the new median, and so is a
band that grew four times wider than asked (a window filling up); a band outgrown within
`_QUICK_REBUILD_STEPS` steps is rebuilt twice as wide, up to the whole window (and half as
wide after a band that held four times as long), so a median that keeps drifting costs
about what the sorted window did, plus a rebuild now and then.

>>> median = WindowMedian(window_steps=2)
>>> median.add(np.array([1.0, 5.0]))
>>> median.add(np.array([2.0, 3.0, 4.0]))
>>> median.value()
3.0
>>> median.add(np.array([10.0, 11.0]))  # the first step leaves the window
>>> median.value()
4.0
"""

from __future__ import annotations

from collections import deque

import numpy as np

#: The band's half-width at first, in ranks, as a multiple of a step's values.
_MARGIN_STEPS = 4
#: A band that held for fewer steps than this is rebuilt wider.
_QUICK_REBUILD_STEPS = 32
#: A band grown this many times wider than its margins ask (a window filling up with
#: values in its range) is rebuilt narrower.
_WIDE_BAND_FACTOR = 4


class WindowMedian:
    """The median of the values of the last `window_steps` steps added."""

    def __init__(self, window_steps: int) -> None:
        self.steps: deque[np.ndarray] = deque(maxlen=window_steps)
        #: Values in the window.
        self.size = 0
        #: The window's values v with low <= v <= high, sorted.
        self.band = np.zeros(0)
        self.low = 0.0
        self.high = 0.0
        #: How many of the window's values lie below `low`, and above `high`.
        self.below = 0
        self.above = 0
        #: The band's half-width in ranks at its next rebuild (0: set at the first).
        self.margin = 0
        #: Steps added since the band was last rebuilt.
        self.held_steps = 0
        #: Rebuilds so far (for tests and benchmarks).
        self.rebuilds = 0

    def add(self, values: np.ndarray) -> None:
        """Add a step's values (sorted ascending); the oldest step leaves a full window."""
        full = len(self.steps) == self.steps.maxlen
        gone = self.steps[0] if full else values[:0]
        self.steps.append(values)
        self.size += values.size - gone.size
        self.held_steps += 1
        if self.band.size:
            band_gone = self._count_out(gone, -1)
            band_new = self._count_out(values, +1)
            self.band = replace_sorted(self.band, band_gone, band_new)
        if not self._holds_median():
            self._rebuild(values.size, outgrown=True)
        elif self.band.size > _WIDE_BAND_FACTOR * (2 * self.margin + 1):
            self._rebuild(values.size, outgrown=False)

    def value(self) -> float:
        """The window's median (the mean of the two middle values of an even count)."""
        middle = self.size // 2 - self.below
        if self.size % 2:
            return float(self.band[middle])
        return (float(self.band[middle - 1]) + float(self.band[middle])) / 2

    def _count_out(self, values: np.ndarray, sign: int) -> np.ndarray:
        """Count `values` (sorted) below and above the band; return those inside it."""
        first = int(np.searchsorted(values, self.low, side="left"))
        end = int(np.searchsorted(values, self.high, side="right"))
        self.below += sign * first
        self.above += sign * (values.size - end)
        return values[first:end]

    def _holds_median(self) -> bool:
        if self.size == 0:
            return True
        low_rank, high_rank = (self.size - 1) // 2, self.size // 2
        return self.below <= low_rank and high_rank < self.below + self.band.size

    def _rebuild(self, step_values: int, *, outgrown: bool) -> None:
        base = max(1, step_values) * _MARGIN_STEPS
        if not self.margin:
            self.margin = base
        elif outgrown and self.held_steps < _QUICK_REBUILD_STEPS:
            self.margin = min(2 * self.margin, self.size)
        elif outgrown and self.held_steps >= 4 * _QUICK_REBUILD_STEPS:
            self.margin = max(base, self.margin // 2)
        self.held_steps = 0
        self.rebuilds += 1
        window = np.sort(np.concatenate(self.steps))
        low_rank, high_rank = (self.size - 1) // 2, self.size // 2
        self.low = window[max(0, low_rank - self.margin)]
        self.high = window[min(self.size - 1, high_rank + self.margin)]
        first = int(np.searchsorted(window, self.low, side="left"))
        end = int(np.searchsorted(window, self.high, side="right"))
        self.band = window[first:end].copy()
        self.below, self.above = first, self.size - end


def replace_sorted(values: np.ndarray, gone: np.ndarray, new: np.ndarray) -> np.ndarray:
    """`values` (sorted) without the elements of `gone` and with those of `new` (both
    sorted; all of `gone` present), sorted. Masks, not `np.delete`/`np.insert`: their
    generic paths cost ~70 µs a call.

    >>> replace_sorted(np.array([1.0, 2.0, 2.0, 5.0]), np.array([2.0]), np.array([0.0, 3.0]))
    array([0., 1., 2., 3., 5.])
    """
    kept = values
    if gone.size:
        # Equal values in `gone` must hit distinct positions: the k-th copy goes k further.
        repeat_rank = np.arange(gone.size) - np.searchsorted(gone, gone, side="left")
        keep = np.ones(values.size, dtype=bool)
        keep[np.searchsorted(values, gone, side="left") + repeat_rank] = False
        kept = values[keep]
    if not new.size:
        return kept
    at = np.searchsorted(kept, new) + np.arange(new.size)
    out = np.empty(kept.size + new.size, dtype=np.result_type(kept, new))
    free = np.ones(out.size, dtype=bool)
    free[at] = False
    out[at] = new
    out[free] = kept
    return out
