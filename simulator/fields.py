"""Checks of the few plain settings the analysis itself holds (a job's layout, the
diagnosis' thresholds), kept to the standard library.

The analysis path (`lagscope analyze`) reads two small records; building pydantic models for
them cost more start-up time than the analysis of a whole trace. The models of the
system's configuration and wire records stay pydantic; these records are frozen
dataclasses checked here, with the same one-line messages ('field: problem; ...').
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from collections.abc import Mapping
from typing import Any


class FieldErrors(ValueError):
    """Every problem of a record at once: 'field: problem; field: problem'."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{name}: {problem}" for name, problem in problems))


@dataclasses.dataclass(frozen=True)
class Bound:
    """What a numeric field accepts: an integer or any real number, and its range."""

    integer: bool = False
    gt: float | None = None
    ge: float | None = None
    le: float | None = None
    optional: bool = False

    def check(self, value: Any) -> tuple[Any, str | None]:
        """The value coerced to int or float, and what is wrong with it (None if nothing).

        >>> Bound(integer=True, gt=0).check(3)
        (3, None)
        >>> Bound(integer=True, gt=0).check(0)
        (0, 'must be greater than 0 (got 0)')
        >>> Bound(gt=0).check("fast")
        ('fast', "must be a number (got 'fast')")
        """
        if value is None:
            return value, None if self.optional else "is required (got null)"
        if isinstance(value, bool):
            return value, f"must be {'an integer' if self.integer else 'a number'} (got {value})"
        if self.integer:
            try:
                value = operator.index(value)
            except TypeError:
                if isinstance(value, float) and value.is_integer():
                    value = int(value)
                else:
                    return value, f"must be an integer (got {value!r})"
        else:
            if not isinstance(value, numbers.Real):
                return value, f"must be a number (got {value!r})"
            value = float(value)
            if not math.isfinite(value):
                return value, f"must be a finite number (got {value})"
        for limit, holds, words in (
            (self.gt, lambda v, x: v > x, "greater than"),
            (self.ge, lambda v, x: v >= x, "at least"),
            (self.le, lambda v, x: v <= x, "at most"),
        ):
            if limit is not None and not holds(value, limit):
                return value, f"must be {words} {limit:g} (got {value:g})"
        return value, None


def check_fields(record: Any, bounds: Mapping[str, Bound]) -> list[tuple[str, str]]:
    """Coerce and check the bounded fields of a frozen dataclass in place (from its
    `__post_init__`); the problems found, in field order."""
    problems = []
    for name, bound in bounds.items():
        value, problem = bound.check(getattr(record, name))
        if problem is None:
            object.__setattr__(record, name, value)
        else:
            problems.append((name, problem))
    return problems


def from_mapping(cls: type, raw: Mapping[str, Any], bounds: Mapping[str, Bound]) -> Any:
    """`cls(**raw)` for a dataclass, with unknown and missing fields reported beside the
    given fields' own problems, all in one FieldErrors."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    problems = [(str(k), "unknown field") for k in raw if k not in known]
    for name, f in known.items():
        if name in raw:
            if name in bounds:
                problem = bounds[name].check(raw[name])[1]
                if problem is not None:
                    problems.append((name, problem))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            problems.append((name, "is required"))
    if problems:
        raise FieldErrors(problems)
    return cls(**raw)
