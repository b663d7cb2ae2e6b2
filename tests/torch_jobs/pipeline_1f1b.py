"""DP x PP with a hand-written 1F1B schedule: real isend/irecv between stages, a real
data-parallel all-reduce of each stage's gradients, SGD; recorded by `lagscope.torch` only.

Rank r is (dp = r // pp, stage = r % pp). Stage 0 reads its micro-batches from a
DataLoader (input waits recorded), the last stage computes an MSE loss.
"""

from __future__ import annotations

import time
from typing import Any

from tests.torch_jobs.harness import (
    Knobs,
    endless,
    main_for,
    straggler_model,
    synthetic_loader,
)


def worker(rank: int, knobs: Knobs) -> None:
    import torch
    import torch.distributed as dist

    import lagscope.torch

    pp = knobs.pp
    dp = knobs.world // pp
    stage, dp_rank = rank % pp, rank // pp
    # Every rank creates every group, in the same order (torch.distributed requires it).
    pp_groups = [dist.new_group([d * pp + s for s in range(pp)]) for d in range(dp)]
    dp_groups = [dist.new_group([d * pp + s for d in range(dp)]) for s in range(pp)]
    pp_group, dp_group = pp_groups[dp_rank], dp_groups[stage]
    model = straggler_model(knobs, rank, seed=knobs.seed + stage)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    first, last = stage == 0, stage == pp - 1
    loader = synthetic_loader(knobs, rank, knobs.microbatches, knobs.seed + dp_rank) if first else None

    monitor = lagscope.torch.monitor(
        modules=[model], optimizer=optimizer, data=loader, dp_group=dp_group,
        pp_group=pp_group, **knobs.monitor_kwargs(),
    )  # fmt: skip
    batches = endless(loader) if first else None
    previous, following = rank - 1, rank + 1
    shape = (knobs.batch, knobs.hidden)
    target_gen = torch.Generator().manual_seed(knobs.seed + 100 + dp_rank)
    targets = [torch.randn(shape, generator=target_gen) for _ in range(knobs.microbatches)]

    for step in range(knobs.steps):
        model.step = step
        sends: list[Any] = []
        saved: dict[int, tuple[Any, Any]] = {}

        def forward(m: int) -> None:
            if first:
                x, _ = next(batches)
            else:
                x = torch.empty(shape)
                dist.irecv(x, previous).wait()
                x.requires_grad_()
            out = model(x)
            if last:
                out = torch.nn.functional.mse_loss(out, targets[m])
            else:
                if knobs.late(rank, step):
                    time.sleep(knobs.late_ms / 1e3)
                sends.append(dist.isend(out.detach(), following))
            saved[m] = (x, out)

        def backward(m: int) -> None:
            x, out = saved.pop(m)
            if last:
                out.backward()
            else:
                grad = torch.empty(shape)
                dist.irecv(grad, following).wait()
                out.backward(grad)
            if not first:
                sends.append(dist.isend(x.grad, previous))

        warmup = min(pp - stage - 1, knobs.microbatches)
        for m in range(warmup):
            forward(m)
        for m in range(knobs.microbatches - warmup):
            forward(warmup + m)
            backward(m)
        for m in range(knobs.microbatches - warmup, knobs.microbatches):
            backward(m)
        for work in sends:
            work.wait()
        grads = [p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=dp_group)
        flat /= dp
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()


if __name__ == "__main__":
    main_for(worker, __doc__.splitlines()[0])
