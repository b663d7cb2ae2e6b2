"""A DDP job with several gradient buckets whose straggler is slow in forward, in backward
or in its input; recorded by `lagscope.torch` only (model, optimizer and loader passed once).

DDP overlaps each bucket's all-reduce with the rest of backward and waits for all of them at
its end, so a rank slow only in backward finishes backward with everyone else: the
difference shows in when its buckets are launched.
"""

from __future__ import annotations

import time

from tests.torch_jobs.harness import Knobs, main_for, straggler_model, synthetic_loader

#: Long enough steps (tens of ms) and several gradient buckets.
DEFAULTS = {"layers": 6, "hidden": 512, "batch": 64, "bucket_mb": 1.5}


def worker(rank: int, knobs: Knobs) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(
        straggler_model(knobs, rank, seed=knobs.seed), bucket_cap_mb=knobs.bucket_mb
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = synthetic_loader(knobs, rank, 1, knobs.seed + rank)
    monitor = knobs.start_monitor(model=model, optimizer=optimizer, data=loader)
    step = 0
    while step < knobs.steps:
        for x, y in loader:
            model.module.step = step
            began = time.perf_counter()
            loss = torch.nn.functional.mse_loss(model(x), y)
            knobs.host_stall(rank, step, time.perf_counter() - began, "forward")
            began = time.perf_counter()
            loss.backward()
            knobs.host_stall(rank, step, time.perf_counter() - began, "backward")
            knobs.host_stall(rank, step, 0.0, "update")
            optimizer.step()
            optimizer.zero_grad()
            knobs.host_stall(rank, step, 0.0, "step")
            step += 1
            if step == knobs.steps:
                break
    monitor.close()


if __name__ == "__main__":
    main_for(worker, __doc__.splitlines()[0], **DEFAULTS)
