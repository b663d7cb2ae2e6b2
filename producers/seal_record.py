"""A seal's ops as the training process writes them, and the batches a reader makes of them.

The timer's sealer runs beside the training thread, on the same cores and under the same
interpreter lock, so what it does per op is the monitor's cost to the job. Measured in a
real 4-rank 1F1B job, encoding a rank-step's ~20 ops into its batch took 75-92 us there,
against 13 us warm in a loop of its own: the training evicts the encoder's code and data
from the caches between seals. So the sealer only serialises a seal's ops with one
C-level call (`SealPacker.pack`) and writes them as one `KIND_SEAL` record; whoever reads
the log (the streamer, `lagscope run`, `read_all`) turns it into the rank-step batches the
timer used to write (`expand_seal`), byte for byte (tests/test_timer.py), warm, in its own
process.

A seal record (little-endian):

    header     version u16, ops u32, continued u16, wall offset i64, context bytes u32
    context    JSON: the timer's job identity and op type names (the batch's identity and
               dictionary; the same bytes every seal of a timer, so a reader keeps its
               encoder per context)
    continued  (step i64, op type code i32, ops before u32) per op type of a step that
               earlier seals of this timer already held ops of: its seq ids continue
    ops        version 2: the ops as the hot path appended them, a list of
               ((code, step, micro-batch, chunk), start, duration), pickled (protocol 5,
               no memo); version 1: three columns, heads (code, step, micro-batch, chunk)
               i64 each per op in the order recorded, starts (perf_counter ns i64 per op),
               durations (ns i64 per op)

Starts are perf_counter ns; + the wall offset, wall-clock ns. Version 2 (the default since
0.4.0) costs the sealer one pass over the ops' objects, which are cache-cold by then:
splitting them into columns took four. In the real 1F1B job, 3 interleaved pairs of runs,
on the sealer's clock: 630-1000 ns an op to pack version 1, 460-610 version 2; warm, in a
loop of its own (`make bench`), 4.8 against 2.9 us per 22-op rank-step. Its reader takes
no globals and no persistent ids (`_OpsUnpickler`): what it can make of any bytes is
builtin containers and numbers, checked on their way to a batch (a count, shape or value
that is not an op's is a SchemaError naming it). Version 1 is still read, and written for
a streamer older than 0.4.0 (`$LAGSCOPE_SEAL_RECORDS=1`).

Everything a batch needs is in its seal's record, so a reader that resumes at any record
makes the same batches (the same `batch_id`s: a re-read is deduplicated downstream).
"""

from __future__ import annotations

import io
import json
import operator
import pickle
import struct
import sys
import zlib
from array import array
from bisect import bisect_right
from collections import Counter, deque
from collections.abc import Sequence
from itertools import chain
from typing import Any

from lagscope.producers.events import _HEADER as _BATCH_HEADER
from lagscope.producers.events import _TRAILER as _BATCH_TRAILER
from lagscope.producers.events import BATCH_MAGIC, BATCH_VERSION, SchemaError, StepEncoder

#: The version a timer writes by default; `expand_seal` reads every one of `SEAL_VERSIONS`.
SEAL_VERSION = 2
SEAL_VERSIONS = (1, 2)
_READS = " and ".join(map(str, SEAL_VERSIONS))
_SEAL_HEADER = struct.Struct("<HIHqI")
_CONTINUED = struct.Struct("<qiI")
#: A rank-step with more ops than this is written as several batches.
MAX_OPS_PER_BATCH = 200_000
#: Most ops in one seal record (48 bytes each: well under the log's 16 MiB record limit).
MAX_OPS_PER_SEAL = 100_000
_BIG_ENDIAN = sys.byteorder == "big"

#: An op as the hot path appends it: ((code, step, microbatch, chunk), start, duration).
Op = tuple[tuple[int, int, int, int], int, int]

_STEP_OF_HEAD = operator.itemgetter(1)
_CODE_OF_HEAD = operator.itemgetter(0)
_HEAD = operator.itemgetter(0)
#: An op's start (`Op`), as a C-level sort key.
_START = operator.itemgetter(1)


