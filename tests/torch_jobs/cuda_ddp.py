"""A small GPT trained with DDP on a CUDA device, recorded by `lagscope.torch` in CUDA mode,
whose straggler is slow on its device (forward or backward), in its host (a stall between
launches, the device's work unchanged) or in its input; each rank also times its own
forward and backward with CUDA events of its own, so what lagscope recorded can be checked
against the job's own clock.

Every rank runs on the machine's first GPU: gloo carries DDP's CUDA gradients (NCCL
refuses two ranks on one device), and a job of one rank runs NCCL (`--backend nccl`), so
that DDP's buckets go through ProcessGroupNCCL. The ranks then share the device's time
slices: an op can wait for another rank's kernels, as on a GPU shared with other work.

How the straggler is made, by `(slow_factor - 1)` times the rank's own time of the op in
the steps before the slow window (measured by its events, read after the step's
`loss.item()`, the sync a training loop's logging makes anyway):

- forward, backward: `torch.cuda._sleep` (a kernel that spins for a number of the GPU's
  clock cycles, calibrated on this rank at start) queued on the op's own stream, inside the
  forward (after the blocks) or inside the backward (between the last block and the first,
  through an autograd function), so the op takes that much longer on the device and
  nothing else changes;
- host: `time.sleep` on the host after forward and after backward returned, of
  `(slow_factor - 1)` times half a step (a stall shorter than the work already queued on
  the device is hidden by it: a GPU job's host runs ahead of its device);
- input: the data loader's collate sleeps `(slow_factor - 1)` times a step.

On a CPU (`--device cpu`, for the harness's own tests) the device's stalls are host sleeps.
Each rank writes `<log_dir>/../truth/rank-<r>.json`: per step, its own forward time (ms:
from the first line of the model's `forward` to its last, what lagscope's forward wrapper
times around it), its backward time (around `loss.backward()`, DDP's wait for the last
bucket included), the step's wall time (s), and the stall it planted.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from pathlib import Path
from typing import Any

from tests.torch_jobs.harness import Knobs, endless, main_for, make_straggler_function

#: A job of a few tens of ms per step on one H200 shared by four ranks, with a gradient of
#: about 17 MB per rank (gloo moves it through host memory).
DEFAULTS = {
    "device": "cuda",
    "timer_mode": "cuda",
    "hidden": 256,
    "layers": 4,
    "batch": 16,
    "bucket_mb": 4.0,
    "steps": 40,
}
#: Vocabulary size, attention heads.
VOCAB = 4096
HEADS = 4
#: Steps whose times make the baseline the straggler's stalls are scaled by: after the
#: first steps (CUDA's and DDP's warm-up), before the slow window.
BASELINE_FROM = 3


class Plan:
    """The rank's planted stalls, scaled by its own op times before the slow window."""

    def __init__(self, knobs: Knobs, rank: int) -> None:
        self.knobs = knobs
        self.rank = rank
        self.cycles_per_ms = 0.0
        self.forward_ms: list[float] = []
        self.backward_ms: list[float] = []
        self.step_s: list[float] = []
        self.planted_ms: list[float] = []
        self._baseline: dict[str, float] | None = None

    def baseline(self) -> dict[str, float]:
        """Median forward, backward (ms) and step (s) of the steps before the slow window."""
        if self._baseline is None:
            last = max(BASELINE_FROM + 1, min(self.knobs.slow_start, len(self.step_s)))
            window = slice(BASELINE_FROM, last)
            self._baseline = {
                "forward_ms": statistics.median(self.forward_ms[window]),
                "backward_ms": statistics.median(self.backward_ms[window]),
                "step_ms": statistics.median(self.step_s[window]) * 1e3,
            }
        return self._baseline

    def extra_ms(self, step: int, phase: str) -> float:
        """The stall planted in `phase` of `step` (0 outside the straggler's window)."""
        if not self.knobs.slow(self.rank, step, phase) or len(self.step_s) <= BASELINE_FROM:
            return 0.0
        factor = self.knobs.slow_factor - 1.0
        base = self.baseline()
        return (
            factor
            * {
                "forward": base["forward_ms"],
                "backward": base["backward_ms"],
                "host": base["step_ms"] / 2,
                "input": base["step_ms"],
            }[phase]
        )

    def write(self, log_dir: str) -> None:
        out = Path(log_dir).parent / "truth"
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank-{self.rank}.json").write_text(json.dumps({
            "forward_ms": self.forward_ms, "backward_ms": self.backward_ms,
            "step_s": self.step_s, "planted_ms": self.planted_ms,
            "cycles_per_ms": self.cycles_per_ms,
        }))  # fmt: skip


def device_stall(torch: Any, plan: Plan, ms: float) -> None:
    """`ms` more of device time on the current stream (a host sleep on a CPU)."""
    if ms <= 0:
        return
    if plan.knobs.device == "cuda":
        torch.cuda._sleep(round(ms * plan.cycles_per_ms))
    else:
        time.sleep(ms / 1e3)


def calibrate(torch: Any, plan: Plan) -> None:
    """The GPU's clock cycles per ms as `torch.cuda._sleep` spins them, measured by this
    rank alone (the ranks take turns: they share the device's time slices)."""
    import torch.distributed as dist

    if plan.knobs.device != "cuda":
        return
    for turn in range(dist.get_world_size()):
        if turn == dist.get_rank():
            cycles, best = 20_000_000, float("inf")
            for _ in range(3):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(cycles)
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end))
            plan.cycles_per_ms = cycles / best
        dist.barrier()


