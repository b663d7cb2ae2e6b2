"""What `lagscope launch` runs in every process of a job it does not edit: it finds the
job's own objects and starts the monitor `lagscope.torch.monitor()` would have started.

Installed by the injected `sitecustomize` (`producers.injection`), it waits for torch to
be imported and then watches, at little cost, for what the first training step shows:

- the optimizer: the first one whose `step()` runs (torch's global step hooks); its first
  update ends step 0, and the monitor starts there, recording from step 1 on (the first
  step is never the job's steady state: DDP re-buckets, FSDP2 initialises, pipeline
  stages exchange shapes);
- the model: from an optimizer's creation to that update, a global forward hook notes the
  modules called at the top level (no other module running), in training mode with
  gradients on: a `DistributedDataParallel` wrapper, an FSDP2 (`fully_shard`) root, or a
  plain module; the one holding most of the optimizer's parameters is the model;
- a `torch.distributed.pipelining` schedule, from its constructor; then its stages are the
  model chunks, its group pipeline parallel, and the data-parallel group is the one group
  of this rank that crosses its pipeline group (or a named `DeviceMesh`);
- a `DeviceMesh` from `init_device_mesh` with dimensions named after roles (dp, pp, ...);
- the data loader: the datasets whose iterators step 0 advanced with gradients on; from
  then on their batches' waits are `input-wait` ops (an evaluation loader is left out);
- megatron-core: its schedules start `lagscope.megatron`'s monitor at their first
  training call (`producers.auto_megatron`).

Nothing changes, besides one line on stderr from rank 0, when the job is not distributed
or its layout cannot be read (point-to-point transfers outside a pipelining schedule, a
world of one rank, groups that do not add up). A job that starts a monitor itself keeps
it: this one stands down, and gives way if it had started first.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from lagscope.producers import import_hooks

PIPELINING_SCHEDULES = "torch.distributed.pipelining.schedules"
#: The point-to-point calls of torch.distributed that a hand-written pipeline makes.
P2P_CALLS = ("send", "recv", "isend", "irecv", "batch_isend_irecv")

_discovery: Discovery | None = None


def install() -> None:
    """Watch for torch (and megatron-core) being imported; nothing else happens before."""
    import_hooks.when_imported("torch", _torch_imported)
    from lagscope.producers import auto_megatron

    auto_megatron.install()


def _torch_imported(_: Any) -> None:
    global _discovery
    if _discovery is not None:
        return
    _discovery = Discovery()
    try:
        _discovery.install()
    except Exception as exc:  # never stop the job
        _discovery.state = "off"
        _discovery._stop_everything()
        say(f"lagscope cannot watch this torch ({type(exc).__name__}: {exc}); the job runs "
            "unrecorded")  # fmt: skip


def discovery() -> Discovery | None:
    """This process's discovery, once torch was imported."""
    return _discovery


def say(message: str) -> None:
    """One line on stderr, from one process of the job: global rank 0 (or a process
    outside any distributed job)."""
    rank = _global_rank()
    if rank in (None, 0):
        print(f"lagscope launch: {message}", file=sys.stderr, flush=True)


def _global_rank() -> int | None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:
        pass
    rank = os.environ.get("RANK")
    return int(rank) if rank and rank.isdigit() else None


