"""Monitor a torch.distributed training job with one call.

    # train.py: torchrun --standalone --nproc-per-node 2 train.py
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    import lagscope.torch

    dist.init_process_group("gloo")                  # "nccl" on GPUs
    model = DDP(torch.nn.Linear(64, 64))             # or fully_shard(model), a pipeline, ...
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.randn(512, 64), torch.randn(512, 64)),
                        batch_size=32)
    monitor = lagscope.torch.monitor(model=model, optimizer=optimizer, data=loader,
                                     job_id="my-job", log_dir="lagscope-logs")
    for x, y in loader:                              # unchanged training loop
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    dist.destroy_process_group()

Recorded, with no timing lines in the job: forward and backward per micro-batch (a
forward wrapper and autograd hooks), the optimizer step (optimizer hooks; it also ends each
step), DDP gradient buckets (comm hook), FSDP2 all-gathers and reduce-scatters, data-
parallel collectives and pipeline send/recv of torch.distributed timed to completion (on a
GPU with CUDA events, the end one recorded where the stream waits for the comm), and the
wait for the next batch (`data=`).
The job record (dp/pp/tp sizes, this rank's host, GPU and its PCI bus id, node and pod) is
derived from the process groups and the environment; the analysis stores every rank's
machine and names it next to the workers it names.
Then `lagscope run --log-dir lagscope-logs` analyses the job.

Call order: the process groups, the model (wrapped in DDP/FSDP, or the pipeline schedule
built), the optimizer and the data loader, then `monitor(...)`, then the training loop.
A job without an optimizer calls `monitor.step()` at the end of each step. Sampling is
`schedule=lagscope.torch.schedule(wait=9, active=1)` (one step in ten), like
torch.profiler's. Internals: `lagscope.producers.torch_*`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from lagscope.producers.torch_monitor import Monitor
from lagscope.producers.torch_sampling import EVERY_STEP, Schedule

__all__ = ["Monitor", "Schedule", "monitor", "schedule"]


def schedule(*, wait: int = 0, active: int = 1, repeat: int = 0, skip_first: int = 0) -> Schedule:
    """Record `active` steps of every `wait + active` (torch.profiler's words)."""
    return Schedule(wait=wait, active=active, repeat=repeat, skip_first=skip_first)


def monitor(
    *,
    model: Any = None,
    optimizer: Any = None,
    data: Any = None,
    pipeline: Any = None,
    job_id: str | None = None,
    log_dir: str | Path | None = None,
    dp_group: Any = None,
    pp_group: Any = None,
    tp_group: Any = None,
    cp_group: Any = None,
    ep_group: Any = None,
    mesh: Any = None,
    modules: Sequence[Any] | None = None,
    ddp_comm_hook: tuple[Any, Any] | None = None,
    schedule: Schedule = EVERY_STEP,
    gc_probe: bool = True,
    mode: Literal["auto", "host", "cuda"] = "auto",
    first_step: int = 0,
) -> Monitor:
    """Start monitoring this rank; call after the process groups and the model exist.

    model: the model (a DDP model: its gradient buckets are timed and its process group is
    data parallel; an FSDP2 model: its parameters' 1-D mesh is data parallel). pipeline: a
    torch.distributed.pipelining schedule (its stages are hooked; its group is pipeline
    parallel). modules: the model chunks to hook when neither says (e.g. a hand-written
    pipeline's stage module). data: the data loader whose waits are recorded (iterate the
    returned object if it is not the loader itself).
    dp_group/pp_group/...: the roles of hand-built groups; mesh: a DeviceMesh with named
    dimensions. job_id/log_dir default to $LAGSCOPE_JOB_ID (else the launcher's run id)
    and $LAGSCOPE_LOG_DIR.
    """
    from lagscope.producers.torch_setup import start_monitor

    return start_monitor(
        model=model,
        optimizer=optimizer,
        data=data,
        pipeline=pipeline,
        job_id=job_id,
        log_dir=log_dir,
        groups={"dp": dp_group, "pp": pp_group, "tp": tp_group, "cp": cp_group, "ep": ep_group},
        mesh=mesh,
        modules=modules,
        ddp_comm_hook=ddp_comm_hook,
        schedule=schedule,
        gc_probe=gc_probe,
        mode=mode,
        first_step=first_step,
    )
