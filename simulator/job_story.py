"""A job's story: the one place that turns its steps into what every output shows (its
totals, its episodes and their prices, the run's verdict), for a job followed live and
for a recorded trace alike.

- `LiveJob`: one job attempt followed step by step. Each host's step processor owns one
  per job attempt and feeds it every closed step in closing order, so both hosts (the
  embedded one and the faust worker) find the same episodes at the same steps and store
  the same rows.
- `tell_trace`: a recorded trace's story (`lagscope analyze`), told by a `LiveJob` fed
  its steps one at a time, as a host following the job would have told it.
- `roll_up`: steps as one trace and their what-if analysis: the diagnosis, the report
  and a resumed story all start from it.

What a `LiveJob` keeps:

- **Totals** (`simulator/job_totals.py`): GPU-seconds, GPU-seconds above the
  straggler-free step (of which the episodes' share is what stragglers cost; the rest
  is the job's own jitter), MFU.
- **Episodes** (`simulator/online_episodes.py`): updated at every complete step; an open
  episode's cost (`simulator/episode_cost.py`) grows with every step it covers, and its
  diagnosis (`simulator/episode_diagnosis.py`) is redone with it. An episode is named (a
  state, a row, an alert) once it has cost the job enough (`costs_the_job`: the run's own
  test for a slow worker), from the step it does: a worker whose own time rose while the
  job lost next to nothing to it is the job's noise, and one that closes so is never
  named. Its `first_seen` is the step it was named at.
- **Diagnosis**: the retained steps are rolled up (`roll_up`), diagnosed, and the run's
  one story is composed from that diagnosis and the episodes
  (`simulator/run_story.py`): first after `diagnose_every_steps` complete steps, then
  after twice as many steps each time, up to the retained window's length. A roll-up
  costs as much as analysing its steps again: a fixed cadence would analyse every step
  once per cadence the window holds, doubling up to the window about twice. Between
  roll-ups the story is composed again, at no cost, when an episode opens or closes, so
  the verdict follows the episodes at once. At the end of the job (its input ended, or
  it fell idle) once more, with each episode's bounds refined on the steps around it.

State (`state_dict` / `from_state`) is plain data; the retained steps it needs after a
restore are the processor's own (looked up by step id), and so are the steps of its last
diagnosis, which a restore makes again from them (the same roll-up and run, bit for bit):
the story is told again on it when an episode opens or closes before the next one.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from lagscope.simulator.advice import Advice, advise_resplit, escalation, resimulated_step_time
from lagscope.simulator.causes import WORKER_CAUSES, Cause
from lagscope.simulator.diagnose import Diagnosis, DiagnosisSettings, diagnose
from lagscope.simulator.episode_cost import EpisodeCost
from lagscope.simulator.episode_diagnosis import (
    CAUSE_OF_KIND,
    costs_the_job,
    episode_diagnosis,
    refined_bounds,
    rise_is_shared,
)
from lagscope.simulator.episode_prices import EpisodePrices, Priced, paid_times
from lagscope.simulator.job_totals import STEP_SERIES_KEPT, JobSize, JobTotals
from lagscope.simulator.online_episodes import (
    HOST,
    EpisodeChange,
    OnlineEpisodes,
    OnlineEpisodeSettings,
    WorkerEpisode,
    signal_kinds,
    worker_signals,
)
from lagscope.simulator.prepare import PreparedTrace, concat_steps
from lagscope.simulator.run_story import run_story
from lagscope.simulator.whatif import WhatIfResult, analyze, each_step_of

#: The kind of own time a run's worker cause is about (None: the op its worker is slow in).
_KIND_OF_CAUSE: dict[Cause, str | None] = {
    Cause.SLOW_WORKERS: None,
    **{cause: kind for kind, cause in CAUSE_OF_KIND.items()},
}


def in_step_order(steps: Sequence[PreparedTrace]) -> PreparedTrace:
    """Steps prepared one by one (a host's retained steps, in any order) as one trace,
    in step order."""
    return concat_steps(sorted(steps, key=lambda p: int(p.steps[0])))


def roll_up(
    steps: Sequence[PreparedTrace], *, decompose_threshold: float
) -> tuple[PreparedTrace, WhatIfResult]:
    """The roll-up: `steps` as one trace, in step order, and its what-if analysis with
    ideals from those steps (`lagscope analyze` of them). A job's diagnosis, its report
    and its resumed story all start from this.

    >>> from lagscope.simulator.generate import JobSpec, generate_job
    >>> from lagscope.simulator.prepare import prepare
    >>> job = generate_job(JobSpec(dp=2, pp=2, steps=4))
    >>> whole = prepare(job.trace, job.meta)
    >>> steps = [whole.select_steps([i]) for i in (3, 1, 0, 2)]
    >>> joined, result = roll_up(steps, decompose_threshold=0.0)
    >>> joined.steps.tolist() == whole.steps.tolist(), len(result.steps)
    (True, 4)
    """
    joined = in_step_order(steps)
    return joined, analyze(joined, decompose_threshold=decompose_threshold)


#: Closed named episodes a job keeps (their states, costs and re-splits): beyond it the
#: cheapest is let go, its latest state stored, its price kept in the job's sum. A day of
#: a 5 s-step job is 17,000 steps; a worker that flaps opens an episode every few dozen.
CLOSED_EPISODES_KEPT = 64


@dataclass(frozen=True)
class EpisodeState:
    """One episode as it stands after a step: what the `episodes` table stores."""

    episode: WorkerEpisode
    cost: EpisodeCost
    diagnosis: Diagnosis
    #: The job's last closed step when this state was made.
    at_step: int
    #: GPUs of the job: each lost second of the job is lost on every one of them.
    n_gpus: int
    #: When its onset step, its recovery step and its latest step began (ns since the
    #: epoch; 0 where not known).
    onset_ns: int = 0
    recovery_ns: int = 0
    last_ns: int = 0
    #: Made at the end of the job: its bounds refined on the steps around it.
    final: bool = False

    @property
    def gpu_seconds_lost(self) -> float:
        return self.cost.price_s * self.n_gpus


@dataclass(frozen=True)
class JobDiagnosis:
    """The job's diagnosis at a step: the roll-up of its retained steps, their diagnosis,
    and the story the run tells with its episodes (what is stored and printed)."""

    step: int
    rollup: WhatIfResult
    run: Diagnosis
    verdict: Diagnosis
    final: bool = False
    #: Episodes this diagnosis found (`LiveJob.adopt_verified`), named: stored with it.
    episodes: tuple[EpisodeState, ...] = ()


class LiveJob:
    """A job attempt's totals, episodes and diagnosis, one closed step at a time."""

    def __init__(
        self,
        info: JobSize,
        diagnose_every_steps: int,
        episode_settings: OnlineEpisodeSettings | None = None,
        diagnosis_settings: DiagnosisSettings | None = None,
    ) -> None:
        self.info = info
        self.diagnose_every_steps = diagnose_every_steps
        self.episode_settings = episode_settings or OnlineEpisodeSettings()
        self.diagnosis_settings = diagnosis_settings or DiagnosisSettings()
        self.totals = JobTotals()
        self.detector: OnlineEpisodes | None = None
        #: What each episode costs the job (`costs`), kept step by step.
        self.prices = EpisodePrices(self.episode_settings.baseline_steps)
        #: The latest state of every named episode, by id.
        self.states: dict[int, EpisodeState] = {}
        #: The episodes named so far and kept (their cost passed `costs_the_job`), by the
        #: detector's id: the step each was named at and the id it is shown with (1, 2, ...
        #: in the order they were named: the detector's ids count the unnamed ones too).
        self.named: dict[int, tuple[int, int]] = {}
        #: Those episodes as the detector has them (it lets go of closed ones its history
        #: no longer holds), and how many were named in all.
        self._named_episode: dict[int, WorkerEpisode] = {}
        self.named_count = 0
        #: Closed named episodes let go (`CLOSED_EPISODES_KEPT`): how many, and their price
        #: (seconds of the job), which the job's straggler cost still counts.
        self.forgotten_episodes = 0
        self.forgotten_price_s = 0.0
        #: Per compute episode, the re-split of micro-batches its steps were re-simulated
        #: with (at its opening, again at the job's end); None where it would not help.
        self.resplit: dict[int, Advice | None] = {}
        #: The latest complete steps with their measured, no-delay and ideal step times,
        #: for costing the steps an episode opened with.
        self.recent: deque[tuple[PreparedTrace, tuple[float, float, float]]] = deque(
            maxlen=self.episode_settings.confirm_steps
        )
        self.last_diagnosis: JobDiagnosis | None = None
        #: How the last diagnosis was made, so that a snapshot can make it again: its
        #: roll-up's steps, the decompose threshold, and the losses its escalation read
        #: (the episodes' GPU-seconds, the job's above its straggler-free steps). A
        #: resumed job without it told no story again when an episode opened or closed
        #: before its next roll-up (the `diagnoses` rows of a rebalance differed).
        self.last_made: dict[str, Any] | None = None
        #: The losses the last `_diagnosed` read.
        self._losses_read = (0.0, 0.0)
        #: The last roll-up, with the decompose threshold and the step objects it was made
        #: of (weakly: the window lets them go): a job that ends right after a diagnosis
        #: concludes on the same steps, and a roll-up of 100,000 GPUs' window costs half a
        #: second to make again.
        self._last_rollup: (
            tuple[float, dict[int, weakref.ref[PreparedTrace]], WhatIfResult] | None
        ) = None
        #: The job attempt's first complete step.
        self.first_step: int | None = None
        #: When each of the latest steps began (ns), to date an episode's bounds.
        self.step_start_ns: dict[int, int] = {}
        #: Complete steps analysed since the last diagnosis, and how many make the next.
        self.since_diagnosis = 0
        self.diagnosis_interval = diagnose_every_steps
        #: An episode opened or closed since the story was last composed.
        self.story_changed = False

    @property
    def costs(self) -> dict[int, EpisodeCost]:
        """Each episode's cost, by the detector's id (`EpisodePrices.costs`)."""
        return self.prices.costs

    # -- per step -----------------------------------------------------------------------
    def on_step(
        self,
        step: int,
        start_ns: int,
        result: WhatIfResult | None,
        prepared: PreparedTrace | None,
        *,
        complete: bool,
    ) -> list[EpisodeState]:
        """Take a closed step (`prepared`: its inputs when it is complete and analysed);
        returns the episodes it changed."""
        self.totals.add(step, start_ns, complete, result, self.info)
        self.step_start_ns[step] = start_ns
        if len(self.step_start_ns) > STEP_SERIES_KEPT:
            del self.step_start_ns[min(self.step_start_ns)]
        if not complete or result is None or prepared is None:
            return []
        self.since_diagnosis += 1
        if self.first_step is None:
            self.first_step = step
        if self.detector is None:
            kinds = signal_kinds(prepared)
            self.detector = OnlineEpisodes(
                kinds, prepared.n_stages, prepared.n_dp, self.episode_settings
            )
        signals = worker_signals(prepared, self.detector.kinds)[0]
        paid = float(paid_times(prepared, result.t_actual)[0])
        changes = self.detector.update(step, signals, paid)
        times = (paid, float(result.t_nodelay[0]), float(result.t_ideal[0]))
        self.recent.append((prepared, times))
        changed = self._priced_changes(changes, step, (prepared, times))
        self._forget_closed()
        return changed

    def _priced_changes(
        self,
        changes: list[EpisodeChange],
        step: int,
        latest: tuple[PreparedTrace, tuple[float, float, float]],
    ) -> list[EpisodeState]:
        """The detector's `changes` at `step` priced, named once they cost the job enough;
        the states of the named ones. Every episode's model price of its steps first, then
        each its share of what the job measured in them: episodes that overlap share the
        job's loss."""
        priced: dict[int, Priced] = {}
        for change in changes:
            episode = change.episode
            if change.change == "opened":
                inside = [e for e in self.recent if int(e[0].steps[0]) >= episode.onset]
                priced[episode.episode_id] = self.prices.measure(episode, inside)
            elif change.change == "updated":
                priced[episode.episode_id] = self.prices.measure(episode, [latest])
        changed = []
        for change in changes:
            episode = change.episode
            key = episode.episode_id
            if change.change == "opened":
                cost = self.prices.add(episode, priced[key], self._with_baseline(episode))
                first_priced = int(priced[key].steps[0]) if priced[key].steps else step + 1
                self.costs[key] = self._with_unpriced(episode, cost, first_priced)
                self.resplit[key] = _resplit(episode, priced[key].inputs)
            if change.change == "updated":
                self.costs[key] = self.prices.add(episode, priced[key], self.costs[key])
            if change.change == "closed":
                self.prices.without_recovered(episode)
            if key not in self.named:
                if not costs_the_job(self.costs[key], self.diagnosis_settings) or (
                    self._rise_is_shared(episode)
                ):
                    if change.change == "closed":  # never named: nothing to keep
                        self.costs.pop(key, None)
                        self.resplit.pop(key, None)
                    continue
                self._name(episode, step)
                self.story_changed = True
            elif change.change == "closed":
                self.story_changed = True
            changed.append(self._state(episode, step))
        return changed

    def _name(self, episode: WorkerEpisode, step: int) -> None:
        """Name the episode at `step`: it is shown with the next id."""
        self.named_count += 1
        self.named[episode.episode_id] = (step, self.named_count)
        self._named_episode[episode.episode_id] = episode

    def _forget_closed(self) -> None:
        """Let go of the cheapest closed named episodes beyond `CLOSED_EPISODES_KEPT`:
        their latest state is stored; the story keeps the costliest, and the job's
        straggler cost their price."""
        closed = [k for k, e in self._named_episode.items() if e.recovery is not None]
        if len(closed) <= CLOSED_EPISODES_KEPT:
            return
        closed.sort(key=lambda k: (self.states[k].cost.price_s if k in self.states else 0.0, k))
        for key in closed[: len(closed) - CLOSED_EPISODES_KEPT]:
            state = self.states.pop(key, None)
            self.forgotten_episodes += 1
            self.forgotten_price_s += state.cost.price_s if state is not None else 0.0
            self.prices.forget(key)
            for kept in (self.resplit, self.named, self._named_episode):
                kept.pop(key, None)

    def _with_baseline(self, episode: WorkerEpisode) -> EpisodeCost:
        assert self.detector is not None
        return self.prices.with_baseline(episode, self.detector, self.first_step)

    def _with_unpriced(
        self, episode: WorkerEpisode, cost: EpisodeCost, first_priced: int
    ) -> EpisodeCost:
        assert self.detector is not None
        return self.prices.with_unpriced(episode, cost, first_priced, self.detector)

    def price_ahead(self, steps: Sequence[tuple[PreparedTrace, WhatIfResult]]) -> None:
        """Price every open episode over `steps` ahead of them
        (`EpisodePrices.price_ahead`)."""
        episodes = self.detector.open_episodes() if self.detector is not None else []
        self.prices.price_ahead(steps, episodes)

    def _rise_is_shared(self, episode: WorkerEpisode) -> bool:
        """Whether half the job's workers rose with the episode's (`rise_is_shared`):
        then none of them is named."""
        assert self.detector is not None
        steps, values, _ = self.detector.history(episode.kind)
        return rise_is_shared(
            steps, values, episode, baseline_steps=self.episode_settings.baseline_steps
        )

    def _state(self, episode: WorkerEpisode, step: int, *, final: bool = False) -> EpisodeState:
        first_seen, shown_id = self.named.get(
            episode.episode_id, (episode.first_seen, episode.episode_id)
        )
        snapshot = dataclasses.replace(episode, episode_id=shown_id, first_seen=first_seen)
        cost = self.costs.get(episode.episode_id, EpisodeCost())
        diagnosis = episode_diagnosis(
            snapshot,
            cost,
            n_gpus=self.info.world_size,
            settings=self.diagnosis_settings,
            resplit=self.resplit.get(episode.episode_id),
        )
        starts = self.step_start_ns
        earlier = self.states.get(episode.episode_id)
        state = EpisodeState(
            snapshot,
            cost,
            diagnosis,
            step,
            self.info.world_size,
            onset_ns=starts.get(episode.onset, earlier.onset_ns if earlier else 0),
            recovery_ns=starts.get(episode.recovery, 0) if episode.recovery is not None else 0,
            last_ns=starts.get(step, 0),
            final=final,
        )
        self.states[episode.episode_id] = state
        return state

    # -- the job's diagnosis ------------------------------------------------------------
    def interval_after(self, interval: int, capacity: int) -> int:
        """The steps between a diagnosis and the next, after one `interval` steps after
        the last: twice as many, up to the retained window's `capacity` (at least
        `diagnose_every_steps`)."""
        return min(2 * interval, max(self.diagnose_every_steps, capacity))

    def diagnose(
        self,
        window: Sequence[PreparedTrace],
        *,
        final: bool = False,
        decompose_threshold: float,
        capacity: int = 0,
    ) -> JobDiagnosis | None:
        """Roll up and diagnose `window` (the retained steps at this point, of at most
        `capacity`) and compose the run's story with the episodes; None without a
        retained step."""
        if not final:
            # A conclusion (a job that stopped, or only paused for a checkpoint) is one
            # diagnosis more: the cadence stays on the job's steps, so every host
            # diagnoses (and adopts) at the same steps whatever pauses it saw.
            self.since_diagnosis = 0
            self.diagnosis_interval = self.interval_after(self.diagnosis_interval, capacity)
        if not window:
            return None
        prepared, rollup, run = self._run_diagnosis(window, decompose_threshold)
        # The end adds no episode (its bounds are refined, none is found there).
        adopted = [] if final else self.adopt_verified(run, prepared, rollup)
        if adopted:
            # What the run has lost to stragglers now counts the adopted episodes too.
            run = self._diagnosed(rollup, prepared)
        found = JobDiagnosis(
            int(prepared.steps[-1]), rollup, run, self.story(run, rollup), final, tuple(adopted)
        )
        self.last_diagnosis = found
        self.last_made = {
            "steps": [int(step) for step in prepared.steps],
            "decompose_threshold": decompose_threshold,
            "losses": list(self._losses_read),
        }
        self.story_changed = False
        return found

    def rolled_up(
        self, window: Sequence[PreparedTrace], *, final: bool = False, decompose_threshold: float
    ) -> JobDiagnosis | None:
        """`window` rolled up and diagnosed, the job's state untouched: what `diagnose`
        stores, or what a page shows before the first one is due (a reader must not move
        the cadence of what the store is given)."""
        if not window:
            return None
        prepared, rollup, run = self._run_diagnosis(window, decompose_threshold)
        return JobDiagnosis(int(prepared.steps[-1]), rollup, run, self.story(run, rollup), final)

    def _run_diagnosis(
        self, window: Sequence[PreparedTrace], decompose_threshold: float
    ) -> tuple[PreparedTrace, WhatIfResult, Diagnosis]:
        """The retained steps as one trace, their roll-up and its diagnosis."""
        prepared, rollup = self._roll_up(window, decompose_threshold)
        return prepared, rollup, self._diagnosed(rollup, prepared)

    def _roll_up(
        self, window: Sequence[PreparedTrace], decompose_threshold: float
    ) -> tuple[PreparedTrace, WhatIfResult]:
        """`roll_up(window)`, its analysis taken from the last roll-up where that was made
        of these very step objects with this threshold (the same inputs: the same
        result)."""
        made = self._last_rollup
        if made is not None and made[0] == decompose_threshold and _made_of(made[1], window):
            return in_step_order(window), made[2]
        prepared, rollup = roll_up(window, decompose_threshold=decompose_threshold)
        self._last_rollup = (
            decompose_threshold,
            {int(p.steps[0]): weakref.ref(p) for p in window},
            rollup,
        )
        return prepared, rollup

    def _diagnosed(
        self,
        rollup: WhatIfResult,
        prepared: PreparedTrace,
        losses: tuple[float, float] | None = None,
    ) -> Diagnosis:
        """The diagnosis of the retained steps, its escalation on what the job has lost
        so far to its cause: to stragglers, their episodes' cost; to a cause of the job's
        own make (a heavier last stage, unequal sequences, GC, slow links), which no
        episode prices, everything its steps lost above their straggler-free time, as
        `lagscope analyze` counts it (a heavier stage read "0 s lost" live). `losses`:
        those two GPU-second figures as a snapshot kept them, else the job's now."""
        cfg = self.diagnosis_settings
        if losses is None:
            losses = (self.straggler_gpu_seconds(), self.totals.gpu_seconds_above_ideal)
        self._losses_read = losses
        run = diagnose(rollup, prepared, settings=cfg, wasted_gpu_s=losses[0])
        if run.cause in WORKER_CAUSES or run.cause in (Cause.NONE, Cause.UNATTRIBUTED):
            return run
        ladder = escalation(
            losses[1], self.info.world_size, cfg, run.cause, run.evidence.finding.refuted_actions
        )
        return dataclasses.replace(run, escalation=ladder)

    def adopt_verified(
        self,
        run: Diagnosis,
        prepared: PreparedTrace,
        rollup: WhatIfResult,
        *,
        final: bool = False,
        whole_trace: bool = False,
    ) -> list[EpisodeState]:
        """Episodes for the workers `run` (the diagnosis of `prepared`, rolled up as
        `rollup`) verified slow where no episode of theirs is open (`OnlineEpisodes.adopt`):
        a worker slow from the job's first step has no rise for the detector to see, yet
        it is a straggler, and the store, the alerts and the job's losses count stragglers
        by their episodes. Each is costed over its steps in `prepared` and named, as any
        episode, once it costs the job enough; returns the named ones' states.
        `whole_trace`: `prepared` is a recorded trace read whole, each episode seen where
        its evidence was complete."""
        if run.cause not in _KIND_OF_CAUSE or self.detector is None:
            return []
        # A worker in an episode already is the usual case of a named one: the window's
        # signals are read only for the others.
        in_episode = {(e.dp, e.stage) for e in self.detector.open_episodes()}
        workers = [w for w in run.evidence.named_workers if (w.dp, w.stage) not in in_episode]
        if not workers:
            return []
        kinds = self.detector.kinds
        signals = worker_signals(prepared, kinds)
        step = int(prepared.steps[-1])
        slow_in = {v.worker: v.first_op for v in run.evidence.finding.verified}
        states = []
        for worker in workers:
            kind = _KIND_OF_CAUSE[run.cause] or slow_in.get(worker)
            if kind not in kinds:
                continue
            # The longer of the retained window and the detector's own history: a large
            # job retains a few steps (4 at 100,000 GPUs), fewer than a stretch needs.
            series = self.detector.history(kind)
            if series[0].size <= prepared.n_steps:
                series = (prepared.steps, signals[:, kinds.index(kind)], rollup.t_actual)
            episode = self.detector.adopt(
                (worker.dp, worker.stage), kind, *series, seen_at_evidence=whole_trace
            )
            if episode is None:
                continue
            inside = np.flatnonzero(prepared.steps >= episode.onset)
            steps = prepared.select_steps(inside)
            paid = paid_times(steps, rollup.t_actual[inside])
            times = (paid, rollup.t_nodelay[inside], rollup.t_ideal[inside])
            key = episode.episode_id
            cost = self.prices.cost_of(episode, steps, times, self._with_baseline(episode))
            first_priced = int(steps.steps[0]) if steps.n_steps else step + 1
            self.costs[key] = self._with_unpriced(episode, cost, first_priced)
            self.resplit[key] = _resplit(episode, [steps])
            if not costs_the_job(self.costs[key], self.diagnosis_settings):
                continue  # followed from here on, named once it costs enough
            self._name(episode, episode.first_seen)
            self.story_changed = True
            states.append(self._state(episode, step, final=final))
        self._forget_closed()
        return states

    def retake(
        self,
        before: tuple[float, float, float] | None,
        after: tuple[float, float, float] | None,
        *,
        complete: bool,
    ) -> None:
        """A step that closed incomplete closed again (late batches came): its figures
        `before` leave the totals, `after` replace them."""
        self.totals.count(before, self.info, complete=False, sign=-1)
        self.totals.count(after, self.info, complete=complete)

    def recompose(self, step: int) -> JobDiagnosis | None:
        """The run's story at `step` told again with the episodes as they are now, on the
        last roll-up (None before the first): when an episode opened or closed."""
        self.story_changed = False
        last = self.last_diagnosis
        if last is None:
            return None
        found = JobDiagnosis(step, last.rollup, last.run, self.story(last.run, last.rollup))
        self.last_diagnosis = found
        return found

    def story(self, run: Diagnosis, rollup: WhatIfResult) -> Diagnosis:
        """The run's one story: `run` (the diagnosis of `rollup`'s steps) told with the
        episodes as they stand (`simulator/run_story.py`)."""
        episodes = [s.diagnosis for s in self._states_by_cost()]
        return run_story(run, episodes, rollup, settings=self.diagnosis_settings)

    def conclude(
        self, window: Sequence[PreparedTrace], *, decompose_threshold: float, ended: bool = True
    ) -> tuple[JobDiagnosis | None, list[EpisodeState]]:
        """The end of the job's input (`ended`), or a long idle: every episode's bounds
        refined on the retained steps around it (at an idle, only those of the closed
        ones), then the final diagnosis."""
        refined = self.refine(window, open_ones=ended)
        return self.diagnose(window, final=True, decompose_threshold=decompose_threshold), refined

    def refine(
        self, window: Sequence[PreparedTrace], *, open_ones: bool = True
    ) -> list[EpisodeState]:
        """Every episode's final state, its bounds refined on the steps of `window`
        around it (the retained ones). Without `open_ones`, an episode still open keeps
        its live state: a job that only paused (a checkpoint's save) resumes it, and a
        refit of its bounds there (a recovery found in its last steps' noise, an onset
        moved) would be taken back at its next step, its alert resolved and fired again."""
        refined = []
        if window and self.detector is not None:
            prepared = in_step_order(window)
            for episode in self._named_episodes():
                if episode.recovery is None and not open_ones:
                    continue
                onset, recovery = refined_bounds(episode, prepared, self.episode_settings)
                fitted = dataclasses.replace(episode, onset=onset, recovery=recovery)
                self.prices.measure_around(fitted, prepared, self.first_step)
                end = recovery if recovery is not None else np.inf
                inside = [p for p in window if onset <= int(p.steps[0]) < end]
                if inside:
                    self.resplit[episode.episode_id] = _resplit(fitted, inside)
                refined.append(self._state(fitted, self.totals.last_step, final=True))
        return refined

    def _named_episodes(self) -> list[WorkerEpisode]:
        return sorted(self._named_episode.values(), key=lambda e: e.episode_id)

    def _states_by_cost(self) -> list[EpisodeState]:
        return sorted(self.states.values(), key=lambda s: -s.cost.price_s)

    def episodes(self) -> list[EpisodeState]:
        """Every episode's latest state, in onset order."""
        return sorted(self.states.values(), key=lambda s: (s.episode.onset, s.episode.episode_id))

    def straggler_gpu_seconds(self) -> float:
        """GPU-seconds the episodes cost the job (the part of its loss above the ideal
        that stragglers explain; the rest is its own jitter)."""
        kept = sum(s.cost.price_s for s in self.states.values())
        return (kept + self.forgotten_price_s) * self.info.world_size

    # -- state --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "totals": asdict(self.totals),
            "detector": self.detector.state_dict() if self.detector else None,
            **self.prices.state_dict(),
            "resplit": {str(k): asdict(v) if v else None for k, v in self.resplit.items()},
            "recent_steps": [[int(p.steps[0]), *times] for p, times in self.recent],
            "since_diagnosis": self.since_diagnosis,
            "diagnosis_interval": self.diagnosis_interval,
            "step_start_ns": [[k, v] for k, v in self.step_start_ns.items()],
            "named": [[k, *v] for k, v in self.named.items()],
            "named_episodes": [asdict(e) for e in self._named_episodes()],
            "named_count": self.named_count,
            "forgotten": [self.forgotten_episodes, self.forgotten_price_s],
            "first_step": self.first_step,
            "last_diagnosis": self._last_diagnosis_made(),
        }

    def _last_diagnosis_made(self) -> dict[str, Any] | None:
        """How to make the last diagnosis again (`_diagnose_again`); None before one."""
        if self.last_diagnosis is None or self.last_made is None:
            return None
        found = self.last_diagnosis
        return {**self.last_made, "step": found.step, "final": found.final}

    @property
    def diagnosis_steps(self) -> list[int]:
        """The steps of the last diagnosis' roll-up: a snapshot needs them to make it
        again (`restore`)."""
        return list(self.last_made["steps"]) if self.last_made is not None else []

    def restore(
        self,
        state: dict[str, Any],
        retained: Sequence[PreparedTrace],
        diagnosed: Sequence[PreparedTrace] = (),
    ) -> list[int]:
        """Resume from `state_dict()`; the recent steps come back from `retained`, and the
        last diagnosis is made again from its steps among `retained` and `diagnosed`
        (those the window no longer holds). Returns the steps of it that neither holds:
        then there is none until the next (the host says so)."""
        self.totals = JobTotals(**state["totals"])
        if state["detector"] is not None:
            self.detector = OnlineEpisodes.from_state(state["detector"])
        self.prices.restore(state)
        self.resplit = {int(k): Advice(**v) if v else None for k, v in state["resplit"].items()}
        by_step = {int(p.steps[0]): p for p in retained}
        for step, *times in state["recent_steps"]:
            if int(step) in by_step:
                self.recent.append((by_step[int(step)], tuple(float(t) for t in times)))
        self.since_diagnosis = int(state["since_diagnosis"])
        self.diagnosis_interval = int(state.get("diagnosis_interval", self.diagnose_every_steps))
        self.step_start_ns = {int(k): int(v) for k, v in state["step_start_ns"]}
        named = state.get("named")
        if named is None:  # a snapshot from before naming: every episode was named
            episodes = self.detector.episodes if self.detector is not None else []
            named = [[e.episode_id, e.first_seen, e.episode_id] for e in episodes]
        self.named = {int(k): (int(step), int(shown)) for k, step, shown in named}
        # The detector's own objects where it still has them: it moves them on.
        current = {e.episode_id: e for e in self.detector.episodes} if self.detector else {}
        saved = state.get("named_episodes")
        if saved is None:  # a snapshot from before: the detector kept every episode
            saved = [asdict(current[k]) for k in self.named if k in current]
        self._named_episode = {
            int(e["episode_id"]): current.get(int(e["episode_id"])) or WorkerEpisode(**e)
            for e in saved
        }
        self.named_count = int(
            state.get("named_count", max((s for _, s in self.named.values()), default=0))
        )
        self.forgotten_episodes, self.forgotten_price_s = state.get("forgotten", (0, 0.0))
        self.first_step = state.get("first_step")
        for episode in self._named_episodes():
            self._state(episode, self.totals.last_step)
        made = state.get("last_diagnosis")
        if made is None:
            return []
        return self._diagnose_again(made, [*retained, *diagnosed])

    def _diagnose_again(self, made: dict[str, Any], steps: Sequence[PreparedTrace]) -> list[int]:
        """The last diagnosis as `diagnose` made it (the same steps, threshold and losses:
        the same roll-up and run, bit for bit), the story told with the episodes now; or
        the steps of it missing from `steps`."""
        by_step = {int(p.steps[0]): p for p in steps}
        wanted = [int(step) for step in made["steps"]]
        missing = [step for step in wanted if step not in by_step]
        if missing:
            return missing
        prepared, rollup = self._roll_up(
            [by_step[step] for step in wanted], float(made["decompose_threshold"])
        )
        losses = (float(made["losses"][0]), float(made["losses"][1]))
        run = self._diagnosed(rollup, prepared, losses)
        self.last_made = {**made, "steps": wanted}
        self.last_diagnosis = JobDiagnosis(
            int(made["step"]), rollup, run, self.story(run, rollup), bool(made["final"])
        )
        return []


