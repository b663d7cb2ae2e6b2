"""Episodes through the step processor: a generated noisy job streamed step by step names its
slow worker while it is slow, with its cost, and refines its bounds at the end; a healthy
noisy job has none; the end-of-job fit (`square_wave`) finds a raised stretch in a noisy
series."""

from __future__ import annotations

import numpy as np
import pytest

from lagscope.simulator.diagnose import DiagnosisSettings
from lagscope.simulator.episodes import square_wave
from lagscope.simulator.generate import CostModel, JobSpec, SlowWorker, generate_job
from lagscope.stream_app.processor import ProcessorSettings, StepProcessor
from tests.test_processor import stream_of

NOISY = CostModel(first_stage_extra=0.0, last_stage_extra=0.1, noise_cv=0.12)


#: A GPU job's costs: its kernels hardly jitter, its last stage is heavier.
QUIET = CostModel(last_stage_extra=0.1, noise_cv=0.02)


def streamed(stragglers, steps, seed, settings=None, *, cost=NOISY, dp=2, pp=2):
    """The processor's outputs of a generated job (DP 2 x PP 2 unless said), closed step
    by step, and its conclusion."""
    job = generate_job(
        JobSpec(
            dp=dp, pp=pp, microbatches=4, steps=steps, cost=cost, stragglers=stragglers,
            seed=seed,
        )
    )  # fmt: skip
    info, batches = stream_of(job)
    processor = StepProcessor(settings)
    processor.on_job(info)
    outputs = []
    for _, _, step_batches in batches:
        outputs.extend(processor.on_batches(step_batches))
    return outputs, processor.conclude(info.job_id)


@pytest.mark.parametrize("seed", range(6))
def test_a_worker_slow_for_a_window_is_named_while_slow_and_bounded_at_the_end(seed):
    """One worker 2x slower for steps 15-29 of 40: its episode opens at most 10 steps after
    the onset, is updated while open, closes within 3 steps of the recovery; the end of
    the job refines the bounds to within 3 steps of both and never drops it."""
    slow = SlowWorker(dp=1, stage=0, factor=2.0, start_step=15, end_step=30)
    outputs, conclusion = streamed((slow,), 40, seed)
    states = [state for out in outputs for state in out.episodes]
    opened = states[0]
    assert (opened.episode.dp, opened.episode.stage) == (1, 0)
    assert opened.episode.open and opened.episode.first_seen - 15 <= 10
    assert opened.diagnosis.cause == "slow_workers"
    assert opened.cost.lost_s > 0 and 0 < opened.cost.share <= 1
    assert {s.episode.episode_id for s in states} == {opened.episode.episode_id}
    assert not states[-1].episode.open
    (final,) = conclusion.episodes
    assert final.final and final.episode.episode_id == opened.episode.episode_id
    assert abs(final.episode.onset - 15) <= 3 and abs(final.episode.recovery - 30) <= 3
    # The run's verdict is the episode's: the job's noise hides nothing it names.
    assert conclusion.diagnosis.verdict.cause == "slow_workers"
    first = conclusion.diagnosis.verdict.evidence.named_workers[0]
    assert (first.dp, first.stage) == (1, 0)


@pytest.mark.parametrize("factor", [1.25, 1.35])
def test_a_throttled_gpu_in_a_quiet_job_is_named_and_bounded(factor):
    """A worker 1.25-1.35x slower for steps 16-31 of 40 in a quiet job (DP 8 x PP 4): below
    the 1.5x a noisy job needs, yet it costs its stage that much of every step. It is
    named while slow (8 steps of evidence), with its worker and op, and bounded at the end
    to within 3 steps; a healthy quiet job has no episode."""
    slow = SlowWorker(dp=5, stage=2, factor=factor, start_step=16, end_step=32)
    outputs, conclusion = streamed((slow,), 40, 3, cost=QUIET, dp=8, pp=4)
    states = [state for out in outputs for state in out.episodes]
    assert states, "no episode"
    opened = states[0]
    assert (opened.episode.dp, opened.episode.stage) == (5, 2)
    assert opened.episode.first_seen - 16 <= 10 and opened.diagnosis.cause == "slow_workers"
    (final,) = conclusion.episodes
    assert abs(final.episode.onset - 16) <= 3 and abs(final.episode.recovery - 32) <= 3
    outputs, conclusion = streamed((), 40, 3, cost=QUIET, dp=8, pp=4)
    assert [s for out in outputs for s in out.episodes] == [] and conclusion.episodes == ()