class Discovery:
    """The watching in one process, from torch's import to the monitor's start."""

    def __init__(self) -> None:
        #: "watching", "recording", "standing down" (the job started a monitor itself, or
        #: megatron-core's monitor took the process), "off" (nothing to record).
        self.state = "watching"
        self.monitor: Any = None
        #: What the watching changed, undone at the first update.
        self._watching: list[Callable[[], None]] = []
        self._roots: dict[int, weakref.ref[Any]] = {}
        self._depth = threading.local()
        self._schedules: weakref.WeakSet[Any] = weakref.WeakSet()
        self._meshes: list[Any] = []
        self._p2p_calls = 0
        self._forward_hooks: list[Any] = []
        self._update_hook: Any = None
        self._own_start = False
        self.input: Any = None

    # -- installing ---------------------------------------------------------------------

    def install(self) -> None:
        import torch
        from torch.optim import optimizer as optimizers

        from lagscope.producers import integration_start
        from lagscope.producers.auto_input import InputWaits

        integration_start.listen_for_starts(self._monitor_starting)
        self._patch(torch.optim.Optimizer, "__init__", self._optimizer_created)
        self._update_hook = optimizers.register_optimizer_step_post_hook(self._after_update)
        self._watch_meshes()
        self._watch_p2p()
        self.input = InputWaits()
        import_hooks.when_imported(PIPELINING_SCHEDULES, self._pipelining_imported)

    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """Replace `owner.name` with `make(original)` until the watching ends."""
        had_own = name in vars(owner)
        original = getattr(owner, name)
        setattr(owner, name, make(original))

        def undo() -> None:
            if had_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)

        self._watching.append(undo)

    def _stop_watching(self) -> None:
        self._remove_forward_hooks()
        for undo in reversed(self._watching):
            undo()
        self._watching.clear()

    def _stop_everything(self) -> None:
        """Leave the job as it was (the global update hook stays, returning at once: torch
        runs it while iterating its hooks, and it may be there now)."""
        self._stop_watching()
        if self.input is not None:
            self.input.remove()
            self.input = None

    # -- what the job builds ------------------------------------------------------------

    def _optimizer_created(self, original_init: Any) -> Any:
        def __init__(optimizer: Any, *args: Any, **kwargs: Any) -> None:
            original_init(optimizer, *args, **kwargs)
            if self.state == "watching" and not self._forward_hooks:
                self._watch_roots()

        return __init__

    def _watch_roots(self) -> None:
        """Note the modules called at the top level, in training, with gradients on."""
        import torch
        from torch.nn.modules import module as nn_module

        grad_enabled = torch.is_grad_enabled
        depth = self._depth
        roots = self._roots

        def before(module: Any, _: Any) -> None:
            level = getattr(depth, "level", 0)
            depth.level = level + 1
            if level == 0 and module.training and grad_enabled() and id(module) not in roots:
                roots[id(module)] = weakref.ref(module)

        def after(module: Any, _: Any, __: Any) -> None:
            depth.level = max(0, getattr(depth, "level", 1) - 1)

        self._forward_hooks = [
            nn_module.register_module_forward_pre_hook(before),
            nn_module.register_module_forward_hook(after, always_call=True),
        ]

    def _remove_forward_hooks(self) -> None:
        for handle in self._forward_hooks:
            handle.remove()
        self._forward_hooks = []

    def _watch_meshes(self) -> None:
        import torch.distributed as dist

        if not dist.is_available():
            return
        from torch.distributed import device_mesh

        def make(original: Any) -> Any:
            @functools.wraps(original)
            def init_device_mesh(*args: Any, **kwargs: Any) -> Any:
                mesh = original(*args, **kwargs)
                self._meshes.append(mesh)
                return mesh

            return init_device_mesh

        self._patch(device_mesh, "init_device_mesh", make)
        if getattr(dist, "init_device_mesh", None) is not None:
            self._patch(dist, "init_device_mesh", lambda _: device_mesh.init_device_mesh)

    def _watch_p2p(self) -> None:
        """Count point-to-point calls until the first update: made outside a pipelining
        schedule, they are a hand-written pipeline whose stages lagscope cannot tell."""
        import torch.distributed as dist

        if not dist.is_available():
            return
        from torch.distributed import distributed_c10d as c10d

        def counting(original: Any) -> Any:
            @functools.wraps(original)
            def call(*args: Any, **kwargs: Any) -> Any:
                self._p2p_calls += 1
                return original(*args, **kwargs)

            return call

        # On both modules, as the monitor's own wrappers: c10d checks a `P2POp`'s function
        # against its own globals.
        for name in P2P_CALLS:
            original = getattr(c10d, name, None)
            if original is not None:
                wrapper = counting(original)
                self._patch(c10d, name, lambda _, w=wrapper: w)
                self._patch(dist, name, lambda _, w=wrapper: w)

    def _pipelining_imported(self, schedules: Any) -> None:
        def make(original: Any) -> Any:
            def __init__(schedule: Any, *args: Any, **kwargs: Any) -> None:
                original(schedule, *args, **kwargs)
                self._schedules.add(schedule)

            return __init__

        base = getattr(schedules, "_PipelineSchedule", None)
        if base is not None and self.state == "watching":
            self._patch(base, "__init__", make)

    # -- a monitor of the job's own -----------------------------------------------------

    def _monitor_starting(self, api: str) -> None:
        if self._own_start or self.state in ("standing down", "off"):
            return
        if self.monitor is not None:
            say(f"the job starts {api}() itself: it records from here on")
            self.close()
        self.state = "standing down"
        self._stop_everything()

    # -- the first update: what the job is -----------------------------------------------

    def _after_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.state != "watching":
            return
        self._stop_watching()
        try:
            problem = self._start(optimizer)
        except Exception as exc:  # never stop the job
            problem = f"lagscope could not start ({type(exc).__name__}: {exc})"
        if problem is not None:
            self.state = "off"
            self._stop_everything()
            if problem:
                say(f"{problem}; the job runs unrecorded")

    def _start(self, optimizer: Any) -> str | None:
        """Start the monitor on what step 0 showed; why not as one line ("": nothing to
        say), or None when it records."""
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        if _megatron_job():
            return ""  # lagscope.megatron's monitor could not start, and said why
        if not dist.is_available() or not dist.is_initialized():
            return (
                "this job is not distributed (torch.distributed was not initialised by its "
                "first optimizer step), so it has no stragglers to find"
            )
        if dist.get_world_size() < 2:
            return "this job runs a world of one rank, so it has no stragglers to find"
        schedule = self._schedule()
        if self._p2p_calls and schedule is None:
            return (
                "the job sends tensors between ranks outside a torch.distributed.pipelining "
                "schedule (a hand-written pipeline), whose stages lagscope cannot tell: call "
                "lagscope.torch.monitor(modules=..., pp_group=..., dp_group=...) in the job"
            )
        groups: dict[str, Any] = dict.fromkeys(("dp", "pp", "tp", "cp", "ep"))
        model = modules = None
        mesh = self._mesh()
        if schedule is not None:
            if mesh is None:
                groups["dp"] = _crossing_group(_stages_group(schedule))
        else:
            model = self._model(optimizer)
            if model is None:
                return (
                    "no module ran forward in training mode before the first optimizer "
                    "step, so lagscope found no model to time"
                )
            if isinstance(model, DistributedDataParallel):
                if _redirects_forward(model.module):
                    modules = [model]
                if getattr(model, "_comm_hooks", []):
                    # A comm hook of the job's own: DDP takes one, so the buckets go untimed.
                    groups["dp"], model = model.process_group, model.module
        from lagscope.producers.torch_sampling import EVERY_STEP
        from lagscope.producers.torch_setup import start_monitor

        self._own_start = True
        try:
            self.monitor = start_monitor(
                model=model, optimizer=optimizer, data=None, pipeline=schedule,
                job_id=None, log_dir=None, groups=groups, mesh=mesh, modules=modules,
                ddp_comm_hook=None, schedule=EVERY_STEP, gc_probe=True, mode="auto",
                first_step=1,
            )  # fmt: skip
        finally:
            self._own_start = False
        from lagscope.simulator import optypes

        # The step open when the process exits is written only if it trained: what the job
        # did once it stopped training (a final metrics gather) is no step.
        self.monitor.timer.last_step_needs = (optypes.FORWARD_COMPUTE, optypes.BACKWARD_COMPUTE)
        self.state = "recording"
        self.input.start(self.monitor)
        atexit.register(self.close)
        return None

    def close(self) -> None:
        """Stop recording (at the process's exit): the rank's last steps and its end."""
        monitor, self.monitor = self.monitor, None
        if self.input is not None:
            self.input.remove()
            self.input = None
        if monitor is not None:
            monitor.close()

    def _schedule(self) -> Any:
        """The pipelining schedule this rank runs (the latest built with its stages)."""
        built = [
            schedule
            for schedule in self._schedules
            if getattr(schedule, "_stages", None) or getattr(schedule, "_stage", None)
        ]
        return built[-1] if built else None

    def _model(self, optimizer: Any) -> Any:
        """The top-level module holding most of the optimizer's parameters."""
        optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
        best, best_count = None, 0
        for ref in self._roots.values():
            module = ref()
            if module is None:
                continue
            count = sum(1 for p in module.parameters() if id(p) in optimized)
            if count > best_count:
                best, best_count = module, count
        return best

    def _mesh(self) -> Any:
        """The DeviceMesh the job built with dimensions named after roles, if one."""
        from lagscope.producers.torch_layout import ROLES

        named = [m for m in self._meshes if set(m.mesh_dim_names or ()) & set(ROLES)]
        return named[-1] if named else None


