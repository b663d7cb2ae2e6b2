"""A small real torch.distributed job recorded with torch.profiler, one trace per rank.

Four processes on CPU (gloo, 127.0.0.1): 2 pipeline stages x 2 data-parallel replicas
(rank = stage * dp_size + dp, Megatron's order). Each step runs a 1F1B schedule of
`microbatches` (Megatron's order, its sends and receives posted in pairs), all-reduces the
gradients over the DP group and takes an SGD step; `prof.step()` marks every step (the
first is the profiler's warm-up and is not recorded). The rank named `--slow-rank` spins
as long again as its own forward, and 10 ms more, in every forward, so the analysis has a
straggler to find.

    python -m tests.torch_profiler.pipeline_job --out DIR [--steps 4] [--slow-rank 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DP, PP = 2, 2
HIDDEN, BATCH = 64, 16
#: What the slow rank adds to every forward on top of doubling it: a loaded machine
#: (two cores, four ranks) must not hide the straggler.
SLOW_EXTRA_S = 0.01


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, port: int, out: str, steps: int, microbatches: int, slow: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=DP * PP
    )
    stage = rank // DP
    dp_group = None
    for s in range(PP):
        group = dist.new_group([s * DP + d for d in range(DP)])
        if s == stage:
            dp_group = group
    model = torch.nn.Sequential(
        torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    prev_rank = rank - DP if stage > 0 else None
    next_rank = rank + DP if stage < PP - 1 else None

    def exchange(send: tuple | None = None, recv: tuple | None = None) -> None:
        """Post a send and a receive together and wait for both, as Megatron's p2p
        helpers do (batch_isend_irecv): two neighbours that both block in a send would
        wait for each other forever."""
        ops = []
        if send is not None:
            ops.append(dist.P2POp(dist.isend, *send))
        if recv is not None:
            ops.append(dist.P2POp(dist.irecv, *recv))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def forward(mb: int, x: torch.Tensor | None, inputs: dict, outputs: dict) -> torch.Tensor:
        if x is None:
            x = torch.randn(BATCH, HIDDEN)
        x.requires_grad_(prev_rank is not None)
        began = time.perf_counter()
        y = model(x)
        if next_rank is None:
            y = y.pow(2).mean()
        if rank == slow:
            # Spun, not slept: a sleeping rank hands its core to the others on a loaded
            # machine, and the job's steps then lose nothing to it.
            until = time.perf_counter() + (time.perf_counter() - began) + SLOW_EXTRA_S
            while time.perf_counter() < until:
                pass
        inputs[mb], outputs[mb] = x, y
        return y

    def backward(mb: int, grad: torch.Tensor | None, inputs: dict, outputs: dict):
        y = outputs.pop(mb)
        y.backward(grad)
        return inputs.pop(mb).grad

    def buffer() -> torch.Tensor:
        return torch.empty(BATCH, HIDDEN)

    def one_step() -> None:
        """Megatron's non-interleaved 1F1B: warm-up forwards, steady 1F1B, cool-down."""
        inputs: dict = {}
        outputs: dict = {}
        warmup = min(PP - stage - 1, microbatches)
        steady = microbatches - warmup
        for mb in range(warmup):
            x = None
            if prev_rank is not None:
                x = buffer()
                exchange(recv=(x, prev_rank))
            y = forward(mb, x, inputs, outputs)
            exchange(send=(y.detach(), next_rank) if next_rank is not None else None)
        x = None
        if steady and prev_rank is not None:
            x = buffer()
            exchange(recv=(x, prev_rank))
        for i in range(steady):
            y = forward(warmup + i, x, inputs, outputs)
            grad = None
            if next_rank is not None:
                grad = buffer()
                exchange(send=(y.detach(), next_rank), recv=(grad, next_rank))
            dx = backward(i, grad, inputs, outputs)
            last = i == steady - 1
            x = None if last or prev_rank is None else buffer()
            send = (dx, prev_rank) if prev_rank is not None else None
            exchange(send=send, recv=(x, prev_rank) if x is not None else None)
        for mb in range(steady, microbatches):
            grad = buffer()
            exchange(recv=(grad, next_rank))
            dx = backward(mb, grad, inputs, outputs)
            exchange(send=(dx, prev_rank) if prev_rank is not None else None)
        for p in model.parameters():
            dist.all_reduce(p.grad, group=dp_group)
        optimizer.step()
        optimizer.zero_grad()

    trace_file = Path(out) / f"rank{rank}.pt.trace.json"
    # A schedule is what makes prof.step() record the ProfilerStep#N markers; the first
    # step is the profiler's warm-up and is not recorded.
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        schedule=torch.profiler.schedule(wait=0, warmup=1, active=steps),
        on_trace_ready=lambda p: p.export_chrome_trace(str(trace_file)),
    ) as prof:
        for _ in range(steps + 1):
            one_step()
            prof.step()
    dist.destroy_process_group()


def record(out: Path, *, steps: int = 4, microbatches: int = 4, slow_rank: int = -1) -> None:
    """Run the job and leave one Chrome trace per rank in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(
        _rank_main,
        args=(_free_port(), str(out), steps, microbatches, slow_rank),
        nprocs=DP * PP,
        join=True,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--slow-rank", type=int, default=-1)
    args = parser.parse_args()
    record(args.out, steps=args.steps, microbatches=args.microbatches, slow_rank=args.slow_rank)