def test_an_episode_is_named_from_the_step_it_has_cost_the_job_enough():
    """The straggler's episode, with the bar its cost must pass raised: half-way between
    the share of the job's slowdown it explained when it opened and at its end, it is
    named at the first step its share reaches that, seen there, and nothing before; with a
    bar no cost can pass, never, not even at the end of the job."""
    slow = SlowWorker(dp=1, stage=0, factor=2.0, start_step=15, end_step=30)
    outputs, _ = streamed((slow,), 40, 0)
    shares = [(out.step, state.cost.share) for out in outputs for state in out.episodes]
    onset = next(state.episode.onset for out in outputs for state in out.episodes)
    bar = (shares[0][1] + shares[-1][1]) / 2
    named_at = next(step for step, share in shares if share >= bar)
    assert named_at > shares[0][0]
    raised = ProcessorSettings(diagnosis=DiagnosisSettings(explains_share=bar, floor_margin=1.0))
    outputs, conclusion = streamed((slow,), 40, 0, raised)
    states = [(out.step, state) for out in outputs for state in out.episodes]
    assert states[0][0] == named_at and states[0][1].episode.first_seen == named_at
    assert states[0][1].episode.onset == onset  # named later, the same slow steps
    (final,) = conclusion.episodes
    assert final.episode.first_seen == named_at
    never = ProcessorSettings(diagnosis=DiagnosisSettings(explains_share=1.5, floor_margin=1.0))
    outputs, conclusion = streamed((slow,), 40, 0, never)
    assert [s for out in outputs for s in out.episodes] == [] and conclusion.episodes == ()


def test_named_episodes_are_numbered_in_the_order_they_were_named():
    """Two stragglers, one after the other: with the bar raised above what the first (1.5x)
    saves the job, below what the second (3x) does, only the second is named, and it is
    episode 1, not the detector's second."""
    slow = (
        SlowWorker(dp=0, stage=1, factor=1.5, start_step=12, end_step=22),
        SlowWorker(dp=1, stage=0, factor=3.0, start_step=32, end_step=45),
    )
    outputs, conclusion = streamed(slow, 55, 1)
    assert [(e.episode.episode_id, e.episode.dp) for e in conclusion.episodes] == [(1, 0), (2, 1)]
    first = max(s.cost.saved_share for out in outputs for s in out.episodes if s.episode.dp == 0)
    second = min(s.cost.saved_share for out in outputs for s in out.episodes if s.episode.dp == 1)
    assert first < second
    bar = DiagnosisSettings(explains_share=1.5, floor_margin=(first + second) / 2)
    raised = ProcessorSettings(diagnosis=bar)
    outputs, conclusion = streamed(slow, 55, 1, raised)
    shown = {(s.episode.episode_id, s.episode.dp) for out in outputs for s in out.episodes}
    assert shown == {(1, 1)}
    assert [(e.episode.episode_id, e.episode.dp) for e in conclusion.episodes] == [(1, 1)]


@pytest.mark.parametrize("seed", range(3))
def test_an_episode_still_open_at_the_end_takes_the_recovery_its_series_shows(seed):
    """The worker is back from step 30 but 1.7x slow again every other step: the live rule
    (3 steps in a row below the middle of its two levels) never closes the episode; the
    end of the input does, where the worker's whole series shows it came back."""
    slow = [SlowWorker(dp=1, stage=0, factor=2.0, start_step=15, end_step=30)]
    slow += [SlowWorker(dp=1, stage=0, factor=1.7, start_step=s, end_step=s + 1)
             for s in range(31, 50, 2)]  # fmt: skip
    outputs, conclusion = streamed(tuple(slow), 50, seed)
    states = [state for out in outputs for state in out.episodes]
    assert states and states[-1].episode.open
    (final,) = conclusion.episodes
    assert abs(final.episode.onset - 15) <= 3
    assert final.episode.recovery is not None and abs(final.episode.recovery - 30) <= 3
    assert "(ongoing)" not in final.diagnosis.summary, final.diagnosis.summary


@pytest.mark.parametrize("seed", range(6))
def test_a_worker_slow_from_the_first_step_to_the_end_is_still_slow_at_the_end(seed):
    """Slow from step 0 (its first steps slower still, as a warm-up is) to the last: its
    episode, adopted at the first diagnosis, ends the job still open from step 0; the fit
    at the end, which would find the warm-up's bump and call what follows a recovery, is
    not asked (the worker has no quicker level of its own)."""
    slow = (SlowWorker(dp=1, stage=0, factor=2.0, start_step=0, end_step=40),
            SlowWorker(dp=1, stage=0, factor=1.6, start_step=0, end_step=3))  # fmt: skip
    outputs, conclusion = streamed(slow, 40, seed)
    states = [state for out in outputs for state in out.episodes]
    assert states and states[0].episode.standing and states[0].episode.onset == 0
    (final,) = conclusion.episodes
    assert final.final and final.episode.onset == 0 and final.episode.open
    assert "(ongoing)" in final.diagnosis.summary


@pytest.mark.parametrize("seed", range(6))
def test_a_healthy_noisy_job_has_no_episode_and_no_cause(seed):
    outputs, conclusion = streamed((), 60, seed)
    assert [s for out in outputs for s in out.episodes] == []
    assert conclusion.episodes == ()
    assert conclusion.diagnosis.verdict.cause == "none", conclusion.diagnosis.verdict.summary


