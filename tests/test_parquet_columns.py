"""The parquet reader of trace files: the same columns as pyarrow's, bit for bit, on every
file lagscope reads; pyarrow for the rest; one-line errors for broken files."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lagscope.producers import reference_format
from lagscope.producers.parquet_columns import (
    ParquetError,
    ParquetFormatError,
    ParquetNulls,
    UnsupportedParquet,
    parquet_rows,
    read_parquet_columns,
    rle_bit_packed,
)
from lagscope.producers.reference_format import load_meta, load_trace, write_trace
from lagscope.simulator.trace import Trace, TraceError
from tests.conftest import REFERENCE_TRACES, load_reference


def assert_same_as_pyarrow(path: Path) -> None:
    """Every column of `path` as this reader and as pyarrow read it: equal bytes and
    dtypes; strings compared row by row."""
    mine = read_parquet_columns(path)
    table = pq.read_table(path)
    assert list(mine.columns) == table.column_names
    for name in table.column_names:
        theirs = table.column(name).combine_chunks()
        if name in mine.dictionaries:
            names = np.asarray(mine.dictionaries[name], dtype=object)
            strings = theirs.cast(pa.string()) if pa.types.is_dictionary(theirs.type) else theirs
            assert names[mine.columns[name]].tolist() == strings.to_pylist(), name
            continue
        expected = theirs.to_numpy()
        assert mine.columns[name].dtype == expected.dtype, name
        assert mine.columns[name].tobytes() == expected.tobytes(), name
    metadata = table.schema.metadata or {}
    assert {k: v for k, v in mine.key_value.items() if k != b"ARROW:schema"} == metadata


def assert_loads_as_through_pyarrow(path: Path, monkeypatch) -> Trace:
    """load_trace of `path` (without pyarrow) equals the trace pyarrow's columns make."""
    columns, _ = reference_format._read_with_pyarrow(path)
    expected = Trace.from_columns(columns, source=str(path))

    def no_pyarrow(path):
        raise AssertionError(f"{path} was read through pyarrow")

    with monkeypatch.context() as patched:
        patched.setattr(reference_format, "_read_with_pyarrow", no_pyarrow)
        trace = load_trace(path)
    for field in dataclasses.fields(Trace):
        mine, theirs = getattr(trace, field.name), getattr(expected, field.name)
        if isinstance(mine, np.ndarray):
            assert mine.dtype == theirs.dtype and mine.tobytes() == theirs.tobytes(), field.name
        else:
            assert mine == theirs, field.name
    return trace


