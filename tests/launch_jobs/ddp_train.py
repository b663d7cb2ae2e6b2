"""A plain DDP training script (gloo on CPU): run it with torchrun.

python -m torch.distributed.run --standalone --nproc-per-node 2 ddp_train.py --steps 40
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from straggler import Accelerator, parse, rank
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    args = parse(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    accelerator = Accelerator(args, rank())
    layers = [torch.nn.Linear(args.hidden, args.hidden), accelerator, torch.nn.ReLU(),
              torch.nn.Linear(args.hidden, args.hidden)]  # fmt: skip
    model = DistributedDataParallel(torch.nn.Sequential(*layers))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(64 * args.batch, args.hidden),
                         torch.randn(64 * args.batch, args.hidden))  # fmt: skip
    loader = DataLoader(data, batch_size=args.batch, shuffle=True)
    step = 0
    while step < args.steps:
        for x, y in loader:
            accelerator.step = step
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == args.steps:
                break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
