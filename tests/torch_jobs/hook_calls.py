"""A two-stage pipeline of one micro-batch per step, whose ranks count the Python calls
lagscope's code receives in each step (`sys.setprofile`): what a recorded step costs the
training thread in calls, the unit of its cost (about a microsecond each in a real job,
whose compute evicts the interpreter's caches between hooks).

Every other step is recorded. Each rank writes `calls/rank-R.json`: per step, the calls
into lagscope's files by function, and whether the step was recorded.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path
from typing import Any

import lagscope
from tests.torch_jobs.harness import Knobs

_ROOT = Path(lagscope.__file__).resolve().parent.parent
#: lagscope's code on a training node (not the tests, nor a virtual environment inside).
_OURS = tuple(f"{_ROOT / part}/" for part in ("lagscope", "producers", "simulator"))


def worker(rank: int, knobs: Knobs) -> None:
    import torch
    import torch.distributed as dist

    import lagscope.torch

    torch.manual_seed(rank)
    model = torch.nn.Linear(knobs.hidden, knobs.hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = lagscope.torch.monitor(
        modules=[model], optimizer=optimizer, pp_group=dist.group.WORLD,
        job_id=knobs.job_id, log_dir=knobs.log_dir, gc_probe=False, mode="host",
        schedule=lagscope.torch.schedule(wait=1, active=1),
    )  # fmt: skip
    steps: list[dict[str, Any]] = []
    counts: collections.Counter[str] = collections.Counter()

    def profile(frame: Any, event: str, _: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(_OURS):
                counts[f"{Path(code.co_filename).name}:{code.co_name}"] += 1

    shape = (4, knobs.hidden)
    for _ in range(knobs.steps):
        recorded = monitor.active
        sys.setprofile(profile)
        if rank == 0:
            out = model(torch.randn(shape))
            dist.isend(out.detach(), 1).wait()
            grad = torch.empty(shape)
            dist.irecv(grad, 1).wait()
            out.backward(grad)
        else:
            x = torch.empty(shape)
            dist.irecv(x, 0).wait()
            x.requires_grad_()
            model(x).sum().backward()
            dist.isend(x.grad, 0).wait()
        optimizer.step()
        sys.setprofile(None)
        optimizer.zero_grad()
        steps.append({"recorded": recorded, "calls": dict(counts)})
        counts.clear()
    monitor.close()
    out_dir = Path(knobs.log_dir).parent / "calls"
    out_dir.mkdir(exist_ok=True)
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(steps))
