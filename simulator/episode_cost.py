"""What a worker's episode costs the job, step by step.

The cost of one step is the step time as measured less the step time had the worker
spent only its own usual time (its level before the episode) on the kind that rose: the
durations of its ops of that op type, or for `host` its host gaps (`prepare.host_gaps`),
scaled down to that level and replayed through the dependency model. A straggler whose
extra time the pipeline absorbs (it waited anyway) costs nothing; one every rank waits for
costs all of it. The job loses that many seconds on every GPU, so GPU-seconds = seconds x GPUs.

What the GC probe recorded inside the worker's ops of that kind (for `host`, inside its
host gaps) is kept beside it: the pauses it had beyond its peers' in the same step, against
how far its own time rose over its level before. A rank whose collections run when its
peers' do not (its heap grew, its collector fires at other steps) is slow in the ops those
pauses stall (on a GPU, in the launches they hold back), and the episode names garbage
collection, not its compute or its host, when the pauses explain the rise
(`episode_diagnosis.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from lagscope.simulator.engine import CompiledModel
from lagscope.simulator.online_episodes import worker_signals
from lagscope.simulator.prepare import PreparedTrace
from lagscope.simulator.step_without import step_times_without

#: Per-step costs an `EpisodeCost` keeps for a picture (the latest ones).
_STEPS_KEPT = 64
#: Steps whose paid time an `EpisodeCost` keeps for its median (the latest ones).
_PAID_KEPT = 512
#: The model's price and the job's own measure agree while neither is more than this
#: many times the other: on a busy machine the model is off by up to a fifth where the
#: straggler's peers got its core (or lost theirs to it), and by 2x or more where it
#: misses a cause.
_AGREE = 1.33


def lost_seconds(
    prepared: PreparedTrace,
    worker: tuple[int, int],
    kind: str,
    level_before: float,
    compiled: CompiledModel | None = None,
) -> np.ndarray:
    """[step]: job seconds each step lost to `worker` (dp, stage) spending more than
    `level_before` seconds of `kind` (an op type, or `host`): the step as the job ran it
    against the step with that worker's time of that kind scaled down to the level
    (`step_without.step_times_without`).

    >>> from lagscope.simulator.generate import JobSpec, SlowWorker, generate_job
    >>> from lagscope.simulator.prepare import prepare
    >>> job = generate_job(JobSpec(dp=2, pp=2, microbatches=4, steps=4, seed=1,
    ...     stragglers=(SlowWorker(dp=1, stage=0, factor=2.0, start_step=2),)))
    >>> prepared = prepare(job.trace, job.meta)
    >>> level = float(worker_signals(prepared.select_steps([0]), ["forward-compute"])[0, 0, 0, 1])
    >>> lost = lost_seconds(prepared, (1, 0), "forward-compute", level)
    >>> bool(lost[0] < 1e-3 < lost[3])
    True
    """
    dp, stage = worker
    own = worker_signals(prepared, [kind])[:, 0, stage, dp]  # [step]
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(own > level_before, level_before / own, 1.0)
    return step_times_without(prepared, worker, kind, scale, compiled).lost


def baseline_of(paid: np.ndarray) -> tuple[float, float, int] | None:
    """What the job paid for a step, from `paid` (its steps' times): their median, their
    spread (1.4826 x their median absolute deviation: a step that lost its core is an
    outlier there, not noise) and how many; None for fewer than 4.

    >>> baseline_of(np.array([1.0, 1.1, 0.9, 1.0, 5.0]))
    (1.0, 0.14826, 5)
    """
    paid = np.asarray(paid, dtype=np.float64)
    paid = paid[np.isfinite(paid)]
    if paid.size < 4:
        return None
    middle = float(np.median(paid))
    return middle, round(1.4826 * float(np.median(np.abs(paid - middle))), 12), int(paid.size)


@dataclass(frozen=True)
class EpisodeCost:
    """What an episode cost the job so far, summed over its steps."""

    #: Job seconds lost to the worker (`lost_seconds`).
    lost_s: float = 0.0
    #: Job seconds above the straggler-free step time over the same steps: what every
    #: straggler and the job's noise cost together.
    excess_s: float = 0.0
    #: What the job paid for those steps (their periods where known, `paid_times`), summed.
    measured_s: float = 0.0
    steps: int = 0
    #: The latest steps' lost seconds, oldest first.
    recent: tuple[float, ...] = field(default=())
    #: The worker's own seconds of the episode's kind above its level before, and its
    #: recorded GC pauses in those ops beyond its peers' (`measures.gc_beyond_peers`), summed.
    rise_s: float = 0.0
    gc_s: float = 0.0
    #: Of `lost_s` and `steps`: the part estimated for steps whose inputs were no longer
    #: held when the episode was found (`with_estimated`).
    estimated_s: float = 0.0
    estimated_steps: int = 0
    #: What the job paid for a step before the episode (`Baseline`); 0 steps: not known.
    baseline_s: float = 0.0
    baseline_spread_s: float = 0.0
    baseline_steps: int = 0
    #: Of the job's measured steps, what they took above `baseline_s`, summed: the job's
    #: own measure of what it lost meanwhile (its share where episodes overlap), and the
    #: shares summed (the steps it stands for: `with_baseline_moved`).
    job_lost_s: float = 0.0
    job_steps: float = 0.0
    #: Of `job_lost_s`, the part over the steps `with_estimated` added (measured, but not
    #: priced by the model: their excess over the ideal is not known).
    job_estimated_s: float = 0.0
    #: What the job paid for each of its latest steps (`_PAID_KEPT`): their median over
    #: the baseline is the speed-up the job measured.
    paid: tuple[float, ...] = field(default=())

    @property
    def job_noise_s(self) -> float:
        """How far the job's own measure can be off by its noise alone (1 sigma): each
        step's spread, and the baseline's own uncertainty, over the episode's steps.

        >>> round(EpisodeCost(steps=16, baseline_spread_s=0.01, baseline_steps=16).job_noise_s, 4)
        0.0566
        """
        if not self.baseline_steps:
            return 0.0
        n = self.steps
        return self.baseline_spread_s * float(np.sqrt(n + n * n / self.baseline_steps))

    @property
    def measured_known(self) -> bool:
        """Whether the job's own measure exists: steps before the episode to compare with."""
        return self.baseline_steps > 0 and self.steps > 0

    @property
    def explained(self) -> float | None:
        """Share of the job's measured loss the model explains (`lost_s` over
        `job_lost_s`); None where the job measured no loss beyond its noise.

        >>> EpisodeCost(lost_s=0.5, job_lost_s=1.0, steps=10, baseline_steps=20).explained
        0.5
        """
        if not self.measured_known or self.job_lost_s <= 2 * self.job_noise_s:
            return None
        return self.lost_s / self.job_lost_s

    @property
    def contradicted(self) -> bool:
        """Whether the job's own step times contradict the model's price: one is more
        than `_AGREE` times the other, by more than twice the job's noise (a shared
        machine, where a sleeping straggler frees its core for its peers, or a busy one
        takes theirs; a cause the model does not describe). Every output then says how
        much of the measure the model explains.

        >>> EpisodeCost(lost_s=0.1, job_lost_s=1.0, steps=10, baseline_steps=20).contradicted
        True
        >>> EpisodeCost(lost_s=0.85, job_lost_s=1.0, steps=10, baseline_steps=20).contradicted
        False
        """
        if not self.measured_known:
            return False
        low, high = sorted((max(self.lost_s, 0.0), max(self.job_lost_s, 0.0)))
        return high > _AGREE * low and high - low > 2 * self.job_noise_s

    @property
    def price_s(self) -> float:
        """What the episode cost the job: what the job's own steps measured, where it
        measured steps before the episode to compare with (the model decides who is to
        blame, and shares the measure between episodes that overlap); the model's price
        (`lost_s`) where it did not.

        >>> EpisodeCost(lost_s=0.1, job_lost_s=1.0, steps=10, baseline_steps=20).price_s
        1.0
        >>> EpisodeCost(lost_s=0.1, steps=10).price_s
        0.1
        """
        if self.measured_known:
            return max(self.job_lost_s, 0.0)
        return self.lost_s

    @property
    def within_noise(self) -> bool:
        """Whether the price is within the job's own noise (the job measured its steps
        and they do not say it lost that much): evidence, not a straggler to act on.

        >>> EpisodeCost(lost_s=0.05, job_lost_s=0.04, steps=8, baseline_spread_s=0.01,
        ...     baseline_steps=20).within_noise
        True
        """
        return self.measured_known and self.price_s <= 2 * self.job_noise_s

    @property
    def share(self) -> float:
        """Share of the job's excess over the episode's priced steps the worker explains
        (0-1): the excess of an estimated step is not known.

        >>> EpisodeCost(lost_s=1.5, excess_s=2.0).share
        0.75
        """
        if self.excess_s <= 0:
            return 0.0
        priced = self.price_s - (self.job_estimated_s if self.measured_known else self.estimated_s)
        return float(min(max(priced / self.excess_s, 0.0), 1.0))

    @property
    def price_estimated_s(self) -> float:
        """Of `price_s`, the part estimated rather than measured or priced: the model's
        extrapolation to steps no longer held when the episode was found (`with_estimated`),
        none where the job's own step times measured them."""
        return 0.0 if self.measured_known else self.estimated_s

    @property
    def saved_share(self) -> float:
        """Share of those steps' measured time the job would have saved without the
        episode.

        >>> EpisodeCost(lost_s=1.0, measured_s=4.0).saved_share
        0.25
        """
        if self.measured_s <= 0:
            return 0.0
        return float(min(max(self.price_s / self.measured_s, 0.0), 1.0))

    @property
    def speedup(self) -> float:
        """How much faster those steps would have run without the episode: where the job
        measured steps before it, its median step inside over its median step before (a
        straggler's pauses make some steps far longer than others, and the median step is
        what the job runs at); else the model's time saved.

        >>> EpisodeCost(lost_s=1.0, measured_s=4.0).speedup
        1.3333333333333333
        >>> EpisodeCost(paid=(2.0, 2.1, 5.0), steps=3, baseline_s=1.0, baseline_steps=8).speedup
        2.1
        """
        if self.measured_known and self.paid and self.baseline_s > 0:
            return max(float(np.median(self.paid)) / self.baseline_s, 1.0)
        if self.measured_s <= self.price_s:
            return 1.0
        return self.measured_s / (self.measured_s - self.price_s)

    @property
    def gc_share(self) -> float:
        """Share of the worker's rise that its own GC pauses (beyond its peers') explain
        (0-1).

        >>> EpisodeCost(rise_s=0.4, gc_s=0.1).gc_share
        0.25
        """
        if self.rise_s <= 0:
            return 0.0
        return float(min(max(self.gc_s / self.rise_s, 0.0), 1.0))

    def plus(
        self, lost_s: float, excess_s: float, measured_s: float, rise_s: float = 0.0,
        gc_s: float = 0.0, job_share: float = 1.0,
    ) -> EpisodeCost:  # fmt: skip
        """This cost with one more step's (`job_share`: the episode's share of the step's
        measured time above the baseline, where episodes overlap)."""
        job = (measured_s - self.baseline_s) * job_share if self.baseline_steps else 0.0
        return replace(
            self,
            lost_s=self.lost_s + max(lost_s, 0.0),
            excess_s=self.excess_s + max(excess_s, 0.0),
            measured_s=self.measured_s + measured_s,
            steps=self.steps + 1,
            recent=(*self.recent, float(lost_s))[-_STEPS_KEPT:],
            rise_s=self.rise_s + max(rise_s, 0.0),
            gc_s=self.gc_s + max(gc_s, 0.0),
            job_lost_s=self.job_lost_s + job,
            paid=(*self.paid, float(measured_s))[-_PAID_KEPT:],
            job_steps=self.job_steps + (job_share if self.baseline_steps else 0.0),
        )

    def minus(self, later: EpisodeCost, earlier: EpisodeCost) -> EpisodeCost:
        """This cost without the steps added between `earlier` and `later` (this cost
        or one it grew into): steps priced after a worker recovered, before its episode
        closed, are not the episode's.

        >>> start = EpisodeCost().plus(1.0, 1.0, 2.0)
        >>> grown = start.plus(0.0, 0.0, 1.0).plus(0.0, 0.0, 1.0)
        >>> back = grown.minus(grown, start)
        >>> back.steps, back.measured_s, back.recent
        (1, 2.0, (1.0,))
        """
        dropped = later.steps - earlier.steps
        return replace(
            self,
            lost_s=self.lost_s - (later.lost_s - earlier.lost_s),
            excess_s=self.excess_s - (later.excess_s - earlier.excess_s),
            measured_s=self.measured_s - (later.measured_s - earlier.measured_s),
            steps=self.steps - dropped,
            recent=self.recent[: max(len(self.recent) - dropped, 0)],
            paid=self.paid[: max(len(self.paid) - dropped, 0)],
            rise_s=self.rise_s - (later.rise_s - earlier.rise_s),
            gc_s=self.gc_s - (later.gc_s - earlier.gc_s),
            job_lost_s=self.job_lost_s - (later.job_lost_s - earlier.job_lost_s),
            job_steps=self.job_steps - (later.job_steps - earlier.job_steps),
        )

    def with_baseline_moved(self, baseline_s: float, spread_s: float, steps: int) -> EpisodeCost:
        """This cost measured against another baseline (the steps on both sides of the
        episode, once the run has moved on).

        >>> cost = EpisodeCost().with_baseline(np.ones(8)).plus(0.5, 0.5, 1.5)
        >>> moved = cost.with_baseline_moved(1.1, 0.0, 16)
        >>> round(cost.job_lost_s, 3), round(moved.job_lost_s, 3)
        (0.5, 0.4)
        """
        if not self.baseline_steps or steps < 4:
            return self
        return replace(
            self,
            job_lost_s=self.job_lost_s - (baseline_s - self.baseline_s) * self.job_steps,
            baseline_s=baseline_s,
            baseline_spread_s=spread_s,
            baseline_steps=steps,
        )

    def with_baseline(self, paid: np.ndarray) -> EpisodeCost:
        """This cost measured against `paid`, what the job paid for each of its steps
        before the episode (its periods where known): their median, and their spread as
        1.4826 x their median absolute deviation (a lost core's step is an outlier there,
        not noise). Fewer than 4 steps: not known.

        >>> cost = EpisodeCost().with_baseline(np.array([1.0, 1.1, 0.9, 1.0, 5.0]))
        >>> cost.baseline_s, round(cost.baseline_spread_s, 4), cost.baseline_steps
        (1.0, 0.1483, 5)
        """
        found = baseline_of(paid)
        if found is None:
            return self
        middle, spread, n = found
        return replace(self, baseline_s=middle, baseline_spread_s=spread, baseline_steps=n)

    def with_estimated(self, rises: np.ndarray, measured: np.ndarray) -> EpisodeCost:
        """This cost with steps that can no longer be priced (a job retains a few steps
        of a large size, and a worker slow from its first step is found at its first
        diagnosis): each loses what the worker rose in it (`rises`: its own seconds of the
        episode's kind above its level) times the share of its rise that the priced steps
        passed on to the job, at most the step's `measured` time. Without a priced step
        there is nothing to scale by, and the cost stays as it is. `rise_s` and `gc_s`
        stay the priced steps' (the GC share is read where pauses were recorded).

        >>> cost = EpisodeCost(lost_s=0.6, measured_s=4.0, steps=2, rise_s=0.8)
        >>> more = cost.with_estimated(np.array([0.4, 0.2, -0.1]), np.array([2.0, 2.0, 2.0]))
        >>> round(more.lost_s, 3), more.steps, round(more.estimated_s, 3), more.estimated_steps
        (1.05, 5, 0.45, 3)
        """
        if not rises.size or self.steps == 0 or self.rise_s <= 0:
            return self
        passed = (self.lost_s - self.estimated_s) / self.rise_s
        rise = np.maximum(rises, 0.0)
        estimated = float(np.minimum(passed * rise, measured).sum())
        job = float((measured - self.baseline_s).sum()) if self.baseline_steps else 0.0
        return replace(
            self,
            lost_s=self.lost_s + estimated,
            job_lost_s=self.job_lost_s + job,
            job_estimated_s=self.job_estimated_s + job,
            job_steps=self.job_steps + (int(rises.size) if self.baseline_steps else 0),
            paid=(*self.paid, *(float(m) for m in measured))[-_PAID_KEPT:],
            measured_s=self.measured_s + float(measured.sum()),
            steps=self.steps + int(rises.size),
            estimated_s=self.estimated_s + estimated,
            estimated_steps=self.estimated_steps + int(rises.size),
        )