def _int64_bytes(values: Sequence[int]) -> bytes:
    # From a sequence: `array` fills from an iterator one append at a time, 4x slower.
    column = array("q", values)
    if _BIG_ENDIAN:
        column.byteswap()
    return column.tobytes()


class SealPacker:
    """The training side: a seal's ops as one record's payload, with C-level calls only,
    and what a later seal's ops of the same steps continue from.

    >>> from lagscope.producers.events import decode_batch
    >>> packer = SealPacker(job_id="j", attempt=0, rank=0, dp_rank=0, pp_rank=0,
    ...                     tp_rank=0, cp_rank=0, optype_names=("forward-compute",))
    >>> payload = packer.pack([((0, 7, 0, 0), 1_000, 50)], wall_offset_ns=10**18)
    >>> [batch.step for batch in map(decode_batch, expand_seal(payload))]
    [7]
    """

    def __init__(
        self,
        *,
        job_id: str,
        attempt: int,
        rank: int,
        dp_rank: int,
        pp_rank: int,
        tp_rank: int,
        cp_rank: int,
        optype_names: Sequence[str],
        version: int = SEAL_VERSION,
    ) -> None:
        if version not in SEAL_VERSIONS:
            raise ValueError(f"seal record version {version}: one of {SEAL_VERSIONS}")
        self.version = version
        context = {
            "job_id": job_id, "attempt": attempt, "rank": rank, "dp_rank": dp_rank,
            "pp_rank": pp_rank, "tp_rank": tp_rank, "cp_rank": cp_rank,
            "optype_names": list(optype_names),
        }  # fmt: skip
        self._context = json.dumps(context, separators=(",", ":")).encode()
        #: The ops of the recent seals with their steps, and the steps they hold: the
        #: steps that may still get ops (an asynchronous op ends after its step's seal).
        #: Counted only when such an op comes (rare): a count per op would cost every
        #: seal its ~350 dictionary updates.
        self._recent: deque[tuple[set[int], Sequence[Op]]] = deque()
        self._sealed_steps: set[int] = set()
        #: Steps packed so far, each counted once per seal that held ops of it.
        self.steps_packed = 0

    def pack(self, ops: Sequence[Op], wall_offset_ns: int, current_step: int = 0) -> bytes:
        """One seal's payload (`MAX_OPS_PER_SEAL` ops at most) in this packer's version.
        `current_step`: steps 16 and more before it are forgotten (no op of theirs is
        expected any more)."""
        continued = self._continued(ops, current_step)
        head = b"".join((
            _SEAL_HEADER.pack(self.version, len(ops), len(continued), wall_offset_ns,
                              len(self._context)),
            self._context,
            b"".join(_CONTINUED.pack(s, c, n) for (s, c), n in continued.items()),
        ))  # fmt: skip
        if self.version == 2:
            return head + _pickled(ops)
        heads, starts, durations = zip(*ops, strict=True)
        return b"".join((
            head,
            _int64_bytes(tuple(chain.from_iterable(heads))),
            _int64_bytes(starts),
            _int64_bytes(durations),
        ))  # fmt: skip

    def batches(self, ops: Sequence[Op], wall_offset_ns: int, current_step: int = 0) -> list[bytes]:
        """The batches `expand_seal` makes of `pack`'s payload, made here (a timer that
        writes batches, not seal records)."""
        counts: dict[int, list[int]] = {}
        encoder = _encoder_of(self._context)
        for (step, code), n in self._continued(ops, current_step).items():
            counts.setdefault(step, [0] * encoder.n_codes)[code] = n
        return encoder.encode_ops(ops, wall_offset_ns, {s: tuple(c) for s, c in counts.items()})

    def _continued(self, ops: Sequence[Op], current_step: int) -> dict[tuple[int, int], int]:
        """Ops that earlier seals held of (step, op type), for the steps of `ops` that
        earlier seals held ops of (rare: an op that ended after its step was sealed); and
        count `ops` for the seals after this one."""
        steps = set(map(_STEP_OF_HEAD, map(_HEAD, ops)))
        self.steps_packed += len(steps)
        again = steps & self._sealed_steps
        before: Counter[tuple[int, int]] = Counter()
        if again:
            for held, earlier in self._recent:
                if held & again:
                    before.update(
                        (step, code) for (code, step, _, _), _, _ in earlier if step in again
                    )
        self._recent.append((steps, ops))
        self._sealed_steps |= steps
        if len(self._sealed_steps) > 64:
            horizon = current_step - 16
            self._sealed_steps = {s for s in self._sealed_steps if s >= horizon}
            self._recent = deque(seal for seal in self._recent if max(seal[0]) >= horizon)
        return before


