"""Online episodes: planted stragglers found with their bounds a few steps after their onset,
noise and machine-wide slowdowns left alone, state saved and restored mid-episode, and the
decisions unchanged by the units the seconds are in."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lagscope.simulator.fields import FieldErrors
from lagscope.simulator.online_episodes import (
    HOST,
    OnlineEpisodes,
    OnlineEpisodeSettings,
    nanmedian_first_axis,
    nanquantile_first_axis,
)

KINDS = ("backward-compute", "forward-compute", "input-wait", HOST)
N_STAGES, N_DP, N_STEPS = 2, 4, 60
LEVELS = np.array([0.060, 0.030, 0.002, 0.040])  # seconds per step of each kind


def _job(seed: int, jitter: float = 0.03) -> np.ndarray:
    """[step, kind, stage, dp] own seconds of a healthy job: each worker at its kind's
    level, log-normal jitter, a rare lost core (a single step 2x slower)."""
    rng = np.random.default_rng(seed)
    shape = (N_STEPS, len(KINDS), N_STAGES, N_DP)
    values = LEVELS[None, :, None, None] * rng.lognormal(0.0, jitter, shape)
    lost = rng.random((N_STEPS, 1, N_STAGES, N_DP)) < 0.02
    return np.where(lost, 2 * values, values)


def _run(values: np.ndarray, settings_: OnlineEpisodeSettings | None = None) -> OnlineEpisodes:
    detector = OnlineEpisodes(KINDS, N_STAGES, N_DP, settings_)
    step_time = values.sum(axis=(1, 3)).max(axis=1)
    for step in range(values.shape[0]):
        detector.update(step, values[step], float(step_time[step]))
    return detector


@pytest.mark.parametrize("kind", range(len(KINDS)))
@pytest.mark.parametrize("seed", range(3))
def test_a_planted_straggler_is_found_with_its_bounds_four_steps_after_its_onset(
    kind: int, seed: int
) -> None:
    values = _job(seed)
    factor = 2.0 if KINDS[kind] != "input-wait" else 15.0
    values[20:35, kind, 1, 2] *= factor  # worker (dp 2, pp 1), steps 20-34
    detector = _run(values)
    (episode,) = detector.episodes
    assert (episode.dp, episode.stage, episode.kind) == (2, 1, KINDS[kind])
    assert episode.onset == 20 and episode.recovery == 35
    assert episode.first_seen == 24  # 5 steps of evidence: the onset's and 4 more
    assert episode.level_inside == pytest.approx(factor * episode.level_before, rel=0.1)


@pytest.mark.parametrize("noisy_step", [36, 37])
def test_one_noisy_step_in_a_recovery_does_not_keep_the_episode_open(noisy_step: int) -> None:
    """Back from step 35, the worker loses its core for one step right after: the episode
    closes at 35 all the same, as soon as 3 of the last 4 steps are back; two such steps in
    four keep it open."""
    values = _job(0)
    values[20:35, 0, 1, 2] *= 2.0
    values[noisy_step, 0, 1, 2] *= 2.0
    (episode,) = _run(values[:39]).episodes
    assert episode.recovery == 35 and episode.last_step == 38
    values[{36: 38, 37: 35}[noisy_step], 0, 1, 2] *= 2.0
    (episode,) = _run(values[:39]).episodes
    assert episode.open


def _run_timed(values: np.ndarray) -> OnlineEpisodes:
    """`_run` with each step as long as its slowest worker's own time (the sum of its
    kinds), not its stage's DP ranks' together: a rise's cost is weighed against a step
    of the job's length."""
    detector = OnlineEpisodes(KINDS, N_STAGES, N_DP)
    for step in range(values.shape[0]):
        detector.update(step, values[step], float(values[step].sum(axis=0).max()))
    return detector


