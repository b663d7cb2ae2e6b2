"""The folders' import contracts (`.importlinter`), checked with import-linter:
`python -m tests.import_layers` (what `make lint` runs) exits non-zero when an import goes
the wrong way.

import-linter builds its graph by walking the root package's folder, but lagscope's
stages are folders beside `lagscope/` that the install maps under it
(`[tool.setuptools.package-dir]`), which an editable install does through an import hook
no folder walk sees. So the graph is built on the layout as installed: a temporary
`lagscope/` whose entries link to the repository's files and folders.

`picture()` draws the layers of the journey contract, as docs/design.md §4 shows them
(tests/test_import_layers.py checks that the page draws the contracts).
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


def journey_layers() -> list[list[str]]:
    """The journey contract's layers, top first; each a list of side-by-side packages."""
    config = configparser.ConfigParser()
    config.read(CONFIG, encoding="utf-8")
    lines = [line.strip() for line in config[JOURNEY]["layers"].splitlines() if line.strip()]
    return [[name.strip() for name in line.split("|")] for line in lines]


def picture() -> str:
    """The layers as docs/design.md §4 draws them: folders, top layer first; `↓`: imports
    the layers below; `·` between folders of one layer: neither imports the other."""
    rows = ["  ·  ".join(folder_of(name) for name in layer) for layer in journey_layers()]
    return "\n    ↓\n".join(rows)


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
