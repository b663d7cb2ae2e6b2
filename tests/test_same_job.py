"""A trace and a job metadata file must describe the same job (issue 27): `analyze` and
`replay` given the files of two jobs stop with one line naming both files and the field,
instead of analysing one job as the other. The CLI runs as a process."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

REFERENCE = Path(__file__).resolve().parent / "data" / "reference-traces"
NAMES = ("AR", "SE", "ST")


def lagscope(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lagscope", *args],
        capture_output=True, text=True, timeout=300, cwd=cwd, check=False,
    )  # fmt: skip


def the_error(done: subprocess.CompletedProcess, command: str) -> str:
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"lagscope {command}: error: ")
    return lines[0]


@pytest.mark.parametrize("trace,meta", list(itertools.permutations(NAMES, 2)))
def test_reference_traces_with_another_jobs_meta_are_refused(trace: str, meta: str) -> None:
    done = lagscope(
        "analyze", "--trace", f"trace-{trace}.parquet", "--meta", f"meta-{meta}.yaml",
        cwd=REFERENCE,
    )  # fmt: skip
    line = the_error(done, "analyze")
    assert f"trace-{trace}.parquet and meta-{meta}.yaml describe different jobs: dp_size:" in line


def test_every_field_is_checked(tmp_path: Path) -> None:
    st = str(REFERENCE / "trace-ST.parquet")
    (tmp_path / "pp.yaml").write_text("trial_name: ST\ndp_size: 2\npp_size: 2\nworld_size: 4\n")
    line = the_error(lagscope("analyze", "--trace", st, "--meta", "pp.yaml", cwd=tmp_path),
                     "analyze")  # fmt: skip
    assert "pp.yaml describe different jobs: pp_size: the trace has 4 pipeline stages" in line
    # AR's ranks are numbered for tp 4 (up to 60): a meta without tensor parallelism has
    # the same dp and pp, and too few ranks
    ar = str(REFERENCE / "trace-AR.parquet")
    (tmp_path / "tp.yaml").write_text("trial_name: AR\ndp_size: 4\npp_size: 4\nworld_size: 16\n")
    line = the_error(lagscope("analyze", "--trace", ar, "--meta", "tp.yaml", cwd=tmp_path),
                     "analyze")  # fmt: skip
    assert "world_size: the trace has rank 60, tp.yaml says world_size 16" in line


def test_a_generated_trace_names_its_job(tmp_path: Path) -> None:
    common = ("--dp", "2", "--pp", "2", "--steps", "4", "--microbatches", "2")
    (tmp_path / "other.yaml").write_text("name: other-job\n")
    for args in (
        ("--out", "a"),
        ("--out", "b", "--tp", "2"),
        ("--out", "c", "--spec", "other.yaml"),
    ):
        assert lagscope("generate", *args, *common, cwd=tmp_path).returncode == 0
    line = the_error(lagscope("analyze", "--trace", "a/trace.parquet", "--meta", "b/meta.yaml",
                              cwd=tmp_path), "analyze")  # fmt: skip
    assert line.endswith(
        "a/trace.parquet and b/meta.yaml describe different jobs: tp_size: the trace was "
        "written for 1, b/meta.yaml says 2"
    )
    line = the_error(lagscope("analyze", "--trace", "a/trace.parquet", "--meta", "c/meta.yaml",
                              cwd=tmp_path), "analyze")  # fmt: skip
    assert "trial_name: the trace was written for 'synthetic', c/meta.yaml says 'other-job'" in line
    same = lagscope("analyze", "--trace", "a/trace.parquet", "--meta", "a/meta.yaml", cwd=tmp_path)
    assert same.returncode == 0, same.stderr


def test_replay_checks_the_pair_too(tmp_path: Path) -> None:
    done = lagscope(
        "replay", "--trace", str(REFERENCE / "trace-ST.parquet"), "--meta",
        str(REFERENCE / "meta-AR.yaml"), "--log-dir", "logs", "--no-progress", cwd=tmp_path,
    )  # fmt: skip
    assert "describe different jobs: dp_size" in the_error(done, "replay")
    assert not (tmp_path / "logs").exists()
