"""NCCL collectives timed on the device by the process group itself (CUDA jobs on NCCL).

ProcessGroupNCCL can time every collective on its own stream (`TORCH_NCCL_ENABLE_TIMING=1`,
or `ProcessGroup._enable_collectives_timing()`) and calls an on-completion hook
(`ProcessGroup._register_on_completion_hook(hook)`) from its watchdog thread with a
`WorkInfo`: `op_type`, `seq` (the group's collective sequence number), `time_started`,
`time_finished` (host wall-clock datetimes) and `active_duration` (a timedelta: the time
between the collective's start and end CUDA events on the NCCL stream). That is the
duration the what-if needs, with no event of ours on the comm stream.

How it is used (only when the group's backend is NCCL and the hook API exists; gloo and
CUDA-less jobs keep the host/CUDA-event paths of `torch_comm`):

1. the collective's wrapper calls the collective, reads the group's sequence number
   (`_get_sequence_number_for_group()`, the `seq` the hook will report for that work) and
   parks the op's head (code, step, micro-batch, chunk) under (group, seq);
2. the hook pops the head of (group, seq) and records the op ending at `time_finished`
   and lasting `active_duration` (`OpTimer.record`, wall-clock, any thread). Works the
   wrappers did not park (unrecorded groups, steps not sampled, calls made from C++)
   find nothing and are ignored.

p2p keeps CUDA events: its works carry the p2p sequence, not the collective one.

NOT RUN HERE: this machine has no GPU and no NCCL. The path is kept to the two functions
above so that it can be reviewed line by line; the torch 2.15 API it uses was checked by
introspection (`WorkInfo` has exactly those fields; the hook and the sequence number are
methods of `ProcessGroup`). `ProcessGroupNCCL` warns that the on-completion hook is
deprecated in favour of the Flight Recorder since torch 2.6; it still exists in 2.15.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lagscope.producers.torch_monitor import Monitor

log = logging.getLogger("lagscope.torch")

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def device_timing_available(group: Any) -> bool:
    """Whether `group` runs on NCCL and can report device-side collective times."""
    import torch.distributed as dist

    try:
        backend = dist.get_backend(group)
    except (RuntimeError, ValueError):
        return False
    return (
        backend == "nccl"
        and hasattr(group, "_register_on_completion_hook")
        and hasattr(group, "_get_sequence_number_for_group")
    )


class NcclDeviceTimes:
    """Device-side durations of the collectives of the NCCL groups a monitor records."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self._parked: dict[tuple[int, int], tuple[int, int, int, int]] = {}
        self._lock = threading.Lock()
        self._groups: set[int] = set()

    def attach(self, group: Any) -> bool:
        """Start device timing on `group`; False (and nothing done) when it cannot."""
        if id(group) in self._groups:
            return True
        if not device_timing_available(group):
            return False
        if hasattr(group, "_enable_collectives_timing"):
            group._enable_collectives_timing()
        group_id = id(group)
        group._register_on_completion_hook(lambda info: self.completed(group_id, info))
        self._groups.add(group_id)
        return True

    def timed_here(self, group: Any) -> bool:
        return id(group) in self._groups

    def park(self, group: Any, head: tuple[int, int, int, int]) -> None:
        """Right after the collective was issued on `group`: its op waits for the hook."""
        seq = group._get_sequence_number_for_group()
        with self._lock:
            self._parked[id(group), seq] = head

    def completed(self, group_id: int, info: Any) -> None:
        """The group's on-completion hook (watchdog thread)."""
        with self._lock:
            head = self._parked.pop((group_id, info.seq), None)
        if head is None:
            return
        duration_ns = int(info.active_duration / dt.timedelta(microseconds=1)) * 1000
        finished = info.time_finished
        if finished.tzinfo is None:
            finished = finished.astimezone(dt.UTC)
        end_ns = (finished - _EPOCH) // dt.timedelta(microseconds=1) * 1000
        code, step, microbatch, chunk = head
        try:
            self.monitor.timer.record(
                self.monitor.timer.optype_names[code],
                start_ns=end_ns - duration_ns,
                duration_ns=duration_ns,
                step=step,
                microbatch=microbatch,
                chunk=chunk,
            )
        except ValueError as exc:  # never raise into the watchdog thread
            log.warning("lagscope: NCCL completion of seq %d not recorded: %s", info.seq, exc)
