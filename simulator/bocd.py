"""Bayesian online change-point detection (Adams & MacKay 2007) for many series at once.

`BocdBank` holds S independent series (a job's step time, every stage's and every DP rank's
compute time, ...) and advances all of them with one vectorized `update` per training step.
Each series keeps a run-length posterior truncated to R run lengths, so memory is O(S x R)
whatever the length of the stream.

Model, per series:
- the detector reads each observation one step late, once its successor is known, so an
  observation far from both neighbours (a single-step spike) can be replaced by the median
  of the three before it enters the run-length posterior; a step change keeps its exact
  position;
- the first `warmup` observations give a robust location and scale (median, MAD) that
  standardize everything after them; iteration times are log-transformed first by default,
  so a slowdown is an additive shift and a constant jitter CV is a constant variance;
- within a regime, observations are Normal with unknown mean and precision under a
  Normal-Gamma prior, so the predictive of each run length is a Student-t;
- the hazard is constant; run lengths >= R-1 share the last slot, whose statistics cover
  the most recent R-1 observations.

Declaring a change: P(r_t = 0) equals the hazard under a constant hazard, so it carries no
signal. Instead, when the most probable run length r* lies in
[min_regime_length, max_detection_lag] and the posterior mass on run lengths up to
`max_detection_lag` is at least `min_probability`, the series has a candidate regime that
began r* observations ago and has persisted for at least `min_regime_length` of them. A lone
spike does not persist, so it never reaches verification as a regime of its own.

Verification (as in Falcon): the candidate stands only if the robust means of the regime
before (since the last verified change, at most `before_window` observations) and after
differ by at least `min_relative_change` (larger over smaller, minus one, so an onset and
its recovery are judged on the same scale). Robust means are trimmed means, so a spike in
either window does not tip the decision.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from math import lgamma, log, log1p, pi
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from lagscope.simulator.defaults import (
    BOCD_HAZARD,
    BOCD_MAX_RUN_LENGTH,
    BOCD_MIN_RELATIVE_CHANGE,
    BOCD_WARMUP,
)

#: MAD of a normal sample times this factor estimates its standard deviation.
_MAD_TO_SIGMA = 1.4826

ChangeKind = Literal["onset", "recovery"]


class BocdConfig(BaseModel):
    """Detector settings; all series of a bank share them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Prior probability that a new regime starts at any observation (1 / expected length).
    hazard: float = Field(default=BOCD_HAZARD, gt=0.0, lt=1.0)
    #: Run lengths kept per series (R); memory and time per update are O(R).
    max_run_length: int = Field(default=BOCD_MAX_RUN_LENGTH, ge=8)
    #: Observations per series used to estimate location and scale before detecting.
    warmup: int = Field(default=BOCD_WARMUP, ge=5)
    #: Verification: the larger regime mean over the smaller must exceed 1 + this.
    min_relative_change: float = Field(default=BOCD_MIN_RELATIVE_CHANGE, gt=0.0)
    #: Observations a new regime must last before it is verified (spike rejection).
    min_regime_length: int = Field(default=8, ge=2)
    #: A regime older than this many observations is no longer a candidate.
    max_detection_lag: int = Field(default=40, ge=2)
    #: Posterior mass on run lengths <= max_detection_lag needed to consider a candidate.
    min_probability: float = Field(default=0.5, gt=0.0, le=1.0)
    #: Most observations of the previous regime that the verification compares against.
    before_window: int = Field(default=100, ge=2)
    #: Fraction trimmed from each end before averaging a regime (robust to spikes).
    trim_fraction: float = Field(default=0.25, ge=0.0, lt=0.5)
    #: An observation this many robust standard deviations from the median of itself and
    #: its neighbours is a lone spike and is replaced by that median.
    spike_z: float = Field(default=5.0, gt=0.0)
    #: Verification waits (up to max_detection_lag) while the measured change is within
    #: this many standard errors of the threshold.
    verification_z: float = Field(default=2.0, ge=0.0)
    #: Detect on log(value): multiplicative slowdowns become shifts. Needs positive values.
    log_transform: bool = True
    #: Normal-Gamma prior on standardized data: mean 0 weighted as `prior_kappa`
    #: pseudo-observations; precision Gamma(prior_alpha, prior_beta) with mean 1.
    prior_kappa: float = Field(default=0.1, gt=0.0)
    prior_alpha: float = Field(default=1.0, gt=0.0)
    prior_beta: float = Field(default=1.0, gt=0.0)
    #: Smallest scale, relative to the warm-up median, so a constant warm-up still works.
    min_relative_scale: float = Field(default=1e-3, gt=0.0)

    @model_validator(mode="after")
    def _windows_fit(self) -> BocdConfig:
        if self.max_detection_lag < self.min_regime_length:
            raise ValueError("max_detection_lag must be >= min_regime_length")
        if self.max_detection_lag >= self.max_run_length - 1:
            raise ValueError("max_detection_lag must be < max_run_length - 1")
        return self

    @property
    def history_length(self) -> int:
        """Raw observations kept per series: the verification windows and the warm-up."""
        return max(self.before_window + self.max_detection_lag + 3, self.warmup + 1)


