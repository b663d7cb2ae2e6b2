"""The per-rank monitor behind `lagscope.torch.monitor()`: one OpTimer, the hooks, the
wrapped collectives, the step counter and the sampling schedule, in one object.

Step boundaries: the optimizer's step post-hook (or `Monitor.step()` in a job without an
optimizer) ends a step. Steps are numbered from `first_step`; only the steps the schedule
records produce ops, and hooks of other steps return after one attribute check.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any, Literal

from lagscope.producers import torch_comm, torch_hooks
from lagscope.producers.events import JobInfo
from lagscope.producers.integration_start import CALLBACKS_IN_FLIGHT, rank_timer
from lagscope.producers.timer import OpTimer, plain_int
from lagscope.producers.torch_layout import Layout
from lagscope.producers.torch_sampling import EVERY_STEP, Schedule

_perf_ns = time.perf_counter_ns


class Monitor:
    """Records one rank of a torch.distributed job into its lagscope log."""

    def __init__(
        self,
        *,
        layout: Layout,
        info: JobInfo,
        log_dir: str | Path,
        schedule: Schedule = EVERY_STEP,
        mode: Literal["auto", "host", "cuda"] = "auto",
        gc_probe: bool = True,
        first_step: int = 0,
    ) -> None:
        first_step = plain_int("first_step", first_step)  # a checkpoint's step may be a tensor
        self.layout = layout
        self.info = info
        self.schedule = schedule
        representative = layout.is_representative
        self.timer = rank_timer(
            layout, info, log_dir, mode=mode, gc_probe=gc_probe,
            extra_optypes=(torch_hooks.INPUT_WAIT,),
        )  # fmt: skip
        self._first_step = first_step
        self.step_id = first_step
        self.timer.step(first_step)
        #: Whether the current step is recorded (read by every hook first).
        self.active = representative and schedule.records(0)
        self._representative = representative
        self.unrecorded_calls = 0
        self._init_attachments()
        self._bind_timer(self.timer)
        self._init_comm_codes()
        self._closed = False
        self._set_gc(self.active)
        torch_comm.install(self)

    def _init_attachments(self) -> None:
        """What the job's objects get: hooks on modules and optimizers, the data loader,
        the async works still running."""
        self.module_hooks: list[torch_hooks.ModuleHooks] = []
        self.optimizer_hooks: list[torch_hooks.OptimizerHooks] = []
        self.backward_calls: torch_hooks.BackwardCalls | None = None
        self.loaders: list[Any] = []
        #: What to iterate for the recorded input waits: the data loader itself when it
        #: could be changed in place, else a wrapping iterator.
        self.data: Any = None
        #: Async works not known to be complete yet (`TimedWork`s), in lanes: the works of
        #: one lane (one peer, direction and tag) complete in the order they were issued.
        self.pending_works: dict[Hashable, collections.deque[Any]] = {}

    def _bind_timer(self, timer: OpTimer) -> None:
        """The timer's entry points the hooks call, bound once: on the host clock, `begin`
        and `end` stamp ops themselves and `append` takes a finished op."""
        recorder = timer.cuda_recorder()
        if recorder is None:
            self.begin = self._begin_host  # type: ignore[method-assign]
            self.end = self._end_host  # type: ignore[method-assign]
        else:
            self._mark, self._add_cuda = recorder
            self.begin = self._begin_cuda  # type: ignore[method-assign]
            self.end = self._end_cuda  # type: ignore[method-assign]
        #: Whether ops are timed on the host clock (then `append` takes a finished op).
        self.host_clock = timer.on_host_clock
        self.append = timer.appender()
        #: What a `TimedWork` appends its finished op with (None: it calls `end`).
        self.timed_work_append = self.append if self.host_clock else None
        self._names = timer.optype_names
        self._codes = {name: timer.code_of(name) for name in timer.optype_names}

    def _init_comm_codes(self) -> None:
        """How collectives and p2p are recorded: learnt per group on first use."""
        #: (collective kind, id(group)) -> op code, or None when the op is not recorded.
        self.collective_codes: dict[tuple[str, int], int | None] = {}
        #: (kind, peer, group peer, id(group)) -> op code, or None when not recorded.
        self.p2p_codes: dict[tuple[str, int | None, int | None, int], int | None] = {}
        #: id(tensor) -> "forward"/"backward", set by a schedule that knows a p2p's direction.
        self.direction_hints: dict[int, str] = {}

    # -- step boundaries ------------------------------------------------------------------

    def step(self) -> None:
        """End the current step (the optimizer's post-hook calls this for you)."""
        self.poll_works()
        self.close_backwards()
        self.step_id += 1
        self.timer.step(self.step_id)
        self.active = self._representative and self.schedule.records(
            self.step_id - self._first_step
        )
        self._set_gc(self.active)

    def _set_gc(self, on: bool) -> None:
        # The GC probe belongs to recorded steps only: a pause in an unrecorded step would
        # make a step of its own that no other rank reports.
        self.timer.gc_paused = not on

    # -- events from hooks and wrappers ---------------------------------------------------

    def on_event(self) -> None:
        """Called by every recording hook: stamp works that completed meanwhile."""
        if self.pending_works:
            self.poll_works()

    def poll_works(self) -> None:
        """Stamp the works that completed since the last poll.

        Only each lane's oldest work is asked: a later one of the same lane cannot have
        completed before it, so a poll costs one native call per lane. Should a transport
        ever complete a lane out of order, the later work is stamped when the earlier one
        completes or when the job waits on it: later, never lost.
        """
        pending = self.pending_works
        for lane in list(pending):
            works = pending[lane]
            while works and works[0].poll():
                works.popleft()
            if not works:
                del pending[lane]

    # -- opening and closing ops (host clock, or CUDA events in CUDA mode) ----------------

    def begin(self, code: int, microbatch: int = -1, chunk: int = 0) -> Any:
        """Start an op of the current step; pass what it returns to `end`."""
        scope = self.timer.op(self._names[code], microbatch=microbatch, chunk=chunk)
        scope.__enter__()
        return scope

    def end(self, opened: Any) -> None:
        opened.__exit__(None, None, None)

    def _begin_host(self, code: int, microbatch: int = -1, chunk: int = 0) -> Any:
        return ((code, self.step_id, microbatch, chunk), _perf_ns())

    def _end_host(self, opened: Any) -> None:
        head, start = opened
        self.append((head, start, _perf_ns() - start))

    def _begin_cuda(self, code: int, microbatch: int = -1, chunk: int = 0) -> Any:
        return (code, self.step_id, microbatch, chunk), self._mark()

    def _end_cuda(self, opened: Any) -> None:
        head, start = opened
        self._add_cuda(head, start, self._mark())

    def close_backwards(self) -> None:
        for hooks in self.module_hooks:
            hooks.close_backward()

    def collective_code(self, kind: str, group: Any) -> int | None:
        """The op code of a collective of `kind` on `group`, or None (not recorded)."""
        key = (kind, id(group))
        try:
            return self.collective_codes[key]
        except KeyError:
            pass
        optype = torch_comm._DP_OPTYPE.get(kind) if self._role(group) == "dp" else None
        code = None if optype is None else self._codes[optype]
        self.collective_codes[key] = code
        return code

    def p2p_code(
        self, kind: str, tensor: Any, peer: int | None, group: Any, group_peer: int | None
    ) -> int | None:
        """The op code of a p2p call: the direction a schedule tagged `tensor` with, else
        the one the peer's stage gives; None when the call is not recorded."""
        if self.direction_hints:
            hint = self.direction_hints.pop(id(tensor), None)
            if hint is not None:
                return self._codes[f"{hint}-{kind}"]
        # The direction follows from the peer's stage alone: worked out once per peer.
        key = (kind, peer, group_peer, id(group))
        try:
            return self.p2p_codes[key]
        except KeyError:
            pass
        optype = self._p2p_optype_by_peer(kind, peer, group, group_peer)
        code = None if optype is None else self._codes[optype]
        self.p2p_codes[key] = code
        return code

    def _p2p_optype_by_peer(
        self, kind: str, peer: int | None, group: Any, group_peer: int | None
    ) -> str | None:
        """The op type of a p2p call from the peer's pipeline stage (None: not recorded)."""
        import torch.distributed as dist

        if peer is None and group_peer is not None:
            peer = dist.get_global_rank(group, group_peer) if group is not None else group_peer
        if peer is None:
            return None
        layout = self.layout
        peer_stage = layout.stage_of(peer)
        stage = layout.coords["pp"]
        if peer_stage is None or peer_stage == stage:
            return None
        wraps_forward = layout.vpp_size > 1 and layout.pp_size > 2 and peer_stage == 0
        forward_peer = peer_stage > stage or (stage == layout.pp_size - 1 and wraps_forward)
        if kind == "send":
            return "forward-send" if forward_peer else "backward-send"
        return "backward-recv" if forward_peer else "forward-recv"

    def _role(self, group: Any) -> str | None:
        if group is None:
            import torch.distributed as dist

            group = dist.group.WORLD
        return self.layout.roles.get(id(group))

    def time_work(self, work: Any, opened: Any, p2p: bool, lane: Hashable = None) -> Any:
        """End the op `opened` when `work` completes; returns what the caller gets back.

        `lane`: works issued with the same lane complete in issue order (same peer,
        direction and tag, or the same group's collectives); they are polled at every hook.
        None: a work that says it is complete only once waited on, not polled."""
        if not p2p:
            try:
                future = work.get_future()
            except RuntimeError:
                future = None
            if future is not None:
                end = self.end
                CALLBACKS_IN_FLIGHT.add()

                def done(_: Any) -> None:
                    try:
                        end(opened)
                    finally:
                        CALLBACKS_IN_FLIGHT.done()

                future.add_done_callback(done)
                return work
        timed = torch_comm.TimedWork(work, opened, self.end, self.timed_work_append)
        if lane is None:  # nothing to poll: its wait() ends the op
            return timed
        works = self.pending_works.get(lane)
        if works is None:
            works = self.pending_works[lane] = collections.deque()
        works.append(timed)
        return timed

    # -- lifecycle ------------------------------------------------------------------------

    def close(self) -> None:
        """Stop recording, remove every hook and wrapper, write what was recorded."""
        if self._closed:
            return
        self._closed = True
        self.active = False
        torch_comm.uninstall(self)
        for hooks in self.module_hooks:
            hooks.remove()
        if self.backward_calls is not None:
            self.backward_calls.remove()
        for hooks in self.optimizer_hooks:
            hooks.remove()
        for loader in self.loaders:
            torch_hooks.untime_input(loader)
        deadline = time.monotonic() + 5.0
        while self.pending_works and time.monotonic() < deadline:
            self.poll_works()
            time.sleep(0.001)
        self.timer.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def attach_modules(self, modules: Sequence[Any]) -> None:
        for chunk, module in enumerate(modules):
            self.module_hooks.append(torch_hooks.ModuleHooks(self, module, chunk))
        if len(self.module_hooks) == 1 and self.backward_calls is None:
            self.backward_calls = torch_hooks.BackwardCalls(self, self.module_hooks[0])

    def attach_optimizer(self, optimizer: Any) -> None:
        self.optimizer_hooks.append(torch_hooks.OptimizerHooks(self, optimizer))
