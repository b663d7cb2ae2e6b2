"""The real DDP and 1F1B jobs of tests/torch_jobs, run unchanged, with what the overhead
bench reads from each rank: its step times, and the CPU of the monitor's own threads.

A global optimizer step post-hook (`torch.optim.optimizer.register_optimizer_step_post_hook`)
stamps the end of every step in both jobs alike, with or without the monitor, so the jobs'
code is not touched. Each rank writes `<log_dir>/../bench/rank-<r>.json`:

- `step_seconds`: the time from each optimizer step's end to the next one's (one per step
  after the first);
- `step_cpu_seconds`: the same on the training thread's CPU clock (the hook runs on it):
  what each step cost the thread that runs the job, the monitor's recording included,
  robust to what other processes do to the wall clock;
- `threads_cpu_s`, `sealed_steps`, `seals`: the CPU seconds of lagscope's threads (named
  `lagscope-*`: the sealer, which encodes and writes the recorded steps), read on their own
  thread CPU clocks, the rank-steps they wrote (batches) and their seals (wakes that wrote),
  from the end of step `WARM_UP_STEPS - 1` to the end of the last step. The CPU per
  rank-step is the first over the second: a direct reading, not the difference of two
  noisy runs, and not skewed by the steps the last seal, at close(), writes on the
  training thread.
- `step_changes`: the times the rank's step time changed in those steps (each starts or
  re-arms a prompt spell of hand-overs, `producers/step_change.py`).
- `threads_gc_s`: of that, the CPU of garbage collections that ran on those threads.
  CPython runs a scheduled collection on whichever thread next checks for pending work,
  so the job's own garbage is often collected on the sealer's thread just after it takes
  the interpreter lock (in a 1F1B run, one young collection every seal and now and then a
  1.6 ms older one): work the job would do anyway, which the monitor's own CPU leaves out.

Knobs for the bench's experiments, in the ranks' environment (`Knobs.env`):
`BENCH_NICE=19` gives the monitor's thread that nice value once the monitor started;
`BENCH_STRETCH=1` turns off the longer seal interval of a saturated node.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from tests.torch_jobs import ddp, pipeline_1f1b
from tests.torch_jobs.harness import Knobs

#: Steps left out of the monitor threads' CPU (start-up: the first seals' one-time work).
WARM_UP_STEPS = 3


def lagscope_threads_cpu() -> dict[str, float]:
    """The CPU seconds of lagscope's threads (named `lagscope-*`) on their own thread
    clocks, by name less the rank (`lagscope-sealer`, `lagscope-cuda-timer`)."""
    found: dict[str, float] = {}
    for thread in threading.enumerate():
        if thread.name.startswith("lagscope-") and thread.ident is not None:
            with contextlib.suppress(OSError):  # ended meanwhile
                cpu = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
                name = thread.name.rstrip("-0123456789")
                found[name] = found.get(name, 0.0) + cpu
    return found


def _lagscope_threads_cpu_s() -> float:
    return sum(lagscope_threads_cpu().values())


class _Probe:
    """Stamps each optimizer step's end; reads the monitor threads' CPU at two steps, and
    the CPU of the collections that ran on them between those steps."""

    def __init__(self, knobs: Knobs) -> None:
        from torch.optim import optimizer

        self.knobs = knobs
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []
        self.cpu_at: dict[int, float] = {}
        self.counts_at: dict[int, tuple[int, int]] = {}
        self.nice = os.environ.get("BENCH_NICE")
        if os.environ.get("BENCH_STRETCH"):
            from lagscope.producers import timer

            timer._SATURATED_STRETCH = int(os.environ["BENCH_STRETCH"])
        self.handle = optimizer.register_optimizer_step_post_hook(self._stamp)
        self.gc_s = 0.0
        self._gc_began: float | None = None
        self._counting_gc = False
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, _: dict[str, int]) -> None:
        if not self._counting_gc or not threading.current_thread().name.startswith("lagscope-"):
            return
        if phase == "start":
            self._gc_began = time.thread_time()
        elif self._gc_began is not None:
            self.gc_s += time.thread_time() - self._gc_began
            self._gc_began = None

    def _stamp(self, *_: Any) -> None:
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.thread_time())
        index = len(self.ends) - 1
        if index == 0 and self.nice:
            self._renice(int(self.nice))
        if index in (WARM_UP_STEPS - 1, self.knobs.steps - 1):
            self.cpu_at[index] = _lagscope_threads_cpu_s()
            self.counts_at[index] = _sealer_counts()
            self._counting_gc = index == WARM_UP_STEPS - 1

    @staticmethod
    def _renice(nice: int) -> None:
        for thread in threading.enumerate():
            if thread.name.startswith("lagscope-") and thread.native_id is not None:
                os.setpriority(os.PRIO_PROCESS, thread.native_id, nice)

    def write(self, rank: int) -> None:
        self.handle.remove()
        gc.callbacks.remove(self._on_gc)
        first, last = WARM_UP_STEPS - 1, self.knobs.steps - 1
        (batches_0, seals_0, changes_0), (batches_1, seals_1, changes_1) = (
            self.counts_at.get(first, (0, 0, 0)), self.counts_at.get(last, (0, 0, 0))
        )  # fmt: skip
        out = Path(self.knobs.log_dir).parent / "bench"
        out.mkdir(exist_ok=True)
        (out / f"rank-{rank}.json").write_text(json.dumps({
            "step_seconds": [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)],
            "step_cpu_seconds": [
                b - a for a, b in zip(self.cpu_ends, self.cpu_ends[1:], strict=False)
            ],
            "threads_cpu_s": self.cpu_at.get(last, 0.0) - self.cpu_at.get(first, 0.0),
            "threads_gc_s": self.gc_s,
            "sealed_steps": batches_1 - batches_0,
            "seals": seals_1 - seals_0,
            "step_changes": changes_1 - changes_0,
        }))  # fmt: skip


def _sealer_counts() -> tuple[int, int, int]:
    """(rank-steps sealed, seals, step changes) of this process' monitor so far."""
    from lagscope.producers import torch_comm

    monitor = torch_comm._monitor
    if monitor is None:
        return 0, 0, 0
    timer = monitor.timer
    return (timer.steps_sealed, int(getattr(timer, "seals", 0)),
            int(getattr(timer, "step_changes", 0)))  # fmt: skip


def ddp_worker(rank: int, knobs: Knobs) -> None:
    probe = _Probe(knobs)
    ddp.worker(rank, knobs)
    probe.write(rank)


def pipeline_worker(rank: int, knobs: Knobs) -> None:
    probe = _Probe(knobs)
    pipeline_1f1b.worker(rank, knobs)
    probe.write(rank)


#: name -> (worker, the job's own defaults)
JOBS = {
    "DDP": (ddp_worker, ddp.DEFAULTS),
    "1F1B": (pipeline_worker, {}),
}
