"""Collectives and p2p of torch.distributed, recorded as lagscope ops.

torch.distributed has no public observer for gloo collectives, so the functions a job (or
`torch.distributed.pipelining`, or FSDP2) calls are wrapped: `all_reduce`,
`reduce_scatter(_tensor)`, `all_gather(_into_tensor)`, `all_gather_single` and
`reduce_scatter_single` (torch >= 2.15; FSDP2 calls these), `broadcast`, `send`/`recv`,
`isend`/`irecv` (and through them `batch_isend_irecv`, which calls `P2POp.op`). Each
wrapper is set on both `torch.distributed` and `torch.distributed.distributed_c10d` (c10d
compares `P2POp.op` and calls the aliases' targets through its own module globals).
`check_seams()` verifies every wrapped function still exists with the parameters the
wrappers read; `install` refuses to patch when it fails, and `tests/test_torch_seams.py`
fails loudly on a torch whose seam moved.

Classification, by the role of the op's process group (`producers.torch_layout`):

- data parallel: all-reduce -> `separate-grads-all-reduce`, reduce-scatter ->
  `grads-reduce-scatter`, all-gather -> `params-all-gather`;
- pipeline parallel: send/recv -> `forward-send`/`forward-recv` when the peer is the next
  stage for a send (the previous one for a recv), `backward-*` the other way; a schedule
  that knows better (pipelining, where pp 2 with virtual stages is ambiguous) tags the
  tensors it sends with their direction first;
- tensor/context/expert parallel and anything else: not recorded as ops of their own.
  They run inside forward/backward, whose compute ops already contain them, as in the
  reference traces.

Timing to completion, never to the call's return:

- blocking calls: call to return;
- async `Work`: from the call to its completion. Collectives on gloo complete a future
  (`Work.get_future()`), whose callback stamps the end on gloo's thread. p2p `Work` on gloo
  has no future, and its `is_completed()` stays False until the job waits on it (torch
  2.15): the job gets a `TimedWork` wrapping it, which stamps the end when
  `wait()` returns. A receive waited on long after it arrived is charged up to its wait,
  as the job itself sees it. p2p works whose `is_completed()` does say it (NCCL, CUDA
  tensors) are also polled at every hook the monitor receives, the oldest of each peer's
  lane, so a receive that completed while the rank computed is not charged for the
  computation;
- CUDA mode: the op's scope records CUDA events on the current stream at the call and at
  completion: for a blocking call after it returned (the stream then waits for the comm
  stream), for an async one in its future's callback, which torch runs on a stream that
  waits for the collective's own completion events. That is also how NCCL collectives are
  timed: an NCCL `Work`'s future is marked done when the collective is enqueued (seen on
  an H200, torch 2.11: the callback ran 0.2-0.3 ms after the call, the device finished
  25 ms later), so only an event recorded in the callback's stream marks its end. The
  process group's own completion hook was tried and given up: it is deprecated, and the
  times it reports are steady-clock points of its watchdog, which notices a completion up
  to ~100 ms late.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lagscope.simulator import optypes as ot

if TYPE_CHECKING:
    from lagscope.producers.torch_monitor import Monitor

log = logging.getLogger("lagscope.torch")

_perf_ns = time.perf_counter_ns

#: torch versions whose c10d signatures the wrappers were written against (major, minor).
TESTED_TORCH = ((2, 4), (2, 15))

#: Wrapped function -> (kind, parameters the wrapper reads, in positional order).
SEAMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "all_reduce": ("all_reduce", ("tensor", "op", "group", "async_op")),
    "reduce_scatter": ("reduce_scatter", ("output", "input_list", "op", "group", "async_op")),
    "reduce_scatter_tensor": ("reduce_scatter", ("output", "input", "op", "group", "async_op")),
    "all_gather": ("all_gather", ("tensor_list", "tensor", "group", "async_op")),
    "all_gather_into_tensor": (
        "all_gather",
        ("output_tensor", "input_tensor", "group", "async_op"),
    ),
    "broadcast": ("broadcast", ("tensor", "src", "group", "async_op")),
    # torch >= 2.15: the single-tensor collectives FSDP2 calls; the `_into_tensor` /
    # `_tensor` names above became aliases that call these.
    "all_gather_single": (
        "all_gather",
        ("output_tensor", "input_tensor", "group", "async_op"),
    ),
    "reduce_scatter_single": ("reduce_scatter", ("output", "input", "op", "group", "async_op")),
    "send": ("send", ("tensor", "dst", "group", "tag", "group_dst")),
    "recv": ("recv", ("tensor", "src", "group", "tag", "group_src")),
    "isend": ("send", ("tensor", "dst", "group", "tag", "group_dst")),
    "irecv": ("recv", ("tensor", "src", "group", "tag", "group_src")),
}
_ASYNC_P2P = frozenset({"isend", "irecv"})
#: Seams a torch older than 2.15 does not have (nothing calls them there).
_OPTIONAL = frozenset({"all_gather_single", "reduce_scatter_single"})

_DP_OPTYPE = {
    "all_reduce": ot.SEPARATE_GRADS_ALL_REDUCE,
    "reduce_scatter": ot.GRADS_REDUCE_SCATTER,
    "all_gather": ot.PARAMS_ALL_GATHER,
}


class SeamError(RuntimeError):
    """A torch function lagscope wraps is missing or changed its signature."""


def check_seams() -> list[str]:
    """What no longer matches in the installed torch (empty when every seam is intact)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    problems = []
    for name, (_, params) in SEAMS.items():
        function = getattr(c10d, name, None)
        if function is None or getattr(dist, name, None) is None:
            if name not in _OPTIONAL:
                problems.append(f"torch.distributed.{name} is missing")
            continue
        function = getattr(function, "__wrapped_by_lagscope__", function)
        try:
            have = tuple(inspect.signature(function).parameters)
        except (TypeError, ValueError):
            problems.append(f"torch.distributed.{name} has no inspectable signature")
            continue
        if have[: len(params)] != params:
            problems.append(f"torch.distributed.{name}{tuple(have)} no longer starts with {params}")
    if not hasattr(dist, "Work") or not hasattr(dist.Work, "wait"):
        problems.append("torch.distributed.Work (with wait()) is missing")
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if not TESTED_TORCH[0] <= version <= TESTED_TORCH[1]:
        log.warning(
            "lagscope.torch was tested with torch %s.%s to %s.%s, this is %s: the wrapped "
            "functions' signatures match, but check the recorded ops",
            *TESTED_TORCH[0], *TESTED_TORCH[1], torch.__version__,
        )  # fmt: skip
    return problems


