"""Examples in docstrings are tests: every `>>>` example in the package runs here.

Modules are imported under their installed names (`lagscope.simulator.bocd`, ...), never as
top-level copies of the source folders.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import lagscope

#: The import root and the stages installed under it (each a folder of the repository).
PACKAGES = (
    "lagscope",
    "lagscope.producers",
    "lagscope.simulator",
    "lagscope.stream_app",
    "lagscope.store",
    "lagscope.cli",
    "lagscope.dashboards",
    "lagscope.deploy",
)


def _modules() -> list[str]:
    names = []
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        names.append(package_name)
        names += [
            f"{package_name}.{info.name}"
            for info in pkgutil.iter_modules(package.__path__)
            if not info.ispkg
        ]
    return sorted(set(names))


def _examples(module_name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(module_name)
    return [test for test in doctest.DocTestFinder().find(module) if test.examples]


MODULES_WITH_EXAMPLES = [name for name in _modules() if _examples(name)]


def test_the_package_has_examples() -> None:
    assert lagscope.__version__
    assert len(MODULES_WITH_EXAMPLES) >= 2, MODULES_WITH_EXAMPLES


@pytest.mark.parametrize("module_name", MODULES_WITH_EXAMPLES)
def test_docstring_examples(module_name: str) -> None:
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in _examples(module_name):
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{results.failed} docstring example(s) failed in {module_name}"


#: A date beside the code (a measurement's, a change's) goes stale while the code moves on:
#: measurements belong in tests/bench/NOTES.md, history in commit messages.
_DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def test_the_code_carries_no_dated_notes() -> None:
    root = Path(lagscope.__file__).resolve().parent.parent
    stages = ("lagscope", *(name.removeprefix("lagscope.") for name in PACKAGES[1:]))
    folders = [name for name in stages if (root / name).is_dir()]  # cli is inside lagscope
    dated = [
        f"{path.relative_to(root)}:{number}"
        for folder in folders
        for path in sorted((root / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _DATE.search(line)
    ]
    assert len(folders) > 5 and not dated, f"dated notes in the code: {dated}"
