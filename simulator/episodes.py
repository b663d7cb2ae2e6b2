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

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from lagscope.simulator.diagnose import Diagnosis, diagnose
from lagscope.simulator.noise import (
    own_work,
    own_work_mask,
    relative_to_peers,
    series_names,
    step_series,
)
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
    values: np.ndarray,
    first_onset: int,
    last_onset: int,
    min_rise: float = 0.10,
    independent_lag: int = 1,
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
    # Step-to-step noise, blind to the level shifts being looked for: differences of values
    # `independent_lag` steps apart, the nearest that share no step (a series of minima over
    # 3 neighbours repeats its values, and its neighbours' differences are mostly 0).
    lag = independent_lag
    noise = 1.4826 * np.median(np.abs(x[lag:] - x[:-lag])) / np.sqrt(2) or 1e-9
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
class Stretch:
    """A single worker's own work of one op type raised against its peers' for a while."""

    span: Span
    dp: int
    stage: int
    optype: str
    #: The worker's work over the median of its peers', inside the stretch and outside it.
    ratio_inside: float
    ratio_outside: float
    #: Extra seconds per step inside the stretch over the worker's own level outside it,
    #: and the job's median step time, to tell a costly stretch from a negligible op.
    extra_s: float
    step_s: float


def worker_stretches(
    prepared: PreparedTrace, min_rise: float = 0.10, min_steps: int = _MIN_STRETCH_STEPS
) -> list[Stretch]:
    """Raised stretches of single workers, found over the finished run: every worker's own
    work of each op type fitted with `square_wave`, bounded by its run of slow steps
    (`_steady_bounds`), kept when it lasts `min_steps` and was raised by `min_rise` in its
    quick steps and its median (`_raised_levels`) and against its peers; in onset order.

    The change-point detector sees a worker's work relative to its peers step by step, and
    on a job whose ops jitter by tens of percent (CPU ranks sharing cores) a worker that
    computes its forwards 2x slower for 15 steps can stay under its bar: a third of its own
    work moved, inside a noisy ratio. Its forward series alone doubled. Fitting the
    worker's own series, not a ratio, also keeps the mirror image out: with two DP ranks the
    healthy peer's ratio falls while the straggler's rises, but its own seconds stay flat.

    Sharing cores also makes stretches of its own: a rank preempted in half of its forwards
    for a dozen steps doubles its median forward time there. Such noise only ever adds time,
    so the rank's quickest forwards still take what they always took, where a straggler's
    take longer every time: its quick steps (`_QUICK_QUANTILE`) decide, and they bound the
    stretch as well. A rank that loses its core in nearly every step for a while has few
    quick steps left there, but its median rises by far less than a straggler's, whose
    every step doubled.
    """
    optypes = sorted(
        {t for t, own in zip(prepared.node_optype, own_work_mask(prepared), strict=True) if own}
    )
    steps, n = prepared.steps, prepared.n_steps
    step_s = float(np.median(prepared.actual_step_time))
    found: list[Stretch] = []
    for optype in optypes:
        work = own_work(prepared, optype)  # [step, stage, dp]
        for stage in range(prepared.n_stages):
            for dp in range(prepared.n_dp):
                own = work[:, stage, dp]
                # Against the others alone: with two DP ranks a median that includes the
                # worker itself halves its rise.
                others = (
                    np.delete(work[:, stage, :], dp, axis=1)
                    if prepared.n_dp > 1
                    else np.delete(work[:, :, 0], stage, axis=1)
                )
                if others.shape[1] == 0:
                    continue
                peers = np.median(others, axis=1)
                ratio = own / np.where(peers > 0, peers, np.nan)
                # Fitted on its own times, and on each step's least time with its
                # neighbours' (lost cores blur the first); of the fits that hold, the one
                # in which the worker stands out most against its peers.
                fits = (
                    square_wave(own, 0, n - 1, min_rise),
                    square_wave(_floor(own), 0, n - 1, min_rise, independent_lag=3),
                )
                held = []
                for fitted in fits:
                    steady = (
                        _steady_bounds(own, others, peers, *fitted, min_rise) if fitted else None
                    )
                    if steady is not None:
                        end = steady[1] if steady[1] is not None else n
                        if end - steady[0] >= min_steps:
                            held.append((steady[0], end))
                if not held:
                    continue
                onset, end = max(held, key=lambda bounds: np.nanmedian(ratio[slice(*bounds)]))
                recovery = end if end < n else None
                inside = np.zeros(n, dtype=bool)
                inside[onset:end] = True
                ratio_in, ratio_out = np.nanmedian(ratio[inside]), np.nanmedian(ratio[~inside])
                # Its typical step is slower than its peers' there, and by more than it
                # usually is, if by less than its quick steps (their own lost cores blur a
                # median ratio): a stretch in which every rank is slow, this one a little
                # more steadily, is the machine's.
                if not ratio_in >= (1 + min_rise / 2) * max(ratio_out, 1.0):
                    continue
                found.append(
                    Stretch(
                        Span(
                            int(steps[onset]),
                            int(steps[recovery]) if recovery is not None else None,
                            (f"worker/{dp}.{stage}",),
                        ),
                        dp,
                        stage,
                        optype,
                        float(ratio_in),
                        float(ratio_out),
                        float(np.median(own[inside]) - np.median(own[~inside])),
                        step_s,
                    )
                )
    return sorted(found, key=lambda s: s.span.onset)


