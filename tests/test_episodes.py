"""Job-level episodes start from any series' change (step time, stage, DP rank, worker),
are named by the diagnosis of their own steps, and a healthy job has none."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from lagscope.simulator.diagnose import diagnose
from lagscope.simulator.episodes import (
    _STRETCH_MIN_STEPS,
    _floor,
    diagnosed_episodes,
    episode_spans,
    square_wave,
    worker_stretches,
)
from lagscope.simulator.generate import CostModel, JobSpec, SlowWorker, generate_job
from lagscope.simulator.prepare import concat_steps, prepare
from lagscope.stream_app.processor import StepProcessor
from tests.test_processor import stream_of

NOISY = CostModel(first_stage_extra=0.0, last_stage_extra=0.1, noise_cv=0.12)


def streamed(stragglers, steps, seed):
    job = generate_job(
        JobSpec(
            dp=2, pp=2, microbatches=4, steps=steps, cost=NOISY, stragglers=stragglers, seed=seed
        )
    )
    info, batches = stream_of(job)
    processor = StepProcessor()
    processor.on_job(info)
    changes = []
    for _, _, step_batches in batches:
        for out in processor.on_batches(step_batches):
            changes.extend(out.changes)
    rollup = processor.rollup(info.job_id)
    retained = processor.jobs[info.job_id, 0].retained
    prepared = concat_steps(sorted(retained, key=lambda p: int(p.steps[0])))
    episodes = diagnosed_episodes(changes, prepared, rollup.ideal_cost)
    return changes, episodes, diagnose(rollup, prepared)


def change(series, step, before, after):
    kind = "onset" if after > before else "recovery"
    return SimpleNamespace(
        series=series, step=step, kind=kind, before_mean=before, after_mean=after
    )


def test_spans_of_several_series_merge_and_a_fall_opens_nothing():
    changes = [
        change("worker/1.0", 15, 1.0, 2.0),
        change("worker/1.0", 30, 2.0, 1.0),
        change("step_time", 16, 0.1, 0.15),
        change("step_time", 31, 0.15, 0.1),
        # The DP peer looks faster while the median moves, then back: not an episode.
        change("dp/0", 15, 1.0, 0.8),
        change("dp/0", 30, 0.8, 1.0),
        change("stage/1", 50, 1.0, 1.3),
    ]
    spans = episode_spans(changes)
    assert [(s.onset, s.recovery) for s in spans] == [(15, 31), (50, None)]
    assert set(spans[0].series) == {"worker/1.0", "step_time"}


@pytest.mark.parametrize("seed", range(6))
def test_a_worker_slow_for_a_window_is_an_episode_named_at_its_onset(seed):
    """One worker 2x slower for steps 15-29 of 40: a job-level episode starts within 3
    steps of 15, recovers within 3 steps of 30, and names that worker first."""
    slow = SlowWorker(dp=1, stage=0, factor=2.0, start_step=15, end_step=30)
    changes, episodes, _ = streamed((slow,), 40, seed)
    assert any(c.series == "worker/1.0" and c.kind == "onset" for c in changes)
    (episode,) = [e for e in episodes if abs(e.onset - 15) <= 3]
    assert episode.recovery is not None and abs(episode.recovery - 30) <= 3
    assert episode.diagnosis.cause == "slow_workers"
    first = episode.diagnosis.evidence["verified_workers"][0]
    assert (first["dp"], first["stage"]) == (1, 0)


@pytest.mark.parametrize("seed", range(6))
def test_a_healthy_noisy_job_has_no_episode_and_no_cause(seed):
    _, episodes, diagnosis = streamed((), 60, seed)
    assert episodes == []
    assert diagnosis.cause == "none", diagnosis.summary


@pytest.mark.parametrize("seed", range(4))
def test_a_raised_stretch_is_fitted_to_its_steps_in_a_noisy_series(seed):
    """The worker's own series, +/-15 % noise and a lone spike, raised 1.35x for 15-29 of 40:
    the fit finds both ends (within a step); raised to the end, no recovery; flat, nothing."""
    rng = np.random.default_rng(seed)
    noise = rng.normal(1.0, 0.15 / 2, 40).clip(0.7, 1.3)
    noise[5] = 2.5
    raised = noise * np.where((np.arange(40) >= 15) & (np.arange(40) < 30), 1.35, 1.0)
    onset, recovery = square_wave(raised, 7, 29)
    assert abs(onset - 15) <= 1 and abs(recovery - 30) <= 1
    to_the_end = noise * np.where(np.arange(40) >= 15, 1.35, 1.0)
    onset, recovery = square_wave(to_the_end, 7, 39)
    assert abs(onset - 15) <= 1 and recovery is None
    assert square_wave(noise, 0, 39) is None


def test_a_fit_on_neighbourhood_minima_measures_their_noise_from_independent_steps():
    """Minima over 3 neighbours repeat each other, so neighbouring differences understate
    their noise and a fit on them takes any wander for a stretch. 200 series of pure noise
    (40 % per step, as CPU ranks sharing cores jitter): differences 3 steps apart keep the
    fit quiet on most; neighbouring ones found a 1.5x "stretch" in 109 of them."""
    wandered = {1: 0, 3: 0}
    for seed in range(200):
        noise = np.exp(np.random.default_rng(seed).normal(0.0, 0.4, 40))
        for lag in wandered:
            if square_wave(_floor(noise), 0, 39, 0.5, independent_lag=lag) is not None:
                wandered[lag] += 1
    assert wandered[3] < 40 < 80 < wandered[1]


@pytest.mark.parametrize("seed", range(12))
def test_a_rank_that_loses_its_core_now_and_then_is_no_stretch_and_a_straggler_is(seed):
    """Ranks sharing cores: every forward loses its core in a quarter of the steps (1.5-4x
    as long, never shorter), and dp 1 in half of steps 20-33, which doubles its median
    there while its quick forwards stay as quick: no stretch. A straggler whose forwards
    all take 2x for steps 15-29 under the same noise is one, bounded within 3 steps (a
    step that lost its core next to the stretch is as slow as the straggler's)."""
    job = generate_job(JobSpec(dp=4, pp=1, microbatches=1, steps=60, cost=NOISY, seed=seed))
    prepared = prepare(job.trace, job.meta)
    rng = np.random.default_rng(seed)
    forward = [i for i, t in enumerate(prepared.node_optype) if t == "forward-compute"]
    shape = (len(forward), prepared.n_steps, prepared.n_dp)
    steps = np.arange(prepared.n_steps)[None, :, None]
    share = np.where((steps >= 20) & (steps < 34) & (np.arange(4) == 1), 1 / 2, 1 / 4)
    lost_core = rng.random(shape) < share
    noisy = prepared.duration.copy()
    noisy[forward] *= np.where(lost_core, rng.uniform(1.5, 4.0, shape), 1.0).astype(noisy.dtype)
    contended = dataclasses.replace(prepared, duration=noisy)
    assert long_forward_stretches(contended) == []

    straggling = noisy.copy()
    slow = (steps >= 15) & (steps < 30) & (np.arange(4) == 2)
    straggling[forward] *= np.where(slow, 2.0, 1.0).astype(noisy.dtype)
    forwards = long_forward_stretches(dataclasses.replace(prepared, duration=straggling))
    assert [(s.dp, s.stage) for s in forwards] == [(2, 0)], forwards
    assert abs(forwards[0].span.onset - 15) <= 3 and abs(forwards[0].span.recovery - 30) <= 3


def long_forward_stretches(prepared):
    """Forward stretches long enough to be diagnosed (shorter ones are chance)."""
    return [
        s
        for s in worker_stretches(prepared, 0.5)
        if s.optype == "forward-compute"
        and (s.span.recovery or prepared.n_steps) - s.span.onset >= _STRETCH_MIN_STEPS
    ]
