"""Where lagscope's Megatron-core adapter attaches, and the check that those places are there.

The adapter (`producers.megatron_adapter`) hooks functions, classes and config fields of
megatron-core. Some are public (`ModelParallelConfig.timers`, `finalize_model_grads_func`,
the `p2p_communicator` argument of the schedules), some are not (the module globals the
schedules look up at call time, the gradient-bucket class). Each one is listed here once,
with the exact parameters the adapter relies on, and `check_seams()` verifies them all when
a monitor starts: a megatron-core release that moved any of them fails at once, naming
what moved, instead of recording a job that cannot be analysed. The test suite runs the
same check (tests/test_megatron_seams.py), so an upgrade of the test environment fails
loudly too.

The adapter is pinned to one release line (`SUPPORTED_SERIES`); a different installed
version is refused before any seam is looked at.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass
from typing import Any

#: The megatron-core release line the seams below were read from (0.19.2).
SUPPORTED_SERIES = "0.19"

SCHEDULES = "megatron.core.pipeline_parallel.schedules"
P2P = "megatron.core.pipeline_parallel.p2p_communication"
FINALIZE = "megatron.core.distributed.finalize_model_grads"
BUCKETS = "megatron.core.distributed.param_and_grad_buffer"
OPTIMIZER = "megatron.core.optimizer.optimizer"
PARALLEL_STATE = "megatron.core.parallel_state"
CONFIG = "megatron.core.model_parallel_config"

_SCHEDULE_PARAMETERS = (
    "forward_step_func",
    "data_iterator",
    "model",
    "num_microbatches",
    "seq_length",
    "micro_batch_size",
    "decoder_seq_length",
    "forward_only",
    "collect_non_loss_data",
    "first_val_step",
    "adjust_tensor_shapes_fn",
    "p2p_communicator",
    "pg_collection",
    "force_all_reduce",
)


class UnsupportedMegatronVersion(RuntimeError):
    """The installed megatron-core is not the release line the adapter was built against,
    or one of the places it hooks has moved."""


@dataclass(frozen=True)
class Seam:
    """One place in megatron-core the adapter hooks or relies on."""

    module: str
    #: Dotted path inside the module: a function, a class, a method or a dataclass field.
    path: str
    #: The callable's parameter names, in order (None: a class or a dataclass field).
    parameters: tuple[str, ...] | None
    #: What the adapter does there.
    use: str
    #: Timer names (`config.timers(name)`) the adapter maps, which this callable must call.
    timer_names: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return f"{self.module}.{self.path}"


SEAMS: tuple[Seam, ...] = (
    Seam(
        SCHEDULES,
        "forward_step",
        (
            "forward_step_func",
            "data_iterator",
            "model",
            "num_microbatches",
            "input_tensor",
            "forward_data_store",
            "config",
            "cp_group_size",
            "collect_non_loss_data",
            "checkpoint_activations_microbatch",
            "is_first_microbatch",
            "current_microbatch",
            "vp_stage",
            "is_last_stage",
        ),
        "forward-compute per micro-batch: the module global the schedules call, replaced; "
        "micro-batch from current_microbatch, model chunk from vp_stage",
    ),
    Seam(
        SCHEDULES,
        "backward_step",
        ("input_tensor", "output_tensor", "output_tensor_grad", "config"),
        "backward-compute per micro-batch: replaced like forward_step; micro-batch and chunk "
        "are those of the forward that produced output_tensor",
    ),
    Seam(
        SCHEDULES,
        "forward_backward_no_pipelining",
        _SCHEDULE_PARAMETERS,
        "step boundaries (one training call per step); forward_only calls are not recorded",
    ),
    Seam(
        SCHEDULES,
        "forward_backward_pipelining_without_interleaving",
        _SCHEDULE_PARAMETERS,
        "step boundaries; a p2p_communicator passed in is timed for the call",
    ),
    Seam(
        SCHEDULES,
        "forward_backward_pipelining_with_interleaving",
        _SCHEDULE_PARAMETERS,
        "step boundaries; a p2p_communicator passed in is timed for the call",
    ),
    Seam(
        SCHEDULES,
        "get_forward_backward_func",
        ("pp_size", "vp_size", "schedule_pg_collection"),
        "relied on to return the schedules through the module globals the adapter replaces",
    ),
    Seam(
        SCHEDULES,
        "P2PCommunicator",
        None,
        "the class the schedules build when no p2p_communicator is passed: replaced by a "
        "timed subclass",
    ),
    Seam(
        P2P,
        "P2PCommunicator._communicate",
        (
            "self",
            "tensor_send_next",
            "tensor_send_prev",
            "recv_prev",
            "recv_next",
            "tensor_shape",
            "wait_on_reqs",
        ),
        "every p2p transfer: forward-send/-recv (next/prev) and backward-send/-recv "
        "(prev/next), fused calls as one op per direction with the same times; handles not "
        "waited for inside are timed to their wait()",
    ),
    Seam(
        CONFIG,
        "ModelParallelConfig.timers",
        None,
        "the timers seam: finalize_model_grads' phases become ops; calls are passed on to "
        "the timers the job had",
    ),
    Seam(
        CONFIG,
        "ModelParallelConfig.finalize_model_grads_func",
        None,
        "a finalize function other than megatron-core's is timed as the DP gradient sync",
    ),
    Seam(
        FINALIZE,
        "finalize_model_grads",
        ("model", "num_tokens", "pg_collection", "force_all_reduce"),
        "its timer phases: all-grads-sync (DP sync when the model has no Megatron DDP "
        "buckets), non-tensor-parallel-grads-all-reduce (layernorm), "
        "embedding-grads-all-reduce",
        timer_names=(
            "all-grads-sync",
            "non-tensor-parallel-grads-all-reduce",
            "embedding-grads-all-reduce",
        ),
    ),
    Seam(
        BUCKETS,
        "_ParamAndGradBucketGroup.start_grad_sync",
        ("self", "force_all_reduce"),
        "a bucket group's gradient sync starts (async with overlap_grad_reduce)",
    ),
    Seam(
        BUCKETS,
        "_ParamAndGradBucketGroup.finish_grad_sync",
        ("self", "force_all_reduce"),
        "a bucket group's gradient sync has completed: one DP op per bucket group",
    ),
    Seam(
        OPTIMIZER,
        "MegatronOptimizer.step",
        ("self",),
        "the optimizer op (timed on the instance)",
    ),
    Seam(
        OPTIMIZER,
        "MegatronOptimizer.get_grad_norm",
        ("self",),
        "the gradient-norm all-reduce: optimizer-clip-main-grad (timed on the instance)",
    ),
    Seam(PARALLEL_STATE, "model_parallel_is_initialized", (), "monitor() after the groups"),
    *(
        Seam(
            PARALLEL_STATE,
            f"get_{role}_group",
            ("check_initialized",),
            "the job record and this rank's coordinates (lagscope.torch's layout)",
        )
        for role in ("tensor_model_parallel", "pipeline_model_parallel", "context_parallel")
    ),
    Seam(
        PARALLEL_STATE,
        "get_data_parallel_group",
        ("with_context_parallel", "with_gtp_remat", "partial_data_parallel"),
        "the job record: the DP group without context parallelism",
    ),
    Seam(
        PARALLEL_STATE,
        "get_virtual_pipeline_model_parallel_world_size",
        (),
        "the job record: model chunks per rank",
    ),
    Seam(
        PARALLEL_STATE,
        "is_rank_in_embedding_group",
        ("ignore_virtual", "vp_stage"),
        "embedding-grads-all-reduce is recorded only where the embedding group includes the rank",
    ),
)


def installed_version() -> str | None:
    """The installed megatron-core version, or None when it is not installed."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_version(version: str | None = None) -> str:
    """Return the installed version if the adapter supports it, else raise naming both."""
    version = installed_version() if version is None else version
    if version is None:
        raise UnsupportedMegatronVersion(
            f"lagscope.megatron needs megatron-core {SUPPORTED_SERIES}.x, which is not installed"
        )
    if version.split(".")[:2] != SUPPORTED_SERIES.split("."):
        raise UnsupportedMegatronVersion(
            f"lagscope.megatron supports megatron-core {SUPPORTED_SERIES}.x; megatron-core "
            f"{version} is installed (use lagscope.torch, or a lagscope release for {version})"
        )
    return version