@pytest.mark.parametrize("factor", [1.3, 1.45])
@pytest.mark.parametrize("seed", range(3))
def test_a_smaller_rise_in_a_quiet_job_opens_an_episode_on_more_evidence(
    factor: float, seed: int
) -> None:
    """A GPU's kernels hardly jitter: a worker 1.3-1.45x slower in its backward for 15
    steps (a throttled GPU) cost its stage that much of every step and was never an
    episode, being under the 1.5x a shared CPU's noise needs. In a quiet job it opens on
    `confirm_steps` of evidence, clear of the noise by `onset_z`, with its bounds."""
    values = _job(seed, jitter=0.01)
    values[20:35, 0, 1, 2] *= factor  # worker (dp 2, pp 1), steps 20-34
    (episode,) = _run_timed(values).episodes
    assert (episode.dp, episode.stage, episode.kind) == (2, 1, "backward-compute")
    assert episode.onset == 20 and episode.recovery == 35
    assert episode.first_seen == 27  # 8 steps of evidence: the onset's and 7 more
    assert episode.level_inside == pytest.approx(factor * episode.level_before, rel=0.05)


@pytest.mark.parametrize("seed", range(3))
def test_a_smaller_rise_in_a_job_whose_workers_jump_so_is_no_episode(seed: int) -> None:
    """Where the workers jump by 1.3x in 10 % of their steps (ranks that lose a shared
    core now and then), a 1.3x rise is within what the job's own noise does: no episode;
    a 2x straggler still is one."""
    rng = np.random.default_rng(seed)
    values = _job(seed, jitter=0.01)
    jumps = rng.random(values.shape) < 0.1
    values = np.where(jumps, 1.3 * values, values)
    moderate = values.copy()
    moderate[20:35, 0, 1, 2] = 1.3 * _job(seed, jitter=0.01)[20:35, 0, 1, 2]
    assert _run_timed(moderate).episodes == []
    strong = values.copy()
    strong[20:35, 0, 1, 2] = 2.0 * _job(seed, jitter=0.01)[20:35, 0, 1, 2]
    assert len(_run_timed(strong).episodes) == 1


@pytest.mark.parametrize("seed", range(5))
def test_a_healthy_job_has_no_episode(seed: int) -> None:
    assert _run(_job(seed, jitter=0.08)).episodes == []


def test_the_whole_machine_slowing_down_is_no_one_s_episode() -> None:
    values = _job(7)
    values[25:40] *= 2.0  # every worker, every kind: the machine's load
    assert _run(values).episodes == []


def test_a_worker_that_loses_its_core_now_and_then_is_no_straggler() -> None:
    values = _job(8)
    # Every other step of 20, the worker's forward 2x slower: quick again in between.
    values[20:40:2, 1, 0, 1] *= 2.0
    assert _run(values).episodes == []


def test_a_short_stretch_of_a_noisy_job_waits_for_more_evidence() -> None:
    """A job whose workers jump often (shared cores) needs `noisy_steps` of evidence: a
    9-step stretch as slow as a straggler is no episode there, on a quiet job it is."""
    stretch = slice(30, 39)
    quiet = _job(9)
    quiet[stretch, 1, 0, 0] *= 2.0
    assert len(_run(quiet).episodes) == 1
    noisy = _job(9)
    rng = np.random.default_rng(9)
    jumps = rng.random(noisy.shape) < 0.3
    noisy = np.where(jumps, 2.0 * noisy, noisy)
    noisy[stretch, 1, 0, 0] = 2.0 * _job(9)[stretch, 1, 0, 0]
    assert _run(noisy).episodes == []


@pytest.mark.parametrize("seed", range(3))
def test_a_rise_far_beyond_a_noisy_job_s_jumps_needs_no_more_evidence(seed: int) -> None:
    """Workers that jump 2x in 30 % of their steps make a 2x stretch wait for
    `noisy_steps`; a host stalled to 8x its level is beyond anything they do: it opens on
    `onset_steps`, as in a quiet job; without the steps that tell how seldom the job
    jumps so (`own_rise_baseline_steps`), it waits as a 2x stretch does."""
    host = KINDS.index(HOST)
    rng = np.random.default_rng(seed)
    noisy = _job(seed)
    noisy = np.where(rng.random(noisy.shape) < 0.3, 2.0 * noisy, noisy)
    noisy[30:45, host, 0, 1] = 8.0 * LEVELS[host]
    (episode,) = _run(noisy).episodes
    assert (episode.kind, episode.dp, episode.stage) == (HOST, 1, 0)
    assert (episode.onset, episode.first_seen, episode.recovery) == (30, 34, 45)
    (waited,) = _run(noisy, OnlineEpisodeSettings(own_rise_baseline_steps=100)).episodes
    assert waited.first_seen - waited.onset + 1 > OnlineEpisodeSettings().onset_steps


