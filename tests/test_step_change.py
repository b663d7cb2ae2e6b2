"""A rank's step time: a lasting change is told within a few steps, noise and a lone slow
step are not, and the timer then hands steps over one at a time."""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path

import pytest

from lagscope.producers import timer as timer_module
from lagscope.producers.step_change import StepChange
from lagscope.producers.timer import _PROMPT_STEPS, OpTimer


def _steady(change: StepChange, rng: random.Random, steps: int, level: float = 0.1) -> int:
    """Feed `steps` steps of `level` s with 10 % noise; how many fired."""
    return sum(change.observe(rng.gauss(level, 0.1 * level)) for _ in range(steps))


@pytest.mark.parametrize(("rise", "within"), [(1.3, 5), (1.5, 3), (0.7, 5)])
def test_a_lasting_change_is_told_within_a_few_steps(rise: float, within: int) -> None:
    """A step time 30 % or 50 % slower (a straggler's onset), or 30 % faster (its
    recovery), fires within `within` steps in at least 9 of 10 noisy runs."""
    quick = 0
    for seed in range(10):
        rng = random.Random(seed)
        change = StepChange()
        _steady(change, rng, 40)
        fired_at = next(
            (k for k in range(1, 30) if change.observe(rng.gauss(0.1 * rise, 0.01 * rise))), 99
        )
        quick += fired_at <= within
    assert quick >= 9


def test_steady_noise_rarely_fires_and_a_lone_slow_step_never() -> None:
    rng = random.Random(7)
    change = StepChange()
    assert _steady(change, rng, 5000) <= 0.01 * 5000
    change = StepChange()
    _steady(change, random.Random(8), 40, level=0.1)
    for _ in range(5):  # one step 10x slower now and then, steady in between
        assert not change.observe(1.0)
        assert _steady(change, random.Random(9), 20) == 0


def test_a_rank_whose_steps_repeat_exactly_needs_a_real_change() -> None:
    """No noise at all: the scale's floor (2 % of the median) keeps 1 % jitter quiet."""
    change = StepChange()
    assert not any(change.observe(0.1) for _ in range(40))
    assert not any(change.observe(0.1 * (1.01 if i % 2 else 0.99)) for i in range(200))
    assert any(change.observe(0.15) for _ in range(3))


@pytest.mark.parametrize(("rise", "fires_by"), [(1.03, None), (1.1, 4), (1.15, 3)])
def test_a_quiet_rank_tells_a_change_an_episode_could_open_on(
    rise: float, fires_by: int | None
) -> None:
    """Steps with 1 % noise: a 3 % drift costs less than any episode and never hurries the
    log (20 steps); 10 % fires on its fourth step, 15 % on its third."""
    rng = random.Random(3)
    change = StepChange()
    assert not any(change.observe(rng.gauss(0.1, 0.001)) for _ in range(40))
    fired = [change.observe(rng.gauss(0.1 * rise, 0.001)) for _ in range(20)]
    first = fired.index(True) + 1 if any(fired) else None
    assert first == fires_by, fired


def _handed_over(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    durations: list[float],
    saturated: bool = False,
    changes: list[int] | None = None,
) -> list[int]:
    """The steps at which a timer whose steps take `durations` hands its ops over (the
    timer module's monotonic clock driven by the test), on a node whose cores are all busy
    or not (whatever this machine's own load is)."""
    clock = [1000.0]
    monkeypatch.setattr(timer_module, "_node_saturated", lambda: saturated)

    class _Clock:
        """The timer module's `time`, its monotonic clock driven by the test."""

        def __getattr__(self, name: str) -> object:
            return getattr(time, name)

        def monotonic(self) -> float:
            return clock[0]

    monkeypatch.setattr(timer_module, "time", _Clock())
    timer = OpTimer(job_id="j", rank=0, dp_rank=0, pp_rank=0, log_dir=tmp_path, mode="host")
    timer.saturated = saturated  # as the sealer finds at its first wake
    handed: list[int] = []

    def hand_over(finished_steps_only: bool = False, wake: bool = True) -> None:
        if not finished_steps_only:  # not the sealer's own, when no step ends for a while
            handed.append(timer._current_step)

    monkeypatch.setattr(timer, "_hand_over", hand_over)
    try:
        for step, duration in enumerate(durations, start=1):
            clock[0] += duration
            timer.step(step)
    finally:
        monkeypatch.undo()
        timer.close()
    if changes is not None:
        changes.append(timer.step_changes)
    return handed


def test_the_timer_hands_steps_over_one_at_a_time_after_a_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Short steady steps go to the sealer several at a time (every 0.5 s, the seal's
    cap); once the step time rose, every step is handed over as it ends, for a few steps,
    then the steps' own pace resumes (not the shortest interval: a spell costs no short
    seal after it)."""
    changes: list[int] = []
    handed = _handed_over(
        tmp_path, monkeypatch, [0.075] * 120 + [0.12] * 12 + [0.12] * 100, changes=changes
    )
    steady = [s for s in handed if s <= 120]
    gaps = {b - a for a, b in itertools.pairwise(steady[1:])}
    assert gaps <= {6, 7}, handed  # 0.5 s of 75 ms steps a hand-over
    slow = [s for s in handed if 120 < s <= 132]
    # The change is told on its third slow step; from there on every step is handed over
    # while the change lasts (the detector fires again every third step).
    assert slow[0] <= 123, handed
    assert slow == list(range(slow[0], 133)), handed
    # Each time the detector fired is counted (the bench reports them per 100 steps).
    assert changes[0] >= 3, changes
    assert _PROMPT_STEPS >= 3
    # Once the new level is the rank's usual (its window's median), the spell ends and the
    # next hand-over comes at the pace of 0.12 s steps: the seal's 0.5 s cap, 4-5 steps on.
    spell = [s for s in handed if s > 132]
    ends = next(i for i, (a, b) in enumerate(itertools.pairwise(spell)) if b - a > 1)
    assert spell[ends + 1] - spell[ends] >= 4, handed


def test_steps_shorter_than_the_readers_poll_are_handed_over_no_more_often(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps of 40 ms that rise to 60 ms: the change is still told at once, but the spell
    hands steps over no more often than the log's readers look (every 0.1 s), so every
    other step: more would wake the sealer for nothing."""
    handed = _handed_over(tmp_path, monkeypatch, [0.04] * 120 + [0.06] * 20)
    slow = [s for s in handed if s > 120]
    assert slow and slow[0] <= 124, handed
    gaps = [b - a for a, b in itertools.pairwise(slow)]
    assert gaps and all(gap >= 2 for gap in gaps[: _PROMPT_STEPS // 2]), handed
    assert len(slow) >= 4, handed  # still several hand-overs in the spell, not one


def test_on_a_saturated_node_a_spell_hands_steps_over_half_as_often(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While every core of the node is busy, each wake of the sealer is a thread the
    scheduler must fit between the job's: a spell of 0.12 s steps hands every other step
    over (0.2 s apart at least), not each one, and is still told as soon."""
    durations = [0.075] * 120 + [0.12] * 12
    quiet = [s for s in _handed_over(tmp_path / "quiet", monkeypatch, durations) if s > 120]
    busy = [
        s
        for s in _handed_over(tmp_path / "busy", monkeypatch, durations, saturated=True)
        if s > 120
    ]
    assert busy and quiet and busy[0] <= quiet[0] + 1, (quiet, busy)
    assert all(b - a == 1 for a, b in itertools.pairwise(quiet)), quiet
    assert all(b - a == 2 for a, b in itertools.pairwise(busy)), busy
    assert len(busy) >= 4, busy
