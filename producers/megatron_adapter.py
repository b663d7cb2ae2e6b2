"""Megatron-core's seams, timed into lagscope ops: the machinery behind `lagscope.megatron`.

One `MegatronMonitor` per process. Starting it checks the installed megatron-core against
`producers.megatron_seams` (version line and every hooked signature), reads the job's
layout from `megatron.core.parallel_state`, opens an `OpTimer` for this rank (the lighter
"off" mode on TP/CP ranks other than 0: the analysis needs one rank per (dp, stage)) and
hooks megatron-core where it already separates the work lagscope times:

| megatron-core                                   | lagscope op                                 |
|-------------------------------------------------|---------------------------------------------|
| `schedules.forward_step` (current_microbatch,   | forward-compute, microbatch and chunk       |
|  vp_stage)                                      |                                             |
| `schedules.backward_step`                       | backward-compute, micro-batch and chunk of  |
|                                                 |  the forward that made its output           |
| `P2PCommunicator._communicate`                  | forward-send (to next), forward-recv (from  |
|                                                 |  prev), backward-send (to prev),            |
|                                                 |  backward-recv (from next)                  |
| bucket group `start_grad_sync` ..               | grads-reduce-scatter (distributed           |
|  `finish_grad_sync`                             |  optimizer) or separate-grads-all-reduce,   |
|                                                 |  one op per bucket group                    |
| timer `all-grads-sync` (model without Megatron  | the same DP op types, one per step          |
|  DDP buckets) or a custom finalize function     |                                             |
| timer `non-tensor-parallel-grads-all-reduce`    | layernorm-grads-all-reduce                  |
| timer `embedding-grads-all-reduce`              | embedding-grads-all-reduce (embedding-group |
|                                                 |  ranks only)                                |
| `MegatronOptimizer.get_grad_norm`               | optimizer-clip-main-grad                    |
| `optimizer.step` (Megatron's, or torch's step   | optimizer (from the end of the grad-norm    |
|  hooks)                                         |  all-reduce when there is one)              |

Steps: a step opens at the first training call of a schedule
(`forward_backward_*`, `forward_only=False`) after the previous optimizer step, so a
gradient-accumulating job that calls the schedule several times per update still has
one step per update; without a monitored optimizer every training call is a step.
Calls with `forward_only=True` (evaluation) record nothing.

Asynchronous transfers are timed to completion, never to the call's return: p2p handles
that the schedule waits for later (`overlap_p2p_comm`) end their op in `wait()`, and a
bucket group's op runs from `start_grad_sync` to the end of `finish_grad_sync`. On GPUs
the `OpTimer` records CUDA events on the current stream, which Megatron makes wait for
the communication before it uses the result, so the event after the wait marks the
transfer's completion on the device.

The hooks replace module globals and methods (restored by `close()`); they are listed,
with the signatures relied on, in `producers.megatron_seams`. The timed communicator is
`producers.megatron_p2p`; ops opened and closed by different callbacks (and the
`config.timers` seam) are `producers.megatron_ops`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from lagscope.producers import megatron_p2p
from lagscope.producers.integration_start import (
    announce_start,
    job_and_log_dir,
    rank_job_info,
    rank_timer,
)
from lagscope.producers.megatron_ops import MegatronTimers, Phase, Span
from lagscope.producers.megatron_p2p import TimedP2P, timed_communicator_class
from lagscope.producers.megatron_seams import (
    BUCKETS,
    FINALIZE,
    P2P,
    SCHEDULES,
    check_seams,
)
from lagscope.producers.timer import plain_int
from lagscope.producers.torch_layout import Layout, attempt_from_environment, derive_layout
from lagscope.producers.torch_sampling import EVERY_STEP, Schedule
from lagscope.simulator import optypes as ot

#: The schedule functions `get_forward_backward_func` hands out; each call is (part of) a step.
SCHEDULE_FUNCTIONS = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)

_perf_ns = time.perf_counter_ns

#: The one monitor of this process (the hooks are process-wide).
_active: MegatronMonitor | None = None


def megatron_layout() -> Layout:
    """The job's layout from megatron's own process groups (`parallel_state`)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError(
            "lagscope.megatron.monitor() needs megatron's model-parallel groups: call "
            "parallel_state.initialize_model_parallel(...) first"
        )
    groups = {
        "dp": ps.get_data_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(),
        "tp": ps.get_tensor_model_parallel_group(),
        "cp": ps.get_context_parallel_group(),
    }
    vpp_size = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    return derive_layout(groups, vpp_size=vpp_size)