#: The quantile of an op's times that stands for its quick steps: contention only adds time,
#: so on a loaded machine a rank's true speed shows in its quickest steps, not its median
#: (on 2 shared cores a rank may lose its core in most of its steps for a while).
_QUICK_QUANTILE = 0.1
#: What one step below the raised level costs a stretch, in steps at the raised level: a
#: straggler's ops are slow every step, while a rank that loses its core now and then is
#: quick again every few steps.
_QUICK_STEP_PENALTY = 5.0
#: How far (steps) the run may reach past the fitted stretch: a fit on least times lies a
#: step inside it, and further out a step that lost its core is as slow as a straggler's.
_RUN_SLACK = 2


def _floor(values: np.ndarray) -> np.ndarray:
    """Each step's time or its neighbours', whichever is least: a step that lost its core
    is flanked by quick ones and drops out, a straggler's stretch stays (a step shorter)."""
    padded = np.concatenate([values[:1], values, values[-1:]])
    return np.minimum(np.minimum(padded[:-2], padded[1:-1]), padded[2:])


def _steady_bounds(
    own: np.ndarray,
    others: np.ndarray,
    peers: np.ndarray,
    onset: int,
    recovery: int | None,
    min_rise: float,
) -> tuple[int, int | None] | None:
    """The stretch of `own` (one worker's seconds per step) near the fitted (onset,
    recovery) in which it is slow every step; None unless it is raised there by
    `min_rise` (`_raised_levels`). `others` holds its peers' seconds [step, peer], `peers`
    their median per step.

    A step counts as slow above the geometric mean of the quick levels inside and outside
    the fitted stretch, and as the worker's when it is also slower than its peers' median
    in that step; a slow step in which its peers were as slow (the machine's) counts
    nothing. The bounds are the run of steps, within `_RUN_SLACK` of the fitted ones, that
    holds the most of the worker's slow steps net of `_QUICK_STEP_PENALTY` per quick one.
    """
    n = own.size
    end = recovery if recovery is not None else n
    levels = _raised_levels(own, others, onset, end, min_rise)
    if levels is None:
        return None
    quick_in, quick_out = levels
    slow = own >= np.sqrt(quick_in * quick_out)
    its_own = own >= (1 + min_rise / 2) * peers
    score = np.where(slow, np.where(its_own, 1.0, 0.0), -_QUICK_STEP_PENALTY)
    first, last = max(0, onset - _RUN_SLACK), min(n, end + _RUN_SLACK)
    # The best-scoring run [a, b) within [first, last): a maximum subarray, the earliest
    # and shortest of equal ones.
    best, best_a, best_b = 0.0, onset, end
    total, a = 0.0, first
    for i in range(first, last):
        if total <= 0:
            total, a = 0.0, i
        total += score[i]
        if total > best:
            best, best_a, best_b = total, a, i + 1
    if best <= 0 or _raised_levels(own, others, best_a, best_b, min_rise) is None:
        return None
    return best_a, (best_b if best_b < n else None)


def _raised_levels(
    own: np.ndarray, others: np.ndarray, start: int, end: int, min_rise: float
) -> tuple[float, float] | None:
    """The worker's quick levels in [start, end) and outside it, when [start, end) is
    raised by `min_rise`; else None.

    Raised means: its quick level there over its own outside and over its quickest
    peer's there (a peer that lost its core in most of those steps has a raised quick
    level of its own), and its median there over its own outside. Lost cores raise a
    rank's quick level for a dozen steps now and then, but its median by far less than a
    straggler's, which is slow in every step.
    """
    inside = np.zeros(own.size, dtype=bool)
    inside[start:end] = True
    if inside.all() or not inside.any():
        return None
    quick_in = float(np.quantile(own[inside], _QUICK_QUANTILE))
    quick_out = float(np.quantile(own[~inside], _QUICK_QUANTILE))
    quick_peers = float(np.min(np.quantile(others[inside], _QUICK_QUANTILE, axis=0)))
    raised = 1 + min_rise
    if (
        quick_out > 0
        and quick_in >= raised * max(quick_out, quick_peers)
        and np.median(own[inside]) >= raised * np.median(own[~inside])
    ):
        return quick_in, quick_out
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