def _made_of(refs: dict[int, weakref.ref[PreparedTrace]], window: Sequence[PreparedTrace]) -> bool:
    """Whether `refs` (step -> its prepared step, weakly) name exactly the objects of
    `window`."""
    if len(refs) != len(window):
        return False
    for step in window:
        ref = refs.get(int(step.steps[0]))
        if ref is None or ref() is not step:
            return False
    return True


@dataclass(frozen=True)
class TraceStory:
    """What every output shows of a recorded trace: its what-if `result`, the diagnosis
    of it (`run`), the run's one story (`verdict`: `run` told with the episodes) and the
    episodes, refined."""

    result: WhatIfResult
    run: Diagnosis
    verdict: Diagnosis
    episodes: list[EpisodeState]


def tell_trace(
    prepared: PreparedTrace,
    info: JobSize,
    *,
    decompose_threshold: float,
    episode_settings: OnlineEpisodeSettings | None = None,
    diagnosis_settings: DiagnosisSettings | None = None,
) -> TraceStory:
    """The story of a recorded trace as a host tells it of the same steps: the whole
    trace analysed and diagnosed, its episodes found one step at a time in step order
    (each step costed with the whole trace's ideals), refined at the end, and the run's
    diagnosis told with them. `lagscope analyze` shows this, so a trace and its replay
    through `lagscope run` name the same straggler: the whole trace's diagnosis alone
    blames a worker slow in a third of the steps on nothing, or on the next cause it
    finds.

    >>> from lagscope.simulator.generate import JobSpec, generate_job
    >>> from lagscope.simulator.prepare import prepare
    >>> job = generate_job(JobSpec(dp=2, pp=2, steps=12))
    >>> story = tell_trace(prepare(job.trace, job.meta), job.meta, decompose_threshold=0.0)
    >>> len(story.result.steps), story.episodes
    (12, [])
    """
    result = analyze(prepared, decompose_threshold=decompose_threshold)
    run = diagnose(result, prepared, settings=diagnosis_settings)
    per_step = each_step_of(result, prepared, compiled=prepared.model.compiled)
    live = LiveJob(
        info,
        diagnose_every_steps=prepared.n_steps,
        episode_settings=episode_settings,
        diagnosis_settings=diagnosis_settings,
    )
    for index, step_result in enumerate(per_step):
        step = prepared.select_steps([index])
        live.on_step(int(step.steps[0]), 0, step_result, step, complete=True)
    live.adopt_verified(run, prepared, result, final=True, whole_trace=True)
    # The steps one by one again only to refine episodes: a large trace is not held twice
    # when it has none.
    found = bool(live.named)
    window = [prepared.select_steps([i]) for i in range(prepared.n_steps)] if found else []
    refined = live.refine(window)
    return TraceStory(result, run, live.story(run, result), refined)


def _resplit(episode: WorkerEpisode, steps: Sequence[PreparedTrace]) -> Advice | None:
    """The re-split of micro-batches over a compute episode's steps, when the what-if
    says it would speed them up (None for other causes, one DP rank, or no gain)."""
    if episode.kind in (HOST, "input-wait") or not steps:
        return None
    prepared = in_step_order(steps)
    compiled = prepared.model.compiled
    # The re-split is weighed against the steps as measured, without launch delays: one
    # pass, not a what-if analysis whose attribution passes it would not read.
    base_time = resimulated_step_time(prepared, prepared.cost, compiled)
    advice = advise_resplit(prepared, base_time, compiled)
    return advice if advice is not None and advice.predicted_speedup > 1.0 else None