def expand_seal(payload: bytes | memoryview) -> list[bytes]:
    """The rank-step batches of a seal record (one per step, more where a step exceeds
    `MAX_OPS_PER_BATCH`), in step order. A record that does not hold what its header
    says raises SchemaError naming what is wrong."""
    view = memoryview(payload)
    if len(view) < _SEAL_HEADER.size:
        raise SchemaError(f"seal record of {len(view)} bytes is shorter than its header")
    version, n, n_continued, offset, context_size = _SEAL_HEADER.unpack_from(view)
    if version not in SEAL_VERSIONS:
        raise SchemaError(f"seal record version {version} (this reader reads {_READS})")
    at = _SEAL_HEADER.size
    ops_at = at + context_size + n_continued * _CONTINUED.size
    if version == 1 and len(view) != ops_at + 48 * n:
        raise SchemaError(f"seal record of {len(view)} bytes, its header says {ops_at + 48 * n}")
    if version == 2 and len(view) <= ops_at:
        says = f"at least {ops_at + 1}"
        raise SchemaError(f"seal record of {len(view)} bytes, its header says {says}")
    encoder = _encoder_of(bytes(view[at : at + context_size]))
    at += context_size
    continued: dict[int, list[int]] = {}
    for _ in range(n_continued):
        step, code, count = _CONTINUED.unpack_from(view, at)
        at += _CONTINUED.size
        if not 0 <= code < encoder.n_codes:
            raise SchemaError(f"seal record continues op type code {code} of step {step}")
        continued.setdefault(step, [0] * encoder.n_codes)[code] = count
    ops = _unpickled_ops(view[at:], n) if version == 2 else _column_ops(view[at:], n)
    try:
        codes = list(map(_CODE_OF_HEAD, map(_HEAD, ops)))
        if codes and (min(codes) < 0 or max(codes) >= encoder.n_codes):
            raise SchemaError(f"seal record holds an op type code outside its {encoder.n_codes}")
        return encoder.encode_ops(ops, offset, {s: tuple(c) for s, c in continued.items()})
    except (struct.error, OverflowError) as exc:
        raise SchemaError(
            f"seal record holds a value its batch column cannot hold: {exc}"
        ) from None
    except (TypeError, ValueError, IndexError, KeyError) as exc:
        # Version 2 only (version 1's columns are integers): unpickled bytes can be any
        # builtin containers and numbers, which fail somewhere on the way to a batch.
        raise SchemaError(
            f"seal record holds an op that is not (head of four, start, duration) of "
            f"integers: {exc!r}"
        ) from None


def _column_ops(view: memoryview, n: int) -> list[Op]:
    """A version 1 record's ops, from its three columns."""
    flat, starts, durations = _columns(view, n)
    heads = list(zip(flat[0::4], flat[1::4], flat[2::4], flat[3::4], strict=True))
    return list(zip(heads, starts, durations, strict=True))


def _pickled(ops: Sequence[Op]) -> bytes:
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=5)
    # No memo: the ops share no containers, and a memo entry per object is a third of the
    # time of pickling them.
    pickler.fast = True
    pickler.dump(ops if type(ops) is list else list(ops))
    return buffer.getvalue()


