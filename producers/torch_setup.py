"""`lagscope.torch.monitor()`: from the job's own objects to a running `Monitor`.

Reads the roles of the process groups from what the job passes (a DDP model, a
pipelining schedule, an FSDP2 model, explicit groups, a DeviceMesh), derives the layout and the job
record, starts the monitor and attaches every hook: module hooks on the model chunks, the
optimizer's step hooks, the DDP comm hook, the data loader's iterator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from lagscope.producers import torch_hooks, torch_pipelining
from lagscope.producers.integration_start import announce_start, job_and_log_dir, rank_job_info
from lagscope.producers.torch_layout import Layout, attempt_from_environment, derive_layout
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
    """`lagscope.torch.monitor()`: the layout from the job's objects, the job record, the
    monitor, and every hook on what the job passed."""
    from torch.nn.parallel import DistributedDataParallel

    announce_start("lagscope.torch.monitor")
    job_id, log_dir = job_and_log_dir("lagscope.torch.monitor", job_id, log_dir)
    ddp = model if isinstance(model, DistributedDataParallel) else None
    stages = torch_pipelining.stages_of(pipeline) if pipeline is not None else []
    groups = _groups_by_role(groups, model, ddp, stages, mesh)
    layout = derive_layout(groups, mesh=mesh, vpp_size=max(1, len(stages)))
    _check_stages_fit(stages, layout)
    if ddp is not None or stages:
        # The first step is not the job's steady state: DDP re-buckets its gradients in
        # ready order after it, pipelining stages exchange shapes (extra forwards and p2p)
        # in it. It is not recorded.
        schedule = dataclasses.replace(schedule, skip_first=max(schedule.skip_first, 1))
    info = rank_job_info(layout, job_id=job_id, attempt=attempt_from_environment())
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
        _attach_hooks(
            monitor, model=model, ddp=ddp, stages=stages, modules=modules,
            ddp_comm_hook=ddp_comm_hook, optimizer=optimizer, data=data,
        )  # fmt: skip
    except BaseException:
        monitor.close()
        raise
    return monitor


def _groups_by_role(
    groups: dict[str, Any], model: Any, ddp: Any, stages: Sequence[Any], mesh: Any
) -> dict[str, Any]:
    """The groups the job passed, completed from its objects: a DDP model's group (or an
    FSDP2 model's mesh) is data parallel, the pipeline stages' group pipeline parallel."""
    groups = dict(groups)
    if ddp is not None and groups.get("dp") is None:
        groups["dp"] = ddp.process_group
    if ddp is None and groups.get("dp") is None and mesh is None:
        groups["dp"] = fsdp_group(model)
    if stages and groups.get("pp") is None:
        groups["pp"] = stages[0].group
    return groups


def _check_stages_fit(stages: Sequence[Any], layout: Layout) -> None:
    """A ValueError unless this rank's pipeline stages are chunk x pp + its pp rank, for
    every chunk: how lagscope numbers a virtual pipeline's stages."""
    if not stages:
        return
    pp = layout.pp_size
    wrong = [s.stage_index for s in stages if s.stage_index % pp != layout.coords["pp"]]
    if wrong or len(stages) * pp != stages[0].num_stages:
        raise ValueError(
            f"pipeline stages {[s.stage_index for s in stages]} of {stages[0].num_stages} "
            f"do not fit pipeline rank {layout.coords['pp']} of {pp} with "
            f"{len(stages)} stage(s) per rank (lagscope expects stage = chunk x pp + rank)"
        )


def _attach_hooks(
    monitor: Monitor,
    *,
    model: Any,
    ddp: Any,
    stages: Sequence[Any],
    modules: Sequence[Any] | None,
    ddp_comm_hook: tuple[Any, Any] | None,
    optimizer: Any,
    data: Any,
) -> None:
    """Every hook, on what the job passed: the model chunks (the pipeline's stages, else
    the modules given, else the model, a DDP model's inner module), DDP's gradient buckets,
    the optimizer's steps and the data loader's waits. (The collectives' wrappers are
    installed by the monitor itself.)"""
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


def fsdp_group(model: Any) -> Any:
    """The data-parallel group of an FSDP2 (`fully_shard`) model, or None for other models.

    FSDP2's parameters are DTensors on the mesh they are sharded over (a public DTensor
    attribute): on a 1-D mesh its one group is where the all-gathers and reduce-scatters
    run. A 2-D (HSDP) mesh has two data-parallel groups: pass `mesh=` with named dims.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    if not isinstance(model, FSDPModule):
        return None
    for parameter in model.parameters():
        device_mesh = getattr(parameter, "device_mesh", None)
        if device_mesh is None:
            continue
        if device_mesh.ndim != 1:
            raise ValueError(
                f"this FSDP model is sharded over a {device_mesh.ndim}-D mesh (HSDP): pass "
                "mesh= with its dimensions named (e.g. 'dp') or dp_group= to monitor()"
            )
        return device_mesh.get_group()
    return None
