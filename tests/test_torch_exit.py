"""A monitored job that exits right after a collective ends cleanly: torch's backend
thread gets the interpreter lock back before Python finalizes (`integration_start`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

#: Two torchrun launches.
pytestmark = pytest.mark.slow

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]


def _run(mode: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", str(REPO / "tests/torch_jobs/exit_after_collective.py"),
         mode, str(tmp_path / mode)],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_job_that_exits_right_after_a_collective_exits_cleanly(tmp_path: Path) -> None:
    control = _run("no-grace", tmp_path)
    assert control.returncode != 0 and "terminate called" in control.stderr, (
        "without the pause at exit the job no longer crashes: torch may have fixed its "
        "backend threads' exit, and `_release_the_interpreter_at_exit` can go"
    )
    job = _run("grace", tmp_path)
    assert job.returncode == 0, job.stderr[-3000:]
    assert list((tmp_path / "grace").glob("*")), "the monitored job wrote no log"
