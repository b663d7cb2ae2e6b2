"""How long a step waits for its missing ranks: the job's own pace, not a fixed timeout.

A step is closed without a (dp, pp) coordinate only when that coordinate's data has really
not come, never because the host was behind, starting or handed the job over:

- **Progress.** Each coordinate's batches arrive in step order (one rank writes one log,
  which its streamer ships in order into the job's one partition). Once a coordinate has
  delivered a later step, the step it skipped will not come: every coordinate past a
  step closes it at once, complete or not (the embedded host read logs that way already).
- **Silence.** Otherwise a step waits for a missing coordinate until that coordinate has
  sent nothing at all for the job's lateness: a coordinate that is behind but still
  delivering (its timer seals 40 steps at a time, its streamer or node is slow) is waited
  for, whatever the step's age; one that died or stopped writing is overdue once, and
  the steps after it close as soon as the others are in.
- **The job's lateness** follows its own pace: three times the longest recent gap between
  two deliveries of one coordinate (the timer's seal pace, the streamer, Kafka and this
  host, as observed) plus two of its steps, and the longest recent delay between a
  record's production and its windowing here, at least `FLOOR_S`, at most the
  `processor.lateness_s` setting, which a coordinate that has not delivered yet waits.

All times are the host's lateness clock (`host_core.LatenessClock`): the records' own
times while the host is behind its input, wall-clock time once it has caught up, so a
backlog is judged as it was produced.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

#: The least lateness: the longest a timer of lagscope 0.4 held a rank's steps while every
#: core of its node was busy (3 s, twice that when saturated; now 0.5 s at most: readers
#: are upgraded first, and a job's timers may be older), so a job observed sealing often
#: does not cut a rank whose node turns busy.
FLOOR_S = 6.0
#: Gaps and delays observed within this many seconds (of the lateness clock) make the
#: lateness; older ones are let go (a burst of backlog long ago says nothing of now).
MEMORY_S = 300.0
#: Gaps shorter than this are a seal's batches arriving together, not a silence.
_MIN_GAP_S = 0.01
#: Step intervals kept for the job's step time (their median).
_STEP_TIMES_KEPT = 32
#: Observations kept of each kind, at most.
_KEPT = 512

Coordinate = tuple[int, int]


@dataclass
class JobArrivals:
    """What a job's coordinates delivered and when, and what that makes its lateness."""

    #: The `processor.lateness_s` setting: the most a step waits.
    ceiling_s: float
    #: Per (dp, pp) coordinate, the latest step it delivered and when (lateness clock).
    latest_step: dict[Coordinate, int] = field(default_factory=dict)
    last_at: dict[Coordinate, float] = field(default_factory=dict)
    #: When the job's first batch arrived here.
    first_at: float | None = None
    #: (when, seconds) of recent silences between two deliveries of one coordinate, and
    #: of recent delays between a record's production and its windowing.
    gaps: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=_KEPT))
    delays: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=_KEPT))
    #: Seconds per step between recent steps that began (their starts, in ns).
    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=_STEP_TIMES_KEPT))
    _last_start: tuple[int, int] | None = None

    def on_batch(self, coordinate: Coordinate, step: int, at: float, delay_s: float) -> None:
        """A batch of `coordinate` for `step` was windowed at `at`, `delay_s` after it was
        produced."""
        if self.first_at is None:
            self.first_at = at
        previous = self.last_at.get(coordinate)
        if previous is not None and at - previous >= _MIN_GAP_S:
            self.gaps.append((at, at - previous))
        self.last_at[coordinate] = at
        self.latest_step[coordinate] = max(self.latest_step.get(coordinate, step), step)
        if delay_s > 0:
            self.delays.append((at, delay_s))

    def on_step_start(self, step: int, start_ns: int) -> None:
        """A step closed that began at `start_ns`: the job's step time follows."""
        if self._last_start is not None:
            last_step, last_ns = self._last_start
            if step > last_step and start_ns > last_ns:
                self.step_times.append((start_ns - last_ns) / 1e9 / (step - last_step))
        if self._last_start is None or step > self._last_start[0]:
            self._last_start = (step, start_ns)

    def passed_by_all(self, coordinates: int) -> int | None:
        """The lowest step every one of the job's `coordinates` delivered, once each has
        delivered one: the steps before it have all the data they will get."""
        if len(self.latest_step) < coordinates:
            return None
        return min(self.latest_step.values())

    # -- the lateness -------------------------------------------------------------------
    def step_time_s(self) -> float:
        if not self.step_times:
            return 0.0
        ordered = sorted(self.step_times)
        return ordered[len(ordered) // 2]

    def _recent(self, kept: deque[tuple[float, float]], now: float) -> float:
        return max((value for at, value in kept if now - at <= MEMORY_S), default=0.0)

    def lateness_s(self, now: float) -> float:
        """How long a coordinate that delivered before may stay silent: the ceiling until
        one of the job's coordinates delivered twice (no gap seen yet)."""
        gap = self._recent(self.gaps, now)
        if gap <= 0:
            return self.ceiling_s
        paced = 3 * gap + 2 * self.step_time_s() + self._recent(self.delays, now)
        return min(self.ceiling_s, max(FLOOR_S, paced))

    def silent_s(self, coordinate: Coordinate, now: float) -> float:
        since = self.last_at.get(coordinate, self.first_at)
        return max(0.0, now - since) if since is not None else 0.0

    def wait_s(self, coordinate: Coordinate, now: float) -> float:
        """How long `coordinate` may be silent: the job's lateness, or, before it ever
        delivered, the ceiling (it may still be starting)."""
        return self.lateness_s(now) if coordinate in self.last_at else self.ceiling_s

    def why_missing(
        self, coordinate: Coordinate, step: int, now: float, *, ended: bool = False
    ) -> str:
        """Why `coordinate`'s batch of `step` was not there when the step closed
        (`ended`: the input ended with the step open).

        >>> arrivals = JobArrivals(30.0)
        >>> arrivals.on_batch((0, 0), 5, 100.0, 0.0)
        >>> arrivals.on_batch((1, 0), 3, 100.0, 0.0)
        >>> arrivals.why_missing((0, 0), 4, 101.0)
        '(dp 0, pp 0) sent step 5 but not this one'
        >>> arrivals.why_missing((1, 0), 4, 120.5)
        '(dp 1, pp 0) sent nothing for 20.5 s (it may be silent 30.0 s: the lateness)'
        >>> arrivals.why_missing((1, 1), 4, 131.0)
        '(dp 1, pp 1) never sent a batch (waited 31.0 s)'
        >>> arrivals.why_missing((1, 0), 4, 101.0, ended=True)
        '(dp 1, pp 0) sent step 3 last: the input ended without this one'
        """
        dp, pp = coordinate
        name = f"(dp {dp}, pp {pp})"
        latest = self.latest_step.get(coordinate)
        if latest is not None and latest > step:
            return f"{name} sent step {latest} but not this one"
        if ended:
            sent = "sent no batch" if latest is None else f"sent step {latest} last"
            return f"{name} {sent}: the input ended without this one"
        if latest is None:
            return f"{name} never sent a batch (waited {self.silent_s(coordinate, now):.1f} s)"
        wait = self.wait_s(coordinate, now)
        how = "the lateness" if wait >= self.ceiling_s else self.describe(now)
        return (
            f"{name} sent nothing for {self.silent_s(coordinate, now):.1f} s "
            f"(it may be silent {wait:.1f} s: {how})"
        )

    def describe(self, now: float) -> str:
        """What the job's lateness is made of, in words."""
        return (
            f"3 x its {self._recent(self.gaps, now):.1f} s gaps between deliveries + "
            f"2 x its {self.step_time_s():.2f} s steps + {self._recent(self.delays, now):.1f} s "
            f"delivery delay, at least {FLOOR_S:g} s"
        )

    # -- state --------------------------------------------------------------------------
    def state_dict(self, now: float) -> dict[str, Any]:
        """Plain data, times as ages before `now` (the clock of a host that resumes
        goes on from its own reading)."""
        return {
            "latest_step": [[*c, s] for c, s in self.latest_step.items()],
            "last_age_s": [[*c, now - at] for c, at in self.last_at.items()],
            "first_age_s": None if self.first_at is None else now - self.first_at,
            "gaps": [[now - at, value] for at, value in self.gaps],
            "delays": [[now - at, value] for at, value in self.delays],
            "step_times": list(self.step_times),
            "last_start": list(self._last_start) if self._last_start else None,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], ceiling_s: float, now: float) -> JobArrivals:
        arrivals = cls(ceiling_s)
        arrivals.latest_step = {(int(d), int(p)): int(s) for d, p, s in state["latest_step"]}
        arrivals.last_at = {(int(d), int(p)): now - float(a) for d, p, a in state["last_age_s"]}
        first = state["first_age_s"]
        arrivals.first_at = None if first is None else now - float(first)
        arrivals.gaps.extend((now - float(a), float(v)) for a, v in state["gaps"])
        arrivals.delays.extend((now - float(a), float(v)) for a, v in state["delays"])
        arrivals.step_times.extend(float(t) for t in state["step_times"])
        last = state["last_start"]
        arrivals._last_start = (int(last[0]), int(last[1])) if last else None
        return arrivals
