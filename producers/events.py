"""The event schema: op records, rank-step batches and their wire encoding, job metadata.

This module is the single definition of what travels from training ranks to the stream
app (docs/design.md §3). One *op record* is one timed operation on one rank:

    job_id, attempt, rank, dp_rank, pp_rank, tp_rank, cp_rank, step, optype, microbatch,
    chunk, seq, start_ns, duration_ns

On the wire and in the local log, ops travel as a **rank-step batch**: the ops of one rank
in one step, held as columns. The identity fields (job .. step) are stored once per batch;
the per-op columns are raw little-endian arrays, so encoding and decoding are a few
`numpy.frombuffer` calls and no per-op Python work.

Encoding, version 1 (all integers little-endian)::

    header   struct "<4sHHIIiiiiiqHH"  magic b"LGSB", version, flags, n_ops, attempt,
                                       rank, dp_rank, pp_rank, tp_rank, cp_rank, step,
                                       len(job_id utf-8), n_optype_names
    job_id   utf-8 bytes
    names    n_optype_names x (u8 length, utf-8 bytes)   the op type dictionary
    padding  zeros up to a multiple of 8 bytes (keeps the int64 columns aligned)
    columns  start_ns i8[n], duration_ns i8[n], seq i4[n], microbatch i4[n], chunk i2[n],
             optype u1[n] (codes into the dictionary)
    sections only with flags bit 0 (`FLAG_SECTIONS`): bytes a newer writer added after the
             columns; this version skips them (it writes flags 0)
    trailer  crc32 u32 of everything before it

Compatibility across versions: a reader keeps what it can read of a newer writer's
records and sets aside only what it cannot, naming the version. A batch of a newer
*version* cannot be read (its layout is unknown) and is a dead letter naming that version;
a version-1 batch with sections appended reads as its columns. A job record (`JobInfo`)
carries `schema_version`; fields it does not know, from a newer writer, are kept in the
record (`unknown_fields`), never a reason to drop it, and a record that still fails to
read names its version.

Measured on the AR reference trace (tests/bench/producers_bench.py): 27 bytes per op plus
~70 bytes per batch, against ~250 bytes per op as JSON objects; Kafka's zstd compression
shrinks the binary form further. The encoder normalizes the op type dictionary (only the
names used, sorted), so equal content always gives equal bytes and equal `batch_id`:
a batch re-sent after a crash carries the id of the first send, and sinks drop it.

Op types are data: the encoding carries any name; `simulator.optypes.KNOWN_OPTYPES` is the
vocabulary the timer accepts by default.
"""

from __future__ import annotations

import array
import dataclasses
import hashlib
import operator
import struct
import sys
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Self, get_type_hints

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    ValidationError,
    ValidationInfo,
    create_model,
    model_validator,
)

from lagscope.simulator.optypes import KNOWN_OPTYPES
from lagscope.simulator.trace import JobMeta

__all__ = [
    "BATCH_MAGIC",
    "BATCH_VERSION",
    "FLAG_SECTIONS",
    "JOB_SCHEMA_VERSION",
    "KNOWN_OPTYPES",
    "OP_FIELDS",
    "JobInfo",
    "RankIdentity",
    "RankStepBatch",
    "SchemaError",
    "StepEncoder",
    "decode_batch",
    "encode_batch",
]

BATCH_MAGIC = b"LGSB"
BATCH_VERSION = 1
#: Header flag: the batch carries sections after its columns, which readers that do not
#: know them skip (how a newer writer adds to version 1 without breaking its readers).
FLAG_SECTIONS = 1
#: The version of the job record this build writes (`JobInfo.schema_version`); 2 added
#: `ended_ns` (a reader of version 1 keeps it as an unknown field and ignores it).
JOB_SCHEMA_VERSION = 2
_HEADER = struct.Struct("<4sHHIIiiiiiqHH")
_TRAILER = struct.Struct("<I")
_MAX_OPTYPE_NAMES = 255

#: Per-op columns in encoding order, with their wire dtypes.
_COLUMNS: tuple[tuple[str, np.dtype], ...] = (
    ("start_ns", np.dtype("<i8")),
    ("duration_ns", np.dtype("<i8")),
    ("seq", np.dtype("<i4")),
    ("microbatch", np.dtype("<i4")),
    ("chunk", np.dtype("<i2")),
    ("optype", np.dtype("u1")),
)
_BYTES_PER_OP = sum(dtype.itemsize for _, dtype in _COLUMNS)

