"""What each episode costs the job, step by step: the model's price of its worker in
every step it covers, the job's measured loss of the step shared between the episodes
priced in it, measured against what the job paid for its steps before the onset (and,
once it is over, after its recovery). A job's story (`job_story.LiveJob`) keeps one
`EpisodePrices` and asks it at every step that opens, moves or closes an episode.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from lagscope.simulator.episode_cost import EpisodeCost, baseline_of, lost_seconds
from lagscope.simulator.measures import gc_beyond_peers
from lagscope.simulator.online_episodes import OnlineEpisodes, WorkerEpisode, worker_signals
from lagscope.simulator.prepare import PreparedTrace, concat_steps
from lagscope.simulator.whatif import WhatIfResult

#: Steps whose episodes' model prices are kept, to share the job's loss between them.
_STEP_PRICES_KEPT = 64
#: A job's first steps are its warm-up (caches, allocator, first collectives): no
#: baseline for its later steps.
WARM_UP_STEPS = 3
#: An open episode's latest steps kept to take back at its close (the detector closes
#: an episode `recovery_steps` after its recovery, one more for a noisy step).
_TAIL_KEPT = 16


@dataclass
class Priced:
    """An episode's steps priced by the model: their ids, inputs, and per step its lost,
    excess, measured, own and GC seconds."""

    steps: list[int] = field(default_factory=list)
    inputs: list[PreparedTrace] = field(default_factory=list)
    rows: list[tuple[float, float, float, float, float]] = field(default_factory=list)


class EpisodePrices:
    """The costs of a job's episodes (`costs`, by the detector's id) and what pricing
    them keeps between steps (`baseline_steps`: the most steps on each side of an
    episode its baseline reads)."""

    def __init__(self, baseline_steps: int) -> None:
        self.baseline_steps = baseline_steps
        self.costs: dict[int, EpisodeCost] = {}
        #: (episode id, step) -> its (lost seconds, own seconds, GC beyond peers) in a
        #: step about to come (`price_ahead`).
        self._priced: dict[tuple[int, int], tuple[float, float, float]] = {}
        #: step -> the model's price of each episode priced in it (the latest steps).
        self._step_prices: dict[int, dict[int, float]] = {}
        #: Per open episode, its cost before each of its latest steps was added.
        self._tails: dict[int, deque[tuple[int, EpisodeCost]]] = {}

    def forget(self, key: int) -> None:
        """Let go of an episode's cost and what pricing it kept."""
        self.costs.pop(key, None)
        self._tails.pop(key, None)

    def with_baseline(
        self, episode: WorkerEpisode, detector: OnlineEpisodes, first_step: int | None
    ) -> EpisodeCost:
        """A new episode's cost, with what the job paid for its steps before the onset
        (the detector's history: up to `baseline_steps` of them) to measure it against."""
        steps, _, paid = detector.history(episode.kind)
        kept = (steps < episode.onset) & (steps >= (first_step or 0) + WARM_UP_STEPS)
        return EpisodeCost().with_baseline(paid[kept][-self.baseline_steps :])

    def measure(
        self, episode: WorkerEpisode, steps: Sequence[tuple[PreparedTrace, tuple[Any, Any, Any]]]
    ) -> Priced:
        """The model's price of the episode's worker in `steps` (each a prepared trace
        and its measured, no-delay and ideal step times), kept by step for the episodes
        that share them."""
        found = Priced()
        for inputs, times in steps:
            priced = None
            if inputs.n_steps == 1:
                priced = self._priced.pop((episode.episode_id, int(inputs.steps[0])), None)
            actual, _, ideal = (np.atleast_1d(np.asarray(t, dtype=np.float64)) for t in times)
            if priced is not None:
                lost, own, gc = (np.array([value]) for value in priced)
            else:
                lost, own, gc = _episode_measures(episode, inputs)
            excess = actual - ideal
            for i, step in enumerate(inputs.steps.tolist()):
                self._step_prices.setdefault(step, {})[episode.episode_id] = float(lost[i])
                found.steps.append(step)
                found.rows.append(
                    (float(lost[i]), float(excess[i]), float(actual[i]), float(own[i]),
                     float(gc[i]))
                )  # fmt: skip
            found.inputs.append(inputs)
        while len(self._step_prices) > _STEP_PRICES_KEPT:
            del self._step_prices[min(self._step_prices)]
        return found

    def add(self, episode: WorkerEpisode, priced: Priced, cost: EpisodeCost) -> EpisodeCost:
        """`cost` with the steps of `priced`, each with its share of the job's measured
        time above the episode's baseline (shared by the model's prices of the episodes
        priced in that step)."""
        tail = self._tails.setdefault(episode.episode_id, deque(maxlen=_TAIL_KEPT))
        for step, (lost, excess, actual, own, gc) in zip(priced.steps, priced.rows, strict=True):
            prices = self._step_prices.get(step, {})
            total = sum(max(p, 0.0) for p in prices.values())
            share = max(lost, 0.0) / total if total > 0 else 1.0 / max(len(prices), 1)
            tail.append((step, cost))
            cost = cost.plus(lost, excess, actual, own - episode.level_before, gc, share)
        return cost

    def without_recovered(self, episode: WorkerEpisode) -> None:
        """A closed episode's cost without the steps priced from its recovery on (the
        detector closes it a few steps after the worker came back)."""
        key = episode.episode_id
        tail = self._tails.pop(key, None)
        if not tail or episode.recovery is None or key not in self.costs:
            return
        before = next((cost for step, cost in tail if step >= episode.recovery), None)
        if before is not None:
            self.costs[key] = self.costs[key].minus(self.costs[key], before)

    def cost_of(
        self,
        episode: WorkerEpisode,
        prepared: PreparedTrace,
        times: tuple[Any, Any, Any],
        cost: EpisodeCost,
    ) -> EpisodeCost:
        """`cost` with `prepared`'s steps added (`times`: their measured, no-delay and
        ideal step times)."""
        return self.add(episode, self.measure(episode, [(prepared, times)]), cost)

    def with_unpriced(
        self,
        episode: WorkerEpisode,
        cost: EpisodeCost,
        first_priced: int,
        detector: OnlineEpisodes,
    ) -> EpisodeCost:
        """`cost` (of the episode's steps from `first_priced` on) with its earlier steps
        that are no longer held to be priced, estimated from the detector's history of
        the worker (`EpisodeCost.with_estimated`): at 100,000 GPUs a job retains 4 steps,
        and a worker slow from the first step is found at the 10th, whose first 6 steps
        of loss went uncounted."""
        steps, values, times = detector.history(episode.kind)
        before = (steps >= episode.onset) & (steps < first_priced)
        if not before.any():
            return cost
        own = values[before, episode.stage, episode.dp]
        return cost.with_estimated(own - episode.level_before, times[before])

    def price_ahead(
        self,
        steps: Sequence[tuple[PreparedTrace, WhatIfResult]],
        episodes: Sequence[WorkerEpisode],
    ) -> None:
        """Price `episodes` (the open ones) over `steps` (the complete steps `LiveJob.on_step`
        takes next, in order, with their what-if results) in one engine pass each, not one a
        step: a worker slow throughout a backlog (AR x 20, slow from its first step) cost
        a third of the worker's core in passes of one step. The numbers are the same (the
        engine's columns never mix)."""
        self._priced.clear()
        if len(steps) < 2 or not episodes:
            return
        joint = concat_steps([prepared for prepared, _ in steps])
        for episode in episodes:
            measures = _episode_measures(episode, joint)
            for index, step in enumerate(joint.steps.tolist()):
                self._priced[(episode.episode_id, step)] = tuple(  # type: ignore[assignment]
                    float(m[index]) for m in measures
                )

    def measure_around(
        self, episode: WorkerEpisode, prepared: PreparedTrace, first_step: int | None
    ) -> None:
        """A finished episode's cost measured against the steps on both sides of it in
        `prepared` (the retained ones, past the warm-up), up to `baseline_steps` each:
        the job's own steps before an episode alone moved with the machine's load."""
        key = episode.episode_id
        if key not in self.costs or episode.recovery is None:
            return
        steps = prepared.steps
        paid = paid_times(prepared, prepared.actual_step_time)
        usual = steps >= (first_step or 0) + WARM_UP_STEPS
        n = self.baseline_steps
        before = paid[usual & (steps < episode.onset)][-n:]
        after = paid[usual & (steps >= episode.recovery)][:n]
        found = baseline_of(np.concatenate([before, after]))
        if found is not None:
            self.costs[key] = self.costs[key].with_baseline_moved(*found)

    def state_dict(self) -> dict[str, Any]:
        return {
            "costs": {str(k): asdict(v) for k, v in self.costs.items()},
            "step_prices": [
                [k, [[e, v] for e, v in p.items()]] for k, p in self._step_prices.items()
            ],
            "tails": [
                [k, [[step, asdict(cost)] for step, cost in tail]]
                for k, tail in self._tails.items()
            ],
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Resume from a `state_dict()` (a snapshot from before the prices kept their
        step prices and tails has none)."""
        self.costs = {int(k): cost_from_state(v) for k, v in state["costs"].items()}
        self._step_prices = {
            int(k): {int(e): float(v) for e, v in p} for k, p in state.get("step_prices", [])
        }
        self._tails = {
            int(k): deque(
                ((int(step), cost_from_state(cost)) for step, cost in tail), maxlen=_TAIL_KEPT
            )
            for k, tail in state.get("tails", [])
        }


def cost_from_state(saved: dict[str, Any]) -> EpisodeCost:
    return EpisodeCost(
        **{**saved, "recent": tuple(saved["recent"]), "paid": tuple(saved.get("paid", ()))}
    )


def paid_times(prepared: PreparedTrace, actual: np.ndarray) -> np.ndarray:
    """[step] what the job paid for each step of `prepared`: its period where the step
    before it is known (`PreparedTrace.periods`: overlapping steps count their overlap
    once), else `actual` (its measured span)."""
    periods = prepared.periods
    return np.where(np.isnan(periods), np.asarray(actual, dtype=np.float64), periods)


def _episode_measures(
    episode: WorkerEpisode, prepared: PreparedTrace
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[step] each: the job seconds lost to the episode's worker, its own seconds of the
    episode's kind, and its GC pauses there beyond its peers'."""
    worker = (episode.dp, episode.stage)
    return (
        lost_seconds(prepared, worker, episode.kind, episode.level_before),
        worker_signals(prepared, [episode.kind])[:, 0, episode.stage, episode.dp],
        gc_beyond_peers(prepared, worker, episode.kind),
    )