def _refined(
    span: Span, diagnosis: Diagnosis, prepared: PreparedTrace, stretches: Sequence[Stretch] = ()
) -> Span:
    """The span's bounds from the first named worker's own series, when a worker is named
    and its series shows the raised stretch; the detected bounds otherwise. The series of
    the op type it is slow in comes first: a 2x slower forward is a 2x rise there, but only
    a third of that in the worker's whole own work."""
    named = diagnosis.evidence.get("verified_workers") or []
    if not named:
        return span
    dp, stage = named[0]["dp"], named[0]["stage"]
    worker = f"worker/{dp}.{stage}"
    slow_in = list(named[0].get("slow_in") or {})[:1]
    # A stretch of the worker's own seconds of that op that rose against its peers' (as
    # `worker_stretches` finds them) bounds it best: a ratio to the peers' median carries
    # their jitter too.
    for stretch in stretches:
        if (
            (stretch.dp, stretch.stage) == (dp, stage)
            and stretch.optype in slow_in
            and _overlaps(stretch.span, span)
        ):
            return Span(
                stretch.span.onset,
                stretch.span.recovery,
                tuple(dict.fromkeys((worker, *span.series))),
            )
    candidates = [relative_to_peers(own_work(prepared, optype))[:, stage, dp] for optype in slow_in]
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
    (a slow link leaves the computes alone).

    Then the stretches a single worker's own work of one op type was raised against its
    peers' (`worker_stretches`) that no episode covers yet, when they last and cost the
    worker a share of a step (a healthy job's jitter on shared cores makes stretches of a
    few steps, no longer). The diagnosis of the stretch's own steps names the worker when
    its what-if confirms it; where the job's noise hides the cost, the worker is named on
    its own series' evidence, and the summary says so."""

    def diagnosis_of(inside: np.ndarray) -> Diagnosis:
        part = prepared.select_steps(inside)
        return diagnose(analyze(part, ideal=ideal, decompose_threshold=decompose_threshold), part)

    def diagnosed(span: Span) -> tuple[Span, Diagnosis] | None:
        inside = _inside(span, prepared)
        if inside.sum() < 2:
            return None
        diagnosis = diagnosis_of(inside)
        if diagnosis.cause == "slow_communication" and _machine_slowed(prepared, inside):
            return None
        if diagnosis.cause in ("none", "unattributed"):
            return None
        return span, diagnosis

    stretches = worker_stretches(prepared, min_rise=_STRETCH_MIN_RISE, min_steps=_STRETCH_MIN_STEPS)
    episodes: list[Episode] = []
    for detected in episode_spans(changes):
        found = diagnosed(_fitted_to_moved_worker(detected, prepared))
        if found is not None:
            span, diagnosis = found
            fitted = _refined(span, diagnosis, prepared, stretches)
            if (fitted.onset, fitted.recovery) != (span.onset, span.recovery):
                # The diagnosis describes the episode's own steps: the detected span's
                # steps outside them dilute what the worker is slow in (a forward 3x slower
                # for 15 steps read as "slow in backward" over 25).
                again = diagnosed(fitted)
                if again is not None and _first_named(again[1]) == _first_named(diagnosis):
                    diagnosis = again[1]
            episodes.append(Episode(fitted.onset, fitted.recovery, diagnosis, fitted.series))
    # The costliest stretch first: where stretches overlap (a straggler's peers wait on
    # it and jitter), the one that cost the most seconds is the one to name.
    for stretch in sorted(stretches, key=lambda s: -s.extra_s * _steps_of(s.span, prepared)):
        span = stretch.span
        least = _STRETCH_MIN_STEPS * (1 if span.recovery is not None else 1.5)
        # An episode that names a worker stands; one that names none (a stage, the
        # communication) over the stretch's steps read the straggler's effect without
        # finding it, and gives way.
        overlapping = [e for e in episodes if _overlaps(span, e)]
        if any(e.diagnosis.cause == "slow_workers" for e in overlapping):
            continue
        if _steps_of(span, prepared) < least or _steps_before(span, prepared) < _MIN_BEFORE:
            continue
        if stretch.extra_s < _STRETCH_MIN_COST * stretch.step_s:
            continue
        diagnosis = diagnosis_of(_inside(span, prepared))
        if not (
            diagnosis.cause == "slow_workers"
            and _first_named(diagnosis) == (stretch.dp, stretch.stage)
        ):
            if _steps_of(span, prepared) < _UNCONFIRMED_MIN_STEPS:
                continue
            diagnosis = _stretch_diagnosis(stretch, diagnosis)
        # The stretch was fitted on the worker's own series of the op it is slow in: the
        # bounds the summary states are the episode's.
        episodes = [e for e in episodes if e not in overlapping]
        episodes.append(Episode(span.onset, span.recovery, diagnosis, span.series))
    return sorted(episodes, key=lambda e: e.onset)


