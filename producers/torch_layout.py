"""Which rank is which: the job's parallel layout and this rank's identity, derived from the
process groups a torch.distributed job already built and from the launcher's environment.

A job states the roles of its groups once, through the objects it already has: a DDP
model's `process_group` is data parallel, a `PipelineStage`'s `group` is pipeline parallel,
a `DeviceMesh` names its dimensions ("dp", "pp", "tp", "cp", "ep"), and explicit
`dp_group=`/`pp_group=`/... arguments cover hand-built groups. A role without a group is
size 1, except data parallelism, which takes whatever of the world the other roles leave
(a plain DDP job needs no argument at all). Sizes come from the groups, coordinates from
this rank's position in them, so every rank derives the same `JobInfo` and its own
`RankIdentity` without anyone writing them.

Imports torch only inside functions: `import lagscope.torch` stays light until it is used.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any

from lagscope.producers.events import JobInfo, RankIdentity

ROLES = ("dp", "pp", "tp", "cp", "ep")


class LayoutError(ValueError):
    """The process groups given do not describe a consistent parallel layout."""


@dataclass
class Layout:
    """Sizes, this rank's coordinates and the role of every known process group."""

    world_size: int
    rank: int
    sizes: dict[str, int]
    coords: dict[str, int]
    #: id(ProcessGroup) -> role; the default group maps to "dp" when the job is pure DP.
    roles: dict[int, str] = field(default_factory=dict)
    #: Global ranks of this rank's pipeline group, in stage order (p2p direction).
    pp_ranks: tuple[int, ...] = ()
    vpp_size: int = 1

    @property
    def dp_size(self) -> int:
        return self.sizes["dp"]

    @property
    def pp_size(self) -> int:
        return self.sizes["pp"]

    def stage_of(self, global_rank: int) -> int | None:
        """Pipeline stage of a peer, or None if it is not in this rank's pipeline group."""
        try:
            return self.pp_ranks.index(global_rank)
        except ValueError:
            return None

    @property
    def is_representative(self) -> bool:
        """The analysis reads one TP/CP rank per (dp, pp) coordinate: rank 0 of both."""
        return self.coords["tp"] == 0 and self.coords["cp"] == 0


def derive_layout(groups: dict[str, Any], *, vpp_size: int = 1, mesh: Any = None) -> Layout:
    """The layout from role -> ProcessGroup (None for roles not given) and/or a DeviceMesh."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise LayoutError(
            "torch.distributed is not initialised: call lagscope.torch.monitor() after "
            "init_process_group() and after the job has built its process groups"
        )
    given = {role: group for role, group in groups.items() if group is not None}
    unknown = set(given) - set(ROLES)
    if unknown:
        raise LayoutError(f"unknown group role(s) {sorted(unknown)}; known roles: {ROLES}")
    if mesh is not None:
        for name in mesh.mesh_dim_names or ():
            role = name.lower()
            if role in ROLES and role not in given:
                given[role] = mesh.get_group(name)
    world = dist.get_world_size()
    rank = dist.get_rank()
    sizes: dict[str, int] = {}
    coords: dict[str, int] = {}
    roles: dict[int, str] = {}
    for role, group in given.items():
        sizes[role] = dist.get_world_size(group)
        coords[role] = dist.get_rank(group)
        roles[id(group)] = role
    for role in ("pp", "tp", "cp"):
        sizes.setdefault(role, 1)
        coords.setdefault(role, 0)
    model_parallel = sizes["pp"] * sizes["tp"] * sizes["cp"]
    if "dp" not in sizes:
        if world % model_parallel:
            raise LayoutError(
                f"world size {world} is not a multiple of pp {sizes['pp']} x tp {sizes['tp']}"
                f" x cp {sizes['cp']}: pass dp_group= to say which ranks are data parallel"
            )
        sizes["dp"] = world // model_parallel
        if sizes["dp"] > 1 and model_parallel > 1:
            raise LayoutError(
                f"data parallel size {sizes['dp']} with model parallelism (pp {sizes['pp']}, "
                f"tp {sizes['tp']}, cp {sizes['cp']}): pass dp_group= (or a DDP model) so the "
                "data-parallel coordinate of each rank is known"
            )
        coords["dp"] = 0 if model_parallel > 1 else rank
    if sizes["dp"] == world:
        roles[id(dist.group.WORLD)] = "dp"
    product = sizes["dp"] * model_parallel
    if product != world:
        raise LayoutError(
            f"dp {sizes['dp']} x pp {sizes['pp']} x tp {sizes['tp']} x cp {sizes['cp']} = "
            f"{product}, but the world has {world} ranks: check the groups passed"
        )
    pp_group = given.get("pp")
    pp_ranks = tuple(dist.get_process_group_ranks(pp_group)) if pp_group is not None else (rank,)
    sizes.setdefault("ep", 1)
    coords.setdefault("ep", 0)
    return Layout(world, rank, sizes, coords, roles, pp_ranks, vpp_size)


def job_id_from_environment() -> str | None:
    """A job id every rank of a launch shares: lagscope's own, else the launcher's."""
    for name in ("LAGSCOPE_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        value = os.environ.get(name)
        if value and value != "none":
            return value
    return None


def attempt_from_environment() -> int:
    """The restart count torchrun sets (a restarted job is a new attempt)."""
    try:
        return max(0, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    except ValueError:
        return 0


def rank_identity(layout: Layout) -> RankIdentity:
    """This rank's coordinates and machine (host, GPU, scheduler node, Kubernetes pod)."""
    local_rank = _int_env("LOCAL_RANK", "SLURM_LOCALID") or 0
    in_kubernetes = "KUBERNETES_SERVICE_HOST" in os.environ
    pod = os.environ.get("POD_NAME") or (os.environ.get("HOSTNAME") if in_kubernetes else None)
    node = os.environ.get("NODE_NAME") or os.environ.get("SLURMD_NODENAME")
    gpu = _gpu_index()
    return RankIdentity(
        rank=layout.rank,
        local_rank=local_rank,
        dp_rank=layout.coords["dp"],
        pp_rank=layout.coords["pp"],
        tp_rank=layout.coords["tp"],
        cp_rank=layout.coords["cp"],
        host=socket.gethostname(),
        gpu=gpu,
        node=node,
        pod=pod,
        pci_bus_id=_pci_bus_id(gpu),
    )


def job_info(
    layout: Layout, *, job_id: str, attempt: int, identity: RankIdentity | None = None
) -> JobInfo:
    return JobInfo(
        job_id=job_id,
        attempt=attempt,
        trial_name=job_id,
        dp_size=layout.sizes["dp"],
        pp_size=layout.sizes["pp"],
        tp_size=layout.sizes["tp"],
        dsp_size=layout.sizes["cp"],
        vpp_size=layout.vpp_size,
        world_size=layout.world_size,
        rank_identity=identity,
    )


def _int_env(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                continue
    return None


def _gpu_index() -> int | None:
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.current_device())


def _pci_bus_id(gpu: int | None) -> str | None:
    """The GPU's PCI bus id in nvidia-smi's form ("00000000:3B:00.0"), or None."""
    if gpu is None:
        return None
    import torch

    props = torch.cuda.get_device_properties(gpu)
    try:
        return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    except AttributeError:  # a torch whose device properties lack the PCI ids
        return None
