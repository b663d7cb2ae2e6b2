"""An FSDP2 training script (`fully_shard` per block and on the root, gloo on CPU) that
starts its own ranks: run it with plain python.

    python fsdp_train.py --world 2 --steps 40
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from straggler import Accelerator, parse
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset


def train(rank: int, world: int, port: int, argv: list[str]) -> None:
    args = parse(__doc__.splitlines()[0], argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    accelerator = Accelerator(args, rank)
    blocks = [torch.nn.Sequential(torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU())
              for _ in range(3)]  # fmt: skip
    model = torch.nn.Sequential(blocks[0], accelerator, *blocks[1:])
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(64 * args.batch, args.hidden),
                         torch.randn(64 * args.batch, args.hidden))  # fmt: skip
    loader = DataLoader(data, batch_size=args.batch)
    step = 0
    while step < args.steps:
        for x, y in loader:
            accelerator.step = step
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == args.steps:
                break
    dist.destroy_process_group()


def main() -> None:
    import socket
    import sys

    world = 2
    argv = sys.argv[1:]
    if "--world" in argv:
        at = argv.index("--world")
        world = int(argv[at + 1])
        del argv[at : at + 2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(train, args=(world, port, argv), nprocs=world)


if __name__ == "__main__":
    main()
