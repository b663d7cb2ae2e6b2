"""Job-level episodes from the change points of many series.

A straggler shows first in its own series (its worker's, its stage's, its DP rank's own
work relative to the others), often before or without a verified change of the step time,
which jitters with everything else. So an episode starts from a change in *any* series:

- per series, a span opens at an onset whose new regime lies at least `min_rise` above the
  series' baseline (the regime before its first change), and closes at the first later
  change that brings the series back below that level. A fall below the baseline (a
  worker's DP peer looks faster while the median moves) opens nothing;
- spans of all series that overlap or touch merge into one job-level episode: its onset is
  the earliest onset, its recovery the latest recovery (None while any span is open).

Whether an episode is a straggler is the diagnosis' call, on the episode's own steps.

Once the diagnosis names a worker, the episode's bounds come from that worker's own series,
fitted over the whole retained run (`square_wave`): the detector places a change from what
it has seen so far and verifies a regime only after it has lasted several steps, so it may
start an episode at another series' unrelated wobble (a shared machine moving the step
time) and cannot verify a recovery in a run's last steps. Looking back at the finished
steps it can.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from lagscope.simulator.diagnose import Diagnosis, diagnose
from lagscope.simulator.noise import own_work, relative_to_peers, series_names, step_series
from lagscope.simulator.prepare import PreparedTrace
from lagscope.simulator.whatif import DEFAULT_DECOMPOSE_THRESHOLD, analyze


class Change(Protocol):
    series: str
    step: int
    kind: str
    before_mean: float
    after_mean: float


@dataclass(frozen=True)
class Span:
    onset: int
    recovery: int | None
    series: tuple[str, ...]


def series_spans(changes: Iterable[Change], min_rise: float = 0.10) -> list[Span]:
    """Raised regimes of every series, in onset order."""
    by_series: dict[str, list[Change]] = {}
    for change in changes:
        by_series.setdefault(change.series, []).append(change)
    spans: list[Span] = []
    for name, found in by_series.items():
        found.sort(key=lambda c: c.step)
        baseline = found[0].before_mean
        if not baseline > 0:
            continue
        opened: int | None = None
        for change in found:
            raised = change.after_mean >= baseline * (1 + min_rise)
            if raised and opened is None:
                opened = change.step
            elif not raised and opened is not None:
                spans.append(Span(opened, change.step, (name,)))
                opened = None
        if opened is not None:
            spans.append(Span(opened, None, (name,)))
    return sorted(spans, key=lambda s: s.onset)


def merge_spans(spans: list[Span]) -> list[Span]:
    """Overlapping or touching spans as one episode each, in onset order."""
    merged: list[Span] = []
    for span in sorted(spans, key=lambda s: s.onset):
        if merged and (merged[-1].recovery is None or span.onset <= merged[-1].recovery):
            last = merged[-1]
            recovery = (
                None
                if last.recovery is None or span.recovery is None
                else max(last.recovery, span.recovery)
            )
            merged[-1] = Span(last.onset, recovery, tuple(dict.fromkeys(last.series + span.series)))
        else:
            merged.append(span)
    return merged


def episode_spans(changes: Iterable[Change], min_rise: float = 0.10) -> list[Span]:
    """Job-level episodes (onset, recovery, the series that moved) from change points."""
    return merge_spans(series_spans(changes, min_rise))


#: How far (steps) before a detected onset the fitted onset may lie: the detector verifies a
#: regime at most this late (its minimum regime length).
_ONSET_SLACK = 8
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
    values: np.ndarray, first_onset: int, last_onset: int, min_rise: float = 0.10
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
    # Step-to-step noise, blind to the level shifts being looked for.
    noise = 1.4826 * np.median(np.abs(np.diff(x))) / np.sqrt(2) or 1e-9
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


def _fitted_to_moved_worker(span: Span, prepared: PreparedTrace) -> Span:
    """The span's bounds from the own-work series of the first worker whose series opened
    it, so that its diagnosis reads the worker's slow steps, not a stretch diluted by the
    steps after a recovery the detector could not verify yet."""
    worker = next((name for name in span.series if name.startswith("worker/")), None)
    if worker is None:
        return span
    names = series_names(prepared.n_stages, prepared.n_dp)
    if worker not in names:
        return span
    return _fitted(span, [step_series(prepared)[:, names.index(worker)]], worker, prepared)


def _fitted(span: Span, candidates: list[np.ndarray], worker: str, prepared: PreparedTrace) -> Span:
    """The span refitted on the first candidate series that shows a raised stretch."""
    steps = prepared.steps
    first = int(np.searchsorted(steps, span.onset - _ONSET_SLACK))
    last = int(np.searchsorted(steps, span.recovery if span.recovery is not None else steps[-1]))
    for series in candidates:
        fitted = square_wave(series, first, min(last, steps.size - 1))
        if fitted is not None:
            onset, recovery = fitted
            return Span(
                int(steps[onset]),
                int(steps[recovery]) if recovery is not None else None,
                tuple(dict.fromkeys((worker, *span.series))),
            )
    return span


def _refined(span: Span, diagnosis: Diagnosis, prepared: PreparedTrace) -> Span:
    """The span's bounds from the first named worker's own series, when a worker is named
    and its series shows the raised stretch; the detected bounds otherwise. The series of
    the op type it is slow in comes first: a 2x slower forward is a 2x rise there, but only
    a third of that in the worker's whole own work."""
    named = diagnosis.evidence.get("verified_workers") or []
    if not named:
        return span
    dp, stage = named[0]["dp"], named[0]["stage"]
    worker = f"worker/{dp}.{stage}"
    candidates = [
        relative_to_peers(own_work(prepared, optype))[:, stage, dp]
        for optype in list(named[0].get("slow_in") or {})[:1]
    ]
    names = series_names(prepared.n_stages, prepared.n_dp)
    candidates.append(step_series(prepared)[:, names.index(worker)])
    return _fitted(span, candidates, worker, prepared)


