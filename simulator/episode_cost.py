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

from lagscope.simulator.engine import CompiledModel, simulate
from lagscope.simulator.online_episodes import HOST, worker_signals
from lagscope.simulator.prepare import PreparedTrace, host_gaps

#: Per-step costs an `EpisodeCost` keeps for a picture (the latest ones).
_STEPS_KEPT = 64


def lost_seconds(
    prepared: PreparedTrace,
    worker: tuple[int, int],
    kind: str,
    level_before: float,
    compiled: CompiledModel | None = None,
    *,
    measured_nodelay: np.ndarray | None = None,
) -> np.ndarray:
    """[step]: job seconds each step lost to `worker` (dp, stage) spending more than
    `level_before` seconds of `kind` (an op type, or `host`).

    `measured_nodelay`: the steps' simulated time as measured without launch delays
    (`WhatIfResult.t_nodelay`), where the caller has it: an op type's loss is against
    that time, so only the worker's usual variant is simulated (a host's loss is against
    the steps with their delays, simulated here either way).

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
    compiled = compiled or prepared.model.compiled
    dp, stage = worker
    own = worker_signals(prepared, [kind])[:, 0, stage, dp]  # [step]
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(own > level_before, level_before / own, 1.0)
    node_stage = prepared.model.node_stage()
    n_nodes, n_steps, n_dp = prepared.cost.shape
    cost = prepared.cost.astype(np.float64)
    if kind == HOST:
        # Its host gaps scaled down to the level before; the rest of each launch delay
        # (what the worker ran or waited on before the op) stays.
        rows = node_stage == stage
        delay = prepared.launch_delay.astype(np.float64)
        gaps = host_gaps(prepared)[rows, :, dp].astype(np.float64)
        usual = delay.copy()
        usual[rows, :, dp] -= gaps * (1.0 - scale[None, :])
        costs = np.concatenate([cost.reshape(n_nodes, -1)] * 2, axis=1)
        delays: np.ndarray | None = np.concatenate(
            [delay.reshape(n_nodes, -1), usual.reshape(n_nodes, -1)], axis=1
        )
    else:
        rows = (node_stage == stage) & (np.array(prepared.node_optype) == kind)
        usual = cost.copy()
        usual[rows, :, dp] *= scale[None, :]
        if measured_nodelay is not None:
            # The same columns as the what-if's measured variant: the same numbers.
            offsets = np.arange(0, n_steps * n_dp, n_dp, dtype=np.int64)
            times = simulate(compiled, usual.reshape(n_nodes, -1), None, offsets).step_time
            return np.maximum(np.asarray(measured_nodelay, dtype=np.float64) - times, 0.0)
        costs = np.concatenate([cost.reshape(n_nodes, -1), usual.reshape(n_nodes, -1)], axis=1)
        delays = None
    offsets = np.arange(0, 2 * n_steps * n_dp, n_dp, dtype=np.int64)
    times = simulate(compiled, costs, delays, offsets).step_time
    return np.maximum(times[:n_steps] - times[n_steps:], 0.0)


@dataclass(frozen=True)
class EpisodeCost:
    """What an episode cost the job so far, summed over its steps."""

    #: Job seconds lost to the worker (`lost_seconds`).
    lost_s: float = 0.0
    #: Job seconds above the straggler-free step time over the same steps: what every
    #: straggler and the job's noise cost together.
    excess_s: float = 0.0
    #: The measured step times of those steps, summed.
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

    @property
    def share(self) -> float:
        """Share of the job's excess over the episode's priced steps the worker explains
        (0-1): the excess of an estimated step is not known.

        >>> EpisodeCost(lost_s=1.5, excess_s=2.0).share
        0.75
        """
        if self.excess_s <= 0:
            return 0.0
        return float(min(max((self.lost_s - self.estimated_s) / self.excess_s, 0.0), 1.0))

    @property
    def saved_share(self) -> float:
        """Share of those steps' measured time the job would have saved without the
        episode.

        >>> EpisodeCost(lost_s=1.0, measured_s=4.0).saved_share
        0.25
        """
        if self.measured_s <= 0:
            return 0.0
        return float(min(max(self.lost_s / self.measured_s, 0.0), 1.0))

    @property
    def speedup(self) -> float:
        """How much faster those steps would have run without the episode.

        >>> EpisodeCost(lost_s=1.0, measured_s=4.0).speedup
        1.3333333333333333
        """
        if self.measured_s <= self.lost_s:
            return 1.0
        return self.measured_s / (self.measured_s - self.lost_s)

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
        gc_s: float = 0.0,
    ) -> EpisodeCost:  # fmt: skip
        """This cost with one more step's."""
        return EpisodeCost(
            self.lost_s + max(lost_s, 0.0),
            self.excess_s + max(excess_s, 0.0),
            self.measured_s + measured_s,
            self.steps + 1,
            (*self.recent, float(lost_s))[-_STEPS_KEPT:],
            self.rise_s + max(rise_s, 0.0),
            self.gc_s + max(gc_s, 0.0),
            self.estimated_s,
            self.estimated_steps,
        )

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
        return replace(
            self,
            lost_s=self.lost_s + estimated,
            measured_s=self.measured_s + float(measured.sum()),
            steps=self.steps + int(rises.size),
            estimated_s=self.estimated_s + estimated,
            estimated_steps=self.estimated_steps + int(rises.size),
        )