class _OpsUnpickler(pickle.Unpickler):
    """Reads a version 2 record's ops: builtin containers and numbers only, never a global
    (which could name anything to import and call); a persistent id is refused already."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a seal record names no global, this one {module}.{name}")


def _unpickled_ops(view: memoryview, n: int) -> list[Op]:
    """A version 2 record's list of `n` ops. What they hold is checked on the way to their
    batches (`expand_seal`): a value that is not an integer fails there, one that equals
    one (1.0, True) makes the bytes the integer would."""
    source = io.BytesIO(view)
    try:
        ops = _OpsUnpickler(source).load()
    except Exception as exc:  # damaged bytes raise whatever the opcode they became raises
        raise SchemaError(f"seal record's ops do not unpickle: {exc!r}") from None
    if type(ops) is not list or len(ops) != n:
        got = f"{len(ops)} ops" if type(ops) is list else f"a {type(ops).__name__}"
        raise SchemaError(f"seal record holds {got}, its header says {n} ops")
    if source.tell() != len(view):
        raise SchemaError(f"seal record has {len(view) - source.tell()} bytes after its ops")
    return ops


def _columns(view: memoryview, n: int) -> tuple[list[int], list[int], list[int]]:
    columns = []
    for low, high in ((0, 32 * n), (32 * n, 40 * n), (40 * n, 48 * n)):
        column = array("q")
        column.frombytes(view[low:high])
        if _BIG_ENDIAN:
            column.byteswap()
        columns.append(column.tolist())
    heads, starts, durations = columns
    return heads, starts, durations


_encoders: dict[bytes, SealEncoder] = {}


def _encoder_of(context: bytes) -> SealEncoder:
    encoder = _encoders.get(context)
    if encoder is None:
        try:
            fields = json.loads(context)
            names = fields.pop("optype_names")
            step_encoder = StepEncoder(**fields, optype_names=names)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise SchemaError(f"seal record's context does not decode: {exc}") from None
        encoder = SealEncoder(step_encoder, len(names))
        if len(_encoders) >= 1024:  # a reader of many ranks' logs: bounded anyway
            _encoders.clear()
        _encoders[context] = encoder
    return encoder


#: How the ops of one step are encoded but for their times (`SealEncoder._plan`): the
#: op type counts after them, the job id + dictionary + padding, the number of names, the
#: columns that follow the times (seq, micro-batch, chunk, wire op type codes) as bytes, and
#: the Struct that packs the times.
_Plan = tuple[tuple[int, ...], bytes, int, bytes, struct.Struct]


class SealEncoder:
    """One step's ops as the bytes `StepEncoder.encode` (and `encode_batch`) gives them
    (tests/test_timer.py checks that byte for byte), for several times less CPU.

    The batch layout is producers.events' (its header and trailer structs, its magic and
    version). What differs is how the bytes are made. A job's steps repeat one sequence of
    ops (a schedule: the same op types, micro-batches and chunks in the same order), and
    everything but the times follows from that sequence alone: each op's seq id, the op type
    dictionary of the codes used with the padding after it, and the seq, micro-batch, chunk
    and op type columns. That is worked out once per sequence and kept (`_plan`), so a step
    packs only its start and duration columns (one `struct` pack) and joins them with the
    header and the kept bytes.
    """

    def __init__(self, encoder: StepEncoder, n_codes: int) -> None:
        # The identity and the names StepEncoder checked and prepared.
        self._job = encoder._job
        self._identity = encoder._identity
        self._entries = encoder._entries
        self._name_order = encoder._name_order
        self.n_codes = n_codes
        self._no_counts = (0,) * n_codes
        self._plans: dict[tuple[tuple[int, ...], ...], _Plan] = {}
        self._times: dict[int, struct.Struct] = {}

    def encode_ops(
        self,
        ops: Sequence[Op],
        wall_offset_ns: int,
        counts_before: dict[int, tuple[int, ...]],
    ) -> list[bytes]:
        """The batches of `ops` (in any order), one per step (more where a step exceeds
        MAX_OPS_PER_BATCH), in step order; `counts_before` holds, for a step whose ops
        earlier seals held, the op type counts its seq ids continue from.

        Column-wise: the ops are put in (step, start) order and split into columns by
        C-level calls (`sorted` is stable, `zip`), and a step whose op types come in the
        same order as an earlier step's reuses that step's seq ids and columns (`_plan`).
        """
        n = len(ops)
        if not n:
            return []
        ops = sorted(ops, key=_START)
        # (step, start) order: seq is the order of starts within (step, op type). Ops are
        # appended when they end, so nested or asynchronous ones arrive out of order; a
        # later step's ops start later, but for ops given their step explicitly.
        heads, starts, durations = zip(*ops, strict=True)
        codes, steps, microbatches, chunks = zip(*heads, strict=True)
        if list(steps) != sorted(steps):
            pick = operator.itemgetter(*sorted(range(n), key=steps.__getitem__))  # stable
            codes, steps, microbatches = pick(codes), pick(steps), pick(microbatches)
            chunks, starts, durations = pick(chunks), pick(starts), pick(durations)
            if n == 1:  # itemgetter of one index gives the item, not a tuple
                codes, steps, microbatches = (codes,), (steps,), (microbatches,)
                chunks, starts, durations = (chunks,), (starts,), (durations,)
        starts = [start + wall_offset_ns for start in starts]  # perf_counter -> wall clock
        batches = []
        low = 0
        while low < n:
            step = steps[low]
            high = bisect_right(steps, step, low)
            counts = counts_before.get(step)
            for part in range(low, high, MAX_OPS_PER_BATCH):
                end = min(high, part + MAX_OPS_PER_BATCH)
                encoded, counts = self.encode(
                    step, codes[part:end], microbatches[part:end], chunks[part:end],
                    starts[part:end], durations[part:end], counts,
                )  # fmt: skip
                batches.append(encoded)
            low = high
        return batches

    def _plan(
        self,
        codes: tuple[int, ...],
        microbatch: tuple[int, ...],
        chunk: tuple[int, ...],
        counts: tuple[int, ...],
    ) -> _Plan:
        seqs = []
        after = list(counts)
        for code in codes:
            seqs.append(after[code])
            after[code] += 1
        used = sorted(set(codes), key=self._name_order.__getitem__)
        table = bytearray(256)
        for place, code in enumerate(used):
            table[code] = place
        names = b"".join(self._entries[code] for code in used)
        size = _BATCH_HEADER.size + len(self._job) + len(names)
        n = len(codes)
        times = self._times.get(n)
        if times is None:
            # Little-endian whatever the platform, as the wire's columns.
            times = struct.Struct(f"<{2 * n}q")
            if len(self._times) < 256:
                self._times[n] = times
        rest = struct.pack(f"<{2 * n}i{n}h", *seqs, *microbatch, *chunk)
        return (tuple(after), self._job + names + bytes(-size % 8), len(used),
                rest + bytes(codes).translate(table), times)  # fmt: skip

    def encode(
        self,
        step: int,
        codes: tuple[int, ...],
        microbatch: tuple[int, ...],
        chunk: tuple[int, ...],
        start_ns: Sequence[int],
        duration_ns: tuple[int, ...],
        counts: tuple[int, ...] | None = None,
    ) -> tuple[bytes, tuple[int, ...]]:
        """One step's batch, and the op type counts after it (pass them back as `counts`
        for a later batch of the same step: its seq ids continue from them). `codes` index
        the timer's op type names; a value out of its column's range raises struct.error."""
        if counts is None:  # the step's first batch: the common case, planned once
            key = (codes, microbatch, chunk)
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plan(codes, microbatch, chunk, self._no_counts)
                if len(self._plans) < 256:  # a job has a few schedules: bounded anyway
                    self._plans[key] = plan
        else:
            plan = self._plan(codes, microbatch, chunk, counts)
        after, tail, n_names, rest, times = plan
        body = b"".join((
            _BATCH_HEADER.pack(BATCH_MAGIC, BATCH_VERSION, 0, len(codes), *self._identity,
                               step, len(self._job), n_names),
            tail,
            times.pack(*start_ns, *duration_ns),
            rest,
        ))  # fmt: skip
        return body + _BATCH_TRAILER.pack(zlib.crc32(body)), after
