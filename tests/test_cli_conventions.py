"""The command line follows the conventions users expect: --version, no abbreviations,
output that survives `| head`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lagscope import __version__
from lagscope.stream_app.cli import main
from tests.conftest import REFERENCE_TRACES

LAGSCOPE = [sys.executable, "-m", "lagscope.stream_app.cli"]


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
