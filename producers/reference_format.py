"""Reader and writer of the reference trace format: one parquet file of ops plus a yaml
file of job metadata (the format of the OSDI'25 what-if analyzer's public artifact).

This is the thin I/O edge of the analysis: it turns files into `simulator.trace.Trace` and
`JobMeta`, naming the file in every error.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from lagscope.producers.parquet_columns import (
    ParquetError,
    ParquetFormatError,
    ParquetNulls,
    iter_parquet_row_groups,
    read_parquet_columns,
)
from lagscope.simulator.errors import TraceError
from lagscope.simulator.fields import FieldErrors
from lagscope.simulator.trace import JobMeta, Trace

if TYPE_CHECKING:  # pyarrow is imported where a file needs it: its import is a command's
    import pyarrow as pa  # start (libarrow, libparquet), the trace files lagscope writes not

#: Arrow types used when writing, matching the reference files. A job larger than they
#: can hold (192 DP ranks, 100,000 GPUs) gets the next wider integer (`_column_array`).
_WRITE_TYPES: dict[str, str] = {
    "dp_rank": "int8",
    "stage": "int8",
    "rank": "int16",
    "step": "int64",
    "start_ts": "float32",
    "duration": "float32",
    "seq_id": "int32",
    "mc": "int8",
    "mb_id": "int8",
    "gmc": "int16",
}


def load_trace(
    path: str | Path, *, meta: JobMeta | None = None, meta_path: str | Path | None = None
) -> Trace:
    """Read a reference-format parquet trace; with `meta` (read from `meta_path`), also
    check that the two describe the same job (`check_same_job`)."""
    path = Path(path)
    try:
        read = _read_without_pyarrow(path)
        if not isinstance(read, tuple):
            read = _read_with_pyarrow(path, problem=read)
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    columns, key_value = read
    trace = Trace.from_columns(columns, source=str(path))
    if meta is not None:
        check_same_job(
            trace, meta, trace_path=path, meta_path=meta_path, written_for=_written_for(key_value)
        )
    return trace


#: A trace file larger than this is read a part at a time where it can be (`open_trace`).
PART_BYTES = 64 << 20
#: Rows of a part (whole steps: a step larger than this is a part of its own).
PART_ROWS = 4_000_000


@dataclass(frozen=True)
class TraceParts:
    """A trace file whose steps come in order, read a part of whole steps at a time (each
    iteration reads the file again): what `replay` needs of a trace larger than memory.
    `steps` and `max_step` are the file's, counted when it was opened."""

    path: Path
    steps: int
    max_step: int
    rows: int
    part_rows: int = PART_ROWS

    def __iter__(self) -> Iterator[Trace]:
        pending: list[dict[str, np.ndarray]] = []
        held = 0
        # The rows of the last step read: the next row group may go on with it.
        carried: dict[str, np.ndarray] | None = None
        names: list[str] = []
        for columns, names in self._groups():
            if not columns["step"].size:
                continue
            if carried is not None:
                columns = {k: np.concatenate([carried[k], v]) for k, v in columns.items()}
            done = columns["step"] < columns["step"].max()
            pending.append({k: v[done] for k, v in columns.items()})
            carried = {k: v[~done] for k, v in columns.items()}
            held += int(np.count_nonzero(done))
            if held >= self.part_rows:
                yield self._part(pending, names)
                pending, held = [], 0
        if carried is not None:
            pending.append(carried)
        if pending:
            yield self._part(pending, names)

    def _part(self, pending: list[dict[str, np.ndarray]], names: list[str]) -> Trace:
        return _joined(pending, names, self.path)

    def _groups(self) -> Iterator[tuple[dict[str, np.ndarray], list[str]]]:
        return _row_groups(self.path)


def _joined(parts: list[dict[str, np.ndarray]], names: list[str], path: Path) -> Trace:
    """Columns read a row group at a time, as one trace."""
    columns = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return Trace.from_columns({**columns, "optype_names": names}, source=str(path))


def _row_groups(
    path: Path, groups: list[int] | None = None
) -> Iterator[tuple[dict[str, np.ndarray], list[str]]]:
    """The columns of the file's row groups (`groups`: these alone) and its op type names
    so far, a group at a time; a problem of the file as one TraceError line."""
    try:
        for group in iter_parquet_row_groups(path, groups=groups):
            yield group.columns, group.dictionaries.get("optype", [])
    except ParquetNulls as exc:
        raise TraceError(f"{path}: {exc}") from None
    except ParquetError as exc:
        raise TraceError(f"{path}: not a readable parquet file ({exc})") from None