def test_the_diagnosis_is_redone_at_growing_intervals():
    """A roll-up costs as much as analysing its steps again: the first after 10 complete
    steps (the processor's default), each next one after twice as many."""
    outputs, _ = streamed((), 80, 0)
    diagnosed = [out.step for out in outputs if out.diagnosis is not None]
    assert diagnosed == [9, 29, 69]


def test_the_story_is_retold_when_an_episode_opens_and_when_it_closes():
    slow = SlowWorker(dp=1, stage=0, factor=2.0, start_step=15, end_step=30)
    outputs, _ = streamed((slow,), 40, 0)
    states = [(out.step, state.episode.open) for out in outputs for state in out.episodes]
    opened = states[0][0]
    closed = next(step for step, is_open in states if not is_open)
    by_step = {out.step: out.diagnosis for out in outputs}
    assert by_step[opened] is not None and by_step[closed] is not None
    told = by_step[opened].verdict
    assert told.cause == "slow_workers", told.summary
    first = told.evidence.named_workers[0]
    assert (first.dp, first.stage) == (1, 0)


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


@pytest.mark.parametrize(
    ("before_s", "inside_s", "reads"),
    [(0.05, 0.2, "50.0 -> 200.0 ms per step"), (12.1, 27.8739, "12.1 -> 27.9 s per step")],
)
def test_an_episode_reads_its_levels_in_a_unit_that_fits_the_steps(before_s, inside_s, reads):
    """A job of 46-s steps reads "27.9 s per step", not "27873.9 ms"."""
    from lagscope.simulator.episode_cost import EpisodeCost
    from lagscope.simulator.episode_diagnosis import episode_diagnosis
    from lagscope.simulator.online_episodes import WorkerEpisode

    episode = WorkerEpisode(1, 0, 0, "backward-compute", 16, 24, None, before_s, inside_s,
                            2.3, 1.0, 40)  # fmt: skip
    cost = EpisodeCost(lost_s=30.0, excess_s=40.0, measured_s=400.0, steps=24)
    assert reads in episode_diagnosis(episode, cost, n_gpus=64).summary


def test_half_the_workers_slow_together_name_no_worker():
    """Two of four DP ranks 2x slower in the same steps, as two ranks that lost their
    cores on a busy machine are: each rose far above its peers' median, and no one of
    them is the straggler; no episode is named. One of them alone is."""
    window = {"start_step": 15, "end_step": 30}
    both = (SlowWorker(dp=2, stage=0, factor=2.0, **window),
            SlowWorker(dp=3, stage=0, factor=2.0, **window))  # fmt: skip
    outputs, conclusion = streamed(both, 40, 0, dp=4, pp=1)
    assert [s for out in outputs for s in out.episodes] == [] and conclusion.episodes == ()
    outputs, conclusion = streamed(both[1:], 40, 0, dp=4, pp=1)
    assert [(e.episode.dp, e.episode.stage) for e in conclusion.episodes] == [(3, 0)]


def test_an_episode_priced_by_the_job_says_what_the_model_explains():
    """A worker 2x slower: its price is what the job's step times lost against its steps
    before the episode, and the model's own price is kept beside it in the evidence."""
    slow = SlowWorker(dp=1, stage=0, factor=2.0, start_step=15, end_step=30)
    _, conclusion = streamed((slow,), 40, 0)
    (state,) = conclusion.episodes
    cost, facts = state.cost, state.diagnosis.evidence.finding.episode
    assert cost.measured_known and cost.price_s == max(cost.job_lost_s, 0.0)
    assert facts.lost_s == cost.price_s and facts.model_lost_s == cost.lost_s
    assert facts.job_lost_s == cost.job_lost_s
    assert state.gpu_seconds_lost == cost.price_s * 4


def test_the_verdict_is_the_open_episode_and_at_the_end_names_both():
    """A heavier last stage all along, and a worker 2x slower for steps 15-29: while its
    episode is open it costs the job's steps more than the heavier stage does, and it is
    the job's verdict; the finished run's verdict names both, the costlier over the run
    (the stage) first."""
    from lagscope.simulator.generate import LastStageImbalance

    slow = SlowWorker(dp=1, stage=0, factor=2.0, start_step=15, end_step=30)
    outputs, conclusion = streamed((LastStageImbalance(factor=1.5), slow), 40, 0)
    verdicts = [(out.step, out.diagnosis.verdict) for out in outputs if out.diagnosis]
    assert [v.cause for step, v in verdicts if step < 15] == ["last_stage_imbalance"]
    during = [v for step, v in verdicts if 15 <= step < 30]
    assert during and all(v.cause == "slow_workers" for v in during), during
    final = conclusion.diagnosis.verdict
    assert final.cause == "last_stage_imbalance", final.summary
    assert "; and worker (dp 1, pp 0) was slow in backward-compute" in final.summary
