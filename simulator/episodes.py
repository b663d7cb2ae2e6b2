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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from lagscope.simulator.diagnose import Diagnosis, diagnose
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


@dataclass(frozen=True)
class Episode:
    """A slow period with a cause: the diagnosis of its own steps named one."""

    onset: int
    recovery: int | None
    diagnosis: Diagnosis
    series: tuple[str, ...] = ()


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
    moving the step time) is dropped: a healthy job has no episode."""
    episodes = []
    for span in episode_spans(changes):
        end = span.recovery if span.recovery is not None else np.inf
        inside = (prepared.steps >= span.onset) & (prepared.steps < end)
        if inside.sum() < 2:
            continue
        part = prepared.select_steps(inside)
        result = analyze(part, ideal=ideal, decompose_threshold=decompose_threshold)
        diagnosis = diagnose(result, part)
        if diagnosis.cause not in ("none", "unattributed"):
            episodes.append(Episode(span.onset, span.recovery, diagnosis, span.series))
    return episodes