def open_trace(
    path: str | Path, *, meta: JobMeta | None = None, meta_path: str | Path | None = None
) -> Trace | TraceParts:
    """The trace at `path` as `load_trace` reads it, or, for a file over `PART_BYTES`
    whose row groups hold its steps in order (lagscope's own files do), as `TraceParts`:
    its rows are not all held at once (a 12,288-GPU job's 2,000 steps are 250 M rows).
    With `meta`, the same check that the two describe one job, before any part is read."""
    path = Path(path)
    try:
        large = path.stat().st_size > PART_BYTES
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except OSError:
        large = False
    outline = _step_outline(path) if large else None
    if outline is None:
        return load_trace(path, meta=meta, meta_path=meta_path)
    if meta is not None:
        _check_job_values(
            outline.dp_ranks, outline.stages, outline.top_rank, meta, trace_path=path,
            meta_path=meta_path, written_for=_written_for(outline.key_value),
        )  # fmt: skip
    return TraceParts(path, len(outline.steps), max(outline.steps), outline.rows)


class StepIndex(NamedTuple):
    """Where a file's steps are, its row groups holding them in order (lagscope's own
    files do): its steps, rows and each group's least and greatest step (an empty group's:
    (0, -1)). `read` takes a window of steps from the groups that hold it alone."""

    path: Path
    step_ids: tuple[int, ...]
    rows: int
    group_steps: tuple[tuple[int, int], ...]
    key_value: Mapping[bytes, bytes]

    def read(
        self,
        wanted: Iterable[int],
        *,
        meta: JobMeta | None = None,
        meta_path: str | Path | None = None,
    ) -> Trace:
        """The rows of the steps `wanted` as one trace, read from the row groups that hold
        them alone: a window of a trace larger than memory. With `meta`, the check that
        the two describe one job (`check_same_job`)."""
        wanted = np.unique(np.fromiter(wanted, dtype=np.int64))
        groups = [
            index
            for index, (least, greatest) in enumerate(self.group_steps)
            if np.any((wanted >= least) & (wanted <= greatest))
        ]
        kept: list[dict[str, np.ndarray]] = []
        names: list[str] = []
        for columns, names_so_far in _row_groups(self.path, groups):
            rows = np.isin(columns["step"], wanted)
            kept.append({k: v[rows] for k, v in columns.items()})
            names = names_so_far
        if not kept:
            raise TraceError(f"{self.path}: none of the steps asked for is in the file")
        trace = _joined(kept, names, self.path)
        if meta is not None:
            check_same_job(trace, meta, trace_path=self.path, meta_path=meta_path,
                           written_for=_written_for(self.key_value))  # fmt: skip
        return trace


def index_steps(path: Path) -> StepIndex | None:
    """The file's `StepIndex`, from its step column alone; None where its row groups do
    not hold its steps in order or this reader cannot read it."""
    outline = _step_outline(path, workers=False)
    if outline is None:
        return None
    return StepIndex(path, tuple(sorted(outline.steps)), outline.rows, outline.group_steps,
                     outline.key_value)  # fmt: skip


class _Outline(NamedTuple):
    """What a first pass over a file's step and worker columns says (without the worker
    columns: no DP rank, stage or rank)."""

    steps: set[int]
    dp_ranks: np.ndarray
    stages: np.ndarray
    top_rank: int
    rows: int
    key_value: Mapping[bytes, bytes]
    #: Each row group's least and greatest step (an empty group's: (0, -1)).
    group_steps: tuple[tuple[int, int], ...]


def _step_outline(path: Path, *, workers: bool = True) -> _Outline | None:
    """The file's outline (`workers`: with its worker columns), or None when its row
    groups do not hold its steps in order, or this reader cannot read it (`load_trace`
    then reads it whole and names what is wrong)."""
    steps: set[int] = set()
    dp_ranks: set[int] = set()
    stages: set[int] = set()
    group_steps: list[tuple[int, int]] = []
    top_rank, rows, last = -1, 0, None
    key_value: Mapping[bytes, bytes] = {}
    try:
        names = ("step", "dp_rank", "stage", "rank") if workers else ("step",)
        for group in iter_parquet_row_groups(path, names):
            columns, key_value = group.columns, group.key_value
            if not set(names) <= columns.keys():
                return None
            step = columns["step"]
            if not step.size:
                group_steps.append((0, -1))
                continue
            group_steps.append((int(step.min()), int(step.max())))
            if last is not None and int(step.min()) < last:
                return None
            last = int(step.max())
            steps.update(np.unique(step).tolist())
            rows += step.size
            if workers:
                dp_ranks.update(np.unique(columns["dp_rank"]).tolist())
                stages.update(np.unique(columns["stage"]).tolist())
                top_rank = max(top_rank, int(columns["rank"].max()))
    except (ParquetError, OSError):
        return None
    if not steps:
        return None
    return _Outline(steps, np.array(sorted(dp_ranks)), np.array(sorted(stages)), top_rank,
                    rows, key_value, tuple(group_steps))  # fmt: skip