#: Fields of one op record, in the order docs/design.md §3.1 lists them.
OP_FIELDS: tuple[str, ...] = (
    "job_id",
    "attempt",
    "rank",
    "dp_rank",
    "pp_rank",
    "tp_rank",
    "cp_rank",
    "step",
    "optype",
    "microbatch",
    "chunk",
    "seq",
    "start_ns",
    "duration_ns",
)


class SchemaError(ValueError):
    """Data that is not a valid encoded batch; the message says what is wrong and where."""


#: The validation context of a record read from a log, Kafka or a snapshot (as opposed to
#: one built in code): only a read record may carry fields this build does not know.
_READ = "lagscope.read"


class _WireRecord(BaseModel):
    """A record that crosses process boundaries and versions (see the module docstring).

    Read (`model_validate`, `model_validate_json`), it keeps fields a newer writer added
    (`unknown_fields`); built in code, a field it does not know is a mistake and an error.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _known_fields_unless_read(cls, data: Any, info: ValidationInfo) -> Any:
        if isinstance(data, dict) and not (info.context or {}).get(_READ):
            unknown = sorted(set(data) - set(cls.model_fields))
            if unknown:
                raise ValueError(f"unknown field(s) {', '.join(unknown)}")
        return data

    @classmethod
    def model_validate(cls, obj: Any, *, context: Any = None, **kwargs: Any) -> Self:
        return super().model_validate(obj, context={**(context or {}), _READ: True}, **kwargs)

    @classmethod
    def model_validate_json(
        cls, json_data: str | bytes | bytearray, *, context: Any = None, **kwargs: Any
    ) -> Self:
        return super().model_validate_json(
            json_data, context={**(context or {}), _READ: True}, **kwargs
        )

    @property
    def unknown_fields(self) -> list[str]:
        """Fields of a newer writer this build does not know, kept as they came."""
        return sorted(self.model_extra or ())


class RankIdentity(_WireRecord):
    """Where one rank runs: its coordinates and its machine, so advice can name the host.

    Written by each rank in its own job record (the integrations derive it from the process
    groups and the launcher's environment: torchrun, Slurm, Kubernetes).
    """

    rank: int = Field(ge=0)
    local_rank: int = Field(default=0, ge=0)
    dp_rank: int = Field(default=0, ge=0)
    pp_rank: int = Field(default=0, ge=0)
    tp_rank: int = Field(default=0, ge=0)
    cp_rank: int = Field(default=0, ge=0)
    host: str = ""
    #: CUDA device index as the process sees it (None on CPU).
    gpu: int | None = Field(default=None, ge=0)
    #: Node name from the scheduler (Slurm node, Kubernetes node) when it sets one.
    node: str | None = None
    #: Kubernetes pod name when running in a pod.
    pod: str | None = None
    #: PCI bus id of the GPU ("0000:3b:00.0"): the one name of a GPU that holds across
    #: CUDA_VISIBLE_DEVICES remappings and matches nvidia-smi / DCGM.
    pci_bus_id: str | None = None


class _JobRecord(_WireRecord):
    """Job metadata published once per attempt (topic `lagscope.jobs`, compacted).

    The analysis' `JobMeta` (parallel sizes, world size, MFU inputs; its fields are
    JobInfo's too, checked by JobMeta's own rules) plus the identity of the run;
    `dsp_size` is the context-parallel size (`cp_size`). A record a rank writes into its
    own log also carries that rank's `rank_identity`. `schema_version` is the version of
    the writer's record; a newer one's extra fields are kept (`unknown_fields`).

    A rank whose monitor is closed writes its record once more, `ended_ns` set: that rank
    is done (its training loop ended, or raised through the monitor). A job attempt all of
    whose ranks did so has ended, and is not silent; a rank that hangs or is killed never
    writes it.
    """

    schema_version: int = Field(default=JOB_SCHEMA_VERSION, ge=1)
    job_id: str = Field(min_length=1)
    attempt: int = Field(default=0, ge=0)
    rank_identity: RankIdentity | None = None
    #: When the rank's monitor closed (ns since the epoch); None while it records.
    ended_ns: int | None = Field(default=None, ge=0)

    @model_validator(mode="wrap")
    @classmethod
    def _name_a_newer_version(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        """A newer writer's record that still cannot be read says so, with its version:
        the reason an upgrade of this reader is what it needs."""
        try:
            return handler(data)
        except ValidationError as exc:
            version = data.get("schema_version") if isinstance(data, dict) else None
            if not isinstance(version, int) or version <= JOB_SCHEMA_VERSION:
                raise
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'record'}: {e['msg']}" for e in exc.errors()
            )
            raise ValueError(
                f"job record of schema version {version}, newer than the {JOB_SCHEMA_VERSION} "
                f"this build reads, cannot be read ({problems}); upgrade the reader"
            ) from None

    @model_validator(mode="after")
    def _a_valid_layout(self) -> _JobRecord:
        self.to_meta()
        return self

    @property
    def cp_size(self) -> int:
        return self.dsp_size  # type: ignore[attr-defined]

    @property
    def key(self) -> str:
        """The job attempt's key: one job record per (job, attempt) describes the job."""
        return f"{self.job_id}/{self.attempt}"

    @property
    def record_key(self) -> str:
        """Compaction key on the jobs topic: one live record per rank that carries its
        identity (every rank's machine is kept), else one per (job, attempt)."""
        if self.rank_identity is None:
            return self.key
        return f"{self.key}/{self.rank_identity.rank}"

    @classmethod
    def from_meta(cls, meta: JobMeta, *, job_id: str, attempt: int = 0) -> JobInfo:
        return cls(**meta.as_dict(), job_id=job_id, attempt=attempt)

    def to_meta(self) -> JobMeta:
        return JobMeta(**{name: getattr(self, name) for name in _META_FIELDS})