@pytest.mark.parametrize("seed", range(3))
def test_a_kind_only_some_workers_do_is_as_noisy_as_their_series(seed: int) -> None:
    """Only the first stage waits for input (a pipeline's later stages never do), and its
    input waits jump by 40 ms in 15 % of their steps: a 6-step stretch as long is noise
    there (the second stage's empty series do not make the job quiet), while on a job
    whose input waits never jump it is an episode."""
    for spike_rate, episodes in ((0.0, 1), (0.15, 0)):
        values = _job(seed)
        values[:, 2, 1, :] = 0.0
        spikes = np.random.default_rng(100 + seed).random((N_STEPS, N_DP)) < spike_rate
        values[:, 2, 0, :] += np.where(spikes, 0.040, 0.0)
        values[30:36, 2, 0, 1] = 0.042
        assert len(_run(values).episodes) == episodes, spike_rate


@pytest.mark.parametrize("seed", range(3))
def test_a_straggler_s_own_first_slow_steps_do_not_make_the_job_look_noisy(seed: int) -> None:
    """Two workers wait for input (a 2-DP pipeline's first stage), and one of them spiked
    twice in 20 steps: a job quiet enough to open at 5 steps. The straggler's own first
    slow steps are the evidence, not the job's noise: counted, they made the job read
    noisy and the episode waited 3 steps more."""
    detector = OnlineEpisodes(KINDS, N_STAGES, 2)
    values = _job(seed)[:, :, :, :2].copy()
    values[:, 2, 1] = 0.0
    values[[6, 13], 2, 0, 0] += 0.030
    values[20:35, 2, 0, 1] += 0.060
    step_time = values.sum(axis=(1, 3)).max(axis=1)
    for step in range(N_STEPS):
        detector.update(step, values[step], float(step_time[step]))
    (episode,) = detector.episodes
    assert (episode.kind, episode.stage, episode.dp) == ("input-wait", 0, 1)
    assert (episode.onset, episode.first_seen) == (20, 24)


def test_the_costliest_kind_of_a_worker_is_its_one_episode() -> None:
    """An input-starved rank also starts its next forward late (its host time rises):
    one episode, of the kind that cost the most."""
    values = _job(10)
    values[20:35, 2, 0, 3] += 0.050  # input wait: +50 ms
    values[20:35, 3, 0, 3] += 0.030  # host: +30 ms
    (episode,) = _run(values).episodes
    assert episode.kind == "input-wait"


def test_a_small_episode_does_not_hide_a_costlier_one_that_follows() -> None:
    """A worker already in a small episode (its host, +40 ms) that then waits 150 ms for
    its input gets that episode too; one whose host rises later, by less or by a little
    more than its episode's own kind, stays one episode."""
    values = _job(11)
    values[10:45, 3, 0, 1] += 0.040  # host: +40 ms from step 10
    values[20:35, 2, 0, 1] += 0.150  # input wait: +150 ms for steps 20-34
    episodes = _run(values).episodes
    assert [(e.kind, e.onset, e.recovery) for e in episodes] == [
        (HOST, 10, 45),
        ("input-wait", 20, 35),
    ]
    values = _job(11)
    values[20:35, 2, 0, 1] += 0.150
    values[23:35, 3, 0, 1] += 0.040  # host rises 3 steps later, by less
    assert [e.kind for e in _run(values).episodes] == ["input-wait"]
    # A slow forward that drags its host time up a little more, later (a real 1F1B job's
    # forward straggler did): still one episode.
    values = _job(11)
    values[20:35, 1, 0, 1] += 0.045  # forward: +45 ms
    values[24:35, 3, 0, 1] += 0.050  # host: +50 ms from 4 steps later
    assert [e.kind for e in _run(values).episodes] == ["forward-compute"]


