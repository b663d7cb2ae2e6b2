"""A data- and pipeline-parallel training script through `torch.distributed.pipelining`
(1F1B over 4 micro-batches; rank r is pipeline rank r % 2 of data-parallel replica
r // 2; gloo on CPU): run it with torchrun on 4 processes.

    python -m torch.distributed.run --standalone --nproc-per-node 4 pipelining_train.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from straggler import Accelerator, parse, rank
from torch.distributed import pipelining
from torch.utils.data import DataLoader, TensorDataset

PP = 2
MICROBATCHES = 4


def main() -> None:
    args = parse(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, me = dist.get_world_size(), rank()
    dp = world // PP
    stage_index, replica = me % PP, me // PP
    pp_groups = [dist.new_group([d * PP + s for s in range(PP)]) for d in range(dp)]
    dp_groups = [dist.new_group([d * PP + s for d in range(dp)]) for s in range(PP)]
    pp_group, dp_group = pp_groups[replica], dp_groups[stage_index]
    torch.manual_seed(stage_index)
    accelerator = Accelerator(args, me)
    module = torch.nn.Sequential(torch.nn.Linear(args.hidden, args.hidden), accelerator,
                                 torch.nn.ReLU())  # fmt: skip
    stage = pipelining.PipelineStage(module, stage_index, PP, torch.device("cpu"), group=pp_group)

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(output, target)

    schedule = pipelining.Schedule1F1B(stage, MICROBATCHES, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    batch = args.batch * MICROBATCHES
    generator = torch.Generator().manual_seed(replica)
    data = TensorDataset(torch.randn(16 * batch, args.hidden, generator=generator),
                         torch.randn(16 * batch, args.hidden, generator=generator))  # fmt: skip
    loader = DataLoader(data, batch_size=batch)
    step = 0
    while step < args.steps:
        for x, y in loader:
            accelerator.step = step
            if stage_index == 0:
                schedule.step(x)
            else:
                schedule.step(target=y)
            for parameter in module.parameters():  # the replicas' gradients, averaged
                dist.all_reduce(parameter.grad, group=dp_group)
                parameter.grad /= dp
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == args.steps:
                break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
