"""DP x PP with a hand-written 1F1B schedule: real isend/irecv between stages, a real
data-parallel all-reduce of each stage's gradients, SGD; recorded by `lagscope.torch` only.

Rank r is (dp = r // pp, stage = r % pp). Stage 0 reads its micro-batches from a
DataLoader (input waits recorded), the last stage computes an MSE loss.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tests.torch_jobs.harness import (
    Knobs,
    endless,
    main_for,
    straggler_model,
    synthetic_loader,
)


class Stage:
    """One pipeline stage's forward and backward of a micro-batch, with their p2p."""

    def __init__(self, knobs: Knobs, rank: int, model: Any, batches: Any) -> None:
        import torch

        self.knobs = knobs
        self.rank = rank
        self.model = model
        self.batches = batches
        stage = rank % knobs.pp
        self.first, self.last = stage == 0, stage == knobs.pp - 1
        self.shape = (knobs.batch, knobs.hidden)
        generator = torch.Generator().manual_seed(knobs.seed + 100 + rank // knobs.pp)
        self.targets = [torch.randn(self.shape, generator=generator)
                        for _ in range(knobs.microbatches)]  # fmt: skip
        self.step = 0
        self.sends: list[Any] = []
        self.saved: dict[int, tuple[Any, Any]] = {}
        (Path(knobs.log_dir).parent / "late-sender").mkdir(exist_ok=True)

    def forward(self, m: int) -> None:
        import torch
        import torch.distributed as dist

        if self.first:
            x, _ = next(self.batches)
        else:
            x = torch.empty(self.shape)
            work = dist.irecv(x, self.rank - 1)
            if self.knobs.late(self.rank - 1, self.step):
                self._posted(self.rank, m).write_text(repr(time.time()))
            work.wait()
            x.requires_grad_()
        began = time.perf_counter()
        out = self.model(x)
        self.knobs.host_stall(self.rank, self.step, time.perf_counter() - began, "forward")
        if self.last:
            out = torch.nn.functional.mse_loss(out, self.targets[m])
        else:
            if self.knobs.late(self.rank, self.step):
                self._send_late(m)
            self.sends.append(dist.isend(out.detach(), self.rank + 1))
        self.saved[m] = (x, out)

    def _posted(self, receiver: int, m: int) -> Path:
        return Path(self.knobs.log_dir).parent / "late-sender" / f"{receiver}-{self.step}-{m}"

    def _send_late(self, m: int) -> None:
        """Send `late_ms` after the receiver posted its irecv (it leaves a time stamp in a
        file: no torch.distributed call, so nothing of the handshake is recorded)."""
        posted = self._posted(self.rank + 1, m)
        while not posted.exists() or not posted.read_text():
            time.sleep(0.0005)
        time.sleep(max(0.0, float(posted.read_text()) + self.knobs.late_ms / 1e3 - time.time()))

    def backward(self, m: int) -> None:
        import torch
        import torch.distributed as dist

        x, out = self.saved.pop(m)
        if self.last:
            grad = None
        else:
            grad = torch.empty(self.shape)
            dist.irecv(grad, self.rank + 1).wait()
        began = time.perf_counter()
        out.backward(grad)
        self.knobs.host_stall(self.rank, self.step, time.perf_counter() - began, "backward")
        if not self.first:
            self.sends.append(dist.isend(x.grad, self.rank - 1))

    def one_f_one_b(self, step: int) -> None:
        """Warm-up forwards, then one forward and one backward at a time, then the rest."""
        self.step = self.model.step = step
        n = self.knobs.microbatches
        warmup = min(self.knobs.pp - self.rank % self.knobs.pp - 1, n)
        for m in range(warmup):
            self.forward(m)
        for m in range(n - warmup):
            self.forward(warmup + m)
            self.backward(m)
        for m in range(n - warmup, n):
            self.backward(m)
        for work in self.sends:
            work.wait()
        self.sends.clear()


def all_reduce_grads(params: list[Any], group: Any, size: int) -> None:
    """One data-parallel all-reduce of all gradients, flattened (one op per step)."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


#: Steps left out of the CPU time per step (see the end of `worker`).
CPU_WARM_UP_STEPS = 3


def worker(rank: int, knobs: Knobs) -> None:
    import torch
    import torch.distributed as dist

    pp = knobs.pp
    dp = knobs.world // pp
    stage, dp_rank = rank % pp, rank // pp
    # Every rank creates every group, in the same order (torch.distributed requires it).
    pp_groups = [dist.new_group([d * pp + s for s in range(pp)]) for d in range(dp)]
    dp_groups = [dist.new_group([d * pp + s for d in range(dp)]) for s in range(pp)]
    pp_group, dp_group = pp_groups[dp_rank], dp_groups[stage]
    layers = knobs.layers + (knobs.head_layers if stage == pp - 1 else 0)
    model = straggler_model(knobs, rank, seed=knobs.seed + stage, layers=layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = None
    if stage == 0:
        loader = synthetic_loader(knobs, rank, knobs.microbatches, knobs.seed + dp_rank)
    monitor = knobs.start_monitor(
        modules=[model], optimizer=optimizer, data=loader, dp_group=dp_group, pp_group=pp_group
    )
    runner = Stage(knobs, rank, model, endless(loader) if loader is not None else None)
    params = list(model.parameters())
    step_seconds = []
    cpu_began = monitor_began = 0.0
    for step in range(knobs.steps):
        began = time.perf_counter()
        runner.one_f_one_b(step)
        all_reduce_grads(params, dp_group, dp)
        knobs.host_stall(rank, step, 0.0, "update")
        optimizer.step()
        optimizer.zero_grad()
        knobs.host_stall(rank, step, 0.0, "step")
        step_seconds.append(time.perf_counter() - began)
        if step == CPU_WARM_UP_STEPS - 1:
            cpu_began = time.process_time()
            monitor_began = _monitor_threads_cpu_s()
    # The process's CPU seconds per step once warm: the job's threads and the monitor's (its
    # sealer thread encodes and writes each closed step meanwhile). The first steps carry
    # one-time work: the job's warm-up, and the sealer's first step (its lazy imports, ~80
    # ms) runs during the second.
    counted = max(1, knobs.steps - CPU_WARM_UP_STEPS)
    cpu_per_step = (time.process_time() - cpu_began) / counted
    monitor_cpu_per_step = (_monitor_threads_cpu_s() - monitor_began) / counted
    monitor.close()
    # The job's own step times, for the overhead bench (with and without lagscope).
    times = Path(knobs.log_dir).parent / "step-seconds"
    times.mkdir(exist_ok=True)
    (times / f"rank-{rank}.json").write_text(json.dumps(step_seconds))
    (times / f"rank-{rank}.cpu.json").write_text(json.dumps(cpu_per_step))
    (times / f"rank-{rank}.monitor-threads.json").write_text(json.dumps(monitor_cpu_per_step))


def _monitor_threads_cpu_s() -> float:
    """CPU seconds of lagscope's own threads in this process (the timer's sealer, which
    encodes each closed step, and the log writer): each thread's CPU clock, read directly,
    so the number is not the difference of two noisy runs."""
    import contextlib
    import threading

    total = 0.0
    for thread in threading.enumerate():
        if thread.name.startswith("lagscope-") and thread.ident is not None:
            with contextlib.suppress(OSError):  # ended meanwhile
                total += time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    return total


if __name__ == "__main__":
    main_for(worker, __doc__.splitlines()[0])