def test_a_baseline_still_by_chance_does_not_make_noise_an_episode() -> None:
    """Right after the warm-up, a worker's 4 baseline steps of host time happen to be
    equal (no noise of its own) while its peers' vary by a third: a rise of the size of
    their noise is no episode. Read on its own series only, it was one at once."""
    values = _job(12)[:10]
    peers = np.array([[30, 55, 40], [52, 28, 45], [38, 60, 27], [58, 33, 41]]) * 1e-3
    values[:4, 3, 0, [0, 2, 3]] = peers
    values[:4, 3, 0, 1] = 0.040
    values[4:, 3, 0, [0, 2, 3]] = 0.040
    values[4:, 3, 0, 1] = 0.080
    assert _run(values).episodes == []
    alone = OnlineEpisodeSettings(peer_noise_steps=0)
    assert [e.kind for e in _run(values, alone).episodes] == [HOST]


def test_state_round_trips_mid_episode() -> None:
    values = _job(11)
    values[20:35, 0, 0, 0] *= 2.0
    whole = _run(values)
    first = OnlineEpisodes(KINDS, N_STAGES, N_DP)
    step_time = values.sum(axis=(1, 3)).max(axis=1)
    for step in range(27):
        first.update(step, values[step], float(step_time[step]))
    resumed = OnlineEpisodes.from_state(first.state_dict())
    assert resumed.open_episodes() and resumed.open_episodes()[0].onset == 20
    for step in range(27, N_STEPS):
        resumed.update(step, values[step], float(step_time[step]))
    assert resumed.episodes == whole.episodes


@pytest.mark.slow  # the detector run over many rescaled jobs (~50 s)
@settings(max_examples=20, deadline=None)
@given(scale=st.floats(0.001, 1000.0))
def test_decisions_do_not_depend_on_the_unit_of_time(scale: float) -> None:
    values = _job(12)
    values[15:30, 1, 1, 0] *= 2.0
    baseline = [(e.dp, e.stage, e.kind, e.onset, e.recovery) for e in _run(values).episodes]
    scaled = [(e.dp, e.stage, e.kind, e.onset, e.recovery) for e in _run(values * scale).episodes]
    assert scaled == baseline


def test_settings_are_checked() -> None:
    with pytest.raises(FieldErrors, match="onset_steps: must be at least 2"):
        OnlineEpisodeSettings(onset_steps=1)
    with pytest.raises(FieldErrors, match="confirm_steps: must be at least onset_steps"):
        OnlineEpisodeSettings(onset_steps=6, confirm_steps=5)
    with pytest.raises(FieldErrors, match="quiet_min_rise: must be at most min_rise"):
        OnlineEpisodeSettings(min_rise=0.3, quiet_min_rise=0.4)


def test_signals_of_another_shape_are_refused() -> None:
    detector = OnlineEpisodes(KINDS, N_STAGES, N_DP)
    with pytest.raises(ValueError, match="shape"):
        detector.update(0, np.zeros((len(KINDS), N_STAGES, N_DP + 1)), 0.1)


_columns = st.integers(1, 6).flatmap(
    lambda rows: st.lists(
        st.lists(
            st.one_of(st.floats(-1e3, 1e3, allow_nan=False), st.just(float("nan"))),
            min_size=rows,
            max_size=rows,
        ),
        min_size=1,
        max_size=5,
    )
)


