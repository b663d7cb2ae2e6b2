"""The folders' import contracts hold, and docs/design.md §4 shows the same contracts.

The page is parsed (its layer picture and its table of forbidden contracts) and so is
`.importlinter`; the two must say the same thing, so that neither can change alone.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.import_layers import (
    REPO,
    contracts,
    contracts_table,
    forbidden_contracts,
    journey_layers,
    package_dirs,
    package_of,
    picture,
)

DESIGN = REPO / "docs" / "design.md"
LAYERS_MARK = "<!-- layers: from .importlinter's journey contract -->"
CONTRACTS_MARK = "<!-- contracts: from .importlinter's forbidden contracts -->"

Layers = list[list[str]]
Forbidden = dict[str, tuple[frozenset[str], frozenset[str]]]


def drawn_layers(page: str) -> Layers:
    """The layers the page draws after LAYERS_MARK, top first, as installed packages:
    the picture's rows between `↓` lines, folders of one row separated by `·`."""
    drawn = re.search(re.escape(LAYERS_MARK) + r"\n```\n(.*?)\n```", page, flags=re.S)
    assert drawn is not None, f"docs/design.md has no picture after {LAYERS_MARK}"
    rows = [line.strip() for line in drawn.group(1).splitlines()]
    return [
        [package_of(folder.strip()) for folder in row.split("·")]
        for row in rows
        if row and row != "↓"
    ]


def listed_contracts(page: str) -> Forbidden:
    """The forbidden contracts the page's table lists after CONTRACTS_MARK: contract id ->
    (the modules of `these`, the modules of `never import`), folders as installed."""
    after = page.split(CONTRACTS_MARK, 1)
    assert len(after) == 2, f"docs/design.md has no table after {CONTRACTS_MARK}"
    table = []
    for line in after[1].lstrip("\n").splitlines():
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    header, _rule, *rows = table
    assert header == ["contract", "these", "never import"], header

    def modules(cell: str) -> frozenset[str]:
        return frozenset(package_of(name) for name in re.findall(r"`([^`]+)`", cell))

    return {row[0].strip("`"): (modules(row[1]), modules(row[2])) for row in rows}


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


def test_the_design_page_shows_every_contract() -> None:
    """A contract of a kind the page cannot show (a second layers contract, an
    independence contract) must be added to the page and to this test."""
    kinds = {name: contract["type"] for name, contract in contracts().items()}
    layered = [name for name, kind in kinds.items() if kind == "layers"]
    assert layered == ["journey"], f"one layers contract, the page's picture: {layered}"
    assert set(kinds.values()) <= {"layers", "forbidden"}, kinds


def test_the_design_page_draws_the_journey_layers() -> None:
    page = DESIGN.read_text(encoding="utf-8")
    assert drawn_layers(page) == journey_layers(), (
        "docs/design.md §4 does not draw .importlinter's layers; draw them as "
        f"`python -c 'from tests.import_layers import picture; print(picture())'` does:\n"
        f"{picture()}"
    )


def test_the_design_page_lists_the_forbidden_contracts() -> None:
    page = DESIGN.read_text(encoding="utf-8")
    assert listed_contracts(page) == forbidden_contracts(), (
        "docs/design.md §4 does not list .importlinter's forbidden contracts; list them as "
        "`python -c 'from tests.import_layers import contracts_table; "
        f"print(contracts_table())'` does:\n{contracts_table()}"
    )


@pytest.mark.parametrize(
    ("change", "old", "new"),
    [
        ("two layers swapped", "store/\n    ↓\nproducers/", "producers/\n    ↓\nstore/"),
        ("a folder moved into a layer", "stream_app/  ·  dashboards/", "stream_app/"),
        ("a forbidden import dropped", "`store/`, `dashboards/`, `deploy/` |", "`store/` |"),
        ("a contract renamed", "| `internal` |", "| `inward` |"),
    ],
)
def test_a_page_that_disagrees_is_caught(change: str, old: str, new: str) -> None:
    """The parsers read what the page says: each planted disagreement is seen."""
    page = DESIGN.read_text(encoding="utf-8")
    assert old in page, change
    changed = page.replace(old, new, 1)
    assert (drawn_layers(changed), listed_contracts(changed)) != (
        journey_layers(),
        forbidden_contracts(),
    ), change