#: Job record fields each rank writes for itself; the others describe the job, the same in
#: every rank's record of it.
PER_RANK_FIELDS = frozenset({"rank_identity", "ended_ns"})

_META_FIELDS = tuple(f.name for f in dataclasses.fields(JobMeta))
_META_TYPES = get_type_hints(JobMeta)
#: The wire record: JobMeta's fields (one definition) on the record's own.
JobInfo = create_model(
    "JobInfo",
    __base__=_JobRecord,
    __module__=__name__,
    **{
        f.name: (_META_TYPES[f.name], ... if f.default is dataclasses.MISSING else f.default)
        for f in dataclasses.fields(JobMeta)
    },
)
JobInfo.__doc__ = _JobRecord.__doc__

#: A record's own fields alone, each as the record declares it.
_RankPart = create_model(
    "_RankPart",
    __base__=_WireRecord,
    **{
        name: (field.annotation, field)
        for name, field in _JobRecord.model_fields.items()
        if name in PER_RANK_FIELDS
    },
)


def another_rank(job: JobInfo, own: dict[str, Any]) -> JobInfo:
    """`job` (a validated record) with another rank's own fields (`own`, as read; see
    `PER_RANK_FIELDS`), validated: what that rank's whole record reads as when its other
    fields are `job`'s, without validating the job again (a 100,000-GPU job's ranks send
    200,000 records of one job).

    >>> meta = JobMeta(dp_size=2, pp_size=1, world_size=2)
    >>> job = JobInfo.from_meta(meta, job_id="j")
    >>> another_rank(job, {"rank_identity": {"rank": 1, "dp_rank": 1}, "ended_ns": 7}).ended_ns
    7
    >>> another_rank(job, {"ended_ns": -1})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    pydantic_core._pydantic_core.ValidationError: 1 validation error for _RankPart
    ...
    """
    part = _RankPart.model_validate(own)
    return job.model_copy(update={name: getattr(part, name) for name in PER_RANK_FIELDS})