class _Marks:
    """The job's own clock for forward and backward: CUDA events (perf_counter on a CPU)."""

    def __init__(self, torch: Any, device: str) -> None:
        self.cuda = device == "cuda"
        self.torch = torch
        self.marks: dict[str, Any] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            event = self.torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks[name] = event
        else:
            self.marks[name] = time.perf_counter()

    def ms(self, first: str, second: str) -> float:
        a, b = self.marks[first], self.marks[second]
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def make_model(torch: Any, knobs: Knobs, plan: Plan) -> Any:
    """A causal transformer language model (tied embedding and head) whose forward and
    backward the plan can make slower on the device."""

    straggle = make_straggler_function()

    class TinyGPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(knobs.seed)
            self.embed = torch.nn.Embedding(VOCAB, knobs.hidden)
            self.blocks = torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(
                    knobs.hidden,
                    HEADS,
                    4 * knobs.hidden,
                    dropout=0.0,
                    batch_first=True,
                    norm_first=True,
                )
                for _ in range(knobs.layers)
            )
            self.norm = torch.nn.LayerNorm(knobs.hidden)
            self.step = 0
            #: The job's own clock for its forward, the interval lagscope's forward wrapper
            #: times: from the first line of `forward` to its last.
            self.marks: _Marks | None = None
            self.register_buffer(
                "causal", torch.nn.Transformer.generate_square_subsequent_mask(knobs.seq),
                persistent=False,
            )  # fmt: skip

        def forward(self, tokens: Any) -> Any:
            if self.marks is not None:
                self.marks.mark("f0")
            x = self.embed(tokens)
            backward_ms = plan.extra_ms(self.step, "backward")
            for i, block in enumerate(self.blocks):
                x = block(x, src_mask=self.causal, is_causal=True)
                if i == 0 and backward_ms:
                    # between the last block's backward and the first's: inside backward
                    x = straggle.apply(x, functools.partial(device_stall, torch, plan, backward_ms))
            device_stall(torch, plan, plan.extra_ms(self.step, "forward"))
            logits = self.norm(x) @ self.embed.weight.t()
            if self.marks is not None:
                self.marks.mark("f1")
            return logits

    return TinyGPT()


def token_loader(knobs: Knobs, plan: Plan) -> Any:
    """A real DataLoader over random token sequences; its collate stalls an input
    straggler's steps."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset, default_collate

    generator = torch.Generator().manual_seed(knobs.seed + plan.rank)
    tokens = torch.randint(0, VOCAB, (knobs.batch * 4, knobs.seq + 1), generator=generator)
    data = TensorDataset(tokens)
    fetched = [0]

    def collate(items: Any) -> Any:
        step = fetched[0]
        fetched[0] += 1
        stall = plan.extra_ms(step, "input")
        if stall:
            time.sleep(stall / 1e3)
        return default_collate(items)

    return DataLoader(data, batch_size=knobs.batch, shuffle=False, drop_last=True,
                      collate_fn=collate)  # fmt: skip


def worker(rank: int, knobs: Knobs) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    device = torch.device("cuda", 0) if knobs.device == "cuda" else torch.device("cpu")
    plan = Plan(knobs, rank)
    calibrate(torch, plan)
    model = make_model(torch, knobs, plan).to(device)
    # The causal mask is a constant buffer: no broadcast of it before every forward.
    ddp = DistributedDataParallel(
        model, device_ids=[0] if knobs.device == "cuda" else None,
        bucket_cap_mb=knobs.bucket_mb, broadcast_buffers=False,
    )  # fmt: skip
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    loader = token_loader(knobs, plan)
    monitor = knobs.start_monitor(model=ddp, optimizer=optimizer, data=loader)
    marks = model.marks = _Marks(torch, knobs.device)
    autocast = torch.autocast(knobs.device, dtype=torch.bfloat16, enabled=knobs.device == "cuda")
    step = 0
    began = time.perf_counter()
    for (batch,) in endless(loader):
        batch = batch.to(device, non_blocking=True)
        tokens, targets = batch[:, :-1], batch[:, 1:]
        model.step = step
        host_stall = plan.extra_ms(step, "host") / 1e3
        with autocast:
            logits = ddp(tokens)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        time.sleep(host_stall)
        marks.mark("b0")
        loss.backward()
        marks.mark("b1")
        time.sleep(host_stall)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()  # the job's own logging: the sync of a step
        plan.forward_ms.append(marks.ms("f0", "f1"))
        plan.backward_ms.append(marks.ms("b0", "b1"))
        now = time.perf_counter()
        plan.step_s.append(now - began)
        began = now
        plan.planted_ms.append(
            sum(plan.extra_ms(step, phase) for phase in ("forward", "backward", "input"))
            + 2e3 * host_stall
        )
        step += 1  # noqa: SIM113 (the loader is endless: the step count ends the loop)
        if step == knobs.steps:
            break
    monitor.close()
    plan.write(knobs.log_dir)


if __name__ == "__main__":
    main_for(worker, __doc__.splitlines()[0], **DEFAULTS)
