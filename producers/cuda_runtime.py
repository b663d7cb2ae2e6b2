"""Reading finished CUDA events through the CUDA runtime that torch loaded, for the CUDA
timer's resolver thread.

An op timed on the device is two events; the resolver read each with three of torch's
calls (`query` on the end, `elapsed_time` from the reference to the start and from the
start to the end). Idle, a call costs under a µs; while the job runs, the resolver's calls
cost several each: on an H200 (torch 2.11, the GPT of `tests/bench/cuda_bench.py`, ~4
device ops a step, `tests/bench/cuda_threads.py`) ~20 µs of resolver CPU per op, 70-96 µs
a rank-step. Two calls of `cudaEventElapsedTime` per op do the same (the first says
whether the op is done: cudaErrorNotReady while either event is pending, a return code
where torch raises a C++ exception turned into a Python one), with the same readings to
the bit: ~7 µs per op, 35-38 µs a rank-step on the same machine, two runs.

The calls hold the interpreter lock, as torch's do (ctypes' CDLL would release and take it
around each call; it read 1-2 µs a rank-step more). The runtime acts on the calling
thread's current device, and a call on a thread with none initialises device 0's context
there (hundreds of MiB on a GPU the job may not use): `EventReader.bind_thread` makes the
events' device current on the resolver's own thread first; other threads keep torch's
calls.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger("lagscope.timer")

#: cudaErrorNotReady: an event not yet reached on its stream.
_NOT_READY = 600


def cudart_path(maps: Iterable[str]) -> str | None:
    """The CUDA runtime library among a process's mapped files (`/proc/self/maps` lines),
    or None.

    >>> cudart_path(["7f00-7f01 r-xp 0 08:01 12 /opt/venv/nvidia/cu13/lib/libcudart.so.13",
    ...              "7f02-7f03 r--p 0 08:01 13 /usr/lib/libc.so.6"])
    '/opt/venv/nvidia/cu13/lib/libcudart.so.13'
    >>> cudart_path(["7f02-7f03 r--p 0 08:01 13 /usr/lib/libc.so.6"]) is None
    True
    """
    for line in maps:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and "/libcudart.so" in fields[5]:
            return fields[5].strip()
    return None


class EventReader:
    """An op's start (after a reference event) and duration, in ms, read from its two
    events with the runtime's `cudaEventElapsedTime`; None while it is pending."""

    def __init__(self, library: ctypes.CDLL, device: int) -> None:
        self._elapsed = library.cudaEventElapsedTime
        self._elapsed.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p,
                                  ctypes.c_void_p]  # fmt: skip
        self._elapsed.restype = ctypes.c_int
        self._clear_error = library.cudaGetLastError
        self._set_device = library.cudaSetDevice
        self._set_device.argtypes = [ctypes.c_int]
        self._device = device
        self._ms = ctypes.c_float()
        self._ms_out = ctypes.byref(self._ms)

    def bind_thread(self) -> bool:
        """Make the events' device current on the calling thread; False if it failed."""
        return self._set_device(self._device) == 0

    def read(self, reference: Any, start: Any, end: Any) -> tuple[float, float] | None:
        """(start after `reference`, duration) in ms; None while the op is pending. Raises
        RuntimeError on another error of the runtime (the caller then asks torch)."""
        elapsed, out, ms = self._elapsed, self._ms_out, self._ms
        status = elapsed(out, start.cuda_event, end.cuda_event)
        if status == 0:
            duration = ms.value
            status = elapsed(out, reference.cuda_event, start.cuda_event)
            if status == 0:
                return ms.value, duration
        self._clear_error()  # the thread's last error: a pending event is no error
        if status == _NOT_READY:
            return None
        raise RuntimeError(f"cudaEventElapsedTime returned error {status}")


#: How the runtime is called: holding the interpreter lock, as torch's own event calls
#: do (ctypes.CDLL would release and take it again around each call).
_LIBRARY: type[ctypes.CDLL] = ctypes.PyDLL


def event_reader(device: int) -> EventReader | None:
    """A reader over the CUDA runtime this process loaded, or None where there is none to
    find (torch linked it statically, or no `/proc`)."""
    try:
        with open("/proc/self/maps") as maps:
            path = cudart_path(maps)
        if path is None:
            return None
        return EventReader(_LIBRARY(path), device)
    except (OSError, AttributeError) as exc:
        log.debug("lagscope timer: torch's CUDA event calls kept (%s)", exc)
        return None