@dataclass(frozen=True, eq=False)
class RankStepBatch:
    """All ops of one rank in one step (or a part of them), as columns of equal length.

    `optype` holds codes into `optype_names`. Construct with `RankStepBatch.build` to get
    the columns coerced to their wire dtypes and checked.
    """

    job_id: str
    attempt: int
    rank: int
    dp_rank: int
    pp_rank: int
    tp_rank: int
    cp_rank: int
    step: int
    optype_names: tuple[str, ...]
    optype: np.ndarray
    microbatch: np.ndarray
    chunk: np.ndarray
    seq: np.ndarray
    start_ns: np.ndarray
    duration_ns: np.ndarray

    @classmethod
    def build(
        cls,
        *,
        job_id: str,
        attempt: int,
        rank: int,
        dp_rank: int,
        pp_rank: int,
        tp_rank: int = 0,
        cp_rank: int = 0,
        step: int,
        optype: Sequence[str] | np.ndarray,
        microbatch: Sequence[int] | np.ndarray,
        chunk: Sequence[int] | np.ndarray,
        seq: Sequence[int] | np.ndarray,
        start_ns: Sequence[int] | np.ndarray,
        duration_ns: Sequence[int] | np.ndarray,
        optype_names: Sequence[str] | None = None,
    ) -> RankStepBatch:
        """Build a batch; `optype` is names, or codes into `optype_names` when given."""
        if optype_names is None:
            names_arr, codes = np.unique(np.asarray(optype, dtype=str), return_inverse=True)
            names = tuple(str(n) for n in names_arr)
        else:
            names = tuple(optype_names)
            codes = np.asarray(optype)
        columns = {
            "microbatch": microbatch,
            "chunk": chunk,
            "seq": seq,
            "start_ns": start_ns,
            "duration_ns": duration_ns,
        }
        batch = cls(
            job_id=job_id,
            attempt=int(attempt),
            rank=int(rank),
            dp_rank=int(dp_rank),
            pp_rank=int(pp_rank),
            tp_rank=int(tp_rank),
            cp_rank=int(cp_rank),
            step=int(step),
            optype_names=names,
            optype=_as_column("optype", codes, np.dtype("u1")),
            **{
                name: _as_column(name, columns[name], dtype)
                for name, dtype in _COLUMNS
                if name != "optype"
            },
        )
        batch.validate()
        return batch

    @property
    def n_ops(self) -> int:
        return int(self.start_ns.shape[0])

    def validate(self, where: str = "batch") -> None:
        """Raise `SchemaError` if the batch breaks an invariant of the schema."""
        if not self.job_id:
            raise SchemaError(f"{where}: job_id is empty")
        _check_identity(vars(self), where)
        if len(self.optype_names) > _MAX_OPTYPE_NAMES:
            raise SchemaError(
                f"{where}: {len(self.optype_names)} op type names, at most "
                f"{_MAX_OPTYPE_NAMES} fit one batch"
            )
        n = self.n_ops
        for name, _ in _COLUMNS:
            column = getattr(self, name)
            if column.shape != (n,):
                raise SchemaError(f"{where}: column {name!r} has shape {column.shape}, want ({n},)")
        self._check_values(where)

    def _check_values(self, where: str) -> None:
        if not self.n_ops:
            return
        if int(self.optype.max()) >= len(self.optype_names):
            row = int(np.argmax(self.optype >= len(self.optype_names)))
            raise SchemaError(
                f"{where}: op {row} has op type code {int(self.optype[row])}, but the batch's "
                f"dictionary has {len(self.optype_names)} names"
            )
        if int(self.duration_ns.min()) < 0:
            row = int(np.argmin(self.duration_ns))
            raise SchemaError(
                f"{where}: op {row} has negative duration_ns {int(self.duration_ns[row])}"
            )

    def optype_strings(self) -> list[str]:
        return [self.optype_names[c] for c in self.optype.tolist()]

    def to_records(self) -> list[dict[str, Any]]:
        """One dict per op with the fields of `OP_FIELDS` (tests, JSON, debugging)."""
        head = {
            "job_id": self.job_id,
            "attempt": self.attempt,
            "rank": self.rank,
            "dp_rank": self.dp_rank,
            "pp_rank": self.pp_rank,
            "tp_rank": self.tp_rank,
            "cp_rank": self.cp_rank,
            "step": self.step,
        }
        return [
            {
                **head,
                "optype": op,
                "microbatch": mb,
                "chunk": ch,
                "seq": sq,
                "start_ns": st,
                "duration_ns": du,
            }
            for op, mb, ch, sq, st, du in zip(
                self.optype_strings(),
                self.microbatch.tolist(),
                self.chunk.tolist(),
                self.seq.tolist(),
                self.start_ns.tolist(),
                self.duration_ns.tolist(),
                strict=True,
            )
        ]

    def encode(self) -> bytes:
        return encode_batch(self)

    @property
    def batch_id(self) -> str:
        return batch_id_of(encode_batch(self))


