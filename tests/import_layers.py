"""The folders' import contracts (`.importlinter`), checked with import-linter:
`python -m tests.import_layers` (what `make lint` runs) exits non-zero when an import goes
the wrong way.

import-linter builds its graph by walking the root package's folder, but lagscope's
stages are folders beside `lagscope/` that the install maps under it
(`[tool.setuptools.package-dir]`), which an editable install does through an import hook
no folder walk sees. So the graph is built on the layout as installed: a temporary
`lagscope/` whose entries link to the repository's files and folders.

`picture()` draws the layers of the journey contract and `contracts_table()` lists the
forbidden contracts, as docs/design.md §4 shows them (tests/test_import_layers.py parses
the page and checks it against the contracts read here).
"""

from __future__ import annotations

import configparser
import os
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / ".importlinter"
#: The contract whose layers the design page draws.
JOURNEY = "importlinter:contract:journey"


def package_dirs() -> dict[str, str]:
    """Installed package -> source folder, for the packages installed from elsewhere than
    their own path under `lagscope/`."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    mapping = project["tool"]["setuptools"]["package-dir"]
    return {name: folder for name, folder in mapping.items() if name != "lagscope"}


def folder_of(module: str) -> str:
    """The repository folder of an installed package (`lagscope.store` -> `store/`)."""
    return package_dirs().get(module, module.replace(".", "/")) + "/"


def lay_out_installed(root: Path) -> Path:
    """`root/lagscope/` as installed, made of links to the repository; returns `root`."""
    package = root / "lagscope"
    package.mkdir()
    for entry in (REPO / "lagscope").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in package_dirs().items():
        (package / name.removeprefix("lagscope.")).symlink_to(REPO / folder)
    return root


def package_of(folder: str) -> str:
    """The installed package of a repository folder (`store/` -> `lagscope.store`)."""
    by_folder = {f"{path}/": name for name, path in package_dirs().items()}
    return by_folder.get(folder, folder.rstrip("/").replace("/", "."))


def contracts() -> dict[str, configparser.SectionProxy]:
    """Every contract of `.importlinter`, by its id (`journey`, `public-surface`, ...)."""
    config = configparser.ConfigParser()
    config.read(CONFIG, encoding="utf-8")
    prefix = "importlinter:contract:"
    return {
        section.removeprefix(prefix): config[section]
        for section in config.sections()
        if section.startswith(prefix)
    }


def _lines(value: str) -> list[str]:
    return [line.strip() for line in value.splitlines() if line.strip()]


def journey_layers() -> list[list[str]]:
    """The journey contract's layers, top first; each a list of side-by-side packages."""
    layers = contracts()[JOURNEY.removeprefix("importlinter:contract:")]["layers"]
    return [[name.strip() for name in line.split("|")] for line in _lines(layers)]


def forbidden_contracts() -> dict[str, tuple[frozenset[str], frozenset[str]]]:
    """Each forbidden contract's id -> (its source modules, the modules they never import)."""
    return {
        name: (
            frozenset(_lines(contract["source_modules"])),
            frozenset(_lines(contract["forbidden_modules"])),
        )
        for name, contract in contracts().items()
        if contract["type"] == "forbidden"
    }


def shown(module: str) -> str:
    """A module as the design page names it: a folder for an installed folder
    (`lagscope.store` -> `store/`), else its import name (`lagscope.timer`, `pyarrow`)."""
    folder = folder_of(module)
    return folder if (REPO / folder).is_dir() else module


def picture() -> str:
    """The layers as docs/design.md §4 draws them: folders, top layer first; `↓`: imports
    the layers below; `·` between folders of one layer: neither imports the other."""
    rows = ["  ·  ".join(folder_of(name) for name in layer) for layer in journey_layers()]
    return "\n    ↓\n".join(rows)


def contracts_table() -> str:
    """The forbidden contracts as docs/design.md §4 lists them, one row each, in the order
    of `.importlinter`."""

    def cell(modules: str) -> str:
        return ", ".join(f"`{shown(module)}`" for module in _lines(modules))

    rows = ["| contract | these | never import |", "|---|---|---|"]
    for name, contract in contracts().items():
        if contract["type"] == "forbidden":
            sources, forbidden = contract["source_modules"], contract["forbidden_modules"]
            rows.append(f"| `{name}` | {cell(sources)} | {cell(forbidden)} |")
    return "\n".join(rows)


def main() -> int:
    from importlinter.cli import lint_imports

    with tempfile.TemporaryDirectory(prefix="lagscope-layers-") as temporary:
        root = lay_out_installed(Path(temporary))
        # Before the editable install's hook, which would find the repository's folders.
        sys.path.insert(0, str(root))
        os.chdir(root)
        return lint_imports(config_filename=str(CONFIG), no_cache=True, no_logo=True)


if __name__ == "__main__":
    sys.exit(main())