def resolve(seam: Seam) -> Any:
    """The object at `seam` (a dataclass field resolves to its `dataclasses.Field`)."""
    owner: Any = importlib.import_module(seam.module)
    *parents, last = seam.path.split(".")
    for part in parents:
        owner = getattr(owner, part)
    if dataclasses.is_dataclass(owner):
        for field in dataclasses.fields(owner):
            if field.name == last:
                return field
    return inspect.getattr_static(owner, last)


def seam_problem(seam: Seam) -> str | None:
    """Why `seam` is not what the adapter expects, or None when it is."""
    try:
        target = resolve(seam)
    except (ImportError, AttributeError) as exc:
        return f"{seam.where} is missing ({exc})"
    if seam.parameters is not None:
        function = target.__func__ if isinstance(target, staticmethod | classmethod) else target
        if not callable(function):
            return f"{seam.where} is not callable"
        found = tuple(inspect.signature(function).parameters)
        if found != seam.parameters:
            return (
                f"{seam.where} takes ({', '.join(found)}), expected ({', '.join(seam.parameters)})"
            )
    for name in seam.timer_names:
        if f"timers('{name}'" not in inspect.getsource(target):
            return f"{seam.where} no longer calls config.timers('{name}')"
    return None


def check_seams() -> None:
    """Raise `UnsupportedMegatronVersion` listing every seam that moved (version first)."""
    version = check_version()
    problems = [p for p in map(seam_problem, SEAMS) if p is not None]
    if problems:
        raise UnsupportedMegatronVersion(
            f"megatron-core {version} differs from what lagscope.megatron hooks: "
            + "; ".join(problems)
        )