#: A worker's coordinates, each with the size of its axis in a job record (`JobInfo`).
RANK_AXIS_SIZES = {
    "rank": "world_size",
    "dp_rank": "dp_size",
    "pp_rank": "pp_size",
    "tp_rank": "tp_size",
    "cp_rank": "cp_size",
}
#: What the wire holds of a coordinate without a job record to bound it (int32).
RANK_LIMIT = 1 << 31


def rank_outside(
    ranks: Mapping[str, Any], job: JobInfo | None = None
) -> tuple[str, Any, int] | None:
    """The first of a worker's coordinates (`RANK_AXIS_SIZES`) outside its range, as
    (name, value, size): [0, the job's size of that axis), or [0, `RANK_LIMIT`) without a
    job record; None when every one is in range. A value that is not an integer is outside.
    The one check of a worker's place in its job, for the timer, the schema and admission.

    >>> ranks = {"rank": 5, "dp_rank": 1, "pp_rank": 1, "tp_rank": 0, "cp_rank": 0}
    >>> rank_outside(ranks) is None
    True
    >>> rank_outside({**ranks, "pp_rank": -1})
    ('pp_rank', -1, 2147483648)
    >>> job = JobInfo(job_id="j", dp_size=2, pp_size=2, world_size=4)
    >>> rank_outside(ranks, job)
    ('rank', 5, 4)
    """
    for name, size_name in RANK_AXIS_SIZES.items():
        value = ranks[name]
        size = RANK_LIMIT if job is None else getattr(job, size_name)
        if type(value) is not int:
            try:
                value = operator.index(value)
            except TypeError:
                return name, ranks[name], size
        if not 0 <= value < size:
            return name, value, size
    return None


def _check_identity(fields: Mapping[str, Any], where: str) -> None:
    """A batch's coordinates and step count from 0: a negative one is a broken producer,
    and the store keeps them unsigned."""
    outside = rank_outside(fields)
    if outside is not None:
        name, value, size = outside
        raise SchemaError(f"{where}: {name} is {value}; expected 0 <= {name} < {size}")
    if fields["step"] < 0:
        raise SchemaError(f"{where}: step is {fields['step']}; it must be >= 0")


def _as_column(name: str, values: Sequence[int] | np.ndarray, dtype: np.dtype) -> np.ndarray:
    raw = np.asarray(values)
    if raw.ndim != 1:
        raise SchemaError(f"column {name!r} must be one-dimensional, got shape {raw.shape}")
    if raw.size and raw.dtype.kind not in "iub":
        raise SchemaError(f"column {name!r} must hold integers, got dtype {raw.dtype}")
    if raw.size and raw.dtype != dtype:
        info = np.iinfo(dtype)
        low, high = int(raw.min()), int(raw.max())
        if low < info.min or high > info.max:
            raise SchemaError(
                f"column {name!r} holds values in [{low}, {high}], outside {dtype.name}'s range"
            )
    return np.ascontiguousarray(raw, dtype=dtype)


#: Identity fields of a batch, as `pack_batches` keeps them.
_IDENTITY = ("job_id", "attempt", "rank", "dp_rank", "pp_rank", "tp_rank", "cp_rank", "step")


