"""Compute, optimizer, gradient-bucket and input ops, from PyTorch's public hooks.

- Forward per micro-batch: a wrapper set as the module's `forward` (cheaper than a pair of
  forward hooks, see `ModuleHooks`). The n-th training forward of a module in a step is
  micro-batch n; the module's index among the modules given is its chunk (virtual
  pipeline stage).
- Backward per micro-batch: it starts when the job calls `torch.autograd.backward` (what
  `loss.backward()` and the pipeline schedules call) and ends when every parameter of the
  module has its gradient: in the first backward through
  `torch.autograd.graph.register_multi_grad_hook`, which also learns whose gradient comes
  last, then through one hook on that parameter. A rank's backwards run in the order of its
  forwards, so the n-th backward call of a step is the n-th forward's micro-batch. With
  several model chunks on a rank (an interleaved schedule) a call does not say whose
  backward it is, and a tensor hook registered on each forward's output (about 2 us a
  forward) catches the start instead. With DDP the end is when the last gradient bucket
  became ready: the wait for the buckets' all-reduces after it is not compute, it is the
  comm ops' own time (see the comm hook).
- DDP gradient buckets: a comm hook (`register_comm_hook`) that runs the default all-
  reduce (or the job's own hook) and records one `separate-grads-all-reduce` op per bucket,
  from the bucket becoming ready to its future completing. The buckets overlap backward,
  so a rank slow in backward launches its buckets late and every peer's all-reduce waits:
  the what-if sees that in the launch times, not in the peers' backward time. On a GPU
  (CUDA events, the end one in the future's callback, on a stream that waits for the
  all-reduce) only the step's last bucket is timed: from the end of backward to every
  all-reduce done (on NCCL's one stream it waits for the earlier buckets), the exposed
  part of the step's gradient sync, which the dependency model takes as one all-reduce.
  Timing each bucket put two events and their Python on the autograd thread per bucket,
  and the launches a GPU job's backward waits for came that much later: on an H100 a
  device-bound GPT's recorded steps took +1.4 to +1.6 % longer than their unrecorded
  neighbours with its 17 buckets timed, +0.2 to +0.3 % with the last one, -0.2 to +0.0 %
  with none, against -0.3 % for the same contrast without a monitor
  (`tests/bench/cuda_ablation.py`).
- Optimizer: `register_step_pre_hook` / `register_step_post_hook`; the post hook also ends
  the step (the next step's ops, its input wait first, belong to the next step).
- Input: the time `next()` takes on the job's data loader iterator, as an `input-wait` op.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from lagscope.producers import torch_comm
from lagscope.simulator import optypes as ot

if TYPE_CHECKING:
    from lagscope.producers.torch_monitor import Monitor

_perf_ns = time.perf_counter_ns

#: The data loader wait's op type (the analysis gives it its own dependency and diagnosis).
INPUT_WAIT = getattr(ot, "INPUT_WAIT", "input-wait")


_TENSOR: Any = None


def first_grad_tensor(value: Any) -> Any:
    """The first tensor in a forward's output that will receive a gradient, or None."""
    global _TENSOR
    if _TENSOR is None:
        import torch

        _TENSOR = torch.Tensor
    if isinstance(value, _TENSOR):
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
    """Forward and backward ops of one module (one model chunk) of a rank.

    The forward is timed by a wrapper set as the module's instance attribute `forward`,
    not by forward pre/post hooks: a module with hooks leaves `nn.Module.__call__`'s fast
    path, which alone costs about 3 us per call on this machine's CPU, more than the
    whole op budget. Hooks the job (or FSDP) registered still run around the wrapper, so
    an FSDP all-gather waited for in a pre-hook is not counted as forward compute.
    """

    def __init__(self, monitor: Monitor, module: Any, chunk: int) -> None:
        import torch

        self.monitor = monitor
        self.module = module
        self.chunk = chunk
        self._backward: Any = None
        #: Whether backward starts come from `BackwardCalls` (one chunk on the rank), else
        #: from a tensor hook on each forward's output.
        self.by_call = False
        #: (micro-batch, step) of the forwards whose backward has not started, in order.
        self.awaiting: collections.deque[tuple[int, int]] = collections.deque()
        self._forward_count = 0
        self._counted_step = -1
        timer = monitor.timer
        self._host_clock = timer.on_host_clock
        self._append = monitor.append
        self._forward_code = timer.code_of(ot.FORWARD_COMPUTE)
        self._backward_code = timer.code_of(ot.BACKWARD_COMPUTE)
        self._own_forward = module.__dict__.get("forward")
        module.forward = self._timed_forward(module.forward)
        # The backward's end: when the last parameter gets its gradient. Waiting for every
        # parameter (`register_multi_grad_hook`) costs a Python call per parameter per
        # backward, ~1.5 us each: 300 us per micro-batch for a 200-parameter chunk. So the
        # first backward learns which parameter's gradient comes last (the order is the
        # graph's, the same every step, as DDP's bucketing relies on), and from then on a
        # hook on that one parameter ends the backward.
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._arrivals: list[int] = []
        self._learned = False
        self.handles: list[Any] = []
        if self._params:
            self.handles.append(
                torch.autograd.graph.register_multi_grad_hook(
                    self._params, self._first_backward_end
                )
            )
            self.handles += [p.register_hook(self._arrival(i)) for i, p in enumerate(self._params)]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self._own_forward is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self._own_forward

    def _timed_forward(self, forward: Any) -> Any:
        import torch

        monitor = self.monitor
        module = self.module
        grad_enabled = torch.is_grad_enabled
        tensor_type = torch.Tensor
        perf_ns = _perf_ns
        code = self._forward_code
        host = monitor.timer.on_host_clock
        append = monitor.timer.appender()

        def timed_forward(*args: Any, **kwargs: Any) -> Any:
            if not monitor.active or not module.training or not grad_enabled():
                return forward(*args, **kwargs)
            step = monitor.step_id
            if self._counted_step != step:
                self._counted_step, self._forward_count = step, 0
                self.awaiting.clear()  # forwards of an earlier step that had no backward
            if monitor.pending_works:
                monitor.poll_works()
            if self._backward is not None:
                self.close_backward()
            if self._learned and self._arrivals:
                self._hook_the_last_parameter()
            microbatch = self._forward_count
            self._forward_count = microbatch + 1
            if host:
                start = perf_ns()
                output = forward(*args, **kwargs)
                append(((code, step, microbatch, self.chunk), start, perf_ns() - start))
            else:
                opened = monitor.begin(code, microbatch, self.chunk)
                output = forward(*args, **kwargs)
                monitor.end(opened)
            if type(output) is tensor_type:  # the usual output: no search through it
                tensor = output if output.requires_grad else None
            else:
                tensor = first_grad_tensor(output)
            if tensor is not None:
                if self.by_call:
                    self.awaiting.append((microbatch, step))
                else:
                    tensor.register_hook(lambda grad: self._backward_start(microbatch, step))
            return output

        timed_forward.__wrapped__ = forward  # type: ignore[attr-defined]
        return timed_forward

    def _backward_start(self, microbatch: int, step: int) -> None:
        """Open micro-batch `microbatch`'s backward (from the wrapped backward call, or from
        a tensor hook with several chunks on the rank); `begin` inline on the host clock: it
        runs once per micro-batch, and each Python call costs a recorded step about a
        microsecond of the training thread."""
        monitor = self.monitor
        if not monitor.active or step != monitor.step_id:
            return
        if monitor.pending_works:
            monitor.poll_works()
        if self._backward is not None:
            self.close_backward()
        if self._host_clock:
            head = (self._backward_code, step, microbatch, self.chunk)
            self._backward = (head, _perf_ns())
        else:
            self._backward = monitor.begin(self._backward_code, microbatch, self.chunk)

    def backward_called(self) -> None:
        """The job called a backward: the oldest forward still waiting for its backward
        starts it (nothing when none waits: a backward through other modules)."""
        if self.awaiting:
            self._backward_start(*self.awaiting.popleft())

    def _arrival(self, index: int) -> Any:
        def arrived(grad: Any) -> None:
            self._arrivals.append(index)

        return arrived

    def _first_backward_end(self, grads: Any) -> None:
        self._ended()
        if self._arrivals:
            self._learned = True

    def _ended(self, grad: Any = None) -> None:
        """The backward's end: the first backward's multi-grad hook, then the last
        parameter's gradient hook (`_last_gradient`, this method itself: no call between);
        `end` inline on the host clock."""
        opened = self._backward
        if opened is not None:
            self._backward = None
            if self._host_clock:
                head, start = opened
                self._append((head, start, _perf_ns() - start))
            else:
                self.monitor.end(opened)
        elif self.by_call and self.awaiting:
            # A backward ran that the wrapped `torch.autograd.backward` did not see (called
            # through a reference taken before the monitor started, or the engine
            # directly): from the next forward on, a tensor hook starts each backward.
            self.by_call = False
            self.awaiting.clear()

    _last_gradient = _ended

    def _hook_the_last_parameter(self) -> None:
        """Swap the learning hooks for one on the parameter whose gradient came last; done
        outside the backward pass (at the next forward), never from inside a hook."""
        for handle in self.handles:
            handle.remove()
        last = self._params[self._arrivals[-1]]
        self.handles = [last.register_hook(self._last_gradient)]
        self._arrivals = []

    def close_backward(self) -> None:
        """End the open backward op (also the fallback when no parameter gets a gradient)."""
        opened = self._backward
        if opened is not None:
            self._backward = None
            self.monitor.end(opened)


