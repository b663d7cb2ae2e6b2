"""Iteration times from a rank's collective calls alone, without step ids (Falcon's ACF).

A training step issues the same communication calls in the same order every iteration, so
the sequence of (call type, size) tokens of one rank is periodic. The period in calls is
the first lag at which the sequence's autocorrelation reaches 0.95 (Falcon), and the
iteration-time series is the spacing of every period-th call.

The autocorrelation of a categorical sequence is taken as the sum, over tokens, of the
autocovariances of each token's centred indicator sequence, normalized per lag by the
number of overlapping pairs: a perfectly periodic sequence scores exactly 1 at its
period. All indicator spectra come from one batched FFT and one inverse FFT, so the
whole ACF costs O(K n log n) for K distinct tokens and n calls.

Missing calls (a tracer that drops records) shift everything after them by one position,
so the ACF at the period decays roughly like (1 - drop rate)^period and may never reach
the threshold. Counts, unlike positions, are barely affected. Every call type recurs a
whole number of times per iteration and the rarest one, the anchor, once; between two
consecutive anchors lies one iteration, so a token's (nearly) largest count over those
intervals is its calls per iteration, which missing calls can only lower, and the sum
over tokens is the period. (This assumes every call type recurs every iteration: filter
out occasional calls, such as checkpoint collectives, when calls can be missing.) The
counts also guard the ACF against a long steady 1F1B phase, which repeats every few calls
and can reach the threshold at a fraction of the iteration.

Either way, iterations are delimited by the anchor's occurrences, and the calls between two
anchors say how many iterations the interval spans: a missing anchor makes a two-iteration
gap that is reported as such, not as one slow iteration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

#: Falcon's threshold on the autocorrelation at the period.
DEFAULT_ACF_THRESHOLD = 0.95


def encode_calls(call_types: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, list[tuple]]:
    """Integer token per call, one per distinct (type, size); and the token vocabulary."""
    call_types = np.asarray(call_types)
    sizes = np.asarray(sizes)
    if call_types.shape != sizes.shape or call_types.ndim != 1:
        raise ValueError("call types and sizes must be 1-d arrays of the same length")
    type_names, type_codes = np.unique(call_types, return_inverse=True)
    size_values, size_codes = np.unique(sizes, return_inverse=True)
    pairs = type_codes.astype(np.int64) * size_values.size + size_codes
    distinct, tokens = np.unique(pairs, return_inverse=True)
    vocabulary = [
        (type_names[pair // size_values.size].item(), size_values[pair % size_values.size].item())
        for pair in distinct
    ]
    return tokens.astype(np.int64), vocabulary


def token_acf(tokens: np.ndarray, max_lag: int | None = None) -> np.ndarray:
    """ACF of a categorical sequence at lags 0..max_lag (default n // 2), via FFT."""
    tokens = np.asarray(tokens, dtype=np.int64)
    n = tokens.size
    if n < 2:
        raise ValueError("need at least two calls")
    max_lag = n // 2 if max_lag is None else min(max_lag, n - 1)
    n_tokens = int(tokens.max()) + 1
    frequency = np.bincount(tokens, minlength=n_tokens) / n
    indicators = np.zeros((n, n_tokens))
    indicators[np.arange(n), tokens] = 1.0
    indicators -= frequency
    # Zero-padding to >= 2n turns the FFT's circular correlation into a linear one.
    size = 1 << int(np.ceil(np.log2(2 * n)))
    spectrum = np.fft.rfft(indicators, n=size, axis=0)
    power = (spectrum.real**2 + spectrum.imag**2).sum(axis=1)
    autocovariance = np.fft.irfft(power, n=size)[: max_lag + 1]
    lags = np.arange(max_lag + 1)
    per_pair = autocovariance / (n - lags)
    if per_pair[0] <= 0.0:
        return np.ones(max_lag + 1)  # a single repeated token: periodic at every lag
    return per_pair / per_pair[0]


def acf_period(
    tokens: np.ndarray, threshold: float = DEFAULT_ACF_THRESHOLD, max_lag: int | None = None
) -> int | None:
    """First lag whose ACF reaches `threshold` (moved up to its local peak), or None."""
    acf = token_acf(tokens, max_lag)
    above = np.flatnonzero(acf[1:] >= threshold)
    if above.size == 0:
        return None
    lag = int(above[0]) + 1
    while lag + 1 < acf.size and acf[lag + 1] > acf[lag]:
        lag += 1
    return lag


def per_iteration_counts(tokens: np.ndarray) -> tuple[int, np.ndarray]:
    """Anchor token and the number of calls of every token per iteration, from counts.

    Every token is assumed to recur every iteration, so the least frequent one occurs once
    per iteration: it is the anchor. Most intervals between consecutive anchors hold exactly
    one iteration; those whose call total is near the median are taken as such (a missing
    anchor doubles the total). Missing calls only ever lower a token's count in an interval,
    so its (nearly) largest count over those intervals is its calls per iteration.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    counts = np.bincount(tokens)
    present = np.flatnonzero(counts)
    anchor = int(present[np.argmin(counts[present])])
    anchor_positions = np.flatnonzero(tokens == anchor)
    calls = np.zeros(counts.size, dtype=np.int64)
    if anchor_positions.size < 3:
        calls[present] = 1
        return anchor, calls
    between = _counts_between(tokens, anchor_positions, present)
    totals = between.sum(axis=1)
    typical = np.median(totals)
    single = (totals >= 0.75 * typical) & (totals <= 1.25 * typical)
    # The second largest (or 99th percentile) rather than the largest, so that one interval
    # misjudged as a single iteration cannot double a token's count.
    ordered = np.sort(between[single], axis=0)[::-1]
    rank = min(max(1, int(np.ceil(0.01 * ordered.shape[0]))), ordered.shape[0] - 1)
    calls[present] = ordered[rank]
    return anchor, calls


def _counts_between(
    tokens: np.ndarray, anchor_positions: np.ndarray, kinds: np.ndarray
) -> np.ndarray:
    """Calls of each token in `kinds` from each anchor up to (not including) the next."""
    one_hot = tokens[:, None] == kinds[None, :]
    cumulative = np.vstack([np.zeros((1, kinds.size), dtype=np.int64), np.cumsum(one_hot, 0)])
    return np.diff(cumulative[anchor_positions], axis=0)


def per_iteration_token_counts(tokens: np.ndarray, period: int) -> np.ndarray:
    """Calls of every token per iteration, for a known period (in calls)."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64))
    return np.round(counts * period / counts.sum()).astype(np.int64)


def _iterations_between(
    tokens: np.ndarray, anchor_positions: np.ndarray, per_iteration: np.ndarray
) -> np.ndarray:
    """Iterations spanned by each interval between consecutive anchors.

    Judged from the calls in the interval, not from its duration: a slow iteration has the
    usual calls, a missing anchor leaves twice as many. Each token's count over its calls per
    iteration is an estimate that missing calls can only lower, so the largest one is kept.
    """
    regular = np.flatnonzero(per_iteration >= 1)
    between = _counts_between(tokens, anchor_positions, regular)
    spans = np.round(between / per_iteration[regular]).max(axis=1)
    return np.maximum(spans, 1).astype(np.int64)


@dataclass(frozen=True)
class IterationSeries:
    """Iterations delimited by an anchor call, numbered from the first complete one."""

    #: Calls per iteration.
    period_calls: int
    #: How the period was found: Falcon's ACF threshold, or token counts (missing calls).
    method: Literal["acf", "counts"]
    #: ACF at the period (1.0 for a complete, perfectly periodic sequence).
    acf_at_period: float
    #: (call type, size) of the anchor call.
    anchor: tuple
    #: Timestamp of the anchor of every iteration boundary; NaN where it is missing.
    boundary_times: np.ndarray
    #: Duration of every iteration between two boundaries; NaN where a boundary is missing.
    iteration_times: np.ndarray

    @property
    def mean_iteration_time(self) -> float:
        """Mean over the whole span, gaps included (first to last known boundary)."""
        known = np.flatnonzero(np.isfinite(self.boundary_times))
        first, last = known[0], known[-1]
        return float((self.boundary_times[last] - self.boundary_times[first]) / (last - first))


def iteration_times(
    call_types: np.ndarray,
    sizes: np.ndarray,
    timestamps: np.ndarray,
    *,
    threshold: float = DEFAULT_ACF_THRESHOLD,
) -> IterationSeries:
    """Iteration-time series of one rank from its collective calls (type, size, timestamp)."""
    timestamps = np.asarray(timestamps, dtype=np.float64)
    tokens, vocabulary = encode_calls(call_types, sizes)
    if timestamps.shape != tokens.shape:
        raise ValueError("timestamps must have one entry per call")
    order = np.argsort(timestamps, kind="stable")
    tokens, timestamps = tokens[order], timestamps[order]

    acf = token_acf(tokens)
    period = acf_period(tokens, threshold)
    anchor, per_iteration = per_iteration_counts(tokens)
    counted_period = int(per_iteration.sum())
    # A long steady 1F1B phase repeats every few calls and can reach the threshold at a
    # fraction of the iteration; the counts know an iteration holds the anchor call.
    within_iteration = (
        period is not None and counted_period > period and counted_period % period == 0
    )
    method: Literal["acf", "counts"] = "acf"
    if period is not None and not within_iteration:
        per_iteration = per_iteration_token_counts(tokens, period)
        once = np.flatnonzero(per_iteration == 1)
        if once.size:
            anchor = int(once[np.argmax(np.bincount(tokens)[once])])
            anchor_positions = np.flatnonzero(tokens == anchor)
        else:
            # No call occurs once per iteration: Falcon's every period-th call, exact for a
            # complete sequence (the only kind whose ACF reaches the threshold).
            anchor = int(tokens[0])
            anchor_positions = np.arange(0, tokens.size, period)
    else:
        period, method = counted_period, "counts"
        anchor_positions = np.flatnonzero(tokens == anchor)
    if anchor_positions.size < 2:
        raise ValueError("fewer than two iterations in the calls")
    spans = _iterations_between(tokens, anchor_positions, per_iteration)
    boundary_index = np.concatenate(([0], np.cumsum(spans)))
    boundary_times = np.full(int(boundary_index[-1]) + 1, np.nan)
    boundary_times[boundary_index] = timestamps[anchor_positions]
    durations = np.diff(boundary_times)  # NaN on both sides of a missing boundary
    return IterationSeries(
        period_calls=period,
        method=method,
        acf_at_period=float(acf[period]) if period < acf.size else float("nan"),
        anchor=vocabulary[anchor],
        boundary_times=boundary_times,
        iteration_times=durations,
    )
