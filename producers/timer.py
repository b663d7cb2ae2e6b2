"""The timer API that training code calls: time ops, write rank-step batches to the local log.

    import time

    from lagscope.producers.timer import OpTimer

    timer = OpTimer(job_id="llama-70b", rank=0, dp_rank=0, pp_rank=0, tp_rank=0, cp_rank=0,
                    log_dir="lagscope-logs")
    for iteration in range(3):
        timer.step(iteration)
        with timer.op("forward-compute", microbatch=0, chunk=0):
            time.sleep(0.001)                                    # output = model(batch)
        t0 = time.time_ns()                                      # timed elsewhere:
        timer.record("params-all-gather", start_ns=t0, duration_ns=250_000)
    timer.close()

Op type names are checked at the call against `simulator.optypes.KNOWN_OPTYPES` (plus
`extra_optypes`): a typo raises `UnknownOpTypeError` at once instead of producing data no
one can analyse. `seq` (the op's order among ops of its type in its step on this rank) is
derived from start times when the step is sealed, so call sites never pass it.

Hot path (host mode): `op()` looks the name up in a dict, takes a scope object from a
free list, and the scope appends one 6-tuple of ints to a list on exit (measured the
cheapest container: `list.append` of a tuple costs ~20 ns, `array.extend` with the same
tuple several hundred); no lock, no I/O. `step(s)` hands the steps recorded so far to
the one background thread, the sealer, which converts `perf_counter_ns` stamps to
wall-clock ns (`time.time_ns` anchor taken at start and refreshed at every seal), derives
seq ids, encodes one rank-step batch per step (the bytes of producers.events'
`encode_batch`) and writes them to the local log (producers.log) in one `write`.
`list.append` is atomic under the GIL, so ops recorded from other threads (or the GC
callback) never interleave fields. The one per-op allocation is that tuple (it also counts
toward gen-0 GC thresholds: one cheap young collection per ~700 ops, which the GC probe
reports like any other).

The sealer's CPU is the monitor's cost beyond the hot path, so it is kept to a wake and a
write per seal plus one pass over the steps' ops into a seal record
(`producers/seal_record.py`: the ops pickled; whoever reads the log encodes the batches,
in its own process): short steps are handed over ~40 at a time (80 while the node's cores
are all busy), but at most 0.5 s apart (the live analysis' budget is 1 s from a step's end
to the store), and as they end for a few steps once the rank's step time changed (a
straggler appeared or recovered, `producers/step_change.py`: the live analysis needs those
steps within a step or two), no two hand-overs closer than the log's readers poll.
`$LAGSCOPE_SEAL_RECORDS` says what is written: unset or 2, version 2 of the seal record;
1, version 1 (int64 columns, for a streamer of 0.2.0 to 0.3.x); 0, batches the sealer
encodes itself (`seal_records=False`: for a streamer older than 0.2.0, which cannot read
seal records; a step whose ops repeat an earlier step's sequence then reuses everything
but its times). The sealer keeps the job's own scheduling priority: a lower one (nice 19,
SCHED_IDLE) slows the job down on a saturated machine, as the low-priority thread,
preempted while it holds the interpreter lock, keeps the training thread waiting for it.
What each of these costs is measured by `make bench` (producers, torch and latency
modules); tests/bench/NOTES.md ("The timer") has the figures behind the choices.

How ops are timed is the timer's backend (`TimingBackend`), chosen once by `mode`: the
host clock, CUDA events, or, `mode="off"` for the TP/CP ranks the analysis does not need,
nothing: every call is still checked (a typo fails on every rank alike), nothing is timed
or written, and no thread is started. The timer owns the calls, their checks, the steps'
pace and the log; `op()` takes a scope of its backend from a free list and fills it in.

CUDA mode (`mode="cuda"`, or "auto" with torch and a GPU present; torch is imported lazily):
`op()` records a pooled `torch.cuda.Event(enable_timing=True)` on the op's stream at entry
and exit (the current stream, or `stream=`); nothing on the hot path waits on the device.
A resolver thread reads completed ops at the pace host-clock ops are handed over (every ~40
steps, from `flush_interval_s` to 0.5 s apart): the start as the time elapsed after a
reference event whose wall-clock time is known, the duration as the time between the op's
two events (through the CUDA runtime torch loaded, `cuda_runtime.py`: half the CPU of
torch's `query` and `elapsed_time`, which flush() uses), and returns events to the pool.
It is the one writer of finished steps: the ops timed on the host clock (input waits, GC
pauses, `record()`) join their step's CUDA ops, and a step is written once both are in, so
each rank-step reaches the log whole. The training thread's cost per op is kept down by
events pooled up front, recorded through torch._C's event methods on the current stream's
cached Stream object (the public calls build a Stream per call; `tests/bench/cuda_bench.py`
measures it). The reference is re-calibrated
every `calibrate_every_s` from the resolver thread: it records an event on a private idle
stream and waits for *that event* only (`event.synchronize()`, never
`torch.cuda.synchronize()`), bracketing it with host clock reads.

Why record on the comm stream, and why that is safe with CUDA_DEVICE_MAX_CONNECTIONS=1:
Megatron-LM sets CUDA_DEVICE_MAX_CONNECTIONS=1 so that all streams feed one hardware work
queue, in issue order, which is what lets a collective overlap the compute issued after it.
Timing a collective with events on the *compute* stream would measure the compute stream
(and a `wait_event`/`wait_stream` to tie the two would add a real cross-stream dependency
that serialises the overlap away). `Event.record(stream)` on the NCCL/comm stream the
collective runs on is a marker in that stream only: it adds no wait to any other stream,
and in the single hardware queue it is a no-op entry between kernels, so the issue order
and the overlap Megatron relies on are unchanged. Pass `stream=` for collectives launched
on a side stream (Megatron's `async_op=True` all-gathers/reduce-scatters).

GC probe: with `gc_probe=True` a `gc.callbacks` hook records every collection as a
`gc-pause` op (host time on the training thread). A pause lies inside whatever op was
running, any number of them per step and worker (or none), so the analysis keeps pauses as
evidence about those ops, never as ops of the step's dependency model.

Megatron-LM integration (megatron/core, which call sites map to which op types):

- `pipeline_parallel/schedules.py` `forward_step` → `forward-compute` (microbatch = the
  microbatch index, chunk = the virtual-pipeline model chunk id); `backward_step` →
  `backward-compute`.
- `pipeline_parallel/p2p_communication.py` `_communicate` → `forward-send`/`forward-recv`
  (tensor_send_next / tensor_recv_prev) and `backward-send`/`backward-recv`
  (tensor_send_prev / tensor_recv_next), timed on the p2p stream.
- `distributed/param_and_grad_buffer.py` bucket `start_param_sync` → `params-all-gather`,
  `start_grad_sync` → `grads-reduce-scatter` (distributed optimizer) or
  `separate-grads-all-reduce` (plain DDP), with `stream=` the comm stream.
- `distributed/finalize_model_grads.py` `_allreduce_embedding_grads` →
  `embedding-grads-all-reduce`, `_allreduce_layernorm_grads` → `layernorm-grads-all-reduce`.
- `optimizer/clip_grads.py` `clip_grad_norm_fp32` all-reduce → `optimizer-clip-main-grad`;
  `optimizer/optimizer.py` `step` → `optimizer`.
- `training.py` `train_step`: call `timer.step(iteration)` before the step's first op.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import operator
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, ParamSpec, Protocol, TypeVar

from lagscope.producers.cuda_runtime import EventReader, event_reader
from lagscope.producers.events import RANK_LIMIT, JobInfo, StepEncoder, rank_outside
from lagscope.producers.log import KIND_BATCH, KIND_JOB, KIND_SEAL, LogWriter
from lagscope.producers.seal_record import (
    MAX_OPS_PER_SEAL,
    SEAL_VERSION,
    SEAL_VERSIONS,
    Op,
    SealPacker,
)
from lagscope.producers.step_change import StepChange
from lagscope.simulator.optypes import GC_PAUSE, KNOWN_OPTYPES

log = logging.getLogger("lagscope.timer")

P = ParamSpec("P")
R = TypeVar("R")

#: Bound once: a module-global lookup is cheaper than `time.perf_counter_ns` per call.
_perf_ns = time.perf_counter_ns


class UnknownOpTypeError(ValueError):
    """An op type name that the timer does not know (likely a typo at the call site)."""


# Ranges the wire format can hold (producers.events: step int64, microbatch int32, chunk
# int16; ranks: events.RANK_LIMIT); tighter ones come from the job record when the timer
# has one.
_STEP_LIMIT = 1 << 63
_MICROBATCH_LIMIT = 1 << 31
_CHUNK_LIMIT = 1 << 15


def _out_of_range(name: str, value: object, low: int, high: int, optype: str = "") -> ValueError:
    where = f" for op {optype!r}" if optype else ""
    return ValueError(f"{name} {value!r}{where} is out of range: expected {low} <= {name} < {high}")


def _check_identity(ranks: dict[str, int], attempt: int, job_info: JobInfo | None) -> None:
    """Reject a rank coordinate outside the job's layout (or negative when there is none)."""
    outside = rank_outside(ranks, job_info)
    if outside is not None:
        name, value, size = outside
        raise _out_of_range(name, value, 0, size)
    if not 0 <= attempt < RANK_LIMIT:
        raise _out_of_range("attempt", attempt, 0, RANK_LIMIT)


