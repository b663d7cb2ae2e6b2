"""Compute, optimizer, gradient-bucket and input ops, from PyTorch's public hooks.

- Forward per micro-batch: a module's forward pre-hook and forward hook. The n-th training
  forward of a module in a step is micro-batch n; the module's index among the modules
  given is its chunk (virtual pipeline stage).
- Backward per micro-batch: it starts when the gradient of the forward's output arrives (a
  tensor hook registered on the output by the forward hook, which also carries the
  micro-batch over) and ends when every parameter of the module has its gradient
  (`torch.autograd.graph.register_multi_grad_hook`, once per backward pass). With DDP
  that end is when the last gradient bucket became ready: the wait for the buckets' all-
  reduces after it is not compute, it is the comm ops' own time (see the comm hook).
- DDP gradient buckets: a comm hook (`register_comm_hook`) that runs the default all-
  reduce (or the job's own hook) and records one `separate-grads-all-reduce` op per bucket,
  from the bucket becoming ready to its future completing. The buckets overlap backward,
  so a rank slow in backward launches its buckets late and every peer's all-reduce waits:
  the what-if sees that in the launch times, not in the peers' backward time.
- Optimizer: `register_step_pre_hook` / `register_step_post_hook`; the post hook also ends
  the step (the next step's ops, its input wait first, belong to the next step).
- Input: the time `next()` takes on the job's data loader iterator, as an `input-wait` op.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from lagscope.producers import torch_comm
from lagscope.simulator import optypes as ot

if TYPE_CHECKING:
    from lagscope.producers.torch_monitor import Monitor

_perf_ns = time.perf_counter_ns

#: The data loader wait's op type (the analysis gives it its own dependency and diagnosis).
INPUT_WAIT = getattr(ot, "INPUT_WAIT", "input-wait")


def first_grad_tensor(value: Any) -> Any:
    """The first tensor in a forward's output that will receive a gradient, or None."""
    import torch

    if isinstance(value, torch.Tensor):
        return value if value.requires_grad else None
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            found = first_grad_tensor(item)
            if found is not None:
                return found
    return None


class ModuleHooks:
    """Forward and backward ops of one module (one model chunk) of a rank."""

    def __init__(self, monitor: Monitor, module: Any, chunk: int) -> None:
        import torch

        self.monitor = monitor
        self.module = module
        self.chunk = chunk
        self._forwards: list[Any] = []
        self._backward: Any = None
        self._forward_count = 0
        self._backward_count = 0
        self._counted_step = -1
        self._grad_enabled = torch.is_grad_enabled
        params = [p for p in module.parameters() if p.requires_grad]
        self.handles = [
            module.register_forward_pre_hook(self._forward_start),
            module.register_forward_hook(self._forward_end),
        ]
        if params:
            self.handles.append(
                torch.autograd.graph.register_multi_grad_hook(params, self._backward_end)
            )

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _new_step(self) -> None:
        self._counted_step = self.monitor.step_id
        self._forward_count = 0
        self._backward_count = 0

    def _forward_start(self, module: Any, args: Any) -> None:
        monitor = self.monitor
        if not monitor.active or not module.training or not self._grad_enabled():
            self._forwards.append(None)
            return
        if self._counted_step != monitor.step_id:
            self._new_step()
        monitor.on_event()
        self.close_backward()
        microbatch = self._forward_count
        self._forward_count += 1
        scope = monitor.timer.op(ot.FORWARD_COMPUTE, microbatch=microbatch, chunk=self.chunk)
        scope.__enter__()
        self._forwards.append((scope, microbatch, monitor.step_id))

    def _forward_end(self, module: Any, args: Any, output: Any) -> None:
        if not self._forwards:
            return
        opened = self._forwards.pop()
        if opened is None:
            return
        scope, microbatch, step = opened
        scope.__exit__(None, None, None)
        tensor = first_grad_tensor(output)
        if tensor is not None:
            tensor.register_hook(lambda grad: self._backward_start(microbatch, step))

    def _backward_start(self, microbatch: int, step: int) -> None:
        monitor = self.monitor
        if not monitor.active or step != monitor.step_id:
            return
        monitor.on_event()
        self.close_backward()
        scope = monitor.timer.op(ot.BACKWARD_COMPUTE, microbatch=microbatch, chunk=self.chunk)
        scope.__enter__()
        self._backward = scope

    def _backward_end(self, grads: Any) -> None:
        self.close_backward()

    def close_backward(self) -> None:
        """End the open backward op (also the fallback when no parameter gets a gradient)."""
        scope = self._backward
        if scope is not None:
            self._backward = None
            scope.__exit__(None, None, None)