def _read_without_pyarrow(path: Path) -> tuple[dict[str, object], Mapping] | str | None:
    """The columns and key-value metadata of a file `parquet_columns` reads (lagscope's
    and the reference files: flat, dictionary-encoded, snappy); else what is wrong with
    the file (a broken one) or None (one using more of parquet), for pyarrow to read."""
    try:
        parquet = read_parquet_columns(path)
    except ParquetNulls as exc:
        raise TraceError(f"{path}: {exc}") from None
    except ParquetFormatError as exc:
        return str(exc)
    except ParquetError:
        return None
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        return None
    columns: dict[str, object] = {}
    for name, values in parquet.columns.items():
        names = parquet.dictionaries.get(name)
        if name == "optype" and names is not None:
            columns["optype"], columns["optype_names"] = values, names
        elif names is not None:
            columns[name] = np.asarray(names, dtype=object)[values]
        else:
            columns[name] = values
    return columns, parquet.key_value


def _read_with_pyarrow(path: Path, problem: str | None = None) -> tuple[dict[str, object], Mapping]:
    """The columns and key-value metadata of a parquet file, read by pyarrow; when it
    cannot, the error names `problem` (what `parquet_columns` found wrong), else pyarrow's
    own message in one line."""
    import pyarrow as pa

    try:
        table = _read_parquet(path)
    except (pa.ArrowInvalid, OSError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        problem = problem or " ".join(
            "".join(c if c.isprintable() else " " for c in str(exc)).split()
        )
        raise TraceError(f"{path}: not a readable parquet file ({problem})") from None
    columns: dict[str, object] = {}
    for name in table.column_names:
        column = table.column(name).combine_chunks()
        if name == "optype":
            if pa.types.is_dictionary(column.type):
                columns["optype"] = _values(column.indices)
                columns["optype_names"] = column.dictionary.to_pylist()
                if column.null_count:
                    raise TraceError(f"{path}: column 'optype' has {column.null_count} nulls")
            else:
                columns["optype"] = np.asarray(column.to_pylist(), dtype=object)
            continue
        if column.null_count:
            first = int(np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False))[0])
            raise TraceError(
                f"{path}: column {name!r} has {column.null_count} null(s), first at row {first}"
            )
        columns[name] = _values(column)
    return columns, table.schema.metadata or {}


def _read_parquet(path: Path) -> pa.Table:
    """The whole file as one table, through parquet's file reader alone: not read_table,
    which goes through pyarrow.dataset (whose import pulls in pandas, a fifth of a second
    of a command's start), nor pyarrow.parquet, which imports pyarrow.fs for remote
    filesystems (and with it ssl and the S3 bindings: a tenth of `analyze` on a small
    trace) where a local file needs none of them."""
    try:
        from pyarrow._parquet import ParquetReader
    except ImportError:  # the reader moved: the public module reads the same file
        import pyarrow.parquet as pq

        with pq.ParquetFile(path) as parquet:
            return parquet.read()
    reader = ParquetReader()
    reader.open(str(path))
    try:
        return reader.read_all()
    finally:
        reader.close()


#: numpy dtypes of the arrow types (by their names) whose values are one plain buffer.
_PLAIN_NUMPY_TYPES = {
    name: np.dtype(name.replace("float", "float32").replace("double", "float64"))
    for name in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                 "float", "double")
}  # fmt: skip


def _values(column: pa.Array) -> np.ndarray:
    """The values of a null-free arrow array as numpy, viewed in place where the type has
    one plain buffer. pyarrow's own `to_numpy` imports pandas on first use, which would be
    a fifth of a second of every `lagscope analyze`."""
    dtype = _PLAIN_NUMPY_TYPES.get(str(column.type))
    if dtype is None:
        return column.to_numpy(zero_copy_only=False)
    return np.frombuffer(
        column.buffers()[1], dtype=dtype, count=len(column), offset=column.offset * dtype.itemsize
    )


