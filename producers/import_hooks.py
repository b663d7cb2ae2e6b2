"""Run a function right after a module is imported, before the code that imported it
goes on: how the automatic monitor (`producers.auto_monitor`) reaches torch and
megatron-core in a job it may not edit.

A finder first on `sys.meta_path` answers for the watched names only: it asks the other
finders for the module's spec and wraps the spec's loader so that the callbacks run once
the module's own code has run. A job's `from torch.distributed.pipelining import
ScheduleGPipe` therefore already sees what a callback changed. A module imported before
`when_imported` is called gets its callbacks at once.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import importlib.machinery

Callback = Callable[[ModuleType], None]


class _AfterImport:
    """A finder (of `sys.meta_path`'s protocol; not a subclass of importlib's, whose import
    costs every Python process of the job 12 ms) that finds nothing itself and gives the
    watched modules' loaders a last step."""

    def __init__(self) -> None:
        self.callbacks: dict[str, list[Callback]] = {}
        self._local = threading.local()

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name not in self.callbacks or getattr(self._local, "busy", False):
            return None
        self._local.busy = True
        try:
            spec = _other_finders_spec(self, name, path, target)
        finally:
            self._local.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        own_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            own_exec(module)
            loader.exec_module = own_exec  # type: ignore[method-assign]
            for callback in self.callbacks.pop(name, []):
                callback(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def _other_finders_spec(
    hooks: _AfterImport, name: str, path: Sequence[str] | None, target: ModuleType | None
) -> importlib.machinery.ModuleSpec | None:
    for finder in sys.meta_path:
        if finder is hooks:
            continue
        find_spec: Any = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        spec = find_spec(name, path, target)
        if spec is not None:
            return spec
    return None


_hooks: _AfterImport | None = None


def when_imported(name: str, callback: Callback) -> None:
    """Call `callback(module)` once module `name` has been imported (now if it has)."""
    global _hooks
    module = sys.modules.get(name)
    if module is not None and not _initialising(module):
        callback(module)
        return
    if _hooks is None:
        _hooks = _AfterImport()
        sys.meta_path.insert(0, _hooks)
    _hooks.callbacks.setdefault(name, []).append(callback)


def _initialising(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))