@settings(max_examples=300, deadline=None)
@given(_columns, st.floats(0.0, 1.0))
def test_the_column_quantiles_are_numpy_s(columns: list[list[float]], q: float) -> None:
    values = np.array(columns, dtype=float).T  # [row, column], NaN where a value is missing
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's "All-NaN slice"
        expected_quantile = np.nanquantile(values, q, axis=0)
        expected_median = np.nanmedian(values, axis=0)
    np.testing.assert_array_equal(nanquantile_first_axis(values, q), expected_quantile)
    np.testing.assert_array_equal(nanmedian_first_axis(values), expected_median)


def test_only_the_series_that_may_pass_are_weighed() -> None:
    """The candidate filter is a shortcut: weighing every series changes no decision."""
    values = _job(seed=7, jitter=0.08)
    values[25:45, 0, 1, 2] *= 1.6
    values[30:38, 3, 0, 1] *= 1.4
    filtered = _run(values)
    everything = OnlineEpisodes(KINDS, N_STAGES, N_DP)
    everything._candidates = lambda: np.ones((len(KINDS), N_STAGES, N_DP), dtype=bool)
    step_time = values.sum(axis=(1, 3)).max(axis=1)
    for step in range(values.shape[0]):
        everything.update(step, values[step], float(step_time[step]))
    assert filtered.episodes, "the planted straggler should open an episode"
    assert filtered.episodes == everything.episodes


def _adopt_from(detector: OnlineEpisodes, values: np.ndarray, kind: int, worker: tuple[int, int]):
    """`OnlineEpisodes.adopt` of `worker` (dp, stage) on `values`' steps so far (a step
    as long as its busiest worker's own time)."""
    step_time = values.sum(axis=1).max(axis=(1, 2))
    return detector.adopt(
        worker, KINDS[kind], np.arange(values.shape[0]), values[:, kind], step_time
    )


def test_a_worker_slow_from_the_first_step_is_adopted_and_followed_to_its_recovery() -> None:
    """Slow from step 0, it never rose: no episode of the detector's own. Adopted at step
    11 (the job's diagnosis verified it), it is an episode since step 0 at its peers' level
    before, followed like any other: closed at its recovery (step 45). It leaves the other
    workers' baselines alone: one rising at step 30, while it is still open, opens an
    episode of its own."""
    values = _job(3)
    values[:45, 1, 1, 2] *= 2.0  # worker (dp 2, pp 1), forward, steps 0-44
    values[30:, 0, 0, 1] *= 2.0  # worker (dp 1, pp 0), backward, from step 30
    detector = _run(values[:12])
    assert detector.episodes == []
    standing = _adopt_from(detector, values[:12], 1, (2, 1))
    assert standing is not None and standing.standing
    assert (standing.onset, standing.first_seen, standing.kind) == (0, 11, KINDS[1])
    assert standing.level_before == pytest.approx(LEVELS[1], rel=0.1)
    assert standing.level_inside == pytest.approx(2 * LEVELS[1], rel=0.1)
    assert _adopt_from(detector, values[:12], 1, (2, 1)) is None  # it has one open
    step_time = values.sum(axis=(1, 3)).max(axis=1)
    for step in range(12, N_STEPS):
        detector.update(step, values[step], float(step_time[step]))
    assert standing.recovery == 45
    (later,) = [e for e in detector.episodes if e is not standing]
    assert (later.dp, later.stage, later.kind, later.onset) == (1, 0, KINDS[0], 30)


@pytest.mark.parametrize(
    ("slow_steps", "then_also", "reason"),
    [
        (slice(5, 12), slice(3, 5), "7 steps: fewer than confirm_steps"),
        (slice(0, 11), slice(11, 12), "quick in the latest step"),
    ],
)
def test_a_worker_is_adopted_only_on_a_long_enough_stretch_up_to_now(
    slow_steps: slice, then_also: slice, reason: str
) -> None:
    values = _job(4)[:12]
    values[slow_steps, 1, 1, 2] *= 2.0
    detector = OnlineEpisodes(KINDS, N_STAGES, N_DP)
    assert _adopt_from(detector, values, 1, (2, 1)) is None, reason
    assert detector.episodes == []
    values[then_also, 1, 1, 2] *= 2.0  # slow long enough, up to the latest step
    assert _adopt_from(detector, values, 1, (2, 1)) is not None