def write_trace(trace: Trace, path: str | Path, meta: JobMeta | None = None) -> None:
    """Write a trace in the reference format (the generator and tests use it); with
    `meta`, the file also names the job it belongs to (`check_same_job` reads it)."""
    write_traces([trace], path, meta)


#: The reference format's column order.
_COLUMN_ORDER = ("dp_rank", "stage", "rank", "step", "optype", "start_ts", "duration",
                 "seq_id", "mc", "mb_id", "gmc")  # fmt: skip


def write_traces(traces: Iterable[Trace], path: str | Path, meta: JobMeta | None = None) -> int:
    """Write consecutive parts of one trace as one file, a row group (or more) each, one
    part in memory at a time; returns the rows written. The first part sets each
    column's type (a later part's values must fit it: every part of a job holds all of
    its workers), the op type names may differ from part to part."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    writer = None
    rows = 0
    try:
        for trace in traces:
            arrays = {
                name: _column_array(getattr(trace, name), pa.type_for_alias(alias))
                for name, alias in _WRITE_TYPES.items()
            }
            arrays["optype"] = pa.DictionaryArray.from_arrays(
                pa.array(trace.optype, type=pa.int8()), pa.array(list(trace.optype_names))
            )
            table = pa.table({k: arrays[k] for k in _COLUMN_ORDER})
            if writer is None:
                if meta is not None:
                    written_for = {name: getattr(meta, name) for name in _JOB_FIELDS}
                    table = table.replace_schema_metadata({_JOB_KEY: json.dumps(written_for)})
                writer = pq.ParquetWriter(Path(path), table.schema)
            else:
                table = table.cast(writer.schema)
            writer.write_table(table)
            rows += trace.n_rows
    finally:
        if writer is not None:
            writer.close()
    if writer is None:
        raise ValueError(f"{path}: no trace to write")
    return rows


#: The parquet key-value metadata naming the job a trace was written for, and its fields.
_JOB_KEY = "lagscope.job"
_JOB_FIELDS = ("trial_name", "run_id", "dp_size", "pp_size", "tp_size", "dsp_size", "vpp_size",
               "world_size")  # fmt: skip


def _written_for(key_value: Mapping[bytes, bytes]) -> dict[str, object]:
    """The job a trace file names in its key-value metadata (`write_trace(..., meta)`), or
    {} (reference files)."""
    raw = key_value.get(_JOB_KEY.encode())
    try:
        found = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}


def check_same_job(
    trace: Trace,
    meta: JobMeta,
    *,
    trace_path: str | Path,
    meta_path: str | Path | None = None,
    written_for: dict[str, object] | None = None,
) -> None:
    """Raise TraceError, in one line naming both files and the field, when a trace and a
    job metadata file describe different jobs: the job the trace file names (its name and
    sizes, when it names one), its DP ranks and pipeline stages (all of 0 .. size-1, as a
    recorded job has them), and its ranks (below the world size). `analyze --trace T
    --meta M` with the files of two jobs would otherwise analyse one job as the other.
    """
    _check_job_values(
        np.unique(trace.dp_rank), np.unique(trace.stage),
        int(trace.rank.max()) if trace.rank.size else None,
        meta, trace_path=trace_path, meta_path=meta_path, written_for=written_for,
    )  # fmt: skip


def _check_job_values(
    dp_ranks: np.ndarray,
    stages: np.ndarray,
    top_rank: int | None,
    meta: JobMeta,
    *,
    trace_path: str | Path,
    meta_path: str | Path | None,
    written_for: dict[str, object] | None,
) -> None:
    """`check_same_job` on what it reads of a trace: its DP ranks and stages (each
    distinct, ascending) and its highest rank (None without rows)."""
    meta_name = str(meta_path) if meta_path is not None else "the job metadata"
    prefix = f"{trace_path} and {meta_name} describe different jobs"
    for name, value in (written_for or {}).items():
        if name in _JOB_FIELDS and value != getattr(meta, name):
            raise TraceError(
                f"{prefix}: {name}: the trace was written for {value!r}, "
                f"{meta_name} says {getattr(meta, name)!r}"
            )
    for field, present, size, what in (
        ("dp_size", dp_ranks, meta.dp_size, "DP ranks (dp_rank"),
        ("pp_size", stages, meta.pp_size, "pipeline stages (stage"),
    ):
        if not present.size:
            continue
        if present[0] < 0 or present[-1] >= size or present.size != size:
            raise TraceError(
                f"{prefix}: {field}: the trace has {present.size} {what} "
                f"{_span(present)}), {meta_name} says {field} {size}"
            )
    if top_rank is not None and top_rank >= meta.world_size:
        raise TraceError(
            f"{prefix}: world_size: the trace has rank {top_rank}, "
            f"{meta_name} says world_size {meta.world_size}"
        )


def _span(values: np.ndarray) -> str:
    """`0-3` for a run of integers, else the values (a few of them)."""
    low, high = int(values[0]), int(values[-1])
    if values.size == high - low + 1:
        return f"{low}-{high}" if high > low else str(low)
    shown = ", ".join(str(int(v)) for v in values[:6])
    return shown + (", ..." if values.size > 6 else "")


def _column_array(values: np.ndarray, reference_type: pa.DataType) -> pa.Array:
    """`values` as the reference file's type, or the narrowest wider integer that holds
    them: the reference types are the files' own, and too narrow for large jobs.

    >>> import pyarrow as pa
    >>> _column_array(np.array([0, 191]), pa.int8()).type
    DataType(int16)
    >>> _column_array(np.array([0, 7]), pa.int8()).type
    DataType(int8)
    """
    import pyarrow as pa

    if not pa.types.is_integer(reference_type) or not len(values):
        return pa.array(values, type=reference_type)
    low, high = int(np.min(values)), int(np.max(values))
    wider_integers = ((pa.int8(), np.int8), (pa.int16(), np.int16), (pa.int32(), np.int32))
    wider = [(t, d) for t, d in wider_integers if t.byte_width >= reference_type.byte_width]
    for candidate, dtype in wider:
        if np.iinfo(dtype).min <= low and high <= np.iinfo(dtype).max:
            return pa.array(values, type=candidate)
    return pa.array(values, type=pa.int64())


def load_meta(path: str | Path) -> JobMeta:
    """Read and validate a job metadata yaml file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except UnicodeDecodeError:
        # A binary file (a parquet trace given as --meta): its bytes say nothing useful.
        raise TraceError(f"{path}: not a yaml text file (not UTF-8 text)") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror or exc})") from None
    raw = flat_yaml_mapping(text)
    if raw is None:
        import yaml

        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise TraceError(f"{path}: not valid yaml ({' '.join(str(exc).split())})") from None
    if not isinstance(raw, dict):
        raise TraceError(f"{path}: expected a mapping of job metadata, got {type(raw).__name__}")
    try:
        return JobMeta.from_mapping(raw)
    except FieldErrors as exc:
        raise TraceError(f"{path}: invalid job metadata: {exc}") from None


