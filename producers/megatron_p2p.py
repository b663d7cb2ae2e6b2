"""Pipeline transfers as lagscope ops: a timed `P2PCommunicator`.

Every transfer of megatron-core's pipeline schedules goes through
`P2PCommunicator._communicate(tensor_send_next, tensor_send_prev, recv_prev, recv_next,
...)`. `timed_communicator_class(cls)` puts `TimedP2P` in front of a communicator class:
each call becomes one op per direction it moves, named by megatron's own arguments
(send to next / receive from prev: forward; send to prev / receive from next: backward).

A fused call (a send and a receive in one `_communicate`, as 1F1B's steady state makes)
gives one op per direction with the same stamps; the analysis pairs each with its peer.
With `overlap_p2p_comm` the schedule waits for each handle later: each direction's op
then ends at the transfer's completion, not at the call's return: at its handle's `wait()`,
or, on host clocks, at the first compute boundary that finds it complete (`poll`). The
interleaved schedule never waits for its last send, and gloo's send handles never say
they are complete before a wait: handles still open when the gradient finalisation
starts end there (`end_outstanding`), at the latest when the schedule returns.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

from lagscope.producers.megatron_ops import Span
from lagscope.producers.torch_comm import TimedWork
from lagscope.simulator import optypes as ot

if TYPE_CHECKING:
    from lagscope.producers.megatron_adapter import MegatronMonitor

#: `_communicate`'s request keys (`_p2p_ops`) and its arguments, by lagscope op type.
_P2P_DIRECTIONS = (
    ("send_next", "tensor_send_next", ot.FORWARD_SEND),
    ("recv_prev", "recv_prev", ot.FORWARD_RECV),
    ("send_prev", "tensor_send_prev", ot.BACKWARD_SEND),
    ("recv_next", "recv_next", ot.BACKWARD_RECV),
)

_perf_ns = time.perf_counter_ns

#: The monitor the timed communicators report to (one per process; see `attach`).
_monitor: MegatronMonitor | None = None


#: Handles given to the schedule whose transfer was not yet seen complete.
_outstanding: list[TimedWork] = []


def attach(monitor: MegatronMonitor | None) -> None:
    """Send the timed communicators' ops to `monitor` (None: record nothing)."""
    global _monitor
    _monitor = monitor
    _outstanding.clear()


def poll() -> None:
    """End the ops of handles whose transfer completed (host clocks: now is close to it)."""
    if _outstanding:
        _outstanding[:] = [work for work in _outstanding if not work.poll()]


def end_outstanding() -> None:
    """End every op still open: the schedule is done with its transfers."""
    poll()
    for work in _outstanding:
        work.complete()
    _outstanding.clear()


class TimedP2P:
    """Mixed in front of a `P2PCommunicator` class: every `_communicate` is timed, one op
    per direction it moves. A fused call (a send and a receive together) gives one op per
    direction with the same start and duration, as the analysis expects."""

    def _communicate(self, **kwargs: Any) -> Any:
        monitor = _monitor
        if monitor is None or not monitor.recording:
            return super()._communicate(**kwargs)  # type: ignore[misc]
        moved = [
            (key, optype, *monitor.producer_of(optype))
            for key, argument, optype in _P2P_DIRECTIONS
            if kwargs.get(argument) is not None and kwargs.get(argument) is not False
        ]
        if not kwargs.get("wait_on_reqs", True):
            return self._communicate_unwaited(monitor, moved, kwargs)
        timer = monitor.timer
        if monitor.host_timing:
            start = _perf_ns()
            result = super()._communicate(**kwargs)  # type: ignore[misc]
            end = _perf_ns()
            step = timer.current_step
            for _, optype, microbatch, chunk in moved:
                timer.add(timer.code_of(optype), step, microbatch, chunk, start, end)
            return result
        # CUDA events, recorded back to back on the current stream: the same device times.
        scopes = [timer.op(optype, microbatch=mb, chunk=ch) for _, optype, mb, ch in moved]
        for scope in scopes:
            scope.__enter__()
        result = super()._communicate(**kwargs)  # type: ignore[misc]
        for scope in reversed(scopes):
            scope.__exit__(None, None, None)
        return result

    def _communicate_unwaited(
        self, monitor: MegatronMonitor, moved: list[tuple[str, str, int, int]], kwargs: Any
    ) -> Any:
        """overlap_p2p_comm: the schedule waits for each direction's handle later, so each
        op ends at its handle's wait() (the transfer's completion), not at the return."""
        spans = {}
        for key, optype, microbatch, chunk in moved:
            span = spans[key] = Span()
            span.begin(monitor.timer, optype, microbatch, chunk)
        recv_prev, recv_next, requests = super()._communicate(**kwargs)  # type: ignore[misc]
        for key in list(requests or ()):
            if key in spans:
                work = requests[key] = TimedWork(requests[key], spans.pop(key), Span.end)
                _outstanding.append(work)
        for span in spans.values():  # no handle came back for these (ring exchange)
            span.end()
        return recv_prev, recv_next, requests


@functools.cache
def timed_communicator_class(cls: type) -> type:
    """`cls` with `TimedP2P` in front (one class per communicator class)."""
    if issubclass(cls, TimedP2P):
        return cls
    return type(cls.__name__, (TimedP2P, cls), {"__module__": __name__})