def plain_int(name: str, value: object, optype: str = "") -> int:
    """`value` as a plain int (a numpy or torch integer is one, a float is not): a seal
    record holds the ops as given, and its reader takes builtin values only.

    >>> import numpy as np
    >>> plain_int("step", np.int64(7)), type(plain_int("step", np.int64(7))).__name__
    (7, 'int')
    """
    if type(value) is int:
        return value
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        where = f" (op type {optype!r})" if optype else ""
        raise TypeError(
            f"{name} must be an integer, got {type(value).__name__} {value!r}{where}"
        ) from None


def _seal_records_from_env() -> int:
    """`$LAGSCOPE_SEAL_RECORDS`: 0 (batches) or the seal record version to write."""
    value = os.environ.get("LAGSCOPE_SEAL_RECORDS", "").strip()
    if not value:
        return SEAL_VERSION
    if value not in {"0", *map(str, SEAL_VERSIONS)}:
        raise ValueError(
            f"LAGSCOPE_SEAL_RECORDS={value!r}: 0 (batches) or a seal record version, "
            f"{' or '.join(map(str, SEAL_VERSIONS))}"
        )
    return int(value)


def _wall_minus_perf_ns() -> int:
    """time_ns() - perf_counter_ns(), from the tightest of a few bracketed samples."""
    best = None
    for _ in range(5):
        before = time.perf_counter_ns()
        wall = time.time_ns()
        after = time.perf_counter_ns()
        if best is None or after - before < best[0]:
            best = (after - before, wall - (before + after) // 2)
    assert best is not None
    return best[1]


#: How long the sealer waits for a step to end before it takes the steps that did end (at
#: least; twice the seal interval when that is longer).
_STALL_SEAL_S = 1.0
#: Short steps are handed to the sealer this many at a time: each hand-over wakes it, and a
#: seal costs a wake (taking the interpreter lock from a training thread that drops and
#: retakes it around every torch op) and a write besides its steps' ops, each several
#: times what a step's ops cost to pack (tests/bench/NOTES.md, "The timer").
_STEPS_PER_SEAL = 40
#: ... but the log never lags the job by more than this, busy node or not: the live
#: analysis has a budget of 1 s from a step's end to its rows in the store, of which the
#: streamer, Kafka, the host and its store take ~0.5 s (`make bench`, latency module). A
#: straggler's steps do not wait for it: they are handed over as they end (below).
_MAX_SEAL_INTERVAL_S = 0.5
#: While every core of the node is busy, seals are rarer still (this many times fewer
#: wakes, and as many times the lag), and so are the hand-overs of a prompt spell (below):
#: each wake is a thread the scheduler has to fit between the job's, and a busy node's
#: step times swing, which sets off prompt spells often.
_SATURATED_STRETCH = 2
#: When a rank's step time changes (`producers/step_change.py`: a straggler appeared or
#: recovered), its steps are handed over one at a time for this many steps, re-armed while
#: the change goes on: the live analysis needs them within a step or two, not 40. As many
#: as an episode may need to open after the change is told (`OnlineEpisodeSettings.
#: confirm_steps`), so that a spell does not end before the episode's last steps.
_PROMPT_STEPS = 8
#: ... but no two hand-overs closer than this, the interval at which the log's readers look
#: for new records (the streamer's `poll_interval_s`, `lagscope run --follow`'s idle poll):
#: a step handed over sooner is not read sooner, and every hand-over wakes the sealer.
_PROMPT_MIN_GAP_S = 0.1
#: How often the sealer looks at the node's load (`os.getloadavg`).
_LOAD_CHECK_S = 5.0


class _OpScope:
    """The context manager `OpTimer.op` returns on the host clock; pooled (it returns
    itself to the timer's free list on exit) so the hot path allocates only the op's
    tuple. Bound methods are cached: the timer's buffer list is never replaced."""

    __slots__ = ("_append", "_release", "head", "start", "stream")

    def __init__(self, timer: OpTimer) -> None:
        self._append = timer._buffer.append
        self._release = timer._free_scopes.append
        self.head: tuple[int, int, int, int] = (0, 0, -1, 0)
        self.start = 0
        self.stream: Any = None

    def __enter__(self) -> _OpScope:
        self.start = _perf_ns()
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        end = _perf_ns()
        start = self.start
        self._append((self.head, start, end - start))
        self._release(self)


class _NullScope:
    """`_OpScope` of a timer that records nothing: it only returns to the free list."""

    __slots__ = ("_release", "head", "stream")

    def __init__(self, timer: OpTimer) -> None:
        self._release = timer._free_scopes.append
        self.head: tuple[int, int, int, int] = (0, 0, -1, 0)
        self.stream: Any = None

    def __enter__(self) -> _NullScope:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._release(self)


class _Scope(Protocol):
    """What a backend's scopes are: context managers the timer takes from its free list
    and fills in (the op's head, the stream it runs on, which the host clock ignores);
    each returns itself to the list on exit."""

    head: tuple[int, int, int, int]
    stream: Any

    def __enter__(self) -> Any: ...

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None: ...


class TimingBackend(Protocol):
    """How an `OpTimer` times its ops, chosen once by its `mode`: the host clock
    (`_HostClock`), CUDA events (`_CudaTimer`) or not at all (`_Untimed`).

    The timer owns the API, the checks of every call, the steps' pace and the log; a
    backend owns an op's scope and, for a clock that reads its times later, when a step's
    ops are all in. As in torch elastic's timer API (`TimerClient` and its local and
    file-based clients), one small interface, an implementation per mechanism.
    """

    #: Whether ops are recorded at all: no sealer thread, GC probe or `record()` without.
    records: bool
    #: Whether ops are timed on the host clock (`OpTimer.appender` applies).
    on_host_clock: bool

    def new_scope(self) -> _Scope:
        """One more scope for the timer's free list (which starts with a few)."""
        ...

    def recorder(self) -> tuple[Callable[..., Any], Callable[..., None]] | None:
        """`OpTimer.cuda_recorder`'s (mark, add), or None."""
        ...

    def take_host_ops(self, ops: list[_Op], before_step: int) -> bool:
        """Whether the backend took the host clock's `ops` handed over (all of the steps
        before `before_step`) to write with its own; False: the sealer writes them."""
        ...

    def holds_step(self, step: int) -> bool:
        """Whether ops of `step` are timed but not yet handed to the sealer."""
        ...

    def drain(self) -> None:
        """Hand every op timed so far to the sealer (at flush, off the hot path)."""
        ...

    def stop(self) -> None:
        """Stop the backend's own threads (at close, after the last drain)."""
        ...


class _HostClock:
    """Ops timed with `time.perf_counter_ns` on the calling thread, in pooled scopes."""

    records = True
    on_host_clock = True

    def __init__(self, timer: OpTimer) -> None:
        self._timer = timer

    def new_scope(self) -> _Scope:
        return _OpScope(self._timer)

    def recorder(self) -> None:
        return None

    def take_host_ops(self, ops: list[_Op], before_step: int) -> bool:
        return False

    def holds_step(self, step: int) -> bool:
        return False

    def drain(self) -> None:
        return None

    def stop(self) -> None:
        return None


class _Untimed(_HostClock):
    """`mode="off"`, for the TP/CP ranks the analysis does not need: every call is checked
    as on the ranks that time (a typo fails on every rank alike), nothing is recorded."""

    records = False

    def new_scope(self) -> _Scope:
        return _NullScope(self._timer)


def _discard(op: _Op) -> None:
    return None


class OpTimer:
    """Times a rank's ops and writes them, one batch per step, to the local log."""

    def __init__(
        self,
        *,
        job_id: str,
        rank: int,
        dp_rank: int,
        pp_rank: int,
        tp_rank: int = 0,
        cp_rank: int = 0,
        log_dir: str | Path,
        attempt: int = 0,
        mode: Literal["auto", "host", "cuda", "off"] = "auto",
        extra_optypes: Iterable[str] = (),
        gc_probe: bool = True,
        job_info: JobInfo | None = None,
        flush_interval_s: float = 0.2,
        calibrate_every_s: float = 10.0,
        seal_records: bool | None = None,
        seal_version: int | None = None,
    ) -> None:
        ranks = dict(rank=rank, dp_rank=dp_rank, pp_rank=pp_rank, tp_rank=tp_rank, cp_rank=cp_rank)
        _check_identity(ranks, attempt, job_info)
        self.job_id = job_id
        self.attempt = attempt
        self.rank = rank
        self.dp_rank = dp_rank
        self.pp_rank = pp_rank
        self.tp_rank = tp_rank
        self.cp_rank = cp_rank
        self.optype_names: tuple[str, ...] = tuple(dict.fromkeys((*KNOWN_OPTYPES, *extra_optypes)))
        self._codes = {name: code for code, name in enumerate(self.optype_names)}
        #: Write each seal's ops as one seal record, which readers encode
        #: (`producers/seal_record.py`), instead of encoding the batches here.
        #: `$LAGSCOPE_SEAL_RECORDS`: 0 writes batches (for a streamer older than 0.2.0),
        #: 1 seal records of version 1 (older than 0.4.0), 2 (or unset) of version 2.
        chosen = _seal_records_from_env()
        self.seal_records = chosen != 0 if seal_records is None else seal_records
        self.seal_version = seal_version or chosen or SEAL_VERSION
        #: Chunks (virtual-pipeline model chunks) a rank may hold: vpp_size when known.
        self._chunk_limit = job_info.vpp_size if job_info is not None else _CHUNK_LIMIT
        self._open_log(log_dir, job_info)
        self._init_recording()
        self._init_sealing(flush_interval_s)
        self._start(mode, gc_probe, calibrate_every_s)

    def _open_log(self, log_dir: str | Path, job_info: JobInfo | None) -> None:
        """The step encoders and the rank's log writer; the job record goes first."""
        identity = dict(
            job_id=self.job_id, attempt=self.attempt, rank=self.rank, dp_rank=self.dp_rank,
            pp_rank=self.pp_rank, tp_rank=self.tp_rank, cp_rank=self.cp_rank,
            optype_names=self.optype_names,
        )  # fmt: skip
        StepEncoder(**identity)  # checks the identity and the names, once, here
        self._packer = SealPacker(**identity, version=self.seal_version)
        # No writer thread: the sealer thread writes what it encoded (one wake per seal).
        self._writer = LogWriter(log_dir, self.rank, background=False)
        self._job_info = job_info
        if job_info is not None:
            self._writer.append(KIND_JOB, job_info.model_dump_json().encode())
            self._writer.flush()  # at start-up, on the caller's thread: not the hot path

    def _init_recording(self) -> None:
        """What the hot path writes to: the current step, the op buffer, pooled scopes."""
        self._current_step = 0
        self._buffer: list[tuple[tuple[int, int, int, int], int, int]] = []
        #: The backend's scopes not in use (`_Scope`): the hot path allocates none.
        self._free_scopes: list[_Scope] = []
        self._wall_offset_ns = _wall_minus_perf_ns()

    def _init_sealing(self, flush_interval_s: float) -> None:
        """What the hand-overs and the sealer thread share, and the seals' pace."""
        #: Held while ops are encoded and written (the sealer, flush(), the CUDA resolver).
        self._lock = threading.Lock()
        self._closed = False
        #: Op types the step open at close must hold one of to be written (empty: any op
        #: but a GC pause will do); see `_drop_gc_only_step`.
        self.last_step_needs: tuple[str, ...] = ()
        #: Seal records written (each holds the ops of one or more steps).
        self.records_written = 0
        #: Seals so far: hand-overs encoded and written together (by the sealer, or by
        #: flush() and the CUDA resolver on their own threads).
        self.seals = 0
        #: Times the rank's step time changed (`step_change.py`), each starting or
        #: re-arming a prompt spell of hand-overs.
        self.step_changes = 0
        # Steps' ops travel to the sealer thread, which encodes and writes them: the
        # training thread pays a list copy, an append and a lock release per hand-over
        # (every step, or every few short ones), and the sealer wakes once per hand-over.
        self._pending: deque[list[_Op]] = deque()
        #: Released to wake the sealer (a lock as a binary semaphore: waking a thread
        #: blocked on a plain lock costs less CPU than a Condition or a Queue).
        self._wake = threading.Lock()
        self._wake.acquire()
        self._stopping = False
        self._min_seal_interval_s = flush_interval_s
        self._seal_interval_s = flush_interval_s
        #: The interval the steps' pace asks for (`_pace`), which a prompt spell shortens
        #: and its end restores.
        self._paced_interval_s = flush_interval_s
        self._prompt_gap_s = _PROMPT_MIN_GAP_S
        #: Set by the sealer while the node's cores are all busy (see `_node_saturated`).
        self.saturated = False
        self._handed_over_at = time.monotonic()
        self._paced_step = 0
        self._step_ended_at = self._handed_over_at
        self._step_change = StepChange()
        self._prompt_steps = 0
        self._hand_over_lock = threading.Lock()

    def _start(
        self,
        mode: Literal["auto", "host", "cuda", "off"],
        gc_probe: bool,
        calibrate_every_s: float,
    ) -> None:
        """The timing backend `mode` asks for and what it needs: the sealer thread and
        the GC probe where ops are recorded."""
        self.backend: TimingBackend
        if mode == "off":
            self.backend = _Untimed(self)
        elif mode == "cuda" or (mode == "auto" and _cuda_available()):
            self.backend = _CudaTimer(self, calibrate_every_s)
        else:
            self.backend = _HostClock(self)
        self._new_scope = self.backend.new_scope
        self._free_scopes.extend(self._new_scope() for _ in range(8))
        self._keep = self._buffer.append if self.backend.records else _discard
        self._sealer: threading.Thread | None = None
        if self.backend.records:
            self._sealer = threading.Thread(
                target=self._seal_loop, name=f"lagscope-sealer-{self.rank}", daemon=True
            )
            self._sealer.start()
        self._gc_start = 0
        #: Set by an integration that records only some steps (sampling) between them.
        self.gc_paused = False
        self._gc_probe = gc_probe and self.backend.records
        if self._gc_probe:
            gc.callbacks.append(self._on_gc)

    # -- hot path -------------------------------------------------------------------------

    def op(
        self,
        optype: str,
        step: int | None = None,
        microbatch: int = -1,
        chunk: int = 0,
        stream: Any = None,
    ) -> Any:
        """Context manager timing one op of type `optype` (a known op type name)."""
        code = self._codes.get(optype)
        if code is None:
            raise self._unknown(optype)
        if type(microbatch) is not int or type(chunk) is not int:
            microbatch = plain_int("microbatch", microbatch, optype)
            chunk = plain_int("chunk", chunk, optype)
        if step is None:
            step = self._current_step
        elif not 0 <= (step := plain_int("step", step, optype)) < _STEP_LIMIT:
            raise _out_of_range("step", step, 0, _STEP_LIMIT, optype)
        if not -1 <= microbatch < _MICROBATCH_LIMIT:
            raise _out_of_range("microbatch", microbatch, -1, _MICROBATCH_LIMIT, optype)
        if not 0 <= chunk < self._chunk_limit:
            raise _out_of_range("chunk", chunk, 0, self._chunk_limit, optype)
        free = self._free_scopes
        scope = free.pop() if free else self._new_scope()
        scope.head = (code, step, microbatch, chunk)
        scope.stream = stream
        return scope

    def timed(
        self, optype: str, *, microbatch: int = -1, chunk: int = 0
    ) -> Callable[[Callable[P, R]], Callable[P, R]]:
        """Decorator form of `op`: every call of the function is one op of the current step."""
        if optype not in self._codes:
            raise self._unknown(optype)

        def decorate(function: Callable[P, R]) -> Callable[P, R]:
            @functools.wraps(function)
            def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
                with self.op(optype, microbatch=microbatch, chunk=chunk):
                    return function(*args, **kwargs)

            return wrapper

        return decorate

    def record(
        self,
        optype: str,
        *,
        start_ns: int,
        duration_ns: int,
        step: int | None = None,
        microbatch: int = -1,
        chunk: int = 0,
    ) -> None:
        """Record an op timed elsewhere; `start_ns` is wall-clock (time.time_ns) ns."""
        code = self._codes.get(optype)
        if code is None:
            raise self._unknown(optype)
        start_ns = plain_int("start_ns", start_ns, optype)
        duration_ns = plain_int("duration_ns", duration_ns, optype)
        microbatch = plain_int("microbatch", microbatch, optype)
        chunk = plain_int("chunk", chunk, optype)
        if duration_ns < 0:
            raise ValueError(f"duration_ns must be >= 0, got {duration_ns} for {optype!r}")
        if step is None:
            step = self._current_step
        elif not 0 <= (step := plain_int("step", step, optype)) < _STEP_LIMIT:
            raise _out_of_range("step", step, 0, _STEP_LIMIT, optype)
        if not -1 <= microbatch < _MICROBATCH_LIMIT:
            raise _out_of_range("microbatch", microbatch, -1, _MICROBATCH_LIMIT, optype)
        if not 0 <= chunk < self._chunk_limit:
            raise _out_of_range("chunk", chunk, 0, self._chunk_limit, optype)
        self._keep(((code, step, microbatch, chunk), start_ns - self._wall_offset_ns, duration_ns))

    @property
    def steps_sealed(self) -> int:
        """Rank-steps written to the log so far (a step sealed in two parts counts twice)."""
        return self._packer.steps_packed

    def code_of(self, optype: str) -> int:
        """The code of op type `optype` (for integrations that append with `add`)."""
        code = self._codes.get(optype)
        if code is None:
            raise self._unknown(optype)
        return code

    @property
    def current_step(self) -> int:
        return self._current_step

    @property
    def on_host_clock(self) -> bool:
        """Whether ops are timed with the host clock (no CUDA events): `appender()` applies."""
        return self.backend.on_host_clock

    def cuda_recorder(self) -> tuple[Callable[[], Any], Callable[..., None]] | None:
        """CUDA mode's hot path for an integration, or None on the host clock: `mark()`
        records a pooled event on the calling thread's current stream and returns it;
        `add(head, start, end)` takes an op `head` = (code, step, microbatch, chunk)
        between two marks (any thread). What `op()` does, without its checks and scope."""
        return self.backend.recorder()

    def appender(self) -> Callable[[tuple[tuple[int, int, int, int], int, int]], None]:
        """The buffer's bound `append`, for an integration's hottest path (host clock only).

        It takes `((code, step, microbatch, chunk), start_perf_ns, duration_ns)`, with the
        same obligations as `add`; the head tuple can be built once and reused.
        """
        return self._buffer.append

    def add(
        self,
        code: int,
        step: int,
        microbatch: int,
        chunk: int,
        start_perf_ns: int,
        end_perf_ns: int,
    ) -> None:
        """Append an op timed with `time.perf_counter_ns` stamps (integration hot path).

        The caller owns the checks `op()` makes (a code from `code_of`, a step the timer
        accepted, a micro-batch index >= -1): this is one tuple and one `list.append`, safe
        from any thread (a comm completion callback, the autograd engine's thread).
        """
        self._buffer.append(
            ((code, step, microbatch, chunk), start_perf_ns, end_perf_ns - start_perf_ns)
        )

    def step(self, step: int) -> None:
        """Start step `step`: ops recorded so far go to the sealer thread (every ~40 steps,
        from `flush_interval_s` to 0.5 s apart: `_pace`; every step for a few steps after
        the step time changed: `step_change.py`), which encodes them into their steps'
        batches and writes those to the log."""
        if type(step) is not int:
            step = plain_int("step", step)
        if not 0 <= step < _STEP_LIMIT:
            raise _out_of_range("step", step, 0, _STEP_LIMIT)
        # Short steps are handed over several at a time: each hand-over wakes the sealer,
        # whose work then competes with the training thread for the interpreter and the
        # cores.
        self._current_step = step  # before a hand-over: it takes the steps before this one
        now = time.monotonic()
        if self._step_change.observe(now - self._step_ended_at):
            self._prompt_steps = _PROMPT_STEPS
            self.step_changes += 1
        self._step_ended_at = now
        elapsed = now - self._handed_over_at
        prompt = self._prompt_steps > 0
        if prompt:
            self._prompt_steps -= 1
        if elapsed >= self._seal_interval_s or (prompt and elapsed >= self._prompt_gap_s):
            self._handed_over_at = now
            self._pace(step, elapsed)
            if self._prompt_steps:
                # The CUDA resolver waits this long between passes: prompt too.
                self._seal_interval_s = self._min_seal_interval_s
            self._hand_over()
        elif prompt and not self._prompt_steps:
            # A prompt spell ends at the steps' own pace, not at the shortest interval: a
            # spell that fired on a healthy job's noise would cost one more short seal.
            self._seal_interval_s = self._paced_interval_s

    def _pace(self, step: int, elapsed: float) -> None:
        """The next hand-over's interval: `_STEPS_PER_SEAL` steps at the pace of the steps
        since the last one (`_SATURATED_STRETCH` times as many, and the prompt spells'
        least gap as long, while the node's cores are all busy), at least
        `flush_interval_s`, at most `_MAX_SEAL_INTERVAL_S`."""
        steps = max(1, step - self._paced_step)
        self._paced_step = step
        stretch = _SATURATED_STRETCH if self.saturated else 1
        self._prompt_gap_s = _PROMPT_MIN_GAP_S * stretch
        interval = min(_MAX_SEAL_INTERVAL_S, elapsed / steps * _STEPS_PER_SEAL * stretch)
        self._seal_interval_s = self._paced_interval_s = max(self._min_seal_interval_s, interval)

    # -- lifecycle ------------------------------------------------------------------------

    def flush(self) -> None:
        """Seal everything recorded so far and write it to the log file (on this thread)."""
        self._hand_over(wake=False)
        self.backend.drain()
        self._seal_pending()

    def close(self) -> None:
        if self._closed:
            return
        if self._gc_probe and self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._drop_gc_only_step()
        self.flush()
        self.backend.stop()
        self._closed = True
        self._stopping = True
        if self._sealer is not None:
            self._wake_sealer()
            self._sealer.join()
        self.flush()  # what other threads (a comm callback) recorded meanwhile
        if self._job_info is not None:
            # After the rank's last batch: the rank is done, so the job is not silent.
            ended = self._job_info.model_copy(update={"ended_ns": time.time_ns()})
            self._writer.append(KIND_JOB, ended.model_dump_json().encode())
        self._writer.close()

    def _drop_gc_only_step(self) -> None:
        """At close, a step begun but holding nothing but GC pauses (the collections of a
        job's teardown, after the optimizer's last step began the next) is no step:
        written, it would be a step this rank alone reported, held open by every live
        analysis until its lateness timeout and then stored incomplete. With
        `last_step_needs`, a step holding none of those op types is dropped the same way
        (`lagscope launch` closes its monitor at the process's exit, after what the job did
        once it stopped training)."""
        gc_code = self._codes[GC_PAUSE]
        needed = {self._codes[name] for name in self.last_step_needs if name in self._codes}
        with self._hand_over_lock:
            current = self._current_step
            ops = [op for op in self._buffer if op[0][1] == current]
            if not ops:
                return
            if needed:  # e.g. a job's final metrics gathered after its last update
                if any(op[0][0] in needed for op in ops):
                    return
            elif any(op[0][0] != gc_code for op in ops):
                return
            if self.backend.holds_step(current):
                return
            self._buffer[:] = [op for op in self._buffer if op[0][1] != current]

    def __enter__(self) -> OpTimer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------

    def _unknown(self, optype: object) -> UnknownOpTypeError:
        return UnknownOpTypeError(
            f"unknown op type {optype!r} on rank {self.rank}; known op types: "
            f"{', '.join(self.optype_names)} (pass extra_optypes= to OpTimer to add new ones)"
        )

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if self.gc_paused:
            self._gc_start = 0
            return
        if phase == "start":
            self._gc_start = time.perf_counter_ns()
        elif self._gc_start:
            end = time.perf_counter_ns()
            head = (self._codes[GC_PAUSE], self._current_step, -1, 0)
            self._buffer.append((head, self._gc_start, end - self._gc_start))
            self._gc_start = 0

    def _hand_over(self, finished_steps_only: bool = False, wake: bool = True) -> None:
        """Give what was recorded so far to the sealer thread (with `finished_steps_only`,
        the leading ops of steps before the current one).

        The buffer list is never replaced (scopes hold its bound `append`): we copy it and
        delete exactly the copied prefix, so an op appended by another thread (the GC
        callback, a comm thread calling record()) in between is kept for the next seal.
        """
        with self._hand_over_lock:
            buffer = self._buffer
            taken = buffer.copy()
            if finished_steps_only:
                current = self._current_step
                kept = next((i for i, op in enumerate(taken) if op[0][1] >= current), None)
                taken = taken if kept is None else taken[:kept]
            del buffer[: len(taken)]
            # Told even when there are none: a device clock may write the steps before the
            # current one.
            if self.backend.take_host_ops(taken, self._current_step):
                return
            if not taken:
                return
            self._pending.append(taken)
        if wake:
            self._wake_sealer()

    def _wake_sealer(self) -> None:
        # Awake already (released): it takes everything pending before it sleeps again.
        with contextlib.suppress(RuntimeError):
            self._wake.release()

    def _seal_loop(self) -> None:
        last_load_check = -_LOAD_CHECK_S  # at the first wake: a job starts on a busy node too
        while True:
            # Woken by a hand-over; else, after a while, by no step ending (a hung job, or
            # long steps): the steps that did end must reach the log, not wait in memory.
            stall_s = max(_STALL_SEAL_S, 2 * self._seal_interval_s)
            if not self._wake.acquire(timeout=stall_s) and not self._stopping:
                self._hand_over(finished_steps_only=True, wake=False)
            try:
                self._seal_pending()
            except Exception:
                # A batch that cannot be written is lost, never the thread: later steps
                # and flush() must keep working.
                log.exception("lagscope timer on rank %d could not write a batch", self.rank)
            if self._stopping:
                return
            now = time.monotonic()
            if now - last_load_check >= _LOAD_CHECK_S:
                last_load_check = now
                self.saturated = _node_saturated()

    def _seal_pending(self) -> None:
        """Encode the ops handed over and write them to the log, on this thread."""
        with self._lock:
            if not self._pending:
                return
            while self._pending:
                taken = self._pending.popleft()
                try:
                    self._write_seal(taken)
                except Exception:
                    log.exception("lagscope timer on rank %d could not write a seal", self.rank)
            self._writer.flush()
            self.seals += 1
            self._wall_offset_ns = _wall_minus_perf_ns()

    def _write_seal(self, ops: Sequence[Op]) -> None:
        """Append `ops` to the log as seal records (`producers/seal_record.py`; written at
        the next flush). Copying them into columns with C-level calls is all the sealer
        does per op: whoever reads the log encodes the batches, in its own process."""
        packer, append = self._packer, self._writer.append
        for low in range(0, len(ops), MAX_OPS_PER_SEAL):
            part = ops[low : low + MAX_OPS_PER_SEAL]
            if self.seal_records:
                append(KIND_SEAL, packer.pack(part, self._wall_offset_ns, self._current_step))
                self.records_written += 1
                continue
            for batch in packer.batches(part, self._wall_offset_ns, self._current_step):
                append(KIND_BATCH, batch)
                self.records_written += 1


#: An op as the hot path appends it: ((code, step, microbatch, chunk), start, duration).
_Op = Op


def _node_saturated() -> bool:
    """Whether every core of the node is busy: the 1-minute load average at least the
    number of cores (False where the platform has no load average)."""
    try:
        return os.getloadavg()[0] >= (os.cpu_count() or 1)
    except OSError:
        return False


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


#: A calibration whose host-clock bracket is wider than this is not precise enough to use.
_MAX_BRACKET_NS = 200_000
#: Events made when CUDA timing starts: two per op, for the ops of about one seal interval
#: of a large step (more are made when needed, and kept).
_EVENT_POOL = 512
#: The resolver gives the interpreter up after this many ops read.
_YIELD_EVERY = 64
#: Whether the resolver thread reads events through the CUDA runtime (`cuda_runtime.py`)
#: where torch loaded one; the bench turns it off to compare.
_NATIVE_READS = True


def _runtime_reader(torch: Any) -> EventReader | None:
    try:
        device = torch.cuda.current_device()
    except (AttributeError, RuntimeError):  # a torch whose CUDA module lacks it
        return None
    return event_reader(device)


class _CudaTimer:
    """CUDA-event timing: pooled events, resolved off the hot path (see module docstring).

    The one writer of finished steps in CUDA mode: the host clock's ops (input waits, GC
    pauses, ops recorded elsewhere) join their steps' CUDA ops here, so that every
    rank-step reaches the log whole."""

    records = True
    on_host_clock = False

    def __init__(self, owner: OpTimer, calibrate_every_s: float) -> None:
        import torch  # lazily: the host-mode timer must work without torch

        if not torch.cuda.is_available():
            raise RuntimeError("OpTimer(mode='cuda') needs torch with a CUDA device")
        self._torch = torch
        self._owner = owner
        #: Ops whose end event is recorded: (head, start event, end event). Appended by
        #: the threads that time ops (an atomic append, no lock), taken by the resolver.
        self._pending: deque[tuple[tuple[int, int, int, int], Any, Any]] = deque()
        #: Held by whoever resolves (the resolver thread, or flush() at the end); never by
        #: the training thread.
        self._pending_lock = threading.Lock()
        self._resolved: list[_Op] = []
        #: The host clock's ops, handed over by the training thread (atomic appends), and
        #: the step before which all of them have been: a step is written once its CUDA
        #: ops resolved and its host ops arrived.
        self._host_ops: deque[list[_Op]] = deque()
        self._host_ops_before = 0
        self._calibrate_every_s = calibrate_every_s
        self._bind_cuda_calls(torch)
        #: The resolver thread's reader of finished events (`cuda_runtime.py`), if any.
        self._native_reader = _runtime_reader(torch) if _NATIVE_READS else None
        #: Events are created up front: cudaEventCreate on the training thread costs more
        #: than the record itself. The resolver gives them back as it reads them.
        self._pool: list[Any] = [self._new_event() for _ in range(_EVENT_POOL)]
        self._side_stream = torch.cuda.Stream()
        self._reference: tuple[Any, int] | None = None
        self._last_calibration = 0.0
        self._calibrate()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._resolve_loop, name="lagscope-cuda-timer", daemon=True
        )
        self._thread.start()

    def _bind_cuda_calls(self, torch: Any) -> None:
        """The CUDA calls of the hot path and of the resolver, bound once. `Event.record`,
        `query` and `elapsed_time` are thin Python wrappers over `torch._C._CudaEventBase`,
        and `torch.cuda.current_stream()` builds a new Stream object per call: the base
        methods and the current stream's id (its Stream object cached) cost a few µs less
        per op. Where a torch lacks them, the public calls."""
        cuda = torch.cuda
        self._new_event = functools.partial(cuda.Event, enable_timing=True)
        native = getattr(torch, "_C", None)
        base = getattr(native, "_CudaEventBase", None)
        get_stream = getattr(native, "_cuda_getCurrentStream", None)
        get_device = getattr(native, "_cuda_getDevice", None)
        self._record = lambda event, stream: event.record(stream)
        self._query = lambda event: event.query()
        self._elapsed_ms = lambda first, second: first.elapsed_time(second)
        self._current_stream = cuda.current_stream
        if base is None or get_stream is None or get_device is None:
            return
        streams: dict[tuple[int, int, int], Any] = {}

        def current_stream() -> Any:
            key = get_stream(get_device())
            stream = streams.get(key)
            if stream is None:
                stream = streams[key] = cuda.Stream(
                    stream_id=key[0], device_index=key[1], device_type=key[2]
                )
            return stream

        try:  # a torch whose internals moved keeps the public calls
            first, second = self._new_event(), self._new_event()
            base.record(first, current_stream())
            base.record(second, current_stream())
            second.synchronize()
            if base.query(second) and base.elapsed_time(first, second) >= 0:
                self._record, self._query, self._elapsed_ms = (
                    base.record,
                    base.query,
                    base.elapsed_time,
                )
                self._current_stream = current_stream
        except (AttributeError, RuntimeError, TypeError):
            log.warning("lagscope timer: torch's CUDA event internals differ; public API used")

    def mark(self, stream: Any = None) -> Any:
        """A pooled event recorded now on `stream` (default: the calling thread's current
        stream): the hot path's one CUDA call."""
        try:  # the training thread and the autograd thread both take from the pool
            event = self._pool.pop()
        except IndexError:
            event = self._new_event()
        self._record(event, stream if stream is not None else self._current_stream())
        return event

    def add(self, head: tuple[int, int, int, int], start: Any, end: Any) -> None:
        """An op between two marks (any thread)."""
        self._pending.append((head, start, end))

    def new_scope(self) -> _Scope:
        return _CudaScope(self, self._owner._free_scopes.append)

    def recorder(self) -> tuple[Callable[..., Any], Callable[..., None]]:
        return self.mark, self.add

    def _calibrate(self) -> bool:
        """Pin a reference event to the host clock; True if the new reference was taken.

        The marker's wall time is only known to lie between the host reads around it. With
        CUDA_DEVICE_MAX_CONNECTIONS=1 the side stream shares the one hardware queue, so the
        marker can wait behind queued kernels: a bracket wider than `_MAX_BRACKET_NS` says
        nothing precise, so it is discarded and the previous reference is kept.
        """
        event = self._torch.cuda.Event(enable_timing=True)
        before = time.time_ns()
        event.record(self._side_stream)
        event.synchronize()  # waits for this one marker only, on the resolver thread
        after = time.time_ns()
        self._last_calibration = time.monotonic()
        if self._reference is not None and after - before > _MAX_BRACKET_NS:
            return False
        # One tuple assignment: resolve() never sees an event paired with another's time.
        self._reference = (event, (before + after) // 2)
        return True

    def _resolve_loop(self) -> None:
        native = self._native_reader
        bound = native is not None and native.bind_thread()
        read = self._read_natively if bound else self._read_with_torch
        # As often as the host clock's ops are handed over, not more: each round takes the
        # interpreter lock from the training thread, whose kernel launches a GPU job waits
        # on, and the log is written at that pace anyway.
        while not self._stop.wait(self._owner._seal_interval_s):
            # The host clock's ops of the finished steps join them here, with no wait for
            # the training thread's next hand-over.
            self._owner._hand_over(finished_steps_only=True, wake=False)
            self.resolve(read)
            if time.monotonic() - self._last_calibration > self._calibrate_every_s:
                self._calibrate()

    def holds_step(self, step: int) -> bool:
        """Whether an op of `step` timed on the device is pending or resolved unwritten."""
        with self._pending_lock:
            return any(item[0][1] == step for item in tuple(self._pending)) or any(
                op[0][1] == step for op in self._resolved
            )

    def take_host_ops(self, ops: list[_Op], before_step: int) -> bool:
        """The host clock's ops, handed over by the training thread: every one of a step
        before `before_step` is among them or came earlier. No lock: the resolver reads
        the step first, then takes what was appended."""
        if ops:
            self._host_ops.append(ops)
        if before_step > self._host_ops_before:
            self._host_ops_before = before_step
        return True

    def _read_with_torch(self, reference: Any, start: Any, end: Any) -> tuple[float, float] | None:
        """An op's start after `reference` and its duration (ms), or None while pending."""
        try:
            if not self._query(end):
                return None
            return self._elapsed_ms(reference, start), self._elapsed_ms(start, end)
        except RuntimeError:  # its start on another stream is not reached yet
            return None

    def _read_natively(self, reference: Any, start: Any, end: Any) -> tuple[float, float] | None:
        """As `_read_with_torch`, through the runtime reader (its bound thread only)."""
        try:
            return self._native_reader.read(reference, start, end)  # type: ignore[union-attr]
        except RuntimeError:  # an error of the runtime itself: torch's calls say more
            return self._read_with_torch(reference, start, end)

    def resolve(
        self, read: Callable[[Any, Any, Any], tuple[float, float] | None] | None = None
    ) -> int:
        """Move completed ops to the resolved buffer; write steps nothing is pending for.
        `read` reads an op's events (default: torch's calls, which any thread may make)."""
        read = read or self._read_with_torch
        resolved = 0
        owner = self._owner
        with self._pending_lock:
            # Read before taking anything: every op of an earlier step is in what follows.
            current_step = owner._current_step
            host_ops_before = self._host_ops_before
            out = self._resolved
            host_ops = self._host_ops
            while host_ops:
                out.extend(host_ops.popleft())
            reference_event, reference_wall_ns = self._reference  # type: ignore[misc]
            wall_offset_ns = owner._wall_offset_ns
            pool = self._pool
            pending = self._pending
            waiting_step = current_step
            # The training thread appends while we scan: rotate through the items present
            # now (never swap the deque, which would lose a concurrent append). Those it
            # appends meanwhile belong to `current_step` or later.
            for index in range(len(pending)):
                item = pending.popleft()
                head, start_ev, end_ev = item
                # In ms (float, ~0.5 µs resolution).
                times = read(reference_event, start_ev, end_ev)
                if times is None:
                    pending.append(item)
                    waiting_step = min(waiting_step, head[1])
                    continue
                start_ms, duration_ms = times
                out.append((head, reference_wall_ns + round(start_ms * 1e6) - wall_offset_ns,
                            max(0, round(duration_ms * 1e6))))  # fmt: skip
                pool.append(start_ev)
                pool.append(end_ev)
                resolved += 1
                if index % _YIELD_EVERY == _YIELD_EVERY - 1:
                    # Let the training thread have the interpreter: it launches the work
                    # the GPU waits for, and would otherwise wait for a switch interval.
                    time.sleep(0)
            done_ops = self._take_steps_before(min(waiting_step, host_ops_before))
        # Written outside the lock: every op of these steps is in `done_ops`.
        self._write(done_ops)
        return resolved

    def _take_steps_before(self, cutoff: int | None) -> list[_Op]:
        """The resolved ops of the steps before `cutoff` (None: all), taken out of the
        buffer; called with `_pending_lock` held."""
        resolved = self._resolved
        done = [op for op in resolved if cutoff is None or op[0][1] < cutoff]
        if done:
            self._resolved = [op for op in resolved if cutoff is not None and op[0][1] >= cutoff]
        return done

    def _write(self, done: list[_Op]) -> None:
        if done:
            self._owner._pending.append(done)
            self._owner._seal_pending()  # on this thread: the sealer is not woken for it

    def drain(self, timeout_s: float = 60.0) -> None:
        """Wait (off the hot path: at flush/close) for pending events; write everything."""
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline:
            self.resolve()
            time.sleep(0.001)
        self.resolve()
        with self._pending_lock:
            done = self._take_steps_before(None)
        self._write(done)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class _CudaScope:
    """`_OpScope` of CUDA mode: a pooled event recorded on the op's stream at entry and at
    exit (`_CudaTimer.mark`); the pair is read off the hot path."""

    __slots__ = ("_cuda", "_release", "_start", "head", "stream")

    def __init__(self, cuda: _CudaTimer, release: Callable[[_CudaScope], None]) -> None:
        self._cuda = cuda
        self._release = release
        self.head: tuple[int, int, int, int] = (0, 0, -1, 0)
        self.stream: Any = None

    def __enter__(self) -> _CudaScope:
        self._start = self._cuda.mark(self.stream)
        return self

    def __exit__(self, *exc: object) -> None:
        cuda = self._cuda
        cuda.add(self.head, self._start, cuda.mark(self.stream))
        self._release(self)
