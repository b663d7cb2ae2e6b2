"""How many bytes a host's structures hold: the accounting behind a job's memory budget.

A job's state is numpy arrays (retained steps, detectors, running ideals) and Python
objects around them (episodes, their costs and diagnoses, step series). `held_bytes`
walks a structure and sums what it reaches once: an array counted where it was first met
(a step held for the roll-up and for an episode's costing is one step), and an array's
base counted for its views. Approximate for Python objects (their `sys.getsizeof`, as
the interpreter reports it), exact for arrays; enough to show what grows and what does
not, at a cost of a walk (a few ms for a large job; the worker does it at its
snapshots).
"""

from __future__ import annotations

import dataclasses
import sys
from collections import deque
from typing import Any

import numpy as np

#: Leaves: counted by `sys.getsizeof`, nothing inside them to walk.
_ATOMS = (int, float, bool, str, bytes, complex, type(None), type)


def held_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes `obj` holds and reaches, each object once (`seen`: ids already counted
    elsewhere, updated).

    >>> a = np.zeros(1000)
    >>> held_bytes(a) >= 8000, held_bytes([a, a]) - held_bytes(a) < 100
    (True, True)
    >>> seen = set(); _ = held_bytes(a, seen); held_bytes({"a": a}, seen) < 500
    True
    """
    seen = set() if seen is None else seen
    total = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        key = id(item)
        if key in seen:
            continue
        seen.add(key)
        total += sys.getsizeof(item)  # an array's: its data too, where it owns it
        if isinstance(item, np.ndarray):
            if item.base is not None:
                stack.append(item.base)  # a view: what it views
        elif isinstance(item, memoryview):
            stack.append(item.obj)
        elif isinstance(item, _ATOMS) or callable(item):
            continue
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset | deque):
            stack.extend(item)
        elif dataclasses.is_dataclass(item):
            stack.extend(getattr(item, f.name) for f in dataclasses.fields(item))
        elif hasattr(item, "__dict__"):
            stack.append(vars(item))
    return total