def _redirects_forward(module: Any) -> bool:
    """Whether DDP's inner module is a PyTorch Lightning module: Lightning sets its
    `forward` to the training step for each call through DDP (and back after), so the
    forward is timed on the DDP wrapper instead (its own work is part of it)."""
    return any(cls.__name__ == "LightningModule" for cls in type(module).__mro__)


def _megatron_job() -> bool:
    """Whether megatron-core's model-parallel groups exist in this process."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    try:
        return bool(parallel_state and parallel_state.model_parallel_is_initialized())
    except Exception:
        return False


def _stages_group(schedule: Any) -> Any:
    from lagscope.producers.torch_pipelining import stages_of

    return stages_of(schedule)[0].group


def _crossing_group(pp_group: Any) -> Any:
    """The data-parallel group of a pipeline rank: the one process group of this rank, of
    the size the pipeline leaves, that shares no rank but this one with its pipeline
    group. None when there is none (a pure pipeline) or several (the job must say)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    world = dist.get_world_size()
    rank = dist.get_rank()
    pp_ranks = set(dist.get_process_group_ranks(pp_group)) if pp_group is not None else {rank}
    size = world // max(1, len(pp_ranks))
    if size < 2:
        return None
    found = []
    for group, ranks in c10d._world.pg_group_ranks.items():
        members = set(ranks)
        if len(members) == size and rank in members and members & pp_ranks == {rank}:
            found.append(group)
    return found[0] if len(found) == 1 else None
