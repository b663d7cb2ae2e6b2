"""The analysis on real GPU jobs: tests/data/recorded-cuda, recorded by `lagscope.torch` in
CUDA mode on an NVIDIA H100 (see its README), read step by step as the job ran.

Four ranks of a small GPT share the one GPU, so their device times carry the time slices
of their neighbours (a forward of 2.5-10 ms for the same work). On that noise a rank
slower on its device is named with the op it is slow in, and a rank whose host stalls
between launches is named a slow host whose ops take their usual time, each with its
first and last step. Before the timer wrote a CUDA rank-step whole, no step of these jobs
could be analysed at all.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.torch_jobs.harness import analyse_archive

RECORDED = Path(__file__).parent / "data" / "recorded-cuda"
#: Rank 1 is (dp 1, pp 0); slow for steps 15-29 of 40.
WORKER = "(dp 1, pp 0)"


def _analysed(name: str, tmp_path: Path) -> object:
    return analyse_archive(RECORDED / f"{name}.tar.xz", tmp_path)


def _the_episode(job: object) -> object:
    spans = [(e.onset, e.recovery, e.diagnosis.summary) for e in job.episodes]
    assert len(job.episodes) == 1, spans
    (episode,) = job.episodes
    assert abs(episode.onset - 15) <= 3, spans
    assert episode.recovery is not None and abs(episode.recovery - 30) <= 3, spans
    summary = episode.diagnosis.summary
    assert WORKER in summary and summary.count("(dp ") == 1, summary
    return episode


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_rank_slow_on_its_gpu_is_named_with_its_op(tmp_path: Path, phase: str) -> None:
    job = _analysed(f"cuda-ddp-{phase}", tmp_path)
    episode = _the_episode(job)
    assert episode.diagnosis.cause == "slow_workers", episode.diagnosis.summary
    assert f"slow in {phase}-compute" in episode.diagnosis.summary


def test_a_host_stalling_between_launches_is_a_slow_host(tmp_path: Path) -> None:
    """The stalled rank's CUDA-event durations stay as they were: the stall shows only as
    launch delay, and it is named as such, not as slow compute."""
    job = _analysed("cuda-ddp-host", tmp_path)
    episode = _the_episode(job)
    assert episode.diagnosis.cause == "slow_host", episode.diagnosis.summary
    assert "its ops take their usual time" in episode.diagnosis.summary


def test_every_step_of_a_gpu_job_is_analysed(tmp_path: Path) -> None:
    job = _analysed("cuda-ddp-clean", tmp_path)
    assert job.incomplete_steps == []
    assert job.totals.steps == 39  # step 0 (DDP's re-bucketing) is not recorded
    assert job.diagnosis is not None and job.rollup is not None
    # Four ranks sharing one GPU, no straggler planted: no episode on their noise.
    assert job.episodes == [], [(e.onset, e.diagnosis.summary) for e in job.episodes]
