"""`lagscope.torch.monitor()`: from the job's own objects to a running `Monitor`.

Reads the roles of the process groups from what the job passes (a DDP model, a
pipelining schedule, explicit groups, a DeviceMesh), derives the layout and the job
record, starts the monitor and attaches every hook: module hooks on the model chunks, the
optimizer's step hooks, the DDP comm hook, the data loader's iterator.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from lagscope.producers import torch_hooks, torch_pipelining
from lagscope.producers.torch_layout import (
    attempt_from_environment,
    derive_layout,
    job_id_from_environment,
    job_info,
    rank_identity,
)
from lagscope.producers.torch_monitor import Monitor
from lagscope.producers.torch_sampling import Schedule


def start_monitor(
    *,
    model: Any,
    optimizer: Any,
    data: Any,
    pipeline: Any,
    job_id: str | None,
    log_dir: str | Path | None,
    groups: dict[str, Any],
    mesh: Any,
    modules: Sequence[Any] | None,
    ddp_comm_hook: tuple[Any, Any] | None,
    schedule: Schedule,
    gc_probe: bool,
    mode: Literal["auto", "host", "cuda"],
    first_step: int,
) -> Monitor:
    from torch.nn.parallel import DistributedDataParallel

    job_id = job_id or job_id_from_environment()
    if not job_id:
        raise ValueError(
            "lagscope.torch.monitor needs a job id shared by every rank: pass job_id= or set "
            "LAGSCOPE_JOB_ID (torchrun's run id and SLURM_JOB_ID are used when set)"
        )
    log_dir = log_dir or os.environ.get("LAGSCOPE_LOG_DIR")
    if not log_dir:
        raise ValueError(
            "lagscope.torch.monitor needs a local log directory: pass log_dir= or set "
            "LAGSCOPE_LOG_DIR"
        )
    groups = dict(groups)
    ddp = model if isinstance(model, DistributedDataParallel) else None
    if ddp is not None and groups.get("dp") is None:
        groups["dp"] = ddp.process_group
    stages = torch_pipelining.stages_of(pipeline) if pipeline is not None else []
    if stages and groups.get("pp") is None:
        groups["pp"] = stages[0].group
    layout = derive_layout(groups, mesh=mesh, vpp_size=max(1, len(stages)))
    if stages:
        pp = layout.pp_size
        wrong = [s.stage_index for s in stages if s.stage_index % pp != layout.coords["pp"]]
        if wrong or len(stages) * pp != stages[0].num_stages:
            raise ValueError(
                f"pipeline stages {[s.stage_index for s in stages]} of {stages[0].num_stages} "
                f"do not fit pipeline rank {layout.coords['pp']} of {pp} with "
                f"{len(stages)} stage(s) per rank (lagscope expects stage = chunk x pp + rank)"
            )
    if ddp is not None or stages:
        # The first step is not the job's steady state: DDP re-buckets its gradients in
        # ready order after it, pipelining stages exchange shapes (extra forwards and p2p)
        # in it. It is not recorded.
        schedule = dataclasses.replace(schedule, skip_first=max(schedule.skip_first, 1))
    identity = rank_identity(layout)
    info = job_info(layout, job_id=job_id, attempt=attempt_from_environment(), identity=identity)
    monitor = Monitor(
        layout=layout,
        info=info,
        log_dir=log_dir,
        schedule=schedule,
        mode=mode,
        gc_probe=gc_probe,
        first_step=first_step,
    )
    try:
        if stages:
            monitor.attach_modules([s.submod for s in stages])
            for stage in stages:
                torch_pipelining.tag_directions(monitor, stage)
        elif modules is not None:
            monitor.attach_modules(list(modules))
        elif model is not None:
            monitor.attach_modules([ddp.module if ddp is not None else model])
        if ddp is not None:
            hook, state = ddp_comm_hook if ddp_comm_hook is not None else (None, None)
            torch_hooks.register_ddp_hook(monitor, ddp, hook, state)
        if optimizer is not None:
            monitor.attach_optimizer(optimizer)
        if data is not None:
            monitor.data = torch_hooks.time_input(monitor, data)
            if monitor.data is data:
                monitor.loaders.append(data)
    except BaseException:
        monitor.close()
        raise
    return monitor
