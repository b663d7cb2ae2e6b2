"""The real DDP and 1F1B jobs of tests/torch_jobs, run unchanged, with what the overhead
bench reads from each rank: its step times, and the CPU of the monitor's own threads.

A global optimizer step post-hook (`torch.optim.optimizer.register_optimizer_step_post_hook`)
stamps the end of every step in both jobs alike, with or without the monitor, so the jobs'
code is not touched. Each rank writes `<log_dir>/../bench/rank-<r>.json`:

- `step_seconds`: the time from each optimizer step's end to the next one's (one per step
  after the first);
- `threads_cpu_s`, `sealed_steps`, `seals`: the CPU seconds of lagscope's threads (named
  `lagscope-*`: the sealer, which encodes and writes the recorded steps), read on their own
  thread CPU clocks, the rank-steps they wrote (batches) and their seals (wakes that wrote),
  from the end of step `WARM_UP_STEPS - 1` to the end of the last step. The CPU per
  rank-step is the first over the second: a direct reading, not the difference of two
  noisy runs, and not skewed by the steps the last seal, at close(), writes on the
  training thread.

Knobs for the bench's experiments, in the ranks' environment (`Knobs.env`):
`BENCH_NICE=19` gives the monitor's thread that nice value once the monitor started;
`BENCH_STRETCH=1` turns off the longer seal interval of a saturated node.
"""

from __future__ import annotations

import contextlib
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


def _lagscope_threads_cpu_s() -> float:
    total = 0.0
    for thread in threading.enumerate():
        if thread.name.startswith("lagscope-") and thread.ident is not None:
            with contextlib.suppress(OSError):  # ended meanwhile
                total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return total


class _Probe:
    """Stamps each optimizer step's end; reads the monitor threads' CPU at two steps."""

    def __init__(self, knobs: Knobs) -> None:
        from torch.optim import optimizer

        self.knobs = knobs
        self.ends: list[float] = []
        self.cpu_at: dict[int, float] = {}
        self.counts_at: dict[int, tuple[int, int]] = {}
        self.nice = os.environ.get("BENCH_NICE")
        if os.environ.get("BENCH_STRETCH"):
            from lagscope.producers import timer

            timer._SATURATED_STRETCH = int(os.environ["BENCH_STRETCH"])
        self.handle = optimizer.register_optimizer_step_post_hook(self._stamp)

    def _stamp(self, *_: Any) -> None:
        self.ends.append(time.perf_counter())
        index = len(self.ends) - 1
        if index == 0 and self.nice:
            self._renice(int(self.nice))
        if index in (WARM_UP_STEPS - 1, self.knobs.steps - 1):
            self.cpu_at[index] = _lagscope_threads_cpu_s()
            self.counts_at[index] = _sealer_counts()

    @staticmethod
    def _renice(nice: int) -> None:
        for thread in threading.enumerate():
            if thread.name.startswith("lagscope-") and thread.native_id is not None:
                os.setpriority(os.PRIO_PROCESS, thread.native_id, nice)

    def write(self, rank: int) -> None:
        self.handle.remove()
        first, last = WARM_UP_STEPS - 1, self.knobs.steps - 1
        (batches_0, seals_0), (batches_1, seals_1) = (
            self.counts_at.get(first, (0, 0)), self.counts_at.get(last, (0, 0))
        )  # fmt: skip
        out = Path(self.knobs.log_dir).parent / "bench"
        out.mkdir(exist_ok=True)
        (out / f"rank-{rank}.json").write_text(json.dumps({
            "step_seconds": [b - a for a, b in zip(self.ends, self.ends[1:], strict=False)],
            "threads_cpu_s": self.cpu_at.get(last, 0.0) - self.cpu_at.get(first, 0.0),
            "sealed_steps": batches_1 - batches_0,
            "seals": seals_1 - seals_0,
        }))  # fmt: skip


def _sealer_counts() -> tuple[int, int]:
    """(rank-steps sealed, seals) of this process' monitor so far."""
    from lagscope.producers import torch_comm

    monitor = torch_comm._monitor
    if monitor is None:
        return 0, 0
    return monitor.timer.steps_sealed, int(getattr(monitor.timer, "seals", 0))


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