_lock = threading.Lock()
_installed: dict[str, Callable[..., Any]] = {}
_monitor: Monitor | None = None


class _Inside(threading.local):
    #: A class default: reading an attribute a thread never set would raise and catch
    #: AttributeError inside getattr, on every call.
    active = False


_inside = _Inside()


def install(monitor: Monitor) -> None:
    """Wrap the torch.distributed functions for `monitor` (one monitor per process)."""
    global _monitor
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    with _lock:
        if _monitor is not None:
            raise RuntimeError(
                "a lagscope monitor is already running in this process; close() it first"
            )
        problems = check_seams()
        if problems:
            raise SeamError(
                "lagscope.torch cannot time torch.distributed in this torch version: "
                + "; ".join(problems)
            )
        for name, (kind, _) in SEAMS.items():
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapper = _make_wrapper(name, kind, original)
            _installed[name] = original
            setattr(c10d, name, wrapper)
            setattr(dist, name, wrapper)
        _monitor = monitor


def uninstall(monitor: Monitor) -> None:
    global _monitor
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    with _lock:
        if _monitor is not monitor:
            return
        for name, original in _installed.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)
        _installed.clear()
        _monitor = None


_UNSEEN = object()


class suppressed:
    """Within this block, wrapped calls on this thread are not recorded (an integration
    that records the op itself, like the DDP comm hook, calls all_reduce inside)."""

    __slots__ = ("_before",)

    def __enter__(self) -> None:
        self._before = _inside.active
        _inside.active = True

    def __exit__(self, *exc: object) -> None:
        _inside.active = self._before


