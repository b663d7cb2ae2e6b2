"""The command line follows the conventions users expect: --version, no abbreviations,
output that survives `| head`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lagscope import __version__
from lagscope.cli import main
from tests.conftest import REFERENCE_TRACES

LAGSCOPE = [sys.executable, "-m", "lagscope.cli"]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"lagscope {__version__}"


def test_abbreviated_options_are_not_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    trace = str(REFERENCE_TRACES / "trace-ST.parquet")
    meta = str(REFERENCE_TRACES / "meta-ST.yaml")
    with pytest.raises(SystemExit) as exited:
        main(["analyze", "--trace", trace, "--meta", meta, "--always-dec"])
    assert exited.value.code == 2
    assert "unrecognized arguments: --always-dec" in capsys.readouterr().err


def test_output_piped_to_a_reader_that_leaves_early_prints_no_traceback() -> None:
    """`lagscope analyze ... | head -0`: the reader is gone before the first line is written
    (the command needs a third of a second to import and analyse)."""
    command = [
        *LAGSCOPE,
        "analyze",
        "--trace", str(REFERENCE_TRACES / "trace-AR.parquet"),
        "--meta", str(REFERENCE_TRACES / "meta-AR.yaml"),
    ]  # fmt: skip
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        assert process.stdout is not None and process.stderr is not None
        process.stdout.close()
        stderr = process.stderr.read().decode()
        code = process.wait(timeout=60)
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr
    assert code == 141


def test_a_one_shot_command_ends_without_teardown_and_loses_no_output(tmp_path) -> None:
    """`analyze` ends its process without the interpreter's teardown: what it printed to a
    pipe (block-buffered) and every file it wrote are complete, as when main() returns."""
    trace, meta = REFERENCE_TRACES / "trace-SE.parquet", REFERENCE_TRACES / "meta-SE.yaml"
    args = ["analyze", "--trace", str(trace), "--meta", str(meta)]
    piped, in_process = tmp_path / "piped.json", tmp_path / "in-process.json"
    timeline = tmp_path / "timeline.json"
    # Buffered as a user's shell has it (CI and containers often set PYTHONUNBUFFERED).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    done = subprocess.run(
        [*LAGSCOPE, *args, "--json", str(piped), "--timeline", str(timeline)],
        capture_output=True, text=True, timeout=120, check=True, env=env,
    )  # fmt: skip
    assert json.loads(timeline.read_text())["traceEvents"]
    assert main([*args, "--json", str(in_process)]) == 0
    assert json.loads(piped.read_text()) == json.loads(in_process.read_text())
    lines = done.stdout.splitlines()
    assert lines[0].startswith("lagscope analyze:") and len(lines) > 10, done.stdout
    assert lines[-1] == f"  timeline written to {timeline} (open it in https://ui.perfetto.dev)"