def pack_batches(batches: Sequence[RankStepBatch]) -> dict[str, Any]:
    """Batches as a few columns (each op column concatenated), to hand a step's batches to
    another process: pickling these costs a memcpy, where the batches themselves cost
    ~65 us each and decoding their bytes again ~60 us (0.8 s for a 100,000-GPU step).

    >>> batch = RankStepBatch.build(job_id="j", attempt=0, rank=3, dp_rank=1, pp_rank=0,
    ...     step=1, optype=["forward-compute", "optimizer"], microbatch=[0, -1],
    ...     chunk=[0, 0], seq=[0, 1], start_ns=[5, 9], duration_ns=[2, 1])
    >>> again = unpack_batches(pack_batches([batch, batch]))
    >>> [encode_batch(b) == encode_batch(batch) for b in again]
    [True, True]
    """
    # attrgetter: one C call a batch (a generator of getattr was 0.17 s a 100,000-GPU step).
    columns = {
        name: np.concatenate(list(map(attrgetter(name), batches))).astype(dtype, copy=False)
        if batches
        else np.zeros(0, dtype)
        for name, dtype in _COLUMNS
    }
    return {
        "heads": list(map(attrgetter(*_IDENTITY), batches)),
        "names": list(map(attrgetter("optype_names"), batches)),
        "sizes": np.fromiter(
            map(len, map(attrgetter("start_ns"), batches)), np.int64, count=len(batches)
        ),
        **columns,
    }


def unpack_batches(packed: dict[str, Any]) -> list[RankStepBatch]:
    """The batches `pack_batches` packed (their columns are views of the packed ones)."""
    ends = np.cumsum(packed["sizes"]).tolist()
    columns = [(name, packed[name]) for name, _ in _COLUMNS]
    batches = []
    start = 0
    for head, names, end in zip(packed["heads"], packed["names"], ends, strict=True):
        batch = object.__new__(RankStepBatch)
        # As decode_batch: the fields in one go (the values were checked on the way in).
        fields = dict(zip(_IDENTITY, head, strict=True), optype_names=names)
        for name, column in columns:
            fields[name] = column[start:end]
        batch.__dict__.update(fields)
        batches.append(batch)
        start = end
    return batches


def encode_batch(batch: RankStepBatch) -> bytes:
    """The versioned binary encoding of a batch (see module docstring)."""
    optype = batch.optype
    names = batch.optype_names
    # Normalize the dictionary (only used names, sorted) so equal content → equal bytes.
    if batch.n_ops:
        used, inverse = np.unique(optype, return_inverse=True)
        used_names = [names[c] for c in used.tolist()]
        order = np.argsort(np.asarray(used_names, dtype=str), kind="stable")
        rank_of = np.empty_like(order)
        rank_of[order] = np.arange(order.size)
        optype = rank_of[inverse].astype(np.uint8)
        names = tuple(used_names[i] for i in order.tolist())
    else:
        names = ()
    return _encode(
        batch.job_id.encode(),
        (batch.attempt, batch.rank, batch.dp_rank, batch.pp_rank, batch.tp_rank,
         batch.cp_rank, batch.step),
        [_name_entry(name) for name in names],
        [np.ascontiguousarray(optype if name == "optype" else getattr(batch, name), dtype=dtype)
         .tobytes() for name, dtype in _COLUMNS],
    )  # fmt: skip


def _name_entry(name: str) -> bytes:
    raw = name.encode()
    return bytes((len(raw),)) + raw


def _encode(
    job: bytes, identity: tuple[int, ...], name_entries: list[bytes], columns: list[bytes]
) -> bytes:
    """Header, dictionary and the columns' little-endian bytes (in `_COLUMNS` order) as
    one checksummed batch."""
    n_ops = len(columns[0]) // _COLUMNS[0][1].itemsize
    attempt, rank, dp, pp, tp, cp, step = identity
    parts = [
        _HEADER.pack(BATCH_MAGIC, BATCH_VERSION, 0, n_ops, attempt, rank, dp, pp, tp, cp, step,
                     len(job), len(name_entries)),
        job,
        *name_entries,
    ]  # fmt: skip
    size = sum(len(p) for p in parts)
    parts.append(b"\0" * (-size % 8))
    parts += columns
    body = b"".join(parts)
    return body + _TRAILER.pack(zlib.crc32(body))