def _make_wrapper(name: str, kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper set in place of c10d's `name`, an op of `kind`: one for collectives and
    one for p2p, chosen here once rather than on every call."""
    make = _p2p_wrapper if kind in ("send", "recv") else _collective_wrapper
    wrapper = make(name, kind, original)
    wrapper.__wrapped_by_lagscope__ = original  # type: ignore[attr-defined]
    wrapper.__name__ = name
    wrapper.__qualname__ = name
    wrapper.__doc__ = original.__doc__
    wrapper.__signature__ = inspect.signature(original)  # type: ignore[attr-defined]
    return wrapper


def _collective_wrapper(name: str, kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """A collective, recorded by the role of its group: timed on the device where NCCL can,
    else from the call to its return or, async, to its completion. It runs on every
    collective the job calls: the common case (blocking, host clock) has no helper call."""
    params = SEAMS[name][1]
    group_at = params.index("group")
    async_at = params.index("async_op")

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        monitor = _monitor
        if monitor is None or not monitor.active or _inside.active:
            return original(*args, **kwargs)
        group = args[group_at] if len(args) > group_at else kwargs.get("group")
        code = monitor.collective_codes.get((kind, id(group)), _UNSEEN)
        if code is _UNSEEN:
            code = monitor.collective_code(kind, group)
        is_async = bool(args[async_at] if len(args) > async_at else kwargs.get("async_op"))
        if code is None:
            monitor.unrecorded_calls += 1
            return original(*args, **kwargs)
        if monitor.pending_works:
            monitor.poll_works()
        # A c10d function may call another wrapped one (all_gather_into_tensor calls
        # all_gather_single in torch 2.15): the guard records it once.
        _inside.active = True
        if not is_async and monitor.host_clock:
            start = _perf_ns()
            try:
                return original(*args, **kwargs)
            finally:
                _inside.active = False
                monitor.append(((code, monitor.step_id, -1, 0), start, _perf_ns() - start))
        # Inlined here and in the p2p wrapper alike: a shared helper would add a call to
        # every recorded op.
        opened = monitor.begin(code)
        try:
            result = original(*args, **kwargs)
        except BaseException:
            monitor.end(opened)
            raise
        finally:
            _inside.active = False
        if not is_async or result is None:
            monitor.end(opened)
            return result
        return monitor.time_work(result, opened, False, (code, id(group)))

    return wrapper


def _p2p_wrapper(name: str, kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """A send or recv, recorded as a pipeline transfer by the stage of its peer, from the
    call to its return (blocking) or to its completion (isend/irecv).

    In a real job each Python call of a hook costs the training thread about a
    microsecond (the job's compute evicts the interpreter's caches between hooks), so the
    common case (positional arguments, a peer seen before, no direction hint, the host
    clock) reads its arguments with one `len`, looks its op code up in place and opens the
    op inline; a gloo work's `wait()` ends it inline too. A recorded p2p op calls into
    lagscope twice beyond this wrapper (the work's wrapping and its wait), and finds its
    arguments and code with one `len` and one `id` (what that saves: tests/bench/NOTES.md,
    "The timer")."""
    params = SEAMS[name][1]
    group_at = params.index("group")
    peer_name = params[1]
    group_peer_name = "group_dst" if kind == "send" else "group_src"
    is_async = name in _ASYNC_P2P

    def arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
        """(tensor, peer, group, group peer) of a call, however it was made."""
        group = args[group_at] if len(args) > group_at else kwargs.get("group")
        peer = args[1] if len(args) > 1 else kwargs.get(peer_name)
        group_peer = args[4] if len(args) > 4 else kwargs.get(group_peer_name)
        tensor = args[0] if args else kwargs["tensor"]
        return tensor, peer, group, group_peer

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        monitor = _monitor
        if monitor is None or not monitor.active or _inside.active:
            return original(*args, **kwargs)
        count = len(args)
        if kwargs or count < 2:
            tensor, peer, group, group_peer = arguments(args, kwargs)
        else:
            tensor, peer = args[0], args[1]
            group = args[group_at] if count > group_at else None
            group_peer = args[4] if count > 4 else None
        if monitor.direction_hints:
            code = monitor.p2p_code(kind, tensor, peer, group, group_peer)
        else:
            try:
                code = monitor.p2p_codes[(kind, peer, group_peer, id(group))]
            except KeyError:
                code = monitor.p2p_code(kind, tensor, peer, group, group_peer)
        if code is None:
            monitor.unrecorded_calls += 1
            return original(*args, **kwargs)
        if monitor.pending_works:
            monitor.poll_works()
        # send calls isend in some torch versions: the guard records it once.
        _inside.active = True
        if monitor.host_clock:
            opened = ((code, monitor.step_id, -1, 0), _perf_ns())
        else:
            opened = monitor.begin(code)
        try:
            result = original(*args, **kwargs)
        except BaseException:
            monitor.end(opened)
            raise
        finally:
            _inside.active = False
        if not is_async or result is None:
            monitor.end(opened)
            return result
        if not tensor.is_cuda:
            # gloo's p2p works report completion only once waited on (torch 2.15): asking
            # them would cost a call per hook and never stamp anything. Their op ends at
            # the job's wait().
            return TimedWork(result, opened, monitor.end, monitor.timed_work_append)
        tag = args[3] if count > 3 else kwargs.get("tag", 0)
        return monitor.time_work(result, opened, True, (code, peer, group_peer, id(group), tag))

    return wrapper


class TimedWork:
    """A torch.distributed work (`inner`) whose completion ends its op (see the module
    docstring): the job gets it in the work's place. `wait`, `is_completed` and
    `synchronize` see the completion; every other attribute is the inner work's.

    `end(opened)` ends the op `opened`; on the host clock, `append` instead takes the
    finished op `(head, start, duration)` from an `opened` of `(head, start)`, one call
    less on a path every recorded p2p op takes. `lagscope.megatron`'s overlapped p2p
    handles are these too, their op an `OpTimer.op` scope held in a `Span`.

    Not a subclass of torch's `Work`, which built a C++ `Work` for every recorded p2p call:
    0.9 us in a loop, ~19 us a call in place. On the 1F1B test job (every other step
    recorded, 2 x 500 steps, the two builds interleaved) a recorded rank-step cost the
    training thread 350 us (95 % CI +-33) more than an unrecorded one with the subclass,
    194 (+-28) with this wrapper. torch's own p2p callers (`batch_isend_irecv` on gloo, the
    pipelining schedules) only wait on what they get."""

    __slots__ = ("_append", "_end", "inner", "scope")

    def __init__(
        self,
        inner: Any,
        opened: Any,
        end: Callable[[Any], None],
        append: Callable[[Any], None] | None = None,
    ) -> None:
        self.inner = inner
        self.scope = opened
        self._end = end
        self._append = append

    def complete(self) -> None:
        """End the op now (done, or the caller knows no more about it)."""
        opened = self.scope
        if opened is not None:
            self.scope = None
            self._end(opened)

    def poll(self) -> bool:
        """End the op if the inner work has completed; True when it has."""
        if self.scope is None:
            return True
        if self.inner.is_completed():
            self.complete()
            return True
        return False

    def wait(self, timeout: Any = None) -> bool:
        done = self.inner.wait() if timeout is None else self.inner.wait(timeout)
        opened = self.scope  # `complete()` inline: the job waits on every p2p work
        if opened is not None:
            self.scope = None
            if self._append is None:
                self._end(opened)
            else:
                head, start = opened
                self._append((head, start, _perf_ns() - start))
        return done

    def is_completed(self) -> bool:
        return self.poll()

    def synchronize(self) -> None:
        self.inner.synchronize()
        self.complete()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