@dataclass(frozen=True)
class ChangePoint:
    """A verified change of regime in one series."""

    #: Position of the series in the bank.
    series: int
    #: Update call (step) that carried the first observation of the new regime.
    index: int
    kind: ChangeKind
    #: Trimmed means of the raw values in the regimes before and after the change.
    before_mean: float
    after_mean: float
    #: Posterior probability that a regime began within the last `max_detection_lag`
    #: observations, when the change was declared.
    probability: float
    #: Update call at which the change was declared (detection latency = this - index).
    detected_at: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def relative_change(before: float, after: float) -> float:
    """Larger over smaller minus one: a 10 % slowdown and its recovery both give 0.10.

    >>> round(relative_change(1.0, 1.1), 3), round(relative_change(1.1, 1.0), 3)
    (0.1, 0.1)
    >>> relative_change(0.0, 1.0)
    inf
    """
    low, high = min(before, after), max(before, after)
    if low <= 0.0:
        return float("inf")
    return high / low - 1.0


def trimmed_mean(values: np.ndarray, trim_fraction: float) -> float:
    ordered = np.sort(values)
    cut = int(ordered.size * trim_fraction)
    kept = ordered[cut : ordered.size - cut] if ordered.size > 2 * cut else ordered
    return float(kept.mean())


def _logsumexp_rows(values: np.ndarray) -> np.ndarray:
    peak = values.max(axis=1, keepdims=True)
    return (peak + np.log(np.exp(values - peak).sum(axis=1, keepdims=True)))[:, 0]


# State entries, the dtype they are held in, and their shape in units of (S, R or H).
_STATE_ARRAYS: tuple[str, ...] = (
    "obs_count",
    "center",
    "scale",
    "log_run_prob",
    "mean",
    "beta",
    "log_beta",
    "history_values",
    "history_steps",
    "regime_start",
)


