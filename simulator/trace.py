"""The trace model: one row per recorded op, held as columnar numpy arrays.

A trace is what a what-if analysis reads: every op of every representative worker
(one TP/CP rank per (dp, stage) coordinate) in every step, with start times in seconds
relative to the step origin. Loaders (parquet, the wire format) live outside this pure
package and build a `Trace` through `Trace.from_columns`, which validates what the
analysis relies on and names the offending rows when something is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from lagscope.simulator.errors import TraceError
from lagscope.simulator.fields import Bound, FieldErrors, check_fields, from_mapping
from lagscope.simulator.optypes import KNOWN_OPTYPES


@dataclass(frozen=True, kw_only=True)
class JobMeta:
    """Parallel layout of a training job (the reference's meta yaml, plus MFU inputs).

    Checked on construction; every problem is named at once:

    >>> JobMeta(dp_size=2, pp_size=2, world_size=4).tp_size
    1
    >>> JobMeta(dp_size=0, pp_size=2, world_size=5)
    Traceback (most recent call last):
    ...
    lagscope.simulator.fields.FieldErrors: dp_size: must be greater than 0 (got 0)
    >>> JobMeta(dp_size=2, pp_size=2, world_size=5)
    Traceback (most recent call last):
    ...
    lagscope.simulator.fields.FieldErrors: world_size: is 5 but dp_size*pp_size*... = 4
    """

    trial_name: str = "job"
    run_id: int = 0
    dp_size: int
    pp_size: int
    tp_size: int = 1
    dsp_size: int = 1
    vpp_size: int = 1
    world_size: int
    #: Model FLOPs of one training step (all GPUs together); enables MFU figures.
    model_flops_per_step: float | None = None
    #: Peak dense FLOP/s of one GPU (e.g. 989e12 for an H100 SXM in bf16).
    gpu_peak_flops: float | None = None

    def __post_init__(self) -> None:
        problems = check_fields(self, _JOB_META_BOUNDS)
        if not isinstance(self.trial_name, str):
            problems.insert(0, ("trial_name", f"must be a string (got {self.trial_name!r})"))
        if not problems:
            product = self.dp_size * self.pp_size * self.tp_size * self.dsp_size
            if self.world_size != product:
                problems.append((
                    "world_size",
                    f"is {self.world_size} but dp_size*pp_size*tp_size*dsp_size = "
                    f"{self.dp_size}*{self.pp_size}*{self.tp_size}*{self.dsp_size} = {product}",
                ))  # fmt: skip
        if problems:
            raise FieldErrors(problems)

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> JobMeta:
        """From a parsed file or record: unknown and missing fields are errors too."""
        return from_mapping(cls, raw, _JOB_META_BOUNDS)

    def as_dict(self, *, exclude_none: bool = False) -> dict[str, Any]:
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if not (exclude_none and getattr(self, f.name) is None)
        }


_JOB_META_BOUNDS = {
    "run_id": Bound(integer=True, ge=0),
    "dp_size": Bound(integer=True, gt=0),
    "pp_size": Bound(integer=True, gt=0),
    "tp_size": Bound(integer=True, gt=0),
    "dsp_size": Bound(integer=True, gt=0),
    "vpp_size": Bound(integer=True, gt=0),
    "world_size": Bound(integer=True, gt=0),
    "model_flops_per_step": Bound(gt=0, optional=True),
    "gpu_peak_flops": Bound(gt=0, optional=True),
}


#: Columns every trace must have, with the numpy dtype the analysis holds them in.
TRACE_COLUMNS: Mapping[str, np.dtype] = {
    "dp_rank": np.dtype(np.int32),
    "stage": np.dtype(np.int32),
    "rank": np.dtype(np.int64),
    "step": np.dtype(np.int64),
    "start_ts": np.dtype(np.float32),
    "duration": np.dtype(np.float32),
    "seq_id": np.dtype(np.int32),
    "mc": np.dtype(np.int32),
    "gmc": np.dtype(np.int32),
    "mb_id": np.dtype(np.int32),
}
#: Columns a trace may lack; they are filled with -1 ("not set").
OPTIONAL_COLUMNS: frozenset[str] = frozenset({"mb_id", "gmc", "mc", "rank"})


@dataclass(frozen=True)
class Trace:
    """Columnar op records. `optype` holds codes into `optype_names`."""

    dp_rank: np.ndarray
    stage: np.ndarray
    rank: np.ndarray
    step: np.ndarray
    optype: np.ndarray
    optype_names: tuple[str, ...]
    start_ts: np.ndarray
    duration: np.ndarray
    seq_id: np.ndarray
    mc: np.ndarray
    gmc: np.ndarray
    mb_id: np.ndarray
    source: str = "<trace>"
    _end: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def n_rows(self) -> int:
        return int(self.step.shape[0])

    @property
    def end_ts(self) -> np.ndarray:
        # float32 like the reference: end = start + duration in the stored precision.
        return (self.start_ts + self.duration).astype(np.float32, copy=False)

    def optype_of(self, row: int) -> str:
        return self.optype_names[int(self.optype[row])]

    def describe_row(self, row: int) -> str:
        return (
            f"(step {int(self.step[row])}, dp {int(self.dp_rank[row])}, "
            f"stage {int(self.stage[row])}, op {self.optype_of(row)}_{int(self.seq_id[row])})"
        )

    def select(self, rows: np.ndarray) -> Trace:
        """A trace of some rows: a boolean mask or indices (repeats allowed), same
        vocabulary and source. Not re-validated."""
        return Trace(
            **{name: getattr(self, name)[rows] for name in TRACE_ARRAYS},
            optype_names=self.optype_names,
            source=self.source,
        )

    def columns(self) -> dict[str, np.ndarray | tuple[str, ...]]:
        """Copies of the columns, as `Trace.from_columns` takes them back."""
        out: dict[str, np.ndarray | tuple[str, ...]] = {
            name: getattr(self, name).copy() for name in TRACE_ARRAYS
        }
        out["optype_names"] = self.optype_names
        return out

    @classmethod
    def from_columns(
        cls,
        columns: Mapping[str, Sequence | np.ndarray],
        *,
        source: str = "<trace>",
        allow_unknown_optypes: bool = False,
    ) -> Trace:
        """Validate raw columns and build a trace.

        `columns["optype"]` may be strings, or integer codes with `columns["optype_names"]`.
        Raises `TraceError` naming `source`, the column, and the first offending rows.
        """
        missing = [c for c in (*TRACE_COLUMNS, "optype") if c not in columns]
        missing = [c for c in missing if c not in OPTIONAL_COLUMNS]
        if missing:
            raise TraceError(f"{source}: missing column(s) {', '.join(sorted(missing))}")
        n_rows = len(columns["step"])
        arrays: dict[str, np.ndarray] = {}
        for name, dtype in TRACE_COLUMNS.items():
            if name not in columns:
                arrays[name] = np.full(n_rows, -1, dtype=dtype)
                continue
            raw = np.asarray(columns[name])
            if raw.shape != (n_rows,):
                raise TraceError(
                    f"{source}: column {name!r} has {raw.shape[0] if raw.ndim else 0} rows, "
                    f"expected {n_rows}"
                )
            if dtype.kind == "i" and raw.dtype.kind == "f":
                bad = ~np.isfinite(raw) | (raw != np.round(raw))
                if bad.any():
                    raise TraceError(
                        f"{source}: column {name!r} must hold integers; row "
                        f"{int(np.flatnonzero(bad)[0])} has {raw[bad][0]!r}"
                    )
            elif dtype.kind == "i" and raw.dtype.kind not in "iub":
                raise TraceError(f"{source}: column {name!r} must be integer, got {raw.dtype}")
            arrays[name] = raw.astype(dtype, copy=False)

        codes, names = _optype_codes(columns, n_rows, source)
        trace = cls(**arrays, optype=codes, optype_names=names, source=source)
        trace._validate(allow_unknown_optypes)
        return trace

    def _validate(self, allow_unknown_optypes: bool) -> None:
        present = small_ints_present(self.optype)
        unknown = [
            self.optype_names[c] for c in present if self.optype_names[c] not in KNOWN_OPTYPES
        ]
        if unknown and not allow_unknown_optypes:
            first = int(np.flatnonzero(self.optype == self.optype_names.index(unknown[0]))[0])
            raise TraceError(
                f"{self.source}: unknown op type(s) {', '.join(map(repr, unknown))} "
                f"(first at row {first} {self.describe_row(first)}); known op types are "
                f"{', '.join(KNOWN_OPTYPES)}"
            )
        for name in ("start_ts", "duration"):
            values = getattr(self, name)
            bad = ~np.isfinite(values)
            if name == "duration":
                bad |= values < 0
            if bad.any():
                rows = np.flatnonzero(bad)
                raise TraceError(
                    f"{self.source}: column {name!r} has {rows.size} invalid value(s) "
                    f"(NaN, infinite{' or negative' if name == 'duration' else ''}); first at row "
                    f"{int(rows[0])} {self.describe_row(int(rows[0]))}: {values[rows[0]]!r}"
                )
        for name in ("dp_rank", "stage", "seq_id"):
            values = getattr(self, name)
            if values.size and values.min() < 0:
                row = int(np.argmin(values))
                raise TraceError(
                    f"{self.source}: column {name!r} is negative at row {row} "
                    f"{self.describe_row(row)}"
                )


#: The per-row arrays of a trace.
TRACE_ARRAYS: tuple[str, ...] = (*TRACE_COLUMNS, "optype")


def _optype_codes(
    columns: Mapping[str, Sequence | np.ndarray], n_rows: int, source: str
) -> tuple[np.ndarray, tuple[str, ...]]:
    raw = columns["optype"]
    if "optype_names" in columns:
        names = tuple(str(n) for n in columns["optype_names"])
        codes = np.asarray(raw).astype(np.int16, copy=False)
        if codes.size and (codes.min() < 0 or codes.max() >= len(names)):
            raise TraceError(f"{source}: column 'optype' holds codes outside its dictionary")
        return codes, names
    values = np.asarray(raw, dtype=object)
    if values.shape != (n_rows,):
        raise TraceError(f"{source}: column 'optype' has the wrong number of rows")
    names_arr, codes = np.unique(values.astype(str), return_inverse=True)
    return codes.astype(np.int16), tuple(str(n) for n in names_arr)


def small_ints_present(values: np.ndarray) -> np.ndarray:
    """The distinct values of an integer column of small non-negative ids (ranks, stages,
    op type codes), ascending: `np.unique` in one counting pass instead of a sort.

    >>> small_ints_present(np.array([3, 0, 3, 1])).tolist()
    [0, 1, 3]
    """
    if not values.size or int(values.min()) < 0 or int(values.max()) > 1 << 20:
        return np.unique(values)
    return np.flatnonzero(np.bincount(values)).astype(values.dtype)


def ids_and_index(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`np.unique(values, return_inverse=True)` for an integer column whose values span a
    small range (a stream's few steps, repeated over many rows): a counting pass and a
    lookup instead of a sort of the rows.

    >>> ids, index = ids_and_index(np.array([12, 10, 12, 15]))
    >>> ids.tolist(), index.tolist()
    ([10, 12, 15], [1, 0, 1, 2])
    """
    if not values.size:
        return np.unique(values, return_inverse=True)
    low = int(values.min())
    span = int(values.max()) - low
    if span > max(1 << 16, values.size):
        return np.unique(values, return_inverse=True)
    offset = values - low
    present = np.flatnonzero(np.bincount(offset, minlength=span + 1))
    position = np.zeros(span + 1, dtype=np.intp)
    position[present] = np.arange(present.size)
    return (present + low).astype(values.dtype), position[offset]
