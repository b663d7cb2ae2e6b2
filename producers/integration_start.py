"""What every framework integration does to start recording a rank, written once.

`lagscope.torch.monitor()` (`producers.torch_setup`, `producers.torch_monitor`) and
`lagscope.megatron.monitor()` (`producers.megatron_adapter`) read the job's layout each in
their own way; from there on they start alike:

- the job id every rank shares and the local log directory: given, else from the
  environment, else a ValueError saying how to give them;
- the job record: the layout's sizes and this rank's identity (host, GPU, node, pod);
- this rank's `OpTimer`, in the lighter "off" mode on the ranks the analysis does not
  read (all but TP/CP rank 0 of each (dp, pp) worker);
- at the process's exit, a moment with the interpreter lock released (below).

Each announces its start first (`announce_start`): the automatic monitor of `lagscope
launch` (`producers.auto_monitor`) gives way to a monitor the job starts itself.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal

from lagscope.producers.events import JobInfo
from lagscope.producers.timer import OpTimer
from lagscope.producers.torch_layout import Layout, job_id_from_environment, job_info, rank_identity

#: Called with the API's name before a monitor starts in this process.
_start_listeners: list[Callable[[str], None]] = []


def listen_for_starts(listener: Callable[[str], None]) -> None:
    """Have `listener(api)` called before any monitor of this process starts."""
    _start_listeners.append(listener)


def announce_start(api: str) -> None:
    """A monitor of `api` ("lagscope.torch.monitor", ...) is about to start."""
    for listener in list(_start_listeners):
        listener(api)


def job_and_log_dir(
    api: str, job_id: str | None, log_dir: str | Path | None
) -> tuple[str, str | Path]:
    """The job id and the local log directory: given, else from the environment; a
    ValueError naming `api` (the call the job made) and how to give them otherwise."""
    job_id = job_id or job_id_from_environment()
    if not job_id:
        raise ValueError(
            f"{api} needs a job id shared by every rank: pass job_id= or set "
            "LAGSCOPE_JOB_ID (torchrun's run id and SLURM_JOB_ID are used when set)"
        )
    log_dir = log_dir or os.environ.get("LAGSCOPE_LOG_DIR")
    if not log_dir:
        raise ValueError(
            f"{api} needs a local log directory: pass log_dir= or set LAGSCOPE_LOG_DIR"
        )
    return job_id, log_dir


def rank_job_info(
    layout: Layout,
    *,
    job_id: str,
    attempt: int,
    model_flops_per_step: float | None = None,
    gpu_peak_flops: float | None = None,
) -> JobInfo:
    """The job record as this rank writes it: the layout, this rank's machine, and the
    job's FLOPs per step and GPU peak where the job gives them (for MFU)."""
    info = job_info(layout, job_id=job_id, attempt=attempt, identity=rank_identity(layout))
    mfu = {"model_flops_per_step": model_flops_per_step, "gpu_peak_flops": gpu_peak_flops}
    if any(value is not None for value in mfu.values()):
        info = info.model_copy(update=mfu)
    return info


def rank_timer(
    layout: Layout,
    info: JobInfo,
    log_dir: str | Path,
    *,
    mode: Literal["auto", "host", "cuda"],
    gc_probe: bool,
    extra_optypes: Iterable[str] = (),
) -> OpTimer:
    """This rank's timer, writing `info` first; off on ranks that are not their (dp, pp)
    worker's representative. Its GC probe starts paused: the integration resumes it for
    the steps it records (a pause in a step no other rank reports would make a step of
    its own)."""
    timer = OpTimer(
        job_id=info.job_id,
        attempt=info.attempt,
        rank=layout.rank,
        dp_rank=layout.coords["dp"],
        pp_rank=layout.coords["pp"],
        tp_rank=layout.coords["tp"],
        cp_rank=layout.coords["cp"],
        log_dir=log_dir,
        mode=mode if layout.is_representative else "off",
        extra_optypes=extra_optypes,
        gc_probe=gc_probe,
        job_info=info,
    )
    timer.gc_paused = True
    _release_the_interpreter_at_exit()
    return timer


#: How long the interpreter lock is left free at exit: a thread waiting for it wakes in
#: well under a millisecond on an idle core; this leaves room for a loaded one.
EXIT_GRACE_S = 0.05
#: The most the exit waits for the timers' callbacks still in flight (a collective that
#: never completes must not hold the job's end for long).
EXIT_WAIT_MAX_S = 2.0
_exit_grace_registered = False


class CallbacksInFlight:
    """How many of this process' timer callbacks wait on a backend thread (a collective's
    future, which gloo completes on its own thread): the exit waits for them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def add(self) -> None:
        with self._lock:
            self._count += 1

    def done(self) -> None:
        with self._lock:
            self._count -= 1

    def wait(self, timeout_s: float) -> bool:
        """Wait, the interpreter lock free, until none is in flight or `timeout_s` passed;
        whether none is.

        >>> in_flight = CallbacksInFlight()
        >>> in_flight.add()
        >>> in_flight.wait(0.01)
        False
        >>> in_flight.done()
        >>> in_flight.wait(0.01)
        True
        """
        deadline = time.monotonic() + timeout_s
        while self._count and time.monotonic() < deadline:
            time.sleep(0.002)
        return not self._count


#: The callbacks in flight of every monitor of this process.
CALLBACKS_IN_FLIGHT = CallbacksInFlight()


def _release_the_interpreter_at_exit() -> None:
    """Free the interpreter lock for a moment before Python finalizes, once per process.

    torch's backend threads (gloo's work loop, NCCL's watchdog) drop their last reference
    to a finished work, and to its Python callbacks, on their own thread, which needs the
    lock. A job that exits right after its last collective keeps the lock from the work's
    completion to finalization; the thread then asks for it while Python finalizes, is
    ended by CPython inside a C++ noexcept frame, and the process dies in std::terminate
    ("terminate called without an active exception", SIGABRT), after the job did all its
    work and lagscope wrote its log. The README's job without lagscope did so in 7 of 40
    runs on gloo (torch 2.15, CPU), with lagscope in 4 of 30; with this wait, 0 of 40. On
    a loaded machine a collective the job never waited on may complete later than that:
    the exit first waits for the timers' callbacks still in flight (`CALLBACKS_IN_FLIGHT`).
    atexit handlers run before finalization, with every object still alive."""
    global _exit_grace_registered
    if not _exit_grace_registered:
        _exit_grace_registered = True
        atexit.register(_grace_at_exit)


def _grace_at_exit() -> None:
    CALLBACKS_IN_FLIGHT.wait(EXIT_WAIT_MAX_S)
    time.sleep(EXIT_GRACE_S)
