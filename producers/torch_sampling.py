"""Which steps a monitor records: every step, or `active` steps out of every `wait + active`.

The same words as `torch.profiler.schedule` (`skip_first`, `wait`, `active`, `repeat`), so
a user who bounded a profiler's cost once reads this at a glance. There is no `warmup`: a
lagscope step needs no tracer warm-up, the ops of an active step are complete.

    >>> s = Schedule(wait=2, active=1)
    >>> [s.records(i) for i in range(6)]
    [False, False, True, False, False, True]
    >>> Schedule(skip_first=1, active=2, repeat=1).recorded_steps(6)
    [1, 2]
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    """Record `active` steps after `wait` unrecorded ones, `repeat` times (0: forever),
    after `skip_first` steps. Steps are counted from the monitor's first step."""

    wait: int = 0
    active: int = 1
    repeat: int = 0
    skip_first: int = 0

    def __post_init__(self) -> None:
        for name in ("wait", "repeat", "skip_first"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"schedule {name} must be >= 0, got {value}")
        if self.active < 1:
            raise ValueError(f"schedule active must be >= 1, got {self.active}")

    def records(self, index: int) -> bool:
        """Whether the `index`-th step since the monitor started is recorded."""
        if index < self.skip_first:
            return False
        since = index - self.skip_first
        cycle = self.wait + self.active
        if self.repeat and since // cycle >= self.repeat:
            return False
        return since % cycle >= self.wait

    def recorded_steps(self, n_steps: int) -> list[int]:
        return [i for i in range(n_steps) if self.records(i)]


EVERY_STEP = Schedule()