class StepEncoder:
    """Encodes one rank's steps straight from its timer's columns: the bytes
    `encode_batch(RankStepBatch.build(...))` gives, without building the batch.

    The timer's sealer thread encodes a batch per step beside the training thread, on the
    same cores; the identity and the op type dictionary never change for a timer, so they
    are checked and sorted once here, and a step costs a few list operations.
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
    ) -> None:
        identity = {"attempt": attempt, "rank": rank, "dp_rank": dp_rank, "pp_rank": pp_rank,
                    "tp_rank": tp_rank, "cp_rank": cp_rank, "step": 0}  # fmt: skip
        if not job_id:
            raise SchemaError("job_id is empty")
        _check_identity(identity, f"rank {rank}")
        if len(optype_names) > _MAX_OPTYPE_NAMES:
            raise SchemaError(
                f"{len(optype_names)} op type names, at most {_MAX_OPTYPE_NAMES} fit one batch"
            )
        self._job = job_id.encode()
        self._identity = (attempt, rank, dp_rank, pp_rank, tp_rank, cp_rank)
        self._entries = [_name_entry(name) for name in optype_names]
        #: Each code's place in the names' sorted order (the wire dictionary's order).
        by_name = sorted(range(len(optype_names)), key=optype_names.__getitem__)
        self._name_order = [0] * len(optype_names)
        for place, code in enumerate(by_name):
            self._name_order[code] = place

    def encode(
        self,
        step: int,
        codes: list[int],
        microbatch: list[int],
        chunk: list[int],
        seq: list[int],
        start_ns: list[int],
        duration_ns: list[int],
    ) -> bytes:
        """One step's batch (the timer checked the step and the values); `codes` index
        the timer's op type names. An out-of-range value raises OverflowError."""
        used = sorted(set(codes), key=self._name_order.__getitem__)
        wire_code = {code: place for place, code in enumerate(used)}
        return _encode(
            self._job,
            (*self._identity, step),
            [self._entries[code] for code in used],
            [_column(8, start_ns), _column(8, duration_ns), _column(4, seq),
             _column(4, microbatch), _column(2, chunk),
             bytes([wire_code[code] for code in codes])],
        )  # fmt: skip


def _column(width: int, values: list[int]) -> bytes:
    """`values` as little-endian signed integers of `width` bytes (`array` checks the range)."""
    column = array.array(_SIGNED_TYPECODE[width], values)
    if _BIG_ENDIAN:
        column.byteswap()
    return column.tobytes()


_BIG_ENDIAN = sys.byteorder == "big"
#: The array module's signed type code of each width on this platform ('h' is 2 bytes,
#: 'q' 8; 'i' and 'l' vary, and the later one of a width wins).
_SIGNED_TYPECODE = {array.array(t).itemsize: t for t in "hilq"}


def batch_id_of(encoded: bytes | memoryview) -> str:
    """Deterministic id of an encoded batch: equal content ⇒ equal id (sinks dedupe on it)."""
    return hashlib.blake2b(encoded, digest_size=16).hexdigest()


def peek_header(data: bytes | memoryview, where: str = "batch") -> dict[str, Any]:
    """The identity fields of an encoded batch, without decoding the columns."""
    if len(data) < _HEADER.size + _TRAILER.size:
        raise SchemaError(f"{where}: {len(data)} bytes is too short for a batch header")
    fields = _HEADER.unpack_from(data, 0)
    magic, version = fields[0], fields[1]
    if magic != BATCH_MAGIC:
        raise SchemaError(f"{where}: bad magic {bytes(magic)!r}, want {BATCH_MAGIC!r}")
    if version != BATCH_VERSION:
        raise SchemaError(
            f"{where}: unknown batch encoding version {version} (this build reads "
            f"version {BATCH_VERSION})"
        )
    flags = fields[2]
    n_ops, attempt, rank, dp, pp, tp, cp, step, job_len, n_names = fields[3:]
    job_end = _HEADER.size + job_len
    try:
        job_id = bytes(data[_HEADER.size : job_end]).decode()
    except UnicodeDecodeError:
        raise SchemaError(f"{where}: job_id is not valid utf-8") from None
    return {
        "job_id": job_id,
        "attempt": attempt,
        "rank": rank,
        "dp_rank": dp,
        "pp_rank": pp,
        "tp_rank": tp,
        "cp_rank": cp,
        "step": step,
        "n_ops": n_ops,
        "_n_names": n_names,
        "_names_at": job_end,
        "_flags": flags,
    }