#: A worker's own work of one op type raised this much against its peers' is a stretch
#: worth diagnosing (the straggler cases that matter double an op; jitter on shared cores
#: moves a worker's share by tens of percent for a while).
_STRETCH_MIN_RISE = 0.5


#: Fewest steps such a stretch lasts: a little over the change-point detector's shortest
#: regime (8). A rank starved of a shared core for a few steps is the machine, not a
#: straggler (on a loaded 2-core box such stretches reached 8 steps). One still raised at
#: the end of the run is compared with the steps before it only: half again.
_STRETCH_MIN_STEPS = 10


#: Fewest steps of a stretch named on its own series alone, where the what-if of its steps
#: does not single the worker out: it must outlast a rank's runs of lost cores, which
#: reached 10 steps on a loaded 2-core box (the stragglers of 15 steps were bounded to
#: 14-18 there).
_UNCONFIRMED_MIN_STEPS = 12


#: Fewest steps analysed before a stretch: one that starts with the run has no level to
#: rise from (a job's first steps are its warm-up: loaders filling, caches, allocators),
#: and a worker slow from the start is persistent structure, the whole run's diagnosis.
_MIN_BEFORE = 4


def _steps_before(span: Span, prepared: PreparedTrace) -> int:
    return int((prepared.steps < span.onset).sum())


def _inside(span: Span, prepared: PreparedTrace) -> np.ndarray:
    """Which of the prepared steps lie in the span."""
    end = span.recovery if span.recovery is not None else np.inf
    return (prepared.steps >= span.onset) & (prepared.steps < end)


def _steps_of(span: Span, prepared: PreparedTrace) -> int:
    return int(_inside(span, prepared).sum())


#: ... and costs the worker at least this share of a median step: a sub-millisecond op
#: that tripled is no straggler, and a rank of a loaded box losing its core now and then
#: costs a few percent.
_STRETCH_MIN_COST = 0.05


def _stretch_diagnosis(stretch: Stretch, of_its_steps: Diagnosis) -> Diagnosis:
    """A straggler named on its own series' evidence where the what-if of its steps cannot
    tell its cost from the job's noise: how much slower than its peers, in what, and for
    how long, with the what-if's evidence kept beside it."""
    span = stretch.span
    until = f"to {span.recovery - 1}" if span.recovery is not None else "on (not recovered)"
    summary = (
        f"worker(s) (dp {stretch.dp}, pp {stretch.stage}) slow in {stretch.optype}: "
        f"{stretch.ratio_inside:.1f}x its peers' from step {span.onset} {until} "
        f"({stretch.ratio_outside:.1f}x outside), {stretch.extra_s * 1e3:.1f} ms more per "
        f"step; its cost to the job is within the job's noise"
    )
    evidence = {
        **of_its_steps.evidence,
        "named_workers": [{"dp": stretch.dp, "stage": stretch.stage}],
        "verified_workers": [
            {"dp": stretch.dp, "stage": stretch.stage, "slow_in": {stretch.optype: stretch.extra_s}}
        ],
        "stretch": {
            "optype": stretch.optype,
            "ratio_inside": stretch.ratio_inside,
            "ratio_outside": stretch.ratio_outside,
            "extra_s_per_step": stretch.extra_s,
        },
    }
    return dataclasses.replace(
        of_its_steps, cause="slow_workers", summary=summary, evidence=evidence, advice=()
    )


def _first_named(diagnosis: Diagnosis) -> tuple[int, int] | None:
    """(dp, stage) of the worker a diagnosis names first, or None."""
    evidence = diagnosis.evidence
    named = evidence.get("named_workers") or evidence.get("verified_workers") or []
    return (named[0]["dp"], named[0]["stage"]) if named else None


def _overlaps(span: Span, episode: Span | Episode) -> bool:
    span_end = span.recovery if span.recovery is not None else np.inf
    episode_end = episode.recovery if episode.recovery is not None else np.inf
    return span.onset < episode_end and episode.onset < span_end