def test_rle_bit_packed_mixed_runs_match_a_plain_decoder() -> None:
    """Runs of both kinds, short and long, at several widths (the run finder's loop and
    its numpy doubling), against a decoder written value by value."""
    rng = np.random.default_rng(5)
    for bit_width in (1, 3, 5, 8, 12, 17, 24, 32):
        out, expected = bytearray(), []
        for _ in range(400):
            if rng.random() < 0.5:
                size = int(rng.integers(1, 200))
                value = int(rng.integers(0, 1 << bit_width))
                out += _varint(size << 1) + value.to_bytes((bit_width + 7) // 8, "little")
                expected += [value] * size
            else:
                groups = int(rng.integers(1, 4))
                values = rng.integers(0, 1 << bit_width, groups * 8).tolist()
                bits = "".join(format(v, f"0{bit_width}b")[::-1] for v in values)
                out += _varint(groups << 1 | 1) + bytes(
                    int(bits[i : i + 8][::-1], 2) for i in range(0, len(bits), 8)
                )
                expected += values
        decoded = rle_bit_packed(bytes(out), bit_width, len(expected))
        assert decoded.astype(np.int64).tolist() == [v - (v >> 31 << 32) for v in expected]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes([*out, value])


@pytest.mark.parametrize("name", ["AR", "SE", "ST"])
def test_reference_traces_read_as_pyarrow_reads_them(name, monkeypatch) -> None:
    path = REFERENCE_TRACES / f"trace-{name}.parquet"
    assert_same_as_pyarrow(path)
    assert_loads_as_through_pyarrow(path, monkeypatch)


def test_written_traces_many_pages_and_row_groups(tmp_path, monkeypatch) -> None:
    """A trace written by write_trace, then rewritten with small pages and row groups:
    dictionaries differ between row groups, and some pages fall back to PLAIN."""
    trace, meta = load_reference("ST")
    written = tmp_path / "written.parquet"
    write_trace(trace, written, meta)
    assert_same_as_pyarrow(written)
    assert_loads_as_through_pyarrow(written, monkeypatch)
    table = pq.read_table(written)
    for row_group_size, page_size, dictionary_limit in ((1000, 512, 1 << 20), (2500, 4096, 256)):
        path = tmp_path / f"small-{row_group_size}.parquet"
        pq.write_table(
            table,
            path,
            row_group_size=row_group_size,
            data_page_size=page_size,
            dictionary_pagesize_limit=dictionary_limit,
        )
        metadata = pq.ParquetFile(path).metadata
        assert metadata.num_row_groups > 2
        assert parquet_rows(path) == metadata.num_rows == len(trace.step)
        assert_same_as_pyarrow(path)
        assert_loads_as_through_pyarrow(path, monkeypatch)
    # The job the file was written for is read from its key-value metadata.
    with pytest.raises(TraceError, match="trial_name: the trace was written for"):
        other = dataclasses.replace(meta, trial_name="other")
        load_trace(written, meta=other, meta_path="m.yaml")


def test_row_groups_with_different_dictionaries(tmp_path) -> None:
    table = pa.table({"optype": pa.array(["b", "a", "b", "c", "a", "d"]).dictionary_encode()})
    path = tmp_path / "dict.parquet"
    pq.write_table(table, path, row_group_size=2)
    mine = read_parquet_columns(path)
    assert mine.dictionaries["optype"] == ["b", "a", "c", "d"]
    assert_same_as_pyarrow(path)


@pytest.mark.parametrize("compression", ["none", "snappy", "zstd", "gzip"])
@pytest.mark.parametrize("use_dictionary", [True, ["optype"]])
@pytest.mark.parametrize("version", ["1.0", "2.0"])
def test_codecs_encodings_and_page_versions(tmp_path, compression, use_dictionary, version):
    table = pq.read_table(REFERENCE_TRACES / "trace-ST.parquet")
    path = tmp_path / "t.parquet"
    pq.write_table(
        table,
        path,
        compression=compression,
        use_dictionary=use_dictionary,
        data_page_version=version,
        data_page_size=8192,
    )
    assert_same_as_pyarrow(path)


def test_required_columns_and_other_integer_types(tmp_path) -> None:
    schema = pa.schema(
        [pa.field("u8", pa.uint8(), nullable=False), ("u32", pa.uint32()), ("i64", pa.int64()),
         ("f64", pa.float64()), ("u64", pa.uint64())]
    )  # fmt: skip
    rng = np.random.default_rng(1)
    table = pa.table(
        {
            "u8": rng.integers(0, 255, 3000, dtype=np.uint8),
            "u32": rng.integers(0, 1 << 32, 3000, dtype=np.uint32),
            "i64": rng.integers(-(1 << 62), 1 << 62, 3000),
            "f64": rng.normal(size=3000),
            "u64": rng.integers(0, 5, 3000, dtype=np.uint64),
        },
        schema=schema,
    )
    for use_dictionary in (True, False):
        pq.write_table(table, tmp_path / "t.parquet", use_dictionary=use_dictionary)
        assert_same_as_pyarrow(tmp_path / "t.parquet")


@pytest.mark.parametrize("column", ["duration", "optype", "step"])
def test_nulls_are_named_with_their_first_row(tmp_path, column) -> None:
    table = pq.read_table(REFERENCE_TRACES / "trace-ST.parquet")
    values = table.column(column).to_pylist()
    for row in (70, 4000, 4001):
        values[row] = None
    index = table.column_names.index(column)
    table = table.set_column(index, column, pa.array(values, type=table.schema.field(column).type))
    path = tmp_path / "nulls.parquet"
    pq.write_table(table, path, row_group_size=2000)
    with pytest.raises(ParquetNulls, match=rf"column '{column}' has 3 null\(s\), first at row 70"):
        read_parquet_columns(path)
    with pytest.raises(TraceError, match=rf"{path}: column '{column}' has 3 null\(s\), first at"):
        load_trace(path)


@pytest.mark.parametrize(
    "kind", ["delta", "byte_stream_split", "nested", "boolean", "lz4", "timestamp", "plain"]
)
def test_unsupported_files_fall_back_to_pyarrow(tmp_path, kind) -> None:
    trace, _ = load_reference("ST")
    table = pq.read_table(REFERENCE_TRACES / "trace-ST.parquet")
    options: dict = {}
    if kind == "delta":
        options = {"use_dictionary": False, "column_encoding": {"step": "DELTA_BINARY_PACKED"}}
    elif kind == "byte_stream_split":
        options = {"use_dictionary": False, "column_encoding": {"duration": "BYTE_STREAM_SPLIT"}}
    elif kind == "nested":
        table = table.append_column("extra", pa.array([[1, 2]] * table.num_rows))
    elif kind == "boolean":
        table = table.append_column("flag", pa.array([True] * table.num_rows))
    elif kind == "lz4":
        options = {"compression": "lz4"}
    elif kind == "timestamp":
        table = table.append_column("at", pa.array(np.arange(table.num_rows), pa.timestamp("ms")))
    else:  # strings not dictionary-encoded
        table = table.set_column(4, "optype", table.column("optype").cast(pa.string()))
        options = {"use_dictionary": False}
    path = tmp_path / f"{kind}.parquet"
    pq.write_table(table, path, **options)
    with pytest.raises(UnsupportedParquet):
        read_parquet_columns(path)
    loaded = load_trace(path)
    assert loaded.n_rows == trace.n_rows and np.array_equal(loaded.duration, trace.duration)
    names = np.asarray(loaded.optype_names)[loaded.optype]
    assert np.array_equal(names, np.asarray(trace.optype_names)[trace.optype])


def test_truncated_and_corrupt_files_give_one_line(tmp_path) -> None:
    """Cut or overwritten anywhere, a file is read, or fails with a ParquetError in the
    reader and a one-line TraceError naming it in load_trace: never an IndexError."""
    good = (REFERENCE_TRACES / "trace-ST.parquet").read_bytes()
    rng = np.random.default_rng(7)
    broken = [good[:cut] for cut in (0, 3, 4, 100, 30000, len(good) - 9, len(good) - 1)]
    for _ in range(40):
        at = int(rng.integers(0, len(good)))
        span = int(rng.integers(1, 16))
        broken.append(
            good[:at] + bytes(rng.integers(0, 256, span, dtype=np.uint8)) + good[at + span :]
        )
    footer_start = len(good) - 8 - int.from_bytes(good[-8:-4], "little")
    for at in range(footer_start, len(good) - 8, 97):  # the footer itself
        broken.append(good[:at] + bytes([good[at] ^ 0xFF]) + good[at + 1 :])
    path = tmp_path / "broken.parquet"
    for number, data in enumerate(broken):
        path.write_bytes(data)
        try:
            read_parquet_columns(path)
        except ParquetError as exc:
            assert "\n" not in str(exc)
        else:
            assert number >= 7, "a truncated file was read"
        try:
            parquet_rows(path)
        except ParquetError as exc:
            assert "\n" not in str(exc)
        try:
            load_trace(path)
        except TraceError as exc:
            assert str(exc).startswith(f"{path}: ") and "\n" not in str(exc)
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(TraceError, match="not a readable parquet file"):
        load_trace(path)
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "absent.parquet")