@dataclass(frozen=True)
class Episode:
    """A slow period with a cause: the diagnosis of its own steps named one."""

    onset: int
    recovery: int | None
    diagnosis: Diagnosis
    series: tuple[str, ...] = ()


#: Computes this much slower (median step) inside an episode than outside it: the machine.
_MACHINE_SLOWDOWN = 0.04


def _machine_slowed(prepared: PreparedTrace, inside: np.ndarray) -> bool:
    """Whether the workers' own work (computes, optimizer, input) per step is slower inside
    the episode's steps than in the rest of the run, by `_MACHINE_SLOWDOWN`."""
    if inside.all():
        return False
    work = own_work(prepared).sum(axis=(1, 2))
    return bool(np.median(work[inside]) >= (1 + _MACHINE_SLOWDOWN) * np.median(work[~inside]))


def diagnosed_episodes(
    changes: Iterable[Change],
    prepared: PreparedTrace,
    ideal: dict[str, float],
    *,
    decompose_threshold: float = DEFAULT_DECOMPOSE_THRESHOLD,
) -> list[Episode]:
    """Every episode diagnosed on its own steps with the whole run's ideal, so a straggler
    that came and went is named even when something permanent dominates the run. An
    episode whose steps show no cause beyond the job's noise (a shared machine's load
    moving the step time) is dropped: a healthy job has no episode. So is one that reads as
    slow communication while the computes slowed with it: the whole machine was slower
    (a slow link leaves the computes alone)."""
    episodes = []
    for detected in episode_spans(changes):
        span = _fitted_to_moved_worker(detected, prepared)
        end = span.recovery if span.recovery is not None else np.inf
        inside = (prepared.steps >= span.onset) & (prepared.steps < end)
        if inside.sum() < 2:
            continue
        part = prepared.select_steps(inside)
        result = analyze(part, ideal=ideal, decompose_threshold=decompose_threshold)
        diagnosis = diagnose(result, part)
        if diagnosis.cause == "slow_communication" and _machine_slowed(prepared, inside):
            continue
        if diagnosis.cause not in ("none", "unattributed"):
            fitted = _refined(span, diagnosis, prepared)
            episodes.append(Episode(fitted.onset, fitted.recovery, diagnosis, fitted.series))
    return episodes