def decode_batch(data: bytes | memoryview, where: str = "batch") -> RankStepBatch:
    """Decode and validate an encoded batch; raises `SchemaError` naming `where` and why."""
    view = memoryview(data)
    head = peek_header(view, where)
    body_len = len(view) - _TRAILER.size
    (stored_crc,) = _TRAILER.unpack_from(view, body_len)
    if zlib.crc32(view[:body_len]) != stored_crc:
        raise SchemaError(f"{where}: checksum mismatch (corrupted or truncated batch)")
    names_at = head.pop("_names_at")
    n_names = head.pop("_n_names")
    has_sections = bool(head.pop("_flags") & FLAG_SECTIONS)
    if n_names > _MAX_OPTYPE_NAMES:
        raise SchemaError(
            f"{where}: {n_names} op type names, at most {_MAX_OPTYPE_NAMES} fit one batch"
        )
    names, pos = _decode_names(view, names_at, n_names, body_len, where)
    pos += -pos % 8
    n_ops = head.pop("n_ops")
    expected = pos + n_ops * _BYTES_PER_OP
    if expected != body_len and not (has_sections and expected < body_len):
        raise SchemaError(
            f"{where}: {n_ops} ops need {expected - pos} column bytes, found {body_len - pos}"
        )
    if not head["job_id"]:
        raise SchemaError(f"{where}: job_id is empty")
    _check_identity(head, where)
    # One buffer read, then a typed view per column: `np.frombuffer` costs ~2 µs a call,
    # a slice's view a third of that (a 100,000-GPU step decodes 12,480 batches).
    raw = np.frombuffer(view, dtype=np.uint8, count=n_ops * _BYTES_PER_OP, offset=pos)
    columns: dict[str, np.ndarray] = {}
    at = 0
    for name, dtype in _COLUMNS:
        end = at + n_ops * dtype.itemsize
        columns[name] = raw[at:end].view(dtype)
        at = end
    # The columns have their shapes by construction: only the values need checking. The
    # frozen dataclass' __init__ (one object.__setattr__ per field) was a third of the
    # decode time at 5,000 batches/s, so the fields are set in one go.
    batch = object.__new__(RankStepBatch)
    batch.__dict__.update(head, optype_names=names, **columns)
    batch._check_values(where)
    return batch


#: Op-type dictionaries seen recently (the bytes on the wire -> names): every batch of a
#: job carries the same few, so most batches skip decoding them.
_NAMES_CACHE: dict[bytes, tuple[str, ...]] = {}
_NAMES_CACHE_MAX = 1024


def _decode_names(
    view: memoryview, pos: int, n_names: int, body_len: int, where: str
) -> tuple[tuple[str, ...], int]:
    """The op type dictionary starting at `pos`, and the position after it."""
    start = pos
    for i in range(n_names):
        if pos >= body_len or pos + 1 + view[pos] > body_len:
            raise SchemaError(f"{where}: op type dictionary runs past the end (name {i})")
        pos += 1 + view[pos]
    raw = bytes(view[start:pos])
    names = _NAMES_CACHE.get(raw)
    if names is None:
        decoded = []
        at = 0
        for i in range(n_names):
            length = raw[at]
            try:
                decoded.append(raw[at + 1 : at + 1 + length].decode())
            except UnicodeDecodeError:
                raise SchemaError(f"{where}: op type name {i} is not valid utf-8") from None
            at += 1 + length
        names = tuple(decoded)
        if len(_NAMES_CACHE) >= _NAMES_CACHE_MAX:
            _NAMES_CACHE.clear()
        _NAMES_CACHE[raw] = names
    return names, pos


def batch_from_records(records: Sequence[Mapping[str, Any]]) -> RankStepBatch:
    """Build a batch from op dicts that share one (job, attempt, rank, step) identity."""
    if not records:
        raise SchemaError("cannot build a batch from zero records")
    first = records[0]
    identity = ("job_id", "attempt", "rank", "dp_rank", "pp_rank", "tp_rank", "cp_rank", "step")
    for i, record in enumerate(records):
        for key in identity:
            if record[key] != first[key]:
                raise SchemaError(
                    f"record {i} has {key}={record[key]!r}, but the batch's is {first[key]!r}"
                )
    return RankStepBatch.build(
        **{key: first[key] for key in identity},
        **{
            key: [r[key] for r in records]
            for key in ("optype", "microbatch", "chunk", "seq", "start_ns", "duration_ns")
        },
    )
