"""The record of an episode every output shows, and the fit that bounds one once the steps
on both sides of it are known.

Episodes are found while the job runs (`online_episodes.py`), one closed step at a time:
the detector places an onset within its evidence window and a recovery after the worker
has been back for a few steps. At the end of the job, with the steps on both sides in hand,
`square_wave` fits the worker's own series with two levels near those bounds
(`episode_diagnosis.refined_bounds`): least squares on log values, lone spikes taken out,
a stretch kept only when it stands clear of the series' own step-to-step noise.

An episode takes three types on its way out, each made from the one before:

- `online_episodes.WorkerEpisode`, the detector's: one worker's rise in one kind of its own
  time, open until it recovers, with the levels that opened it. No output shows it as is.
- `simulator.job_story.EpisodeState`, a host's: that episode after a step, named (its
  diagnosis) and priced (its cost). One row of the `episodes` table (`store/rows.py`),
  which the dashboards and alert rules read.
- `Episode`, here: what a report prints, its bounds, the diagnosis that named it (machines
  named) and the series it shows in (`JobReport.episodes`, `lagscope analyze`'s page).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from lagscope.simulator.fields import Bound, FieldErrors, check_fields

if TYPE_CHECKING:
    from lagscope.simulator.diagnose import Diagnosis


@dataclass(frozen=True, kw_only=True)
class StretchFit:
    """What `square_wave` takes for a raised stretch of a worker's series. With these
    values the end-of-job bounds of 112 of the 125 straggler runs among 183 real torch
    jobs with a planted straggler or none lie within 3 steps of the planted onset and
    recovery; a change is measured there again."""

    #: The least rise of the stretch over the rest (a share). Low on purpose: the fit only
    #: places the bounds of an episode the live detector opened on a rise of `min_rise`.
    min_rise: float = 0.10
    #: Fewest steps a raised stretch lasts (shorter ones are spikes), and fewest outside it.
    min_stretch_steps: int = 4
    #: Fewest steps back at the old level that make a recovery.
    min_recovered_steps: int = 3
    #: A stretch stands out from the noise by this many standard errors: with hundreds of
    #: (onset, recovery) pairs tried on pure noise, a smaller bar finds stretches in it.
    min_z: float = 5.0
    #: Where the stretch ends is asked only once it is known to exist: a smaller bar.
    min_fall_z: float = 3.0
    #: A lone step this many robust deviations from its neighbours is a spike (a GC pause,
    #: a preempted step), taken out before the fit.
    spike_deviations: float = 5.0

    def __post_init__(self) -> None:
        problems = check_fields(self, _FIT_BOUNDS)
        if problems:
            raise FieldErrors(problems)


_FIT_BOUNDS = {
    "min_rise": Bound(gt=0),
    "min_stretch_steps": Bound(integer=True, ge=1),
    "min_recovered_steps": Bound(integer=True, ge=1),
    "min_z": Bound(ge=0),
    "min_fall_z": Bound(ge=0),
    "spike_deviations": Bound(gt=0),
}


def square_wave(
    values: np.ndarray,
    first_onset: int,
    last_onset: int,
    fit: StretchFit = StretchFit(),
) -> tuple[int, int | None] | None:
    """The raised stretch of a ratio series that best fits it, by least squares on log
    values (lone spikes taken out first): (onset, recovery) positions, recovery None when
    the series stays raised to the end. The onset lies in [first_onset, last_onset]; None
    when no stretch is raised by `fit.min_rise` over the rest and clear of the noise."""
    x = np.log(np.clip(values, 1e-9, None))
    finite = np.isfinite(x)
    x = np.where(finite, x, np.nanmedian(x) if finite.any() else 0.0)
    # A lone spike (a GC pause, a preempted step) is no stretch: replaced by the median of
    # itself and its neighbours when it lies `spike_deviations` robust deviations from it.
    padded = np.concatenate([x[:1], x, x[-1:]])
    local = np.median(np.stack([padded[:-2], padded[1:-1], padded[2:]]), axis=0)
    spread = 1.4826 * np.median(np.abs(x - local)) or 1e-9
    x = np.where(np.abs(x - local) > fit.spike_deviations * spread, local, x)
    n = x.size
    if n < 2 * fit.min_stretch_steps:
        return None
    # Step-to-step noise, blind to the level shifts being looked for: differences of
    # neighbouring values.
    noise = 1.4826 * np.median(np.abs(x[1:] - x[:-1])) / np.sqrt(2) or 1e-9
    total = np.concatenate([[0.0], np.cumsum(x)])
    best, best_gain = None, 0.0
    for a in range(max(0, first_onset), min(last_onset, n - fit.min_stretch_steps) + 1):
        b = np.arange(a + fit.min_stretch_steps, n + 1)
        inside = total[b] - total[a]
        k = b - a
        outside_n = n - k
        mean_in = inside / k
        mean_out = np.where(outside_n > 0, (total[n] - inside) / np.maximum(outside_n, 1), np.nan)
        rise = mean_in - mean_out
        z = rise / (noise * np.sqrt(1 / k + 1 / np.maximum(outside_n, 1)))
        # SSE reduction of a two-level fit over one level: k*m*(mean_in - mean_out)^2/n.
        gain = np.where(
            (outside_n >= fit.min_stretch_steps)
            & (rise >= np.log1p(fit.min_rise))
            & (z >= fit.min_z),
            k * outside_n * rise**2 / n,
            0.0,
        )
        i = int(np.argmax(gain))
        if gain[i] > best_gain:
            best, best_gain = (a, int(b[i])), float(gain[i])
    if best is None:
        return None
    onset, end = best
    if n - end >= fit.min_recovered_steps:
        return onset, end
    return onset, _partial_recovery(x, onset, noise, fit)


def _partial_recovery(x: np.ndarray, onset: int, noise: float, fit: StretchFit) -> int | None:
    """Where a raised log series falls back most of the way after `onset` though it stays
    noisier or a little higher than before it (the straggler's machine still busy): the
    first split of [onset, end) whose fall (medians) is at least half of the rise and clear
    of the noise."""
    n = x.size
    baseline = float(np.mean(x[:onset])) if onset > 0 else None
    if baseline is None:
        return None
    for b in range(onset + fit.min_stretch_steps, n - fit.min_recovered_steps + 1):
        raised, after = float(np.median(x[onset:b])), float(np.median(x[b:]))
        fall = raised - after
        z = fall / (noise * np.sqrt(1 / (b - onset) + 1 / (n - b)))
        if fall >= 0.5 * (raised - baseline) and z >= fit.min_fall_z:
            return b
    return None


@dataclass(frozen=True)
class Episode:
    """A slow period with a cause: the diagnosis of its own steps named one."""

    onset: int
    recovery: int | None
    diagnosis: Diagnosis
    series: tuple[str, ...] = ()
