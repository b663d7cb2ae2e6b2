"""The analysis on recorded real jobs on 4 ranks sharing 2 cores (tests/data/recorded:
DDP, and DP 2 x PP 2 1F1B, real CPU compute of a few ms per op), clean or with the worker
at dp 1, pp 0 2x slower in one phase for steps 15-29, read step by step as the job ran
(episodes are found live, `simulator/online_episodes.py`).

These recordings were kept because they are the hardest seen: ranks of a loaded 2-core box
lose their cores in runs of up to 10 steps, as slow as a 2x straggler's ops. A clean one
must stay quiet; a straggler is named only with the right worker and op, never before its
onset. The live detector needs more steps of evidence on such a job (its own spike rate
is high), so some of these stragglers, 2x slower in ops of 3-10 ms, go unnamed: most of
them must not (tests/bench/NOTES.md, "Live episodes on real jobs", has the counts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.recorded_truth import truth_of
from tests.torch_jobs.harness import analyse_archive

RECORDED = Path(__file__).parent / "data" / "recorded"
NAMES = sorted(p.name.split(".")[0] for p in RECORDED.glob("*.tar.xz"))
#: Of the straggler recordings, at least this share is named with its bounds.
FOUND_AT_LEAST = 0.6


def _analysed(name: str, tmp_path: Path) -> object:
    return analyse_archive(RECORDED / f"{name}.tar.xz", tmp_path)


def _found(job: object, name: str) -> bool:
    """Whether the straggler's episode is there, with its bounds within 3 steps; raises
    when an episode names anything else (another worker, another op, before the onset)."""
    truth = truth_of(RECORDED / f"{name}.tar.xz")
    assert truth.worker is not None and truth.slow_steps is not None
    who = "(dp {}, pp {})".format(*truth.worker)
    what = "stalls between its ops" if truth.kind == "host" else truth.kind
    onset, end = truth.slow_steps
    found = False
    for episode in job.episodes:
        summary = episode.diagnosis.summary
        assert who in summary and summary.count("(dp ") == 1, summary
        assert what in summary, summary
        assert episode.onset >= onset - 3, (episode.onset, summary)
        found |= (
            abs(episode.onset - onset) <= 3
            and episode.recovery is not None
            and abs(episode.recovery - end) <= 3
        )
    return found


@pytest.mark.parametrize("name", [n for n in NAMES if truth_of(RECORDED / f"{n}.tar.xz").healthy])
def test_a_recorded_healthy_job_stays_quiet(name: str, tmp_path: Path) -> None:
    job = _analysed(name, tmp_path)
    assert job.episodes == [], [(e.onset, e.recovery, e.diagnosis.summary) for e in job.episodes]
    assert job.diagnosis.cause == "none", job.diagnosis.summary


def test_a_host_stalling_from_the_start_is_the_runs_slow_host(tmp_path: Path) -> None:
    """1f1b-hoststart-0: the worker at dp 1, pp 0 stalls after each op from the first step.
    Its pipeline partner waits on the sends to it at the end of each step, and one of its
    launch delays then holds that wait: its host gaps (`prepare.host_gaps`) must not."""
    job = _analysed("1f1b-hoststart-0", tmp_path)
    assert job.diagnosis.cause == "slow_host", job.diagnosis.summary
    assert "(dp 1, pp 0)" in job.diagnosis.summary, job.diagnosis.summary


@pytest.mark.parametrize("name", ["1f1b-forward-2", "1f1b-backward-0"])
def test_a_rank_a_third_slower_on_a_quiet_job_is_named_with_its_bounds(
    name: str, tmp_path: Path
) -> None:
    """The rank at dp 1, pp 0 only 1.3x slower in its forward or backward for steps 15-44
    of a real 1F1B job on the emulated accelerator: below the rise by half that noisy
    shared cores need, yet 87-98 % of the job's slowdown over those steps. It is named,
    with its op, bounded to within 3 steps, and is the run's verdict."""
    job = _analysed(name, tmp_path)
    assert _found(job, name), [(e.onset, e.recovery, e.diagnosis.summary) for e in job.episodes]
    assert job.diagnosis.cause == "slow_workers", job.diagnosis.summary


@pytest.mark.slow  # every recorded real job analysed (~12 s)
def test_recorded_stragglers_are_named_right_or_not_at_all(tmp_path: Path) -> None:
    stragglers = [
        n
        for n in NAMES
        if not (truth := truth_of(RECORDED / f"{n}.tar.xz")).healthy and not truth.standing
    ]
    found = [name for name in stragglers if _found(_analysed(name, tmp_path / name), name)]
    assert len(found) >= FOUND_AT_LEAST * len(stragglers), (found, stragglers)


@pytest.mark.parametrize(
    "name", ["ddp-lateback-0", "ddp-hostbw-0", "mcore-hostupdate-0", "mcore-forward-0"]
)
def test_a_straggler_far_beyond_the_jobs_noise_is_named_on_five_steps(
    name: str, tmp_path: Path
) -> None:
    """Real jobs on shared cores whose ranks jump 1.5x in a fifth to a third of their
    steps, with a rank that waits 100 ms in its backward, stalls 100 ms between ops or
    runs its forward 2x slower (its own time 7-110x): the episode opens on the onset's
    step and four more, as on a quiet job, not after the `noisy_steps` a 2x jump of a few
    ms needs there."""
    truth = truth_of(RECORDED / f"{name}.tar.xz")
    job = _analysed(name, tmp_path)
    (state,) = [s for s in job.episode_states if (s.episode.dp, s.episode.stage) == truth.worker]
    onset = truth.slow_steps[0]
    assert (state.episode.onset, state.episode.first_seen) == (onset, onset + 4)
