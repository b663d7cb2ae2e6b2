"""DP x PP through `torch.distributed.pipelining` (GPipe, 1F1B or interleaved 1F1B with two
model chunks per rank), recorded by `lagscope.torch.monitor(pipeline=schedule, ...)` only.

Rank r is (dp = r // pp, pipeline rank = r % pp); pipeline rank p holds stages p (and
p + pp when interleaved). Gradients are all-reduced over the data-parallel group after each
schedule step, then SGD.
"""

from __future__ import annotations

from tests.torch_jobs.harness import Knobs, endless, main_for, straggler_model, synthetic_loader
from tests.torch_jobs.pipeline_1f1b import all_reduce_grads


def worker(rank: int, knobs: Knobs) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining

    pp = knobs.pp
    dp = knobs.world // pp
    pp_rank, dp_rank = rank % pp, rank // pp
    pp_groups = [dist.new_group([d * pp + s for s in range(pp)]) for d in range(dp)]
    dp_groups = [dist.new_group([d * pp + s for d in range(dp)]) for s in range(pp)]
    pp_group, dp_group = pp_groups[dp_rank], dp_groups[pp_rank]
    chunks = 2 if knobs.schedule == "interleaved" else 1
    n_stages = pp * chunks
    modules, stages = [], []
    for chunk in range(chunks):
        index = chunk * pp + pp_rank
        module = straggler_model(knobs, rank, seed=knobs.seed + index)
        modules.append(module)
        stages.append(
            pipelining.PipelineStage(
                module, index, n_stages, torch.device("cpu"),
                group=pp_group,
            )
        )  # fmt: skip

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(output, target)

    m = knobs.microbatches
    if knobs.schedule == "gpipe":
        schedule = pipelining.ScheduleGPipe(stages[0], m, loss_fn=loss_fn)
    elif knobs.schedule == "1f1b":
        schedule = pipelining.Schedule1F1B(stages[0], m, loss_fn=loss_fn)
    elif knobs.schedule == "interleaved":
        schedule = pipelining.ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
    else:
        raise ValueError(f"unknown --schedule {knobs.schedule!r}: gpipe, 1f1b or interleaved")
    params = [p for module in modules for p in module.parameters()]
    optimizer = torch.optim.SGD(params, lr=1e-3)
    holds_first = pp_rank == 0
    holds_last = (n_stages - 1) % pp == pp_rank
    loader = None
    if holds_first:
        loader = synthetic_loader(knobs, rank, 1, knobs.seed + dp_rank)
        loader = torch.utils.data.DataLoader(
            loader.dataset, batch_size=knobs.batch * m, collate_fn=loader.collate_fn,
            drop_last=True,
        )  # fmt: skip
    monitor = knobs.start_monitor(
        pipeline=schedule, optimizer=optimizer, dp_group=dp_group, data=loader
    )
    batches = endless(loader) if holds_first else None
    target = torch.randn((knobs.batch * m, knobs.hidden),
                         generator=torch.Generator().manual_seed(knobs.seed + dp_rank))  # fmt: skip
    for step in range(knobs.steps):
        for module in modules:
            module.step = step
        args = (next(batches)[0],) if holds_first else ()
        if holds_last:
            schedule.step(*args, target=target, losses=[])
        else:
            schedule.step(*args)
        if dp > 1:
            all_reduce_grads(params, dp_group, dp)
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()


if __name__ == "__main__":
    main_for(worker, __doc__.splitlines()[0])