def test_a_busy_job_needs_a_longer_stretch_to_adopt() -> None:
    """Where the other workers jump over their own level in two steps of five (shared
    cores), 9 slow steps of a rank are what its lost core looks like: not adopted until
    the stretch is `noisy_steps` long; on a quiet job 9 are enough."""
    base = _job(5)[:20]
    quiet = base.copy()
    quiet[11:, 1, 1, 2] *= 3.0
    assert _adopt_from(OnlineEpisodes(KINDS, N_STAGES, N_DP), quiet, 1, (2, 1)) is not None
    rng = np.random.default_rng(5)
    busy = np.where(rng.random(base.shape) < 0.4, 2.0 * base, base)
    busy[:, 1, 1, 2] = base[:, 1, 1, 2]  # the rank itself never jumps ...
    busy[11:, 1, 1, 2] *= 3.0  # ... but is 3x slower from step 11
    assert _adopt_from(OnlineEpisodes(KINDS, N_STAGES, N_DP), busy, 1, (2, 1)) is None
    busy[8:11, 1, 1, 2] = 3.0 * base[8:11, 1, 1, 2]  # 12 steps: past the longest lost core
    assert _adopt_from(OnlineEpisodes(KINDS, N_STAGES, N_DP), busy, 1, (2, 1)) is not None


def test_a_worker_adopted_after_a_rise_is_measured_from_its_own_level_before() -> None:
    """Slow from step 12, too weakly for the detector in a job it never saw rise (the
    diagnosis found it): its episode starts at 12 from its own quicker level before, and
    its summary says so; one slow since the first step seen has no level of its own to
    start from, and its summary says that instead."""
    from lagscope.simulator.episode_cost import EpisodeCost
    from lagscope.simulator.episode_diagnosis import episode_diagnosis

    values = _job(6)[:24]
    values[12:, 1, 1, 2] *= 1.6  # worker (dp 2, pp 1), forward, from step 12
    values[:, 1, 0, 3] *= 1.6  # worker (dp 3, pp 0), forward, from the first step
    detector = OnlineEpisodes(KINDS, N_STAGES, N_DP)
    risen, standing = (_adopt_from(detector, values, 1, who) for who in ((2, 1), (3, 0)))
    assert (risen.onset, risen.standing, standing.onset, standing.standing) == (12, False, 0, True)
    assert risen.level_before == pytest.approx(LEVELS[1], rel=0.05)
    assert risen.level_inside == pytest.approx(1.6 * LEVELS[1], rel=0.05)
    assert risen.ratio_before == pytest.approx(1.0, abs=0.05)
    cost = EpisodeCost(lost_s=0.1, excess_s=0.2, measured_s=2.0, steps=12)
    summaries = [episode_diagnosis(e, cost, n_gpus=8).summary for e in (risen, standing)]
    assert "its own level before), 1.6x its peers'" in summaries[0], summaries[0]
    assert "no quicker level" not in summaries[0]
    assert "with no quicker level of its own before" in summaries[1], summaries[1]


def test_a_long_job_s_detector_lets_go_of_episodes_its_history_no_longer_holds() -> None:
    """An episode that ended before the oldest step the detector keeps masks none of its
    baselines: it is let go (a day of a flapping worker piled hundreds up), and a later
    episode is found as in a short job."""
    values = np.concatenate([_job(seed) for seed in range(3)])
    values[20:35, 0, 1, 2] *= 2.0  # worker (dp 2, pp 1), steps 20-34
    values[140:155, 0, 0, 1] *= 2.0  # worker (dp 1, pp 0), steps 140-154
    detector = _run(values[:60])
    assert [(e.onset, e.recovery) for e in detector.episodes] == [(20, 35)]
    for step in range(60, values.shape[0]):
        detector.update(step, values[step], float(values[step].sum(axis=(0, 2)).max()))
    (episode,) = detector.episodes
    assert (episode.dp, episode.stage, episode.onset, episode.recovery) == (1, 0, 140, 155)