class MegatronMonitor:
    """Records this rank's ops from megatron-core's seams; see the module docstring."""

    def __init__(
        self,
        *,
        job_id: str | None = None,
        log_dir: str | Path | None = None,
        optimizer: Any = None,
        attempt: int | None = None,
        first_step: int = 0,
        mode: Literal["auto", "host", "cuda"] = "auto",
        gc_probe: bool = True,
        schedule: Schedule = EVERY_STEP,
        model_flops_per_step: float | None = None,
        gpu_peak_flops: float | None = None,
    ) -> None:
        check_seams()
        announce_start("lagscope.megatron.monitor")
        if _active is not None:
            raise RuntimeError(
                "lagscope.megatron is already monitoring this process; close() that monitor "
                "before starting another"
            )
        job_id, log_dir = job_and_log_dir("lagscope.megatron.monitor", job_id, log_dir)
        first_step = plain_int("first_step", first_step)  # a checkpoint's step may be a tensor
        if first_step < 0:
            raise ValueError(f"first_step must be >= 0, got {first_step}")
        from megatron.core import parallel_state

        self.layout = layout = megatron_layout()
        self.in_embedding_group = parallel_state.is_rank_in_embedding_group(ignore_virtual=True)
        attempt = attempt_from_environment() if attempt is None else attempt
        info = rank_job_info(
            layout, job_id=job_id, attempt=attempt,
            model_flops_per_step=model_flops_per_step, gpu_peak_flops=gpu_peak_flops,
        )  # fmt: skip
        self.timer = timer = rank_timer(layout, info, log_dir, mode=mode, gc_probe=gc_probe)
        #: Host clocks (not CUDA events): ops timed here may share one pair of stamps.
        self.host_timing = getattr(timer, "_cuda", None) is None
        #: True while a training schedule call runs: only then are ops recorded.
        self.recording = False
        #: True while the current step is one the sampling schedule records.
        self.sampled = False
        #: The step being recorded (None before the first training call).
        self.step_id: int | None = None
        #: Schedule calls under way through the hooked schedule functions: a forward outside
        #: any is a schedule obtained before the hooks went in, which records nothing.
        self._schedule_calls = 0
        self._said_unhooked = False
        self._schedule = schedule
        self._first_step = first_step
        self._next_step = first_step
        self._step_open = False
        self._steps_end_at_optimizer = optimizer is not None
        # Micro-batch bookkeeping for the current step.
        self._forward_of: dict[int, tuple[int, int]] = {}
        self._last_forward = (-1, 0)
        self._last_backward = (-1, 0)
        self._forwards_seen = 0
        self._init_gradient_sync_state()
        self._restore: list[Callable[[], None]] = []
        self._closed = False
        self._install(optimizer)
        atexit.register(self.close)

    def _init_gradient_sync_state(self) -> None:
        """What the gradient sync hooks keep: the model's chunks, each DDP bucket's chunk
        and open span, megatron's own timers and config, the optimizer's span."""
        self._model_ids: tuple[int, ...] = ()
        self._chunks: list[Any] = []
        self._chunk_of_bucket: dict[int, int] = {}
        self._open_buckets: dict[int, Span] = {}
        self._has_megatron_buckets = False
        self._config: Any = None
        self._timers: MegatronTimers | None = None
        self._dp_phase: Phase | None = None
        self._finalize_wrapped: Any = None
        self._optimizer_span = Span()

    # -- what the hooks ask ------------------------------------------------------------

    def producer_of(self, optype: str) -> tuple[int, int]:
        """(micro-batch, chunk) a p2p op carries: sends carry those of the compute whose
        result they ship; a recv is posted before its micro-batch is known (-1)."""
        if optype == ot.FORWARD_SEND:
            return self._last_forward
        if optype == ot.BACKWARD_SEND:
            return self._last_backward
        return (-1, 0)

    def dp_sync_optype(self) -> str:
        distributed = any(
            getattr(getattr(chunk, "ddp_config", None), "use_distributed_optimizer", False)
            for chunk in self._chunks
        )
        return ot.GRADS_REDUCE_SCATTER if distributed else ot.SEPARATE_GRADS_ALL_REDUCE

    # -- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        """Undo every hook and write the last step to the log."""
        global _active
        if self._closed:
            return
        self._closed = True
        for undo in reversed(self._restore):
            undo()
        self._restore.clear()
        if _active is self:
            _active = None
            megatron_p2p.attach(None)
        atexit.unregister(self.close)
        self.timer.close()

    def __enter__(self) -> MegatronMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- steps ---------------------------------------------------------------------------

    def _begin_training_call(self, model: Any) -> None:
        if not self._step_open or not self._steps_end_at_optimizer:
            self.step_id = self._next_step
            self._next_step += 1
            self.timer.step(self.step_id)
            self._step_open = True
            self.sampled = self.layout.is_representative and self._schedule.records(
                self.step_id - self._first_step
            )
            # A GC pause in a step that is not recorded would make a step of its own.
            self.timer.gc_paused = not self.sampled
            self._forward_of.clear()
            self._forwards_seen = 0
        self._learn_model(model)
        self.recording = self.sampled

    def _end_step(self) -> None:
        self._step_open = False

    def step(self) -> None:
        """End the current step by hand; the next training call of the schedule opens the
        next one. Rarely needed: with `optimizer=` a step ends at the optimizer's update,
        and without it every training call of the schedule is a step of its own. For a job
        whose update monitor() cannot see, e.g. several schedule calls per update by an
        optimizer it was not given."""
        self._end_step()

    def attach_optimizer(self, optimizer: Any) -> None:
        """From now on a step ends at `optimizer`'s update, as with `optimizer=`: for a
        monitor started before the job's optimizer was known (`lagscope launch` learns it
        at the first update). Until then each training call of the schedule was a step."""
        if self._steps_end_at_optimizer or self._closed:
            return
        self._hook_optimizer(optimizer)
        self._steps_end_at_optimizer = True
        self._end_step()

    def _unhooked_schedule(self) -> None:
        """Megatron runs a schedule function that was fetched before monitor() hooked
        the schedules: say so once, at once, with what the job must change."""
        if self._said_unhooked or self._closed:
            return
        self._said_unhooked = True
        import warnings

        warnings.warn(
            "lagscope.megatron: megatron-core runs a pipeline schedule fetched before "
            "lagscope.megatron.monitor() was called, so nothing of this job is recorded. "
            "Call get_forward_backward_func() after lagscope.megatron.monitor(...) (or call "
            "it again after it) and use the function it returns.",
            RuntimeWarning,
            stacklevel=4,
        )

    def _learn_model(self, model: Any) -> None:
        """Model chunks (for bucket chunk ids and the DP op type) and the config's hooks."""
        chunks = list(model) if isinstance(model, list | tuple) else [model]
        ids = tuple(map(id, chunks))
        if ids == self._model_ids:
            return
        self._model_ids = ids
        self._chunks = chunks
        self._chunk_of_bucket = {
            id(group): index
            for index, chunk in enumerate(chunks)
            for group in itertools.chain(
                getattr(chunk, "bucket_groups", ()) or (),
                getattr(chunk, "expert_parallel_bucket_groups", ()) or (),
            )
        }
        self._has_megatron_buckets = bool(self._chunk_of_bucket)
        if self._dp_phase is not None:
            self._dp_phase.optype = self.dp_sync_optype()
        from megatron.core.utils import get_model_config

        config = get_model_config(chunks[0])
        if config is not self._config:
            self._hook_config(config)

    # -- installing ----------------------------------------------------------------------

    def _install(self, optimizer: Any) -> None:
        global _active
        import importlib

        schedules = importlib.import_module(SCHEDULES)
        p2p = importlib.import_module(P2P)
        buckets = importlib.import_module(BUCKETS)

        self._replace(schedules, "forward_step", self._timed_forward(schedules.forward_step))
        self._replace(schedules, "backward_step", self._timed_backward(schedules.backward_step))
        for name in SCHEDULE_FUNCTIONS:
            self._replace(schedules, name, self._timed_schedule(getattr(schedules, name)))
        self._replace(schedules, "P2PCommunicator", timed_communicator_class(p2p.P2PCommunicator))
        group = buckets._ParamAndGradBucketGroup
        self._replace(group, "start_grad_sync", self._timed_bucket_start(group.start_grad_sync))
        self._replace(group, "finish_grad_sync", self._timed_bucket_finish(group.finish_grad_sync))
        if optimizer is not None:
            self._hook_optimizer(optimizer)
        self._restore.append(self._unhook_config)
        _active = self
        megatron_p2p.attach(self)

    def _replace(self, owner: Any, name: str, value: Any) -> None:
        had_own = name in vars(owner)
        original = vars(owner).get(name)
        setattr(owner, name, value)

        def undo() -> None:
            if had_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)

        self._restore.append(undo)

    def _hook_config(self, config: Any) -> None:
        """`config.timers` (finalize phases) and a custom `finalize_model_grads_func`."""
        if self._config is not None:
            self._unhook_config()
        self._config = config
        phases = {
            "all-grads-sync": Phase(
                self,
                ot.SEPARATE_GRADS_ALL_REDUCE,
                lambda: not self._has_megatron_buckets,
                # Pipeline transfers are over once the gradients are finalised.
                on_start=megatron_p2p.end_outstanding,
            ),
            "non-tensor-parallel-grads-all-reduce": Phase(
                self, ot.LAYERNORM_GRADS_ALL_REDUCE, lambda: True
            ),
            "embedding-grads-all-reduce": Phase(
                self, ot.EMBEDDING_GRADS_ALL_REDUCE, lambda: self.in_embedding_group
            ),
        }
        dp_phase = self._dp_phase = phases["all-grads-sync"]
        dp_phase.optype = self.dp_sync_optype()
        self._timers = MegatronTimers(phases, config.timers)
        config.timers = self._timers
        finalize = config.finalize_model_grads_func
        if finalize is not None and not _is_megatron_finalize(finalize):
            config.finalize_model_grads_func = self._timed_custom_finalize(finalize, dp_phase)
        self._finalize_wrapped = finalize

    def _unhook_config(self) -> None:
        config = self._config
        if config is None:
            return
        if config.timers is self._timers and self._timers is not None:
            config.timers = self._timers.inner
        if self._finalize_wrapped is not None:
            config.finalize_model_grads_func = self._finalize_wrapped
        self._config = None

    def _hook_optimizer(self, optimizer: Any) -> None:
        import torch
        from megatron.core.optimizer.optimizer import MegatronOptimizer

        if isinstance(optimizer, MegatronOptimizer):
            for name, wrap in (("step", self._timed_step), ("get_grad_norm", self._timed_norm)):
                self._replace(optimizer, name, wrap(getattr(optimizer, name)))
        elif isinstance(optimizer, torch.optim.Optimizer):
            span = self._optimizer_span

            def before(*_: Any) -> None:
                if self._step_open and self.sampled:
                    span.begin(self.timer, ot.OPTIMIZER)

            def after(*_: Any) -> None:
                span.end()
                self._end_step()

            handles = (
                optimizer.register_step_pre_hook(before),
                optimizer.register_step_post_hook(after),
            )
            self._restore.append(lambda: [h.remove() for h in handles])
        else:
            raise TypeError(
                f"lagscope.megatron.monitor(optimizer=...) takes a megatron-core or torch "
                f"optimizer, got {type(optimizer).__name__}"
            )

    # -- the hooks -----------------------------------------------------------------------

    def _timed_schedule(self, schedule: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(schedule)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._schedule_calls += 1
            try:
                if kwargs.get("forward_only", False):
                    return schedule(*args, **kwargs)
                self._begin_training_call(kwargs["model"])
                try:
                    with self._communicator_timed(kwargs.get("p2p_communicator")):
                        return schedule(*args, **kwargs)
                finally:
                    megatron_p2p.end_outstanding()
                    self.recording = False
                    if not self._steps_end_at_optimizer:
                        self._end_step()
            finally:
                self._schedule_calls -= 1

        return timed

    @contextlib.contextmanager
    def _communicator_timed(self, communicator: Any) -> Iterator[None]:
        """Time a communicator the caller passed in, for the call only."""
        if communicator is None or isinstance(communicator, TimedP2P):
            yield
            return
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        if not isinstance(communicator, P2PCommunicator):
            yield  # e.g. the multi-module communicator: its transfers are not timed
            return
        original = type(communicator)
        communicator.__class__ = timed_communicator_class(original)
        try:
            yield
        finally:
            communicator.__class__ = original

    def _timed_forward(self, forward_step: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(forward_step)

        @functools.wraps(forward_step)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.recording:
                if not self._schedule_calls:
                    self._unhooked_schedule()
                return forward_step(*args, **kwargs)
            if len(args) > 11:  # the schedules pass these by keyword; be safe if not
                bound = signature.bind(*args, **kwargs).arguments
                microbatch, chunk = bound.get("current_microbatch"), bound.get("vp_stage")
            else:
                microbatch, chunk = kwargs.get("current_microbatch"), kwargs.get("vp_stage")
            if microbatch is None:
                microbatch = self._forwards_seen
            chunk = chunk or 0
            self._forwards_seen += 1
            if self.host_timing:
                megatron_p2p.poll()
            first, last = self._pipeline_ends(chunk)
            if first:
                self._mark_peerless(ot.FORWARD_RECV, microbatch, chunk)
            with self.timer.op(ot.FORWARD_COMPUTE, microbatch=microbatch, chunk=chunk):
                result = forward_step(*args, **kwargs)
            if last:
                self._mark_peerless(ot.FORWARD_SEND, microbatch, chunk)
            self._forward_of[_tensor_key(result[0])] = (microbatch, chunk)
            self._last_forward = (microbatch, chunk)
            return result

        return timed

    def _timed_backward(self, backward_step: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(backward_step)
        def timed(input_tensor: Any, output_tensor: Any, output_tensor_grad: Any, config: Any):
            if not self.recording:
                return backward_step(input_tensor, output_tensor, output_tensor_grad, config)
            microbatch, chunk = self._forward_of.pop(_tensor_key(output_tensor), (-1, 0))
            if self.host_timing:
                megatron_p2p.poll()
            first, last = self._pipeline_ends(chunk)
            if last:
                self._mark_peerless(ot.BACKWARD_RECV, microbatch, chunk)
            with self.timer.op(ot.BACKWARD_COMPUTE, microbatch=microbatch, chunk=chunk):
                result = backward_step(input_tensor, output_tensor, output_tensor_grad, config)
            if first:
                self._mark_peerless(ot.BACKWARD_SEND, microbatch, chunk)
            self._last_backward = (microbatch, chunk)
            return result

        return timed

    def _pipeline_ends(self, chunk: int) -> tuple[bool, bool]:
        """Whether `chunk` is the first / the last model chunk of an interleaved pipeline."""
        layout = self.layout
        if layout.vpp_size == 1:
            return False, False
        global_chunk = chunk * layout.pp_size + layout.coords["pp"]
        return global_chunk == 0, global_chunk == layout.vpp_size * layout.pp_size - 1

    def _mark_peerless(self, optype: str, microbatch: int, chunk: int) -> None:
        """A zero-length transfer where an interleaved pipeline ends and megatron moves
        nothing: the analysis matches every compute of a chunk with its transfers and
        knows these (peer chunk outside the pipeline) as no-ops, as the reference traces
        record them. Without interleaving it accepts the ends' missing ops as they are."""
        timer = self.timer
        if self.host_timing:
            now = _perf_ns()
            timer.add(timer.code_of(optype), timer.current_step, microbatch, chunk, now, now)
        else:
            with timer.op(optype, microbatch=microbatch, chunk=chunk):
                pass

    def _timed_bucket_start(self, start: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(start)
        def timed(group: Any, force_all_reduce: bool | None = False) -> Any:
            if self.recording and id(group) not in self._open_buckets:
                distributed = group.ddp_config.use_distributed_optimizer and not force_all_reduce
                optype = ot.GRADS_REDUCE_SCATTER if distributed else ot.SEPARATE_GRADS_ALL_REDUCE
                span = self._open_buckets[id(group)] = Span()
                span.begin(self.timer, optype, chunk=self._chunk_of_bucket.get(id(group), 0))
            return start(group, force_all_reduce=force_all_reduce)

        return timed

    def _timed_bucket_finish(self, finish: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(finish)
        def timed(group: Any, force_all_reduce: bool | None = False) -> Any:
            result = finish(group, force_all_reduce=force_all_reduce)
            span = self._open_buckets.pop(id(group), None)
            if span is not None:
                span.end()
            return result

        return timed

    def _timed_custom_finalize(
        self, finalize: Callable[..., Any], dp_phase: Phase
    ) -> Callable[..., Any]:
        """A finalize function of the job's own: the whole call is the DP gradient sync
        (unless Megatron DDP buckets are recorded, which then hold the sync)."""

        @functools.wraps(finalize)
        def timed(*args: Any, **kwargs: Any) -> Any:
            dp_phase.start()
            try:
                return finalize(*args, **kwargs)
            finally:
                dp_phase.stop()

        return timed

    def _timed_step(self, step: Callable[[], Any]) -> Callable[[], Any]:
        span = self._optimizer_span

        @functools.wraps(step)
        def timed() -> Any:
            if self._step_open and self.sampled:
                span.begin(self.timer, ot.OPTIMIZER)
            try:
                return step()
            finally:
                span.end()
                self._end_step()

        return timed

    def _timed_norm(self, get_grad_norm: Callable[[], Any]) -> Callable[[], Any]:
        span = self._optimizer_span

        @functools.wraps(get_grad_norm)
        def timed() -> Any:
            if not span.open:
                return get_grad_norm()
            # The norm's all-reduce waits for every rank: an op of its own, and the
            # optimizer op starts again after it.
            with self.timer.op(ot.OPTIMIZER_CLIP_MAIN_GRAD):
                norm = get_grad_norm()
            span.begin(self.timer, ot.OPTIMIZER)
            return norm

        return timed


def _tensor_key(output: Any) -> int:
    """Identity of a forward's output as backward_step receives it (a tensor or a list)."""
    if isinstance(output, list | tuple) and output:
        output = output[0]
    return id(output)


def _is_megatron_finalize(function: Any) -> bool:
    import importlib

    megatron_finalize = importlib.import_module(FINALIZE).finalize_model_grads
    while isinstance(function, functools.partial):
        function = function.func
    return function is megatron_finalize
