"""What the scripts of this folder share, none of it lagscope: their command line and an
emulated accelerator that makes one rank slow on demand.

`Accelerator` is a layer whose forward waits `--device-ms` and whose backward twice that,
as a host waits for its GPU (ranks on a few shared cores would otherwise fight over real
compute, and each op's time would depend on the others'). On `--slow-rank`, for the steps
`--slow-steps A-B`, its forward waits `--slow-factor` times as long: a straggler in
forward compute. The script tells it the step it is in (`accelerator.step = n`), counted
as the job counts its optimizer updates, from 0.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch


def parse(description: str, argv: list[str] | None = None, **defaults: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=defaults.get("steps", 40))
    parser.add_argument("--hidden", type=int, default=defaults.get("hidden", 64))
    parser.add_argument("--batch", type=int, default=defaults.get("batch", 8))
    parser.add_argument("--device-ms", type=float, default=defaults.get("device_ms", 5.0))
    parser.add_argument("--slow-rank", type=int, default=-1, help="global rank of the straggler")
    parser.add_argument("--slow-steps", default="", help="A-B: its slow steps, both included")
    parser.add_argument("--slow-factor", type=float, default=3.0)
    parser.add_argument("--out", default="", help="a folder for what the job reports")
    args = parser.parse_args(argv)
    first, _, last = args.slow_steps.partition("-")
    args.slow_first = int(first) if first else 1 << 30
    args.slow_last = int(last or first) if first else -1
    return args


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        time.sleep(ctx.backward_s)
        return grad, None


class Accelerator(torch.nn.Module):
    """An identity layer that takes the emulated device's time (see the module)."""

    def __init__(self, args: argparse.Namespace, global_rank: int) -> None:
        super().__init__()
        self.args = args
        self.global_rank = global_rank
        self.step = 0

    def slow_now(self) -> bool:
        args = self.args
        return self.global_rank == args.slow_rank and args.slow_first <= self.step <= args.slow_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seconds = self.args.device_ms / 1e3
        time.sleep(seconds * (self.args.slow_factor if self.slow_now() else 1.0))
        return _Wait.apply(x, 2 * seconds)