def write_meta(meta: JobMeta, path: str | Path) -> None:
    import yaml

    data = meta.as_dict(exclude_none=True)
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))


#: One `key: value` line of a flat mapping whose value is a decimal integer without a
#: leading zero, or a plain word: the whole of a reference meta file.
_FLAT_LINE = re.compile(
    r"([A-Za-z_][A-Za-z0-9_]*):[ ]+(?:(0|-?[1-9][0-9]*)|([A-Za-z][A-Za-z0-9_-]*))[ ]*"
)
#: Plain words YAML 1.1 (pyyaml) reads as booleans or null, not as strings (keys too).
_YAML_WORDS = frozenset(
    f(w)
    for w in ("yes", "no", "true", "false", "on", "off", "null")
    for f in (str.lower, str.capitalize, str.upper)
)


def flat_yaml_mapping(text: str) -> dict[str, object] | None:
    """The mapping of a yaml text that is nothing but `key: integer` and `key: word` lines
    (a job's meta file), exactly as yaml reads it; None for anything else (comments,
    quotes, floats, nesting, repeated keys), which is left to yaml itself. Importing the
    yaml package costs more than a small trace's whole analysis.

    >>> flat_yaml_mapping("trial_name: ST\\ndp_size: 2\\n")
    {'trial_name': 'ST', 'dp_size': 2}
    >>> flat_yaml_mapping("dp_size: 010") is None  # octal in YAML 1.1: yaml decides
    True
    """
    found: dict[str, object] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        match = _FLAT_LINE.fullmatch(line)
        if match is None or match[1] in found or {match[1], match[3]} & _YAML_WORDS:
            return None
        found[match[1]] = int(match[2]) if match[2] is not None else match[3]
    return found or None
