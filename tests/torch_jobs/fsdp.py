"""An FSDP2 job (`torch.distributed.fsdp.fully_shard` per block and on the root, gloo on
CPU): every block's parameters are all-gathered before its forward and again before its
backward (resharded after forward, FSDP2's default), its gradients reduce-scattered after
its backward; recorded by `lagscope.torch` only (model, optimizer and loader passed once).
"""

from __future__ import annotations

from tests.torch_jobs.harness import Knobs, main_for, straggler_model, synthetic_loader

DEFAULTS = {"layers": 3, "hidden": 128, "batch": 16}


def worker(rank: int, knobs: Knobs) -> None:
    import torch
    from torch.distributed.fsdp import fully_shard

    model = straggler_model(knobs, rank, seed=knobs.seed)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = synthetic_loader(knobs, rank, 1, knobs.seed + rank)
    monitor = knobs.start_monitor(model=model, optimizer=optimizer, data=loader)
    step = 0
    while step < knobs.steps:
        for x, y in loader:
            model.step = step
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == knobs.steps:
                break
    monitor.close()


if __name__ == "__main__":
    main_for(worker, __doc__.splitlines()[0], **DEFAULTS)
