"""A PyTorch Lightning script: a small regression model, `Trainer(strategy="ddp")` on CPU
(gloo); Lightning starts the other ranks itself: run it with plain python.

    python lightning_train.py --devices 2 --steps 40
"""

from __future__ import annotations

import sys

import pytorch_lightning as pl
import torch
from straggler import Accelerator, parse
from torch.utils.data import DataLoader, TensorDataset


class Regression(pl.LightningModule):
    def __init__(self, hidden: int, accelerator: Accelerator) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(hidden, hidden), accelerator, torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
        )  # fmt: skip
        self.accelerator = accelerator

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        self.accelerator.global_rank = self.global_rank
        self.accelerator.step = self.global_step
        x, y = batch
        return torch.nn.functional.mse_loss(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    argv = sys.argv[1:]
    devices = 2
    if "--devices" in argv:
        at = argv.index("--devices")
        devices = int(argv[at + 1])
        del argv[at : at + 2]
    args = parse(__doc__.splitlines()[0], argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Regression(args.hidden, Accelerator(args, -1))
    data = TensorDataset(torch.randn(64 * args.batch, args.hidden),
                         torch.randn(64 * args.batch, args.hidden))  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp", max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=args.batch))


if __name__ == "__main__":
    main()