def test_a_corrupt_page_is_a_format_error(tmp_path) -> None:
    good = bytearray((REFERENCE_TRACES / "trace-ST.parquet").read_bytes())
    start = pq.ParquetFile(REFERENCE_TRACES / "trace-ST.parquet").metadata.row_group(0)
    offset = start.column(5).data_page_offset  # start_ts: snappy data after a page header
    good[offset + 40 : offset + 80] = b"\xff" * 40
    path = tmp_path / "corrupt.parquet"
    path.write_bytes(bytes(good))
    with pytest.raises(ParquetFormatError):
        read_parquet_columns(path)


def test_analyze_does_not_import_pyarrow(reference_dir) -> None:
    imported = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "lagscope", "analyze",
         "--trace", str(reference_dir / "trace-ST.parquet"),
         "--meta", str(reference_dir / "meta-ST.yaml")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert imported.returncode == 0, imported.stderr[-2000:]
    modules = [line.rsplit("|", 1)[-1].strip() for line in imported.stderr.splitlines()]
    assert "lagscope.producers.parquet_columns" in modules
    assert not [m for m in modules if m.startswith("pyarrow")]
    assert load_meta(reference_dir / "meta-ST.yaml").trial_name == "ST"


def test_row_groups_one_at_a_time(tmp_path: Path) -> None:
    """`iter_parquet_row_groups`: each group's rows, string codes into the dictionaries of
    the groups so far (a prefix of the next's), the columns asked for only; a null in a
    later group names its row in the file."""
    from lagscope.producers.parquet_columns import iter_parquet_row_groups

    path = tmp_path / "groups.parquet"
    table = pa.table({
        "step": pa.array([0, 0, 1, 1, 2], pa.int64()),
        "optype": pa.array(["b", "a", "a", "c", "b"]).dictionary_encode(),
    })  # fmt: skip
    pq.write_table(table, path, row_group_size=2)
    groups = list(iter_parquet_row_groups(path))
    assert [g.columns["step"].tolist() for g in groups] == [[0, 0], [1, 1], [2]]
    decoded = [[g.dictionaries["optype"][code] for code in g.columns["optype"]] for g in groups]
    assert decoded == [["b", "a"], ["a", "c"], ["b"]]
    names = [g.dictionaries["optype"] for g in groups]
    assert all(later[: len(earlier)] == earlier for earlier, later in itertools.pairwise(names))
    assert [list(g.columns) for g in iter_parquet_row_groups(path, ["step"])] == [["step"]] * 3

    with_null = tmp_path / "null.parquet"
    pq.write_table(pa.table({"step": pa.array([0, 1, 2, None, 4], pa.int64())}), with_null,
                   row_group_size=2)  # fmt: skip
    with pytest.raises(ParquetNulls, match="column 'step' has 1 null"):
        list(iter_parquet_row_groups(with_null))
    try:
        list(iter_parquet_row_groups(with_null))
    except ParquetNulls as exc:
        assert exc.first_row == 3