class OptimizerHooks:
    """The optimizer step as an op; its end is the step boundary."""

    def __init__(self, monitor: Monitor, optimizer: Any) -> None:
        self.monitor = monitor
        self._scope: Any = None
        self.handles = [
            optimizer.register_step_pre_hook(self._start),
            optimizer.register_step_post_hook(self._end),
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _start(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        monitor = self.monitor
        monitor.close_backwards()
        if not monitor.active:
            return
        monitor.on_event()
        self._scope = monitor.timer.op(ot.OPTIMIZER)
        self._scope.__enter__()

    def _end(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        scope = self._scope
        if scope is not None:
            self._scope = None
            scope.__exit__(None, None, None)
        self.monitor.step()


def register_ddp_hook(monitor: Monitor, ddp: Any, hook: Any = None, state: Any = None) -> None:
    """Time every gradient bucket of a DDP model (the job's own `hook`, or all-reduce)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if hook is None:
        hook, state = default_hooks.allreduce_hook, ddp.process_group
    code = monitor.timer.code_of(ot.SEPARATE_GRADS_ALL_REDUCE)
    timer = monitor.timer

    def timed_hook(_: Any, bucket: Any) -> Any:
        if not monitor.active:
            with torch_comm.suppressed():
                return hook(state, bucket)
        monitor.on_event()
        step = monitor.step_id
        start = _perf_ns()
        with torch_comm.suppressed():
            future = hook(state, bucket)
        index = bucket.index()

        def done(completed: Any) -> Any:
            timer.add(code, step, index, 0, start, _perf_ns())
            return completed.value()

        return future.then(done)

    # DDP checks the hook's annotations against the real types; this module's are strings.
    timed_hook.__annotations__ = {}
    try:
        ddp.register_comm_hook(None, timed_hook)
    except RuntimeError as exc:
        raise RuntimeError(
            "lagscope.torch cannot time the DDP gradient buckets: this model already has a "
            "comm hook. Pass it as monitor(..., ddp_comm_hook=(hook, state)) instead of "
            f"registering it yourself ({exc})"
        ) from None


class TimedIterator:
    """An iterator whose `next()` is recorded as an `input-wait` op."""

    __slots__ = ("_code", "_count", "_inner", "_monitor", "_step")

    def __init__(self, inner: Iterator[Any], monitor: Monitor, code: int) -> None:
        self._inner = inner
        self._monitor = monitor
        self._code = code
        self._step = -1
        self._count = 0

    def __iter__(self) -> TimedIterator:
        return self

    def __next__(self) -> Any:
        monitor = self._monitor
        if not monitor.active:
            return next(self._inner)
        start = _perf_ns()
        item = next(self._inner)
        end = _perf_ns()
        step = monitor.step_id
        if step != self._step:
            self._step, self._count = step, 0
        monitor.timer.add(self._code, step, self._count, 0, start, end)
        self._count += 1
        return item

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def time_input(monitor: Monitor, loader: Any) -> Any:
    """Make iterating `loader` record input waits; returns the object to iterate.

    A DataLoader (any object of a Python class with `__iter__`) is changed in place, to a
    subclass of its own class whose iterators are timed, so the job's `for batch in
    loader` stays as it is. Other iterables (a generator) are wrapped and returned.
    """
    code = monitor.timer.code_of(INPUT_WAIT)
    cls = type(loader)
    if hasattr(cls, "__iter__") and hasattr(loader, "__dict__") and cls.__module__ != "builtins":

        def timed_iter(self: Any) -> TimedIterator:
            return TimedIterator(cls.__iter__(self), monitor, code)

        loader.__class__ = type(cls.__name__, (cls,), {"__iter__": timed_iter,
                                                       "__lagscope_original__": cls})  # fmt: skip
        return loader
    return TimedIterator(iter(loader), monitor, code)


def untime_input(loader: Any) -> None:
    original = getattr(type(loader), "__lagscope_original__", None)
    if original is not None:
        loader.__class__ = original
