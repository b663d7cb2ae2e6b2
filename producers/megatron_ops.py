"""Megatron-core callbacks whose start and end arrive apart, as lagscope ops.

`Span` holds an `OpTimer.op` scope open between two hooks (a bucket group's sync starts in
one method and finishes in another; a p2p handle completes at its `wait()`). The
`config.timers` seam calls `timers(name).start()` and `timers(name).stop()` as separate
calls: `MegatronTimers` maps the names lagscope needs to `Phase`s holding their open op,
and passes every call on to the timers the job already had (Megatron-LM's `Timers`). A p2p
handle's op, which ends at its `wait()`, is a `torch_comm.TimedWork` holding a `Span`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lagscope.producers.timer import OpTimer

if TYPE_CHECKING:
    from lagscope.producers.megatron_adapter import MegatronMonitor


class Span:
    """An op whose start and end are seen by different hooks (an `OpTimer.op` scope held
    open). `begin` on an open span starts the op again: the earlier start is dropped, and
    nothing is recorded for it."""

    __slots__ = ("_scope",)

    def __init__(self) -> None:
        self._scope: Any = None

    def begin(self, timer: OpTimer, optype: str, microbatch: int = -1, chunk: int = 0) -> None:
        self._scope = timer.op(optype, microbatch=microbatch, chunk=chunk)
        self._scope.__enter__()

    @property
    def open(self) -> bool:
        return self._scope is not None

    def end(self) -> None:
        scope, self._scope = self._scope, None
        if scope is not None:
            scope.__exit__(None, None, None)


class Phase:
    """One `config.timers` name mapped to an op type: start()/stop() come as separate
    `config.timers(name)` calls, so the open op lives here, not in the returned object."""

    __slots__ = ("_monitor", "_span", "on_start", "optype", "wanted")

    def __init__(
        self,
        monitor: MegatronMonitor,
        optype: str,
        wanted: Callable[[], bool],
        on_start: Callable[[], None] | None = None,
    ) -> None:
        self._monitor = monitor
        self._span = Span()
        self.optype = optype
        #: Whether this rank records the phase (asked at every start).
        self.wanted = wanted
        #: Called at every start, recorded or not.
        self.on_start = on_start

    def start(self) -> None:
        if self.on_start is not None:
            self.on_start()
        if self._monitor.recording and self.wanted():
            self._span.begin(self._monitor.timer, self.optype)

    def stop(self) -> None:
        self._span.end()


class PhaseTimer:
    """What `config.timers(name)` returns for a mapped name: our phase, then the job's own."""

    __slots__ = ("_inner", "_phase")

    def __init__(self, phase: Phase, inner: Any) -> None:
        self._phase = phase
        self._inner = inner

    def start(self, barrier: bool = False) -> None:
        if self._inner is not None:
            self._inner.start(barrier=barrier)
        self._phase.start()

    def stop(self, barrier: bool = False) -> None:
        self._phase.stop()
        if self._inner is not None:
            self._inner.stop(barrier=barrier)


class _NullTimer:
    __slots__ = ()

    def start(self, barrier: bool = False) -> None:
        return None

    def stop(self, barrier: bool = False) -> None:
        return None


_NULL_TIMER = _NullTimer()


class MegatronTimers:
    """Set as `config.timers`: maps the timer names lagscope needs to ops and passes every
    call on to the timers the job already had (Megatron-LM's `Timers`, or none)."""

    def __init__(self, phases: dict[str, Phase], inner: Any) -> None:
        self._phases = phases
        self.inner = inner

    def __call__(self, name: str, log_level: int | None = None) -> Any:
        inner = None
        if self.inner is not None:
            inner = self.inner(name) if log_level is None else self.inner(name, log_level)
        phase = self._phases.get(name)
        if phase is None:
            return inner if inner is not None else _NULL_TIMER
        return PhaseTimer(phase, inner)

    def __getattr__(self, name: str) -> Any:
        # Anything else (log, write, ...) belongs to the job's own timers.
        if self.inner is None:
            raise AttributeError(name)
        return getattr(self.inner, name)
