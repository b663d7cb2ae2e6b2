"""The analysis on recorded real jobs on 4 ranks sharing 2 cores (tests/data/recorded:
DDP, and DP 2 x PP 2 1F1B), clean or with the worker at dp 1, pp 0 2x slower in one phase
for steps 15-29."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from tests.torch_jobs.harness import analyse

RECORDED = Path(__file__).parent / "data" / "recorded"
SLOW_OP = {"forward": "forward-compute", "backward": "backward-compute", "input": "input-wait"}


@pytest.mark.parametrize("name", sorted(p.name.split(".")[0] for p in RECORDED.glob("*.tar.xz")))
def test_a_recorded_job_is_read_as_it_ran(name: str, tmp_path: Path) -> None:
    """Clean: no episode and no cause. A straggler: one episode, naming that worker alone
    and the op it was slow in, from within 3 steps of step 15 to within 3 of step 30."""
    with tarfile.open(RECORDED / f"{name}.tar.xz") as archive:
        archive.extractall(tmp_path, filter="data")
    report = analyse(tmp_path / "logs", tmp_path / "store")
    (job,) = report.jobs.values()
    episodes = [(e.onset, e.recovery, e.diagnosis.summary) for e in job.episodes]
    case = name.split("-")[1]
    if case == "clean":
        assert episodes == [], episodes
        assert job.diagnosis.cause == "none", job.diagnosis.summary
        return
    ((onset, recovery, summary),) = episodes
    assert "(dp 1, pp 0)" in summary and summary.count("(dp ") == 1, summary
    assert SLOW_OP[case] in summary, summary
    assert abs(onset - 15) <= 3 and recovery is not None and abs(recovery - 30) <= 3, episodes
