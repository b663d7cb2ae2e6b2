"""Examples in docstrings are tests: every `>>>` example in the package runs here.

Modules are imported under their installed names (`lagscope.simulator.bocd`, ...), never as
top-level copies of the source folders.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

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
