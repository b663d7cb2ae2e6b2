"""The record of an episode every output shows, and the fit that bounds one once the steps
on both sides of it are known.

Episodes are found while the job runs (`online_episodes.py`), one closed step at a time:
the detector places an onset within its evidence window and a recovery after the worker
has been back for a few steps. At the end of the job, with the steps on both sides in hand,
`square_wave` fits the worker's own series with two levels near those bounds
(`episode_diagnosis.refined_bounds`): least squares on log values, lone spikes taken out,
a stretch kept only when it stands clear of the series' own step-to-step noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lagscope.simulator.diagnose import Diagnosis

#: Fewest steps back at the old level that make a recovery.
_MIN_RECOVERED_STEPS = 3
#: Fewest steps a raised stretch lasts (shorter ones are spikes), and fewest outside it.
_MIN_STRETCH_STEPS = 4
#: A stretch stands out from the noise by this many standard errors: with hundreds of
#: (onset, recovery) pairs tried on pure noise, a smaller bar finds stretches in it.
_MIN_Z = 5.0
#: Where the stretch ends is asked only once it is known to exist: a smaller bar.
_MIN_FALL_Z = 3.0


def square_wave(
    values: np.ndarray,
    first_onset: int,
    last_onset: int,
    min_rise: float = 0.10,
) -> tuple[int, int | None] | None:
    """The raised stretch of a ratio series that best fits it, by least squares on log
    values (lone spikes taken out first): (onset, recovery) positions, recovery None when
    the series stays raised to the end. The onset lies in [first_onset, last_onset]; None
    when no stretch is raised by `min_rise` over the rest and clear of the noise."""
    x = np.log(np.clip(values, 1e-9, None))
    finite = np.isfinite(x)
    x = np.where(finite, x, np.nanmedian(x) if finite.any() else 0.0)
    # A lone spike (a GC pause, a preempted step) is no stretch: replaced by the median of
    # itself and its neighbours when it lies 5 robust deviations from it.
    padded = np.concatenate([x[:1], x, x[-1:]])
    local = np.median(np.stack([padded[:-2], padded[1:-1], padded[2:]]), axis=0)
    spread = 1.4826 * np.median(np.abs(x - local)) or 1e-9
    x = np.where(np.abs(x - local) > 5 * spread, local, x)
    n = x.size
    if n < 2 * _MIN_STRETCH_STEPS:
        return None
    # Step-to-step noise, blind to the level shifts being looked for: differences of
    # neighbouring values.
    noise = 1.4826 * np.median(np.abs(x[1:] - x[:-1])) / np.sqrt(2) or 1e-9
    total = np.concatenate([[0.0], np.cumsum(x)])
    best, best_gain = None, 0.0
    for a in range(max(0, first_onset), min(last_onset, n - _MIN_STRETCH_STEPS) + 1):
        b = np.arange(a + _MIN_STRETCH_STEPS, n + 1)
        inside = total[b] - total[a]
        k = b - a
        outside_n = n - k
        mean_in = inside / k
        mean_out = np.where(outside_n > 0, (total[n] - inside) / np.maximum(outside_n, 1), np.nan)
        rise = mean_in - mean_out
        z = rise / (noise * np.sqrt(1 / k + 1 / np.maximum(outside_n, 1)))
        # SSE reduction of a two-level fit over one level: k*m*(mean_in - mean_out)^2/n.
        gain = np.where(
            (outside_n >= _MIN_STRETCH_STEPS) & (rise >= np.log1p(min_rise)) & (z >= _MIN_Z),
            k * outside_n * rise**2 / n,
            0.0,
        )
        i = int(np.argmax(gain))
        if gain[i] > best_gain:
            best, best_gain = (a, int(b[i])), float(gain[i])
    if best is None:
        return None
    onset, end = best
    if n - end >= _MIN_RECOVERED_STEPS:
        return onset, end
    return onset, _partial_recovery(x, onset, noise)


def _partial_recovery(x: np.ndarray, onset: int, noise: float) -> int | None:
    """Where a raised log series falls back most of the way after `onset` though it stays
    noisier or a little higher than before it (the straggler's machine still busy): the
    first split of [onset, end) whose fall (medians) is at least half of the rise and clear
    of the noise."""
    n = x.size
    baseline = float(np.mean(x[:onset])) if onset > 0 else None
    if baseline is None:
        return None
    for b in range(onset + _MIN_STRETCH_STEPS, n - _MIN_RECOVERED_STEPS + 1):
        raised, after = float(np.median(x[onset:b])), float(np.median(x[b:]))
        fall = raised - after
        z = fall / (noise * np.sqrt(1 / (b - onset) + 1 / (n - b)))
        if fall >= 0.5 * (raised - baseline) and z >= _MIN_FALL_Z:
            return b
    return None


@dataclass(frozen=True)
class Episode:
    """A slow period with a cause: the diagnosis of its own steps named one."""

    onset: int
    recovery: int | None
    diagnosis: Diagnosis
    series: tuple[str, ...] = ()