class BackwardCalls:
    """`torch.autograd.backward` wrapped so that each call starts the backward of the
    oldest forward waiting for one: one Python call per backward instead of a tensor hook
    registered per forward. `Tensor.backward` and the pipeline schedules call it through
    the module attribute, so they are caught too."""

    def __init__(self, monitor: Monitor, hooks: ModuleHooks) -> None:
        import torch.autograd

        self._autograd = torch.autograd
        self._original = original = torch.autograd.backward
        started = hooks.backward_called

        def backward(*args: Any, **kwargs: Any) -> Any:
            if monitor.active:
                started()
            return original(*args, **kwargs)

        backward.__wrapped__ = original  # type: ignore[attr-defined]
        self._wrapper = backward
        hooks.by_call = True
        torch.autograd.backward = backward

    def remove(self) -> None:
        if self._autograd.backward is self._wrapper:
            self._autograd.backward = self._original


class OptimizerHooks:
    """The optimizer step as an op; its end is the step boundary."""

    def __init__(self, monitor: Monitor, optimizer: Any) -> None:
        self.monitor = monitor
        self._scope: Any = None
        self._code = monitor.timer.code_of(ot.OPTIMIZER)
        self._host_clock = monitor.timer.on_host_clock
        self._append = monitor.append
        self.handles = [
            optimizer.register_step_pre_hook(self._start),
            optimizer.register_step_post_hook(self._end),
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _start(self, optimizer: Any, args: Any, kwargs: Any) -> Any:
        monitor = self.monitor
        monitor.close_backwards()
        if not monitor.active:
            return None
        closure = (
            kwargs.get("closure") if "closure" in kwargs else (args[1] if len(args) > 1 else None)
        )
        if closure is not None:
            return self._after_closure(closure, args, kwargs)
        if monitor.pending_works:  # `on_event()`, `begin` and `end` inline, as the forward's
            monitor.poll_works()
        if self._host_clock:
            self._scope = ((self._code, monitor.step_id, -1, 0), _perf_ns())
        else:
            self._scope = monitor.begin(self._code)
        return None

    def _open(self) -> None:
        monitor = self.monitor
        if monitor.pending_works:
            monitor.poll_works()
        if self._host_clock:
            self._scope = ((self._code, monitor.step_id, -1, 0), _perf_ns())
        else:
            self._scope = monitor.begin(self._code)

    def _after_closure(self, closure: Any, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """`step(closure)` (PyTorch Lightning, LBFGS) runs the forward and the backward
        inside the optimizer's step: the update starts when the closure has returned (the
        last time, for an optimizer that calls it several times)."""

        def timed_closure() -> Any:
            self._scope = None
            loss = closure()
            self.monitor.close_backwards()
            if self.monitor.active:
                self._open()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": timed_closure}
        return (args[0], timed_closure, *args[2:]), kwargs

    def _end(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        opened = self._scope
        if opened is not None:
            self._scope = None
            if self._host_clock:
                head, start = opened
                self._append((head, start, _perf_ns() - start))
            else:
                self.monitor.end(opened)
        self.monitor.step()


def register_ddp_hook(monitor: Monitor, ddp: Any, hook: Any = None, state: Any = None) -> None:
    """Time every gradient bucket of a DDP model (the job's own `hook`, or all-reduce)."""
    code = monitor.timer.code_of(ot.SEPARATE_GRADS_ALL_REDUCE)
    if hook is None:
        timed_hook = _timed_allreduce(monitor, code, ddp.process_group)
    else:
        timed_hook = _timed_job_hook(monitor, code, hook, state)
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


def _bucket_end(monitor: Monitor, code: int, bucket: Any) -> Callable[[], None]:
    """Open a recorded bucket's op; what ends it when its all-reduce completed.

    On a GPU the start is an event where the stream has produced the bucket's gradients,
    the end one recorded in the future's `then` callback, which torch runs on a stream
    that waits for the all-reduce: NCCL marks the future done when it enqueues the
    collective, so a host clock there would read a few µs."""
    monitor.on_event()
    index = bucket.index()
    if not monitor.timer.on_host_clock:
        opened = monitor.begin(code, index)
        return lambda: monitor.end(opened)
    step, start, add = monitor.step_id, _perf_ns(), monitor.timer.add
    return lambda: add(code, step, index, 0, start, _perf_ns())


def _timed_allreduce(monitor: Monitor, code: int, group: Any) -> Callable[[Any, Any], Any]:
    """DDP's default comm hook (torch's `default_hooks.allreduce_hook`: divide by the group
    size, all-reduce, the result tensor), with the bucket's end in the one `then` it needs
    anyway: a second future per bucket costs the autograd thread more than the timing."""
    import torch
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    size = group.size()

    def first_value(completed: Any) -> Any:
        return completed.value()[0]

    # The process group's own all-reduce, as DDP's C++ default calls it: the Python
    # `dist.all_reduce` (its checks, and lagscope's wrapper around it) costs every bucket
    # of every step several µs, recorded or not.
    allreduce = group.allreduce
    every_bucket = monitor.timer.on_host_clock

    def timed_hook(_: Any, bucket: Any) -> Any:
        tensor = bucket.buffer()
        tensor.div_(size)  # first, as torch's hook does: no overflow in fp16
        if tensor.is_complex():  # as `dist.all_reduce` sends complex tensors
            tensor = torch.view_as_real(tensor)
        if not monitor.active or not (every_bucket or bucket.is_last()):
            return allreduce([tensor]).get_future().then(first_value)
        end = _bucket_end(monitor, code, bucket)
        work = allreduce([tensor])

        def done(completed: Any) -> Any:
            end()
            return completed.value()[0]

        # `then`, not a done-callback: DDP waits for the future this returns, so the bucket
        # ends before the optimizer starts, on the host clock and on the device alike.
        return work.get_future().then(done)

    return timed_hook


def _timed_job_hook(
    monitor: Monitor, code: int, hook: Any, state: Any
) -> Callable[[Any, Any], Any]:
    """The job's own comm hook, each bucket timed from its call to its future's value (on
    a GPU the step's last bucket only, as `_timed_allreduce`)."""

    every_bucket = monitor.timer.on_host_clock

    def timed_hook(_: Any, bucket: Any) -> Any:
        if not monitor.active or not (every_bucket or bucket.is_last()):
            with torch_comm.suppressed():
                return hook(state, bucket)
        end = _bucket_end(monitor, code, bucket)
        with torch_comm.suppressed():
            future = hook(state, bucket)

        def done(completed: Any) -> Any:
            end()
            return completed.value()

        return future.then(done)

    return timed_hook


def record_input_wait(counter: Any, monitor: Monitor, start: int, end: int) -> None:
    """One wait for the next batch, from `start` to `end` (ns), as the `input-wait` op of
    the step being recorded: `counter` holds its op code and the step's waits so far
    (`_code`, `_step`, `_count`), the explicit monitor's iterator or the launcher's hook."""
    step = monitor.step_id
    if step != counter._step:
        counter._step, counter._count = step, 0
    monitor.timer.add(counter._code, step, counter._count, 0, start, end)
    counter._count += 1


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
        record_input_wait(self, monitor, start, _perf_ns())
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
