"""The flat columns of a local parquet file as numpy arrays, decoded without pyarrow.

Importing pyarrow (libarrow and libparquet) costs about as much as analysing a small trace,
and a trace file needs little of it: a flat table of integer, float and dictionary-encoded
string columns. This module decodes exactly that part of the format (Apache parquet-format,
`parquet.thrift`) and raises `UnsupportedParquet` for everything else, which the caller then
reads with pyarrow:

- flat schemas (no nesting, no repeated fields) of INT32, INT64, FLOAT, DOUBLE and UTF-8
  strings, plain or with integer logical types (INT(8, true) -> int8, as pyarrow reads it);
- PLAIN and dictionary encodings (numeric columns; strings only through their dictionary),
  data pages v1 and v2, definition levels of optional columns;
- uncompressed, snappy, gzip and zstd column chunks (through cramjam).

A column holding nulls raises `ParquetNulls` (numpy integer arrays have no null); a file
that is not parquet, or is truncated or corrupt, raises `ParquetFormatError`. Both name the
problem in one line, never as an IndexError from deep inside the decoder.

>>> import tempfile, pathlib
>>> path = pathlib.Path(tempfile.mkdtemp()) / "not.parquet"
>>> _ = path.write_bytes(b"step,duration\\n1,0.5\\n")
>>> try:
...     read_parquet_columns(path)
... except ParquetFormatError as exc:
...     print(exc)
no parquet footer (no PAR1 magic at its end): not parquet, or truncated
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import cramjam
import numpy as np


class ParquetError(Exception):
    """A file this reader does not return columns of."""


class UnsupportedParquet(ParquetError):
    """The file uses a part of the format this reader does not decode (pyarrow may)."""


class ParquetFormatError(ParquetError):
    """The file is not parquet, or is truncated or corrupt."""


class ParquetNulls(ParquetError):
    """A column holds nulls: `count` of them, the first at row `first_row`."""

    def __init__(self, column: str, count: int, first_row: int) -> None:
        super().__init__(f"column {column!r} has {count} null(s), first at row {first_row}")
        self.column, self.count, self.first_row = column, count, first_row


@dataclass(frozen=True)
class ParquetColumns:
    """A file's columns in schema order. A string column holds codes into its entry of
    `dictionaries` (the names in order of first appearance in the file's dictionaries);
    `key_value` is the file's key-value metadata (pyarrow's `schema.metadata`, which adds
    the serialized arrow schema)."""

    columns: dict[str, np.ndarray]
    dictionaries: dict[str, list[str]] = field(default_factory=dict)
    key_value: dict[bytes, bytes] = field(default_factory=dict)


def read_parquet_columns(path: str | Path) -> ParquetColumns:
    """Every column of the parquet file at `path` (see the module's docstring for what is
    read, and the errors). An OSError (no such file) passes through."""
    data = Path(path).read_bytes()
    try:
        return _read(data)
    except ParquetError:
        raise
    except _CORRUPT as exc:
        raise ParquetFormatError(f"corrupt parquet metadata or page ({exc!r})") from None


def parquet_rows(path: str | Path) -> int:
    """The rows of the parquet file at `path`, as its footer counts them (nothing else is
    read). Errors as `read_parquet_columns`."""
    with open(path, "rb") as file, _mapped(file) as data:
        try:
            return int(sum(group[3] for group in _footer(data).row_groups))
        except ParquetError:
            raise
        except _CORRUPT as exc:
            raise ParquetFormatError(f"corrupt parquet metadata ({exc!r})") from None


#: What decoding a corrupt file raises: a field out of the buffer or of the wrong type
#: (the file, not the reader, is wrong; what pyarrow reads of such files is read through
#: it instead).
_CORRUPT = (IndexError, ValueError, KeyError, TypeError, OverflowError, struct.error,
            RecursionError, UnicodeDecodeError)  # fmt: skip


# --- Thrift compact protocol (the encoding of the footer and the page headers) -------------

_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(
    13
)


class _Thrift:
    """A reader of Thrift compact-protocol values from `buf` at `pos`: a struct becomes a
    dict of field id to value, a list a list, a binary bytes, integers int."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf, self.pos = buf, pos

    def varint(self) -> int:
        buf, pos = self.buf, self.pos
        result = shift = 0
        while True:
            byte = buf[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            if byte < 0x80:
                self.pos = pos
                return result
            shift += 7
            if shift > 63:
                raise ParquetFormatError("corrupt parquet metadata (a varint over 64 bits)")

    def zigzag(self) -> int:
        value = self.varint()
        return (value >> 1) ^ -(value & 1)

    def struct(self) -> dict[int, object]:
        fields: dict[int, object] = {}
        field_id = 0
        buf = self.buf
        while True:
            header = buf[self.pos]
            self.pos += 1
            if header == _STOP:
                return fields
            delta, kind = header >> 4, header & 0x0F
            field_id = field_id + delta if delta else self.zigzag()
            if kind in (_TRUE, _FALSE):  # a struct's booleans live in the header
                fields[field_id] = kind == _TRUE
            else:
                fields[field_id] = self.value(kind)

    def value(self, kind: int) -> object:
        if kind in (_I16, _I32, _I64):
            return self.zigzag()
        if kind == _BINARY:
            size = self.varint()
            start = self.pos
            self.pos = start + size
            if self.pos > len(self.buf):
                raise ParquetFormatError("corrupt parquet metadata (a string past its end)")
            return self.buf[start : self.pos]
        if kind == _STRUCT:
            return self.struct()
        if kind in (_LIST, _SET):
            header = self.buf[self.pos]
            self.pos += 1
            size, element = header >> 4, header & 0x0F
            if size == 15:
                size = self.varint()
            return [self.value(element) for _ in range(size)]
        if kind in (_TRUE, _FALSE, _BYTE):  # in a list, a boolean is a byte: 1 is true
            byte = self.buf[self.pos]
            self.pos += 1
            return (byte == 1) if kind != _BYTE else byte - 256 * (byte > 127)
        if kind == _DOUBLE:
            self.pos += 8
            return struct.unpack_from("<d", self.buf, self.pos - 8)[0]
        if kind == _MAP:
            size = self.varint()
            if not size:
                return {}
            types = self.buf[self.pos]
            self.pos += 1
            return {self.value(types >> 4): self.value(types & 0x0F) for _ in range(size)}
        raise ParquetFormatError(f"corrupt parquet metadata (thrift type {kind})")


# --- The footer: schema, row groups, key-value metadata ------------------------------------

_MAGIC = b"PAR1"
_INT32, _INT64, _FLOAT, _DOUBLE_TYPE, _BYTE_ARRAY = 1, 2, 4, 5, 6
#: numpy dtype of each physical type's PLAIN encoding.
_PHYSICAL = {
    _INT32: np.dtype("<i4"),
    _INT64: np.dtype("<i8"),
    _FLOAT: np.dtype("<f4"),
    _DOUBLE_TYPE: np.dtype("<f8"),
}
_PHYSICAL_NAMES = {0: "BOOLEAN", 3: "INT96", 6: "BYTE_ARRAY", 7: "FIXED_LEN_BYTE_ARRAY"}
_OPTIONAL, _REPEATED = 1, 2
#: Converted types of integers (INT_8 .. INT_64, UINT_8 .. UINT_64): (bits, signed).
_CONVERTED_INTEGERS = {15: (8, True), 16: (16, True), 17: (32, True), 18: (64, True),
                       11: (8, False), 12: (16, False), 13: (32, False),
                       14: (64, False)}  # fmt: skip
_UTF8 = 0  # the converted type of strings
_LOGICAL_STRING, _LOGICAL_INTEGER = 1, 10


@dataclass(frozen=True)
class _Column:
    """A leaf column of the schema, with the numpy dtype its values decode to."""

    name: str
    physical: int
    dtype: np.dtype | None  # None: a string column
    optional: bool


@dataclass(frozen=True)
class _Footer:
    """What the file's footer says: its columns, row groups and key-value metadata."""

    columns: list[_Column]
    row_groups: list
    key_value: dict[bytes, bytes]
    #: Where the footer begins: every column chunk ends before it.
    start: int


def _footer(data: bytes | mmap.mmap) -> _Footer:
    footer_end = len(data) - 8
    if len(data) < 12 or data[footer_end + 4 :] != _MAGIC:
        if data[-4:] == b"PARE":
            raise UnsupportedParquet("an encrypted footer")
        raise ParquetFormatError(
            "no parquet footer (no PAR1 magic at its end): not parquet, or truncated"
        )
    footer_size = int.from_bytes(data[footer_end : footer_end + 4], "little")
    footer_start = footer_end - footer_size
    if footer_start < 4 or data[:4] != _MAGIC:
        raise ParquetFormatError(f"a footer of {footer_size} bytes does not fit the file")
    thrift = _Thrift(data, footer_start)
    footer = thrift.struct()
    if thrift.pos > footer_end:
        raise ParquetFormatError("the footer runs past its stated size")
    if 8 in footer:
        raise UnsupportedParquet("encrypted columns")
    key_value = {kv[1]: kv.get(2, b"") for kv in footer.get(5, [])}
    return _Footer(_schema_columns(footer.get(2, [])), footer.get(4, []), key_value, footer_start)


def _read_group(
    data: bytes | mmap.mmap,
    footer: _Footer,
    group: dict,
    dictionaries: dict[str, dict[str, int]],
    names: frozenset[str] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """One row group's columns (those of `names`, all by default), string columns as
    codes into `dictionaries` (grown by this group's names), and the null masks of the
    columns that have nulls."""
    group_chunks = group[1]
    if len(group_chunks) != len(footer.columns):
        raise ParquetFormatError("a row group's columns differ from the schema")
    n_rows = group[3]
    values: dict[str, np.ndarray] = {}
    nulls: dict[str, np.ndarray] = {}
    for column, chunk in zip(footer.columns, group_chunks, strict=True):
        if names is not None and column.name not in names:
            continue
        read, missing = _read_chunk(data, footer.start, chunk, column, n_rows)
        if column.dtype is None:
            read = _global_codes(read, dictionaries.setdefault(column.name, {}))
        values[column.name] = read
        if missing is not None:
            nulls[column.name] = missing
    return values, nulls


def _read(data: bytes) -> ParquetColumns:
    footer = _footer(data)
    chunks: dict[str, list] = {c.name: [] for c in footer.columns}
    dictionaries: dict[str, dict[str, int]] = {
        c.name: {} for c in footer.columns if c.dtype is None
    }
    nulls: dict[str, list[int]] = {c.name: [0, -1] for c in footer.columns}  # count, first row
    first_row = 0
    for group in footer.row_groups:
        values, missing = _read_group(data, footer, group, dictionaries)
        for name, mask in missing.items():
            counted = nulls[name]
            if counted[1] < 0:
                counted[1] = first_row + int(np.flatnonzero(mask)[0])
            counted[0] += int(np.count_nonzero(mask))
        for name, read in values.items():
            chunks[name].append(read)
        first_row += group[3]
    for column in footer.columns:  # the first column with nulls in schema order, as pyarrow's path
        count, first = nulls[column.name]
        if count:
            raise ParquetNulls(column.name, count, first)
    return ParquetColumns(
        columns={c.name: _concatenate(chunks[c.name], c) for c in footer.columns},
        dictionaries={name: list(names) for name, names in dictionaries.items()},
        key_value=footer.key_value,
    )


def iter_parquet_row_groups(
    path: str | Path, names: Iterable[str] | None = None, groups: Sequence[int] | None = None
) -> Iterator[ParquetColumns]:
    """The columns of each row group of the file at `path` in turn (those of `names`, all
    by default; the groups of the indices `groups`, in file order, all by default), string
    codes into the dictionaries of the groups read so far (a group's `dictionaries` are
    those lists then: each a prefix of the next group's). The file is mapped, and each
    group's pages dropped from this process' memory once decoded, so a file far larger
    than memory is read a group at a time. Errors as `read_parquet_columns`, a null naming
    its row in the file."""
    wanted = None if names is None else frozenset(names)
    with open(path, "rb") as file, _mapped(file) as data:
        try:
            footer = _footer(data)
            dictionaries: dict[str, dict[str, int]] = {}
            first_row = 0
            chosen = None if groups is None else frozenset(groups)
            last = len(footer.row_groups) - 1 if chosen is None else max(chosen, default=-1)
            for index, group in enumerate(footer.row_groups[: last + 1]):
                if chosen is not None and index not in chosen:
                    first_row += group[3]
                    continue
                values, missing = _read_group(data, footer, group, dictionaries, wanted)
                for column in footer.columns:
                    if column.name in missing:
                        mask = missing[column.name]
                        first = first_row + int(np.flatnonzero(mask)[0])
                        raise ParquetNulls(column.name, int(np.count_nonzero(mask)), first)
                columns = {c.name: _concatenate([values[c.name]], c)
                           for c in footer.columns if c.name in values}  # fmt: skip
                data.madvise(mmap.MADV_DONTNEED)
                yield ParquetColumns(
                    columns, {n: list(d) for n, d in dictionaries.items()}, footer.key_value
                )
                first_row += group[3]
        except ParquetError:
            raise
        except _CORRUPT as exc:
            raise ParquetFormatError(f"corrupt parquet metadata or page ({exc!r})") from None


@contextlib.contextmanager
def _mapped(file: BinaryIO) -> Iterator[mmap.mmap | bytes]:
    """The file mapped read-only (an empty file, which cannot be mapped, as its bytes)."""
    if os.fstat(file.fileno()).st_size == 0:
        yield b""
        return
    with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        yield data


def _schema_columns(schema: list) -> list[_Column]:
    """The leaf columns of a flat schema (the root's direct children), with the dtype
    pyarrow gives each."""
    if not schema:
        raise ParquetFormatError("the footer has no schema")
    root, leaves = schema[0], schema[1:]
    if root.get(5, 0) != len(leaves):
        raise UnsupportedParquet("a nested schema")
    columns = []
    for element in leaves:
        name = element[4].decode("utf-8")
        if element.get(5) or element.get(3) == _REPEATED:
            raise UnsupportedParquet(f"column {name!r} is nested or repeated")
        physical = element.get(1)
        columns.append(_Column(name, physical, _dtype(name, element), element.get(3) == _OPTIONAL))
    return columns


def _dtype(name: str, element: dict) -> np.dtype | None:
    """The numpy dtype pyarrow reads a leaf as: its physical type, narrowed or made
    unsigned by an integer logical (or converted) type; None for UTF-8 strings."""
    physical = element.get(1)
    logical: dict = element.get(10) or {}
    converted = element.get(6)
    if physical == _BYTE_ARRAY:
        if _LOGICAL_STRING in logical or (not logical and converted == _UTF8):
            return None
        raise UnsupportedParquet(f"column {name!r} holds binary values, not strings")
    if physical not in _PHYSICAL:
        what = _PHYSICAL_NAMES.get(physical, physical)
        raise UnsupportedParquet(f"column {name!r} has physical type {what}")
    if physical in (_FLOAT, _DOUBLE_TYPE):
        if logical or converted is not None:
            raise UnsupportedParquet(f"column {name!r} has an annotated float type")
        return _PHYSICAL[physical]
    if logical:
        if set(logical) != {_LOGICAL_INTEGER}:
            raise UnsupportedParquet(f"column {name!r} has logical type {sorted(logical)}")
        bits, signed = logical[_LOGICAL_INTEGER].get(1), logical[_LOGICAL_INTEGER].get(2)
    elif converted is not None:
        if converted not in _CONVERTED_INTEGERS:
            raise UnsupportedParquet(f"column {name!r} has converted type {converted}")
        bits, signed = _CONVERTED_INTEGERS[converted]
    else:
        return _PHYSICAL[physical]
    if bits not in (8, 16, 32, 64) or bits > _PHYSICAL[physical].itemsize * 8:
        raise UnsupportedParquet(f"column {name!r} has an integer of {bits} bits")
    return np.dtype(f"{'i' if signed else 'u'}{bits // 8}")


def _concatenate(chunks: list[np.ndarray], column: _Column) -> np.ndarray:
    if not chunks:
        return np.empty(0, dtype=column.dtype or np.int32)
    values = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
    if column.dtype is not None and values.dtype != column.dtype:
        values = values.astype(column.dtype)
    return values


def _global_codes(codes_and_names: tuple[np.ndarray, list[str]], names: dict[str, int]):
    """A chunk's dictionary codes as codes into the file's one list of names (each row
    group has its own dictionary)."""
    codes, local = codes_and_names
    remap = np.array([names.setdefault(name, len(names)) for name in local], dtype=np.int32)
    if np.array_equal(remap, np.arange(len(local))):
        return codes
    return remap[codes]


# --- Column chunks and their pages ---------------------------------------------------------

_DATA_PAGE, _INDEX_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = 0, 1, 2, 3
_PLAIN, _PLAIN_DICTIONARY, _RLE, _RLE_DICTIONARY = 0, 2, 3, 8
_UNCOMPRESSED, _SNAPPY, _GZIP, _ZSTD = 0, 1, 2, 6
_CODEC_NAMES = {3: "LZO", 4: "BROTLI", 5: "LZ4", 7: "LZ4_RAW"}


@dataclass
class _Pages:
    """What the pages of one column chunk decode to, in order."""

    values: list[np.ndarray] = field(default_factory=list)
    defined: list[np.ndarray | int] = field(default_factory=list)  # a mask, or a count
    dictionary: np.ndarray | list[str] | None = None
    n_values: int = 0


def _read_chunk(data: bytes, end_of_chunks: int, chunk: dict, column: _Column, n_rows: int):
    """The values of one column chunk and its null mask (None when it has none); a string
    column's values are (codes, the chunk's dictionary)."""
    if 1 in chunk:
        raise UnsupportedParquet(f"column {column.name!r} is stored in another file")
    meta = chunk[3]
    if meta.get(1) != column.physical:
        raise ParquetFormatError(f"column {column.name!r}: chunk type differs from schema")
    codec, n_values, size = meta[4], meta[5], meta[7]
    decompress = _decompressor(codec, column.name)
    start = meta[9]
    dictionary_offset = meta.get(11)
    if dictionary_offset is not None and 0 < dictionary_offset < start:
        start = dictionary_offset
    end = start + size
    if start < 4 or end > end_of_chunks or n_values != n_rows:
        raise ParquetFormatError(f"column {column.name!r}: a chunk outside the file")
    pages = _Pages()
    pos = start
    while pages.n_values < n_values:
        thrift = _Thrift(data, pos)
        header = thrift.struct()
        body_end = thrift.pos + header[3]
        if body_end > end:
            raise ParquetFormatError(f"column {column.name!r}: a page past its chunk")
        body = memoryview(data)[thrift.pos : body_end]
        pos = body_end
        _read_page(header, body, decompress, column, pages)
    if pages.n_values != n_values:
        raise ParquetFormatError(f"column {column.name!r}: pages hold more values than rows")
    return _chunk_values(pages, column)


def _read_page(
    header: dict, body: memoryview, decompress: Callable, column: _Column, pages: _Pages
) -> None:
    kind, uncompressed_size = header[1], header[2]
    if kind == _DICTIONARY_PAGE:
        page = header[7]
        if page.get(2, _PLAIN) not in (_PLAIN, _PLAIN_DICTIONARY):
            raise UnsupportedParquet(f"column {column.name!r}: dictionary encoding {page[2]}")
        raw = decompress(body, uncompressed_size)
        pages.dictionary = _plain(raw, page[1], column, dictionary=True)
        return
    if kind == _DATA_PAGE:
        page = header[5]
        n, encoding = page[1], page[2]
        raw = decompress(body, uncompressed_size)
        if column.optional:
            if page.get(3, _RLE) != _RLE:
                raise UnsupportedParquet(f"column {column.name!r}: BIT_PACKED levels")
            size = int.from_bytes(raw[:4], "little")
            defined = _defined(raw[4 : 4 + size], n)
            raw = raw[4 + size :]
        else:
            defined = n
    elif kind == _DATA_PAGE_V2:
        page = header[8]
        n, encoding = page[1], page[4]
        levels_size, repetition_size = page[5], page[6]
        if repetition_size:
            raise ParquetFormatError(f"column {column.name!r}: a flat column with repetitions")
        defined = _defined(body[:levels_size], n) if column.optional else n
        raw = body[levels_size:]
        if page.get(7, True):
            raw = decompress(raw, uncompressed_size - levels_size)
    elif kind == _INDEX_PAGE:
        return
    else:
        raise ParquetFormatError(f"column {column.name!r}: page type {kind}")
    present = defined if isinstance(defined, int) else int(np.count_nonzero(defined))
    pages.values.append(_page_values(raw, encoding, present, column, pages.dictionary))
    pages.defined.append(defined)
    pages.n_values += n


def _page_values(raw, encoding: int, n: int, column: _Column, dictionary) -> np.ndarray:
    if encoding == _PLAIN:
        if column.dtype is None:
            raise UnsupportedParquet(f"column {column.name!r}: strings not dictionary-encoded")
        return _plain(raw, n, column)
    if encoding not in (_PLAIN_DICTIONARY, _RLE_DICTIONARY):
        raise UnsupportedParquet(f"column {column.name!r}: encoding {encoding}")
    if dictionary is None:
        raise ParquetFormatError(f"column {column.name!r}: dictionary codes without a dictionary")
    if not len(raw):
        if n:
            raise ParquetFormatError(f"column {column.name!r}: an empty page of {n} values")
        return np.empty(0, np.int32)
    codes = rle_bit_packed(raw[1:], raw[0], n)
    if n and (int(codes.max()) >= len(dictionary) or int(codes.min()) < 0):
        raise ParquetFormatError(f"column {column.name!r}: a code past its dictionary")
    return codes if column.dtype is None else dictionary[codes]


def _plain(raw, n: int, column: _Column, dictionary: bool = False):
    """`n` PLAIN values: an array of the physical type, or (a dictionary page's) strings."""
    if column.dtype is not None:
        dtype = _PHYSICAL[column.physical]
        if len(raw) < n * dtype.itemsize:
            raise ParquetFormatError(f"column {column.name!r}: a page shorter than its values")
        return np.frombuffer(raw, dtype=dtype, count=n)
    names, pos, raw = [], 0, bytes(raw)
    for _ in range(n):  # a dictionary's distinct strings: a few op types
        size = int.from_bytes(raw[pos : pos + 4], "little")
        pos += 4 + size
        if pos > len(raw):
            raise ParquetFormatError(f"column {column.name!r}: a string past its page")
        names.append(raw[pos - size : pos].decode("utf-8"))
    return names


def _chunk_values(pages: _Pages, column: _Column):
    values = pages.values[0] if len(pages.values) == 1 else np.concatenate(pages.values)
    missing = None
    if any(not isinstance(d, int) for d in pages.defined):
        defined = np.concatenate(
            [np.ones(d, bool) if isinstance(d, int) else d for d in pages.defined]
        )
        filled = np.zeros(defined.size, values.dtype)
        filled[defined] = values
        values, missing = filled, ~defined
    if column.dtype is None:
        return (values, pages.dictionary or []), missing
    return values, missing


def _defined(levels, n: int) -> np.ndarray | int:
    """Which of `n` values of an optional column are present, from its RLE definition
    levels (bit width 1): the count `n` when all are, else a boolean mask."""
    levels = bytes(levels)
    thrift = _Thrift(levels, 0)
    header = thrift.varint()
    if not header & 1 and header >> 1 >= n and levels[thrift.pos : thrift.pos + 1] == b"\x01":
        return n  # one run of ones: the whole page present
    mask = rle_bit_packed(levels, 1, n)
    return n if mask.all() else mask.astype(bool)


# --- The RLE / bit-packed hybrid encoding (dictionary codes, definition levels) ------------


def rle_bit_packed(buf, bit_width: int, count: int) -> np.ndarray:
    """`count` values of the RLE / bit-packed hybrid encoding (parquet-format's
    Encodings.md) as int32. Its runs are found by a loop while they are long (one page of
    float codes has a few hundred) and by pointer doubling in numpy when they are short
    (a column of ranks has thousands); their values are expanded in numpy.

    >>> rle_bit_packed(bytes([0b110, 5]), 3, 3).tolist()  # one RLE run: 5 three times
    [5, 5, 5]
    >>> rle_bit_packed(bytes([0b11, 0b10001000, 0b11000110, 0b11111010]), 3, 8).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
    """
    if not 0 <= bit_width <= 32:
        raise ParquetFormatError(f"codes of {bit_width} bits")
    data = np.zeros(len(buf) + _PADDING, np.uint8)
    data[: len(buf)] = np.frombuffer(buf, np.uint8)
    starts = _run_starts(bytes(buf), data, bit_width, count)
    headers, header_sizes = _varints(data, starts)
    packed = (headers & 1).astype(bool)
    sizes = np.where(packed, (headers >> 1) * 8, headers >> 1)
    ends = np.cumsum(sizes)
    if not ends.size or ends[-1] < count:
        raise ParquetFormatError(f"RLE data of {count} values ends early")
    last = int(np.searchsorted(ends, count))  # the run holding the last value
    packed, sizes = packed[: last + 1], sizes[: last + 1].copy()
    sizes[-1] -= int(ends[last]) - count
    payload = starts[: last + 1] + header_sizes[: last + 1]
    if not packed.any():
        return np.repeat(_rle_values(data, payload, bit_width), sizes)
    run_bytes = (headers[: last + 1][packed] >> 1) * bit_width
    if int(payload[packed][-1] + run_bytes[-1]) > len(buf):
        needed = (int(sizes[packed][-1]) * bit_width + 7) // 8
        if int(payload[packed][-1]) + needed > len(buf):
            raise ParquetFormatError("bit-packed values past their page")
    groups = int(run_bytes.sum()) // bit_width if bit_width else int(sizes[packed].sum()) // 8
    unpacked = _unpack(_packed_bytes(data, payload[packed], run_bytes), bit_width, groups)
    if packed.all():
        return unpacked[:count]
    value = _rle_values(data, payload, bit_width)
    out = np.repeat(np.where(packed, 0, value), sizes)
    out[np.repeat(packed, sizes)] = unpacked[: int(sizes[packed].sum())]
    return out


def _rle_values(data: np.ndarray, payload: np.ndarray, bit_width: int) -> np.ndarray:
    """The value of each RLE run (little-endian, in whole bytes) at `payload`."""
    value = np.zeros(payload.size, np.int64)
    for k in range((bit_width + 7) // 8):
        value |= data[payload + k].astype(np.int64) << (8 * k)
    return value.astype(np.int32)


def _packed_bytes(data: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The bytes of the bit-packed runs at `starts` (of `sizes` bytes), one after another:
    runs are whole groups of eight values, so their bits join without a gap."""
    if starts.size < 1024:  # a few long runs (high-cardinality codes): copy run by run
        view = data.data
        return np.frombuffer(
            b"".join(
                [view[a : a + b] for a, b in zip(starts.tolist(), sizes.tolist(), strict=True)]
            ),
            np.uint8,
        )
    offsets = np.cumsum(sizes) - sizes
    index = np.repeat(starts - offsets, sizes) + np.arange(int(sizes.sum()))
    return data[np.minimum(index, data.size - 1)]


def _unpack(packed: np.ndarray, bit_width: int, groups: int) -> np.ndarray:
    """`groups` groups of eight `bit_width`-bit values, packed from the least significant
    bit, as int32: value j of every group at once, through a strided view."""
    out = np.zeros((groups, 8), np.int32)
    if not groups or not bit_width:
        return out.ravel()
    buffer = np.zeros(groups * bit_width + 8, np.uint8)
    buffer[: min(len(packed), groups * bit_width)] = packed[: groups * bit_width]
    mask = np.uint64((1 << bit_width) - 1)
    for j in range(8):
        first_bit = j * bit_width
        words = np.ndarray(
            (groups,), dtype="<u8", buffer=buffer, offset=first_bit >> 3, strides=(bit_width,)
        )
        out[:, j] = (words >> np.uint64(first_bit & 7)) & mask
    return out.ravel()


#: Zero bytes after an RLE buffer, so that a value's eight bytes and a header's five can be
#: read at any position in it.
_PADDING = 16
#: A run-length buffer is walked run by run, and checked every `_WALKED_RUNS` runs: where
#: they averaged under `_SHORT_RUN` bytes, the rest are found in numpy instead (pointer
#: doubling costs log2(runs) passes over the bytes left, a walk a loop per run).
_WALKED_RUNS = 64
_SHORT_RUN = 12


def _run_starts(buf: bytes, data: np.ndarray, bit_width: int, count: int) -> np.ndarray:
    """The offsets of the runs of an RLE / bit-packed buffer (at least up to `count`
    values)."""
    value_size = (bit_width + 7) // 8
    starts: list[int] = []
    pos, produced, end = 0, 0, len(buf)
    checked = 0
    while produced < count and pos < end:
        if len(starts) % _WALKED_RUNS == 0 and starts:
            if pos - checked < _SHORT_RUN * _WALKED_RUNS:
                chain = _chain(data, end, pos, bit_width)
                return np.concatenate((np.array(starts, np.int64), chain))
            checked = pos
        starts.append(pos)
        header = buf[pos]
        if header < 0x80:
            pos += 1
        else:
            thrift = _Thrift(buf, pos)
            header = thrift.varint()
            pos = thrift.pos
        if header & 1:
            pos += (header >> 1) * bit_width
            produced += (header >> 1) * 8
        else:
            pos += value_size
            produced += header >> 1
    return np.array(starts, np.int64)


def _chain(data: np.ndarray, end: int, first: int, bit_width: int) -> np.ndarray:
    """The run offsets from `first` to `end`, by pointer doubling: the next run's offset
    is computed at every byte as if a run began there, and the chain from `first` is
    followed 1, 2, 4 ... steps at a time."""
    positions = np.arange(end + 1, dtype=np.int64)
    headers, header_sizes = _varints(data, positions)
    step = np.where(headers & 1, (headers >> 1) * bit_width, (bit_width + 7) // 8)
    jump = np.minimum(positions + header_sizes + step, end)
    jump[end] = end
    chain = np.array([first], np.int64)
    while chain[-1] != end:
        chain = np.concatenate((chain, jump[chain]))
        jump = jump[jump]
    return chain[chain < end]


def _varints(data: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The unsigned varints at `positions` in `data` (five bytes at most, as RLE headers
    are) and their sizes in bytes."""
    value = np.zeros(positions.size, np.int64)
    size = np.ones(positions.size, np.int64)
    going = np.ones(positions.size, bool)
    for k in range(5):
        byte = data[positions + k].astype(np.int64)
        value |= np.where(going, (byte & 0x7F) << (7 * k), 0)
        going &= byte >= 0x80
        size += going
    return value, size


def _decompressor(codec: int, name: str) -> Callable:
    """A function of (compressed bytes, uncompressed size) for a chunk's codec."""
    if codec == _UNCOMPRESSED:
        return _stored
    if codec not in (_SNAPPY, _GZIP, _ZSTD):
        what = _CODEC_NAMES.get(codec, codec)
        raise UnsupportedParquet(f"column {name!r}: compression {what}")
    module = {_SNAPPY: cramjam.snappy, _GZIP: cramjam.gzip, _ZSTD: cramjam.zstd}[codec]

    def decompress(body: memoryview, size: int) -> bytearray:
        out = bytearray(size)
        try:
            if codec == _SNAPPY:
                written = module.decompress_raw_into(body, out)
            else:
                written = module.decompress_into(body, out)
        except Exception as exc:  # cramjam.DecompressionError and its kin
            raise ParquetFormatError(f"column {name!r}: corrupt compressed page ({exc})") from None
        if written != size:
            raise ParquetFormatError(f"column {name!r}: a page of {written} bytes, not {size}")
        return out

    return decompress


def _stored(body: memoryview, size: int) -> memoryview:
    if len(body) != size:
        raise ParquetFormatError(f"an uncompressed page of {len(body)} bytes, not {size}")
    return body
