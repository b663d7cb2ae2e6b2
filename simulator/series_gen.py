"""Seeded synthetic iteration-time series with fail-slow episodes, and how to score them.

A series is calm, then alternates slow episodes (a multiplicative slowdown lasting 10-60
minutes of wall time) with calm stretches. Every observation carries jitter (a constant
coefficient of variation) and, rarely, a single-step spike (a GC pause, a checkpoint
write) that a detector must not mistake for a regime change. Some series have no episode.
Lengths are drawn in minutes and converted with the series' iteration time, so a 1 s job
yields thousands of observations per episode and a 10 s job a few hundred.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from lagscope.simulator.bocd import ChangeKind


class SeriesGenConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    iteration_s: tuple[float, float] = (1.0, 10.0)
    episode_minutes: tuple[float, float] = (10.0, 60.0)
    calm_minutes: tuple[float, float] = (10.0, 30.0)
    slowdown: tuple[float, float] = (0.05, 0.90)
    jitter_cv: tuple[float, float] = (0.01, 0.05)
    max_episodes: int = Field(default=2, ge=1)
    #: Share of series with no episode at all.
    clean_fraction: float = Field(default=0.2, ge=0.0, le=1.0)
    #: Chance that a series ends while still slow (an onset without recovery).
    unrecovered_fraction: float = Field(default=0.1, ge=0.0, le=1.0)
    spike_probability: float = Field(default=0.002, ge=0.0, lt=0.5)
    spike_factor: tuple[float, float] = (1.5, 4.0)


@dataclass(frozen=True)
class SlowEpisode:
    #: First slow observation.
    start: int
    #: First recovered observation (== series length when the series ends slow).
    end: int
    #: Relative slowdown: slow iteration time = base * (1 + slowdown).
    slowdown: float


@dataclass(frozen=True)
class TrueChange:
    index: int
    kind: ChangeKind
    slowdown: float


@dataclass(frozen=True)
class FailSlowSeries:
    values: np.ndarray
    base_iteration_s: float
    jitter_cv: float
    episodes: tuple[SlowEpisode, ...]
    spike_indices: np.ndarray

    def true_changes(self) -> list[TrueChange]:
        changes: list[TrueChange] = []
        for episode in self.episodes:
            changes.append(TrueChange(episode.start, "onset", episode.slowdown))
            if episode.end < self.values.size:
                changes.append(TrueChange(episode.end, "recovery", episode.slowdown))
        return changes


def _uniform(rng: np.random.Generator, bounds: tuple[float, float]) -> float:
    return float(rng.uniform(bounds[0], bounds[1]))


def generate_fail_slow_series(
    rng: np.random.Generator, config: SeriesGenConfig, *, clean: bool = False
) -> FailSlowSeries:
    """One series; `clean` forces a series without any episode."""
    # Log-uniform: a job is as likely to run 1-2 s steps as 5-10 s steps.
    low, high = config.iteration_s
    base = float(np.exp(rng.uniform(np.log(low), np.log(high))))
    jitter_cv = _uniform(rng, config.jitter_cv)

    def observations(minutes_bounds: tuple[float, float]) -> int:
        return max(1, round(_uniform(rng, minutes_bounds) * 60.0 / base))

    n_episodes = 0 if clean else int(rng.integers(1, config.max_episodes + 1))
    episodes: list[SlowEpisode] = []
    length = observations(config.calm_minutes)
    for number in range(n_episodes):
        start = length
        length += observations(config.episode_minutes)
        last = number == n_episodes - 1
        ends_slow = last and rng.random() < config.unrecovered_fraction
        episodes.append(SlowEpisode(start, length, _uniform(rng, config.slowdown)))
        if not ends_slow:
            length += observations(config.calm_minutes)

    level = np.ones(length)
    for episode in episodes:
        level[episode.start : episode.end] = 1.0 + episode.slowdown
    values = base * level * (1.0 + jitter_cv * rng.standard_normal(length))
    spikes = np.flatnonzero(rng.random(length) < config.spike_probability)
    # Single-step spikes only: drop the later of two adjacent ones.
    spikes = spikes[np.concatenate(([True], np.diff(spikes) > 1))] if spikes.size else spikes
    values[spikes] *= rng.uniform(*config.spike_factor, size=spikes.size)
    return FailSlowSeries(values, base, jitter_cv, tuple(episodes), spikes)


def generate_fail_slow_set(
    n_series: int, seed: int, config: SeriesGenConfig | None = None
) -> list[FailSlowSeries]:
    """`n_series` series; the first `clean_fraction` of them have no episode."""
    config = config or SeriesGenConfig()
    rng = np.random.default_rng(seed)
    n_clean = round(n_series * config.clean_fraction)
    return [
        generate_fail_slow_series(rng, config, clean=number < n_clean) for number in range(n_series)
    ]


def stack_series(series: list[FailSlowSeries]) -> np.ndarray:
    """A (steps, series) matrix, NaN-padded after each series ends: one row per update."""
    steps = max(s.values.size for s in series)
    matrix = np.full((steps, len(series)), np.nan)
    for column, s in enumerate(series):
        matrix[: s.values.size, column] = s.values
    return matrix


@dataclass(frozen=True)
class SeriesScore:
    correct: bool
    #: Detected minus true index of every matched required change.
    location_errors: tuple[int, ...]
    missed: int
    false_positives: int


def score_series(
    truth: FailSlowSeries,
    detected: list[tuple[int, ChangeKind]],
    *,
    min_relative_change: float,
    tolerance: int = 3,
    ambiguity: float = 0.25,
) -> SeriesScore:
    """Judge one series' detections (index, kind) against its ground truth.

    A change whose slowdown clears the verification threshold by the factor (1 + ambiguity)
    must be found within `tolerance` observations; one below the threshold divided by that
    factor must not be reported (verification exists to reject it); in between, measured
    means can fall either side of the threshold, so finding it or not are both right.
    Any other detection is a false positive.
    """
    required: list[TrueChange] = []
    allowed: list[TrueChange] = []
    for change in truth.true_changes():
        if change.slowdown >= min_relative_change * (1.0 + ambiguity):
            required.append(change)
            allowed.append(change)
        elif change.slowdown >= min_relative_change / (1.0 + ambiguity):
            allowed.append(change)

    def matches(change: TrueChange, index: int, kind: ChangeKind) -> bool:
        return change.kind == kind and abs(index - change.index) <= tolerance

    false_positives = sum(
        not any(matches(change, index, kind) for change in allowed) for index, kind in detected
    )
    errors: list[int] = []
    missed = 0
    for change in required:
        hits = [index for index, kind in detected if matches(change, index, kind)]
        if hits:
            errors.append(min(hits, key=lambda index: abs(index - change.index)) - change.index)
        else:
            missed += 1
    return SeriesScore(missed == 0 and false_positives == 0, tuple(errors), missed, false_positives)