class BocdBank:
    """Run-length posteriors of `n_series` series, advanced together one step at a time."""

    def __init__(self, n_series: int, config: BocdConfig | None = None) -> None:
        if n_series < 1:
            raise ValueError(f"n_series must be >= 1, got {n_series}")
        self.config = config or BocdConfig()
        self.n_series = n_series
        cfg = self.config
        runs, history = cfg.max_run_length, cfg.history_length
        #: Update calls so far (the index of the next step).
        self.steps_seen = 0
        #: Observations per series (NaN steps do not count).
        self.obs_count = np.zeros(n_series, dtype=np.int64)
        self.center = np.full(n_series, np.nan)
        self.scale = np.full(n_series, np.nan)
        self.log_run_prob = np.full((n_series, runs), -np.inf)
        self.log_run_prob[:, 0] = 0.0
        # Posterior mean and beta of every run length; kappa and alpha depend on the run
        # length only (slot r has seen exactly r observations), so they are shared vectors.
        self.mean = np.zeros((n_series, runs))
        self.beta = np.full((n_series, runs), cfg.prior_beta)
        self.log_beta = np.full((n_series, runs), log(cfg.prior_beta))
        self.history_values = np.full((n_series, history), np.nan)
        self.history_steps = np.full((n_series, history), -1, dtype=np.int64)
        #: Observation number where the current verified regime began.
        self.regime_start = np.zeros(n_series, dtype=np.int64)
        self._derive_constants()

    def _derive_constants(self) -> None:
        cfg = self.config
        run = np.arange(cfg.max_run_length, dtype=np.float64)
        kappa = cfg.prior_kappa + run
        alpha = cfg.prior_alpha + run / 2.0
        self._alpha = alpha
        self._inverse_kappa_plus_one = 1.0 / (kappa + 1.0)
        # Student-t predictive with df 2a, location mu, scale^2 b(k+1)/(a k):
        # log p = C - log(b)/2 - (a + 1/2) log(1 + (x - mu)^2 k / (2 b (k + 1))).
        self._half_shrink = kappa / (2.0 * (kappa + 1.0))
        self._exponent = alpha + 0.5
        self._log_norm = np.array(
            [
                lgamma(a + 0.5) - lgamma(a) - 0.5 * log(2.0 * pi * (k + 1.0) / k)
                for a, k in zip(alpha, kappa, strict=True)
            ]
        )
        self._log_hazard = log(cfg.hazard)
        self._log_survival = log1p(-cfg.hazard)

    # ------------------------------------------------------------------ updating

    def update(self, values: np.ndarray) -> list[ChangePoint]:
        """Add one observation per series (NaN: none this step); return verified changes."""
        values = np.asarray(values, dtype=np.float64)
        if values.shape != (self.n_series,):
            raise ValueError(f"expected {self.n_series} values, got shape {values.shape}")
        step = self.steps_seen
        self.steps_seen += 1
        observed = np.isfinite(values)
        if self.config.log_transform:
            observed &= values > 0.0
        rows = np.flatnonzero(observed)
        if rows.size == 0:
            return []
        raw = values[rows]
        history = self.config.history_length
        slot = self.obs_count[rows] % history
        self.history_values[rows, slot] = raw
        self.history_steps[rows, slot] = step
        self.obs_count[rows] += 1
        counts = self.obs_count[rows]
        # The detector reads each observation once its successor has arrived (see
        # `_despiked`), so it runs one observation behind the history.
        warmup = self.config.warmup
        just_warm = counts == warmup + 1
        if just_warm.any():
            self._start_detection(rows[just_warm])
        running = counts > warmup + 1
        if not running.any():
            return []
        running_rows = rows[running]
        z = self._despiked(running_rows, counts[running])
        target: np.ndarray | slice = running_rows
        if running_rows.size == self.n_series:
            target = slice(None)  # plain views avoid copying the whole state
        self._advance(target, z)
        return self._detect(running_rows, target, step)

    def _despiked(self, rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Standardized observation count - 2 of each row, a lone spike replaced.

        An observation far from the median of itself and its two neighbours is a single-step
        excursion; it is replaced by that median. A step change is left exactly in place (its
        first observation agrees with the next one), and ordinary noise is left untouched, so
        the detector's input stays independent from one observation to the next.
        """
        history = self.config.history_length
        first, middle, last = (
            self.history_values[rows, (counts - back) % history] for back in (3, 2, 1)
        )
        median = np.maximum(np.minimum(first, middle), np.minimum(np.maximum(first, middle), last))
        z_middle = self._standardize(rows, middle)
        z_median = self._standardize(rows, median)
        is_spike = np.abs(z_middle - z_median) > self.config.spike_z
        return np.where(is_spike, z_median, z_middle)

    def _standardize(self, rows: np.ndarray, raw: np.ndarray) -> np.ndarray:
        transformed = np.log(raw) if self.config.log_transform else raw
        return (transformed - self.center[rows]) / self.scale[rows]

    def _start_detection(self, rows: np.ndarray) -> None:
        cfg = self.config
        warm = self.history_values[rows, : cfg.warmup]
        transformed = np.log(warm) if cfg.log_transform else warm
        center = np.median(transformed, axis=1)
        mad = np.median(np.abs(transformed - center[:, None]), axis=1)
        floor = cfg.min_relative_scale * (1.0 if cfg.log_transform else np.abs(center))
        self.center[rows] = center
        self.scale[rows] = np.maximum(_MAD_TO_SIGMA * mad, np.maximum(floor, 1e-12))
        # Replaying the warm-up makes it the first regime, so detection starts informed.
        for count in range(3, cfg.warmup + 2):
            self._advance(rows, self._despiked(rows, np.full(rows.size, count)))

    def _advance(self, rows: np.ndarray | slice, z: np.ndarray) -> None:
        mean = self.mean[rows]
        beta = self.beta[rows]
        deviation = z[:, None] - mean
        spread = deviation * deviation
        spread *= self._half_shrink
        grown_beta = beta + spread  # each run's beta once it includes z
        log_grown_beta = np.log(grown_beta)
        # Student-t log predictive, rewritten so that one log serves it and the update:
        # C - log(b)/2 - (a + 1/2) log(1 + s/b) = C + a log(b) - (a + 1/2) log(b + s).
        joint = self.log_beta[rows] * self._alpha
        joint -= self._exponent * log_grown_beta
        joint += self._log_norm
        joint += self.log_run_prob[rows]
        # Growth and change-point terms sum to the evidence, which is thus the normalizer.
        log_evidence = _logsumexp_rows(joint)
        survive = (self._log_survival - log_evidence)[:, None]
        new_log_run = np.empty_like(joint)
        new_log_run[:, 0] = self._log_hazard
        np.add(joint[:, :-1], survive, out=new_log_run[:, 1:])
        # The last slot absorbs every run length >= R-1.
        new_log_run[:, -1] = np.logaddexp(new_log_run[:, -1], joint[:, -1] + survive[:, 0])
        deviation *= self._inverse_kappa_plus_one
        deviation += mean  # now each run's posterior mean once it includes z
        cfg = self.config
        self._shift_in(self.log_run_prob, rows, new_log_run, None)
        self._shift_in(self.mean, rows, deviation, 0.0)
        self._shift_in(self.beta, rows, grown_beta, cfg.prior_beta)
        self._shift_in(self.log_beta, rows, log_grown_beta, log(cfg.prior_beta))

    @staticmethod
    def _shift_in(
        state: np.ndarray, rows: np.ndarray | slice, grown: np.ndarray, fresh: float | None
    ) -> None:
        """Store run r's grown statistics as run r+1's; `fresh` starts run 0 (None: as is)."""
        if fresh is None:
            state[rows] = grown
            return
        if isinstance(rows, slice):
            state[:, 1:] = grown[:, :-1]
            state[:, 0] = fresh
            return
        shifted = np.empty_like(grown)
        shifted[:, 1:] = grown[:, :-1]
        shifted[:, 0] = fresh
        state[rows] = shifted

    def _detect(self, rows: np.ndarray, target: np.ndarray | slice, step: int) -> list[ChangePoint]:
        cfg = self.config
        log_run = self.log_run_prob[target]
        likeliest_run = np.argmax(log_run, axis=1)
        candidate = (likeliest_run >= cfg.min_regime_length) & (
            likeliest_run <= cfg.max_detection_lag
        )
        if not candidate.any():
            return []
        picked = np.flatnonzero(candidate)
        log_recent = _logsumexp_rows(log_run[picked, : cfg.max_detection_lag + 1])
        recent_mass = np.minimum(np.exp(log_recent), 1.0)  # rounding can exceed 1
        series = rows[picked]
        # The detector's latest observation is number count - 2 (median filter lag).
        onsets = self.obs_count[series] - 1 - likeliest_run[picked]
        # A previous regime shorter than a regime's minimum cannot be compared against
        # (this also skips the verified change itself while it is still recent).
        comparable = (recent_mass >= cfg.min_probability) & (
            onsets - self.regime_start[series] >= cfg.min_regime_length
        )
        events: list[ChangePoint] = []
        for position in np.flatnonzero(comparable):
            event = self._verify(
                int(series[position]),
                int(onsets[position]),
                int(likeliest_run[picked[position]]),
                float(recent_mass[position]),
                step,
            )
            if event is not None:
                events.append(event)
        return events

    def _verify(
        self, series: int, onset: int, run: int, probability: float, step: int
    ) -> ChangePoint | None:
        cfg = self.config
        count = int(self.obs_count[series])
        before_start = max(int(self.regime_start[series]), onset - cfg.before_window)
        history = cfg.history_length
        before = self.history_values[series, np.arange(before_start, onset) % history]
        after = self.history_values[series, np.arange(onset, count) % history]
        before_mean = trimmed_mean(before, cfg.trim_fraction)
        after_mean = trimmed_mean(after, cfg.trim_fraction)
        if before_mean <= 0.0 or after_mean <= 0.0:
            return None
        # Decide as soon as the evidence is clear on either side of the threshold; a change
        # near the threshold waits for more observations, up to max_detection_lag.
        log_ratio = abs(log(after_mean / before_mean))
        margin = log_ratio - log1p(cfg.min_relative_change)
        if margin < 0.0:
            return None
        final = run >= cfg.max_detection_lag
        if not final and margin < cfg.verification_z * _log_ratio_error(before, after):
            return None
        self.regime_start[series] = onset
        return ChangePoint(
            series=series,
            index=int(self.history_steps[series, onset % history]),
            kind="onset" if after_mean > before_mean else "recovery",
            before_mean=before_mean,
            after_mean=after_mean,
            probability=probability,
            detected_at=step,
        )

    # ------------------------------------------------------------------ persistence

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue: numpy arrays, and scalars for the config."""
        state: dict[str, Any] = {name: getattr(self, name).copy() for name in _STATE_ARRAYS}
        state["steps_seen"] = self.steps_seen
        state["n_series"] = self.n_series
        for key, value in self.config.model_dump().items():
            state[f"config.{key}"] = value
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> BocdBank:
        """Rebuild a bank from `state_dict()` output (also as loaded back by `np.load`)."""
        config = BocdConfig(
            **{
                key.removeprefix("config."): _scalar(value)
                for key, value in state.items()
                if key.startswith("config.")
            }
        )
        bank = cls(int(_scalar(state["n_series"])), config)
        for name in _STATE_ARRAYS:
            current = getattr(bank, name)
            restored = np.asarray(state[name], dtype=current.dtype)
            if restored.shape != current.shape:
                raise ValueError(
                    f"state entry {name!r} has shape {restored.shape}, expected {current.shape}"
                )
            setattr(bank, name, restored.copy())
        bank.steps_seen = int(_scalar(state["steps_seen"]))
        return bank


def _log_ratio_error(before: np.ndarray, after: np.ndarray) -> float:
    """Standard error of log(mean after / mean before), from robust spreads (MAD)."""
    variance = 0.0
    for window in (before, after):
        logs = np.log(window)
        spread = _MAD_TO_SIGMA * float(np.median(np.abs(logs - np.median(logs))))
        variance += spread * spread / window.size
    return variance**0.5


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, np.ndarray | np.generic) else value


