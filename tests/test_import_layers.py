"""The folders' import contracts hold, and docs/design.md §4 draws the contracts' layers."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.import_layers import REPO, journey_layers, package_dirs, picture

DESIGN = REPO / "docs" / "design.md"
MARK = "<!-- layers: from .importlinter's journey contract -->"


def test_the_contracts_hold() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "tests.import_layers"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


def test_every_folder_is_a_layer_of_the_journey() -> None:
    """A new folder cannot slip past the contracts: each installed folder but deploy (which
    contracts of its own keep apart) and the command line are in the journey's layers."""
    layered = {name for layer in journey_layers() for name in layer}
    assert set(package_dirs()) - {"lagscope.deploy"} | {"lagscope.cli"} == layered


def test_the_design_page_draws_the_contracts() -> None:
    page = DESIGN.read_text(encoding="utf-8")
    drawn = re.search(re.escape(MARK) + r"\n```\n(.*?)\n```", page, flags=re.S)
    assert drawn is not None, f"docs/design.md has no picture after {MARK}"
    assert drawn.group(1) == picture(), (
        "docs/design.md §4 does not draw .importlinter's layers; draw them as "
        "`python -c 'from tests.import_layers import picture; print(picture())'` does"
    )