def sliding_window_changepoints(
    values: np.ndarray, window: int = 10, min_relative_change: float = 0.10
) -> list[tuple[int, ChangeKind, float, float]]:
    """Baseline detector: the mean ratio of two adjacent windows of `window` observations.

    Every split point where the ratio exceeds the threshold belongs to a run of such points;
    each run reports one change at its strongest split. Returns (index of the first
    observation after the split, kind, before mean, after mean).
    """
    values = np.asarray(values, dtype=np.float64)
    n = values.size
    if n < 2 * window:
        return []
    cumulative = np.concatenate(([0.0], np.cumsum(values)))
    split = np.arange(window, n - window + 1)
    before = (cumulative[split] - cumulative[split - window]) / window
    after = (cumulative[split + window] - cumulative[split]) / window
    change = np.maximum(before, after) / np.minimum(before, after) - 1.0
    exceeds = change >= min_relative_change
    changes: list[tuple[int, ChangeKind, float, float]] = []
    if not exceeds.any():
        return changes
    padded = np.concatenate(([False], exceeds, [False])).astype(np.int8)
    run_starts = np.flatnonzero(np.diff(padded) == 1)
    run_ends = np.flatnonzero(np.diff(padded) == -1)
    for start, end in zip(run_starts, run_ends, strict=True):
        best = start + int(np.argmax(change[start:end]))
        kind: ChangeKind = "onset" if after[best] > before[best] else "recovery"
        changes.append((int(split[best]), kind, float(before[best]), float(after[best])))
    return changes
