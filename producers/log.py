"""The local log: append-only, crash-safe per-rank files between a training rank and the
streamer sidecar.

Layout: ``<log_dir>/rank-<rank:06d>/<wall_ns:020d>-<counter:04d>.lglog``. File names sort in
creation order; a writer only ever appends to its newest file and never reopens an old one
(a restarted writer starts a new file), so a reader knows that every file but the newest
of a rank is complete.

Every record is self-delimiting and checksummed::

    header  struct "<4sBBHII"  magic b"LGRC", version (1), kind, reserved (0),
                               payload length, crc32 of (version..length bytes + payload)
    payload length bytes       kind 1: an encoded rank-step batch (producers.events)
                               kind 2: JobInfo as JSON (a timer writes it first,
                               and once more, `ended_ns` set, when it closes)
                               kind 3: a timer's seal, its ops not yet encoded
                               (producers.seal_record): read as its kind 1 batches

A record is written with a single ``write`` call by the writer's background thread. After a
crash the last record of a file may be torn; the reader detects it (short payload or
checksum mismatch), reports it, and keeps everything before it. Garbage between records
is skipped by scanning for the next magic; every skipped span becomes a `SkippedSpan`
naming the file, the offset and the reason (the streamer ships it as a dead letter,
`producers/dead_letters.py`). Nothing here raises on bad data.
"""

from __future__ import annotations

import os
import struct
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lagscope.producers.events import SchemaError
from lagscope.producers.seal_record import expand_seal

RECORD_MAGIC = b"LGRC"
RECORD_VERSION = 1
KIND_BATCH = 1
KIND_JOB = 2
#: A timer's seal, its ops not yet encoded: a reader gives its batches as KIND_BATCH
#: records (producers/seal_record.py).
KIND_SEAL = 3
KNOWN_KINDS = frozenset({KIND_BATCH, KIND_JOB})
_HEADER = struct.Struct("<4sBBHII")
HEADER_SIZE = _HEADER.size
LOG_SUFFIX = ".lglog"
RANK_DIR_PREFIX = "rank-"
#: A writer refuses larger records; a reader treats a larger length field as corruption.
DEFAULT_MAX_RECORD_BYTES = 16 << 20
DEFAULT_MAX_FILE_BYTES = 64 << 20
_READ_CHUNK = 4 << 20
#: A directory listing is reused only once the directory is this much older than now.
_LISTING_SETTLE_NS = 1_000_000_000


_FIELDS = struct.Struct("<BBHI")
_CRC = struct.Struct("<I")


def frame_record(kind: int, payload: bytes) -> bytes:
    """A record's bytes: header + payload (see module docstring)."""
    fields = _FIELDS.pack(RECORD_VERSION, kind, 0, len(payload))
    crc = zlib.crc32(payload, zlib.crc32(fields))
    # One join: the payload is copied once (a chain of `+` copied it three times).
    return b"".join((RECORD_MAGIC, fields, _CRC.pack(crc), payload))


def rank_dir(log_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(log_dir) / f"{RANK_DIR_PREFIX}{rank:06d}"


class LogWriter:
    """Appends records to one rank's log from a background flusher thread.

    `append` only enqueues (the training thread never touches the file system); the
    flusher writes queued records every `flush_interval_s`, rotating to a new file when the
    current one would exceed `max_file_bytes`.

    With `background=False` there is no flusher thread: `flush()` writes what was queued,
    in one `write` call, on the thread that calls it. The timer's sealer thread, which
    encodes the records, writes them itself: a second thread would cost a second wake per
    seal, and a thread wake is most of what the monitor spends (~20-80 us of CPU each on
    the shared 2-core box of `make bench`, against ~1 us to write a record). Such a writer
    can also let go of its file between writes (`release`): one process writing the logs
    of thousands of ranks (a replay) keeps a bounded number of them open.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        rank: int,
        *,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        flush_interval_s: float = 0.1,
        fsync: bool = False,
        background: bool = True,
    ) -> None:
        self.directory = rank_dir(log_dir, rank)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_file_bytes = max_file_bytes
        self.max_record_bytes = max_record_bytes
        self.flush_interval_s = flush_interval_s
        self.fsync = fsync
        self._queue: deque[bytes] = deque()
        self._wake = threading.Event()
        self._idle = threading.Condition()
        self._pending = 0
        self._closed = False
        self._fd: int | None = None
        #: The file written now (kept while released: the next write appends to it).
        self._file_name: str | None = None
        self._file_size = 0
        self._file_counter = 0
        self.error: BaseException | None = None
        self.records_written = 0
        self._thread: threading.Thread | None = None
        #: Serialises the writes of threads that flush a writer without a flusher thread.
        self._write_lock = threading.Lock()
        if background:
            self._thread = threading.Thread(
                target=self._run, name=f"lagscope-log-{rank}", daemon=True
            )
            self._thread.start()

    def append(self, kind: int, payload: bytes) -> None:
        if self._closed:
            raise RuntimeError(f"log writer for {self.directory} is closed")
        if len(payload) > self.max_record_bytes:
            raise ValueError(
                f"record of {len(payload)} bytes exceeds the log's limit of "
                f"{self.max_record_bytes} bytes ({self.directory})"
            )
        record = frame_record(kind, payload)
        if self._thread is None:
            self._queue.append(record)
            return
        with self._idle:
            self._pending += 1
        self._queue.append(record)

    def flush(self, timeout_s: float = 30.0) -> None:
        """Block until everything appended so far is written."""
        if self._thread is None:
            self._flush_here()
            return
        self._wake.set()
        with self._idle:
            if not self._idle.wait_for(lambda: self._pending == 0, timeout=timeout_s):
                raise TimeoutError(f"log flush of {self.directory} timed out")
        if self.error is not None:
            raise RuntimeError(f"log writer for {self.directory} failed") from self.error

    def _flush_here(self) -> None:
        """Write the queued records on this thread (a writer without a flusher thread)."""
        with self._write_lock:
            if self.error is None:
                try:
                    self._drain()
                except Exception as exc:  # a failed write: the writer stops, flush says so
                    self.error = exc
            if self.error is not None:
                self._queue.clear()
                raise RuntimeError(f"log writer for {self.directory} failed") from self.error

    def release(self) -> None:
        """Write what is queued and close the file; the next write reopens it and appends
        (it is still this rank's newest file, so readers see one file growing). Only for a
        writer without its thread."""
        if self._thread is not None:
            raise RuntimeError("release() is for a writer without its flusher thread")
        self._flush_here()
        if self._fd is not None:
            if self.fsync:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None

    @property
    def holds_file(self) -> bool:
        """Whether the writer has a file open now."""
        return self._fd is not None

    def close(self) -> None:
        if self._closed:
            return
        self.flush()
        self._closed = True
        if self._thread is not None:
            self._wake.set()
            self._thread.join()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> LogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            try:
                self._drain()
            except BaseException as exc:  # surfaced by flush(); the thread must not die silently
                self.error = exc
                with self._idle:
                    self._pending = 0
                    self._idle.notify_all()
                return
            if self._closed and not self._queue:
                return

    def _drain(self) -> None:
        while self._queue:
            chunk: list[bytes] = []
            size = 0
            while self._queue:
                record = self._queue[0]
                if (
                    self._fd is not None
                    and chunk
                    and (self._file_size + size + len(record) > self.max_file_bytes)
                ):
                    break
                if (
                    self._fd is None
                    and self._file_name is not None
                    and (self._file_size + size + len(record) <= self.max_file_bytes)
                ):
                    self._reopen()
                if self._fd is None or (
                    not chunk
                    and self._file_size > 0
                    and self._file_size + len(record) > self.max_file_bytes
                ):
                    self._rotate()
                chunk.append(self._queue.popleft())
                size += len(record)
            self._write_all(b"".join(chunk))
            self._file_size += size
            self.records_written += len(chunk)
            if self._thread is not None:
                with self._idle:
                    self._pending -= len(chunk)
                    self._idle.notify_all()

    def _write_all(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]
        if self.fsync:
            os.fsync(self._fd)

    def _rotate(self) -> None:
        if self._fd is not None:
            if self.fsync:
                os.fsync(self._fd)
            os.close(self._fd)
        self._file_counter += 1
        name = f"{time.time_ns():020d}-{self._file_counter:04d}{LOG_SUFFIX}"
        self._fd = os.open(
            self.directory / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_EXCL, 0o644
        )
        self._file_name = name
        self._file_size = 0

    def _reopen(self) -> None:
        """The released file again, to append to it (a file that vanished meanwhile, a
        retention sweep's, is not made again: the writer rotates to a new one)."""
        assert self._file_name is not None
        try:
            self._fd = os.open(self.directory / self._file_name, os.O_WRONLY | os.O_APPEND)
        except FileNotFoundError:
            self._file_name = None


@dataclass(frozen=True)
class Position:
    """Where reading resumes: a file name in a rank directory and a byte offset in it."""

    file: str
    offset: int


@dataclass(frozen=True)
class Record:
    kind: int
    payload: bytes
    file: str
    offset: int
    end: int

    @property
    def position_after(self) -> Position:
        return Position(self.file, self.end)


@dataclass(frozen=True)
class SkippedSpan:
    """Bytes of a log file that are not a valid record, with why and where: what becomes
    a dead letter (`dead_letters.DeadLetter`) once a streamer or a host sets it aside."""

    source: str
    offset: int
    length: int
    reason: str
    sample: bytes = b""
    end: Position | None = None


def list_log_files(directory: Path) -> list[str]:
    try:
        names = [n for n in os.listdir(directory) if n.endswith(LOG_SUFFIX)]
    except FileNotFoundError:
        return []
    return sorted(names)


def list_rank_dirs(log_dir: str | os.PathLike[str]) -> list[Path]:
    try:
        entries = os.scandir(log_dir)
    except FileNotFoundError:
        return []
    with entries:
        return sorted(
            Path(e.path) for e in entries if e.is_dir() and e.name.startswith(RANK_DIR_PREFIX)
        )


class RankDirs:
    """The rank directories under a log directory (`list_rank_dirs`), listed again only
    when the directory changed (its mtime; trusted once `_LISTING_SETTLE_NS` old): a
    follower of a 100,000-GPU job's 12,544 logs looks for new ones every round."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        self.log_dir = os.fspath(log_dir)
        self._dirs: list[Path] = []
        self._listed_mtime_ns: int | None = None

    def current(self) -> list[Path]:
        try:
            mtime_ns = os.stat(self.log_dir).st_mtime_ns
        except FileNotFoundError:
            self._listed_mtime_ns = None
            return []
        if mtime_ns != self._listed_mtime_ns:
            self._dirs = list_rank_dirs(self.log_dir)
            settled = time.time_ns() - mtime_ns > _LISTING_SETTLE_NS
            self._listed_mtime_ns = mtime_ns if settled else None
        return self._dirs


def rank_logs_nearby(log_dir: str | os.PathLike[str], levels: int = 2) -> list[Path]:
    """Directories up to `levels` below `log_dir` that hold rank logs, for the hint of a
    command given a directory too high up (`lagscope run --log-dir jobs` for
    `jobs/llama/rank-000000/`). Hidden directories are not searched."""
    found: list[Path] = []
    frontier = [Path(log_dir)]
    for _ in range(levels):
        below: list[Path] = []
        for directory in frontier:
            try:
                entries = sorted(
                    Path(e.path)
                    for e in os.scandir(directory)
                    if e.is_dir() and not e.name.startswith(".")
                )
            except OSError:
                continue
            for entry in entries:
                if list_rank_dirs(entry):
                    found.append(entry)
                elif not entry.name.startswith(RANK_DIR_PREFIX):
                    below.append(entry)
        frontier = below
    return found


class RankLogReader:
    """Reads one rank directory's records in order, from a resume position, as they appear.

    `read()` returns what is readable now (records and skipped spans, in file order) and
    advances the reader's own position; call it again later to tail. A partial record at
    the end of the newest file is left for a later call, unless the file has not changed
    for `torn_grace_s` (its writer died): then it is reported as torn.

    A call returns about `max_bytes` of records: a seal record holds up to ~40 steps of a
    rank, and a backlog's reader must not open all of them at once (backpressure), so the
    batches of a seal beyond the budget are kept for the next calls; records a caller
    does not want yet go back with `put_back`.

    The directory's listing is read again only when the directory changed (its mtime),
    so a reader with nothing new costs two `stat` calls: one host follows the 12,544
    logs of a 100,000-GPU job. A listing is trusted only once the directory has not
    changed for `_LISTING_SETTLE_NS`: a file system's coarse timestamps can give two
    changes within a tick one mtime.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        position: Position | None = None,
        *,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        torn_grace_s: float = 60.0,
    ) -> None:
        self.directory = Path(directory)
        self.position = position
        self.max_record_bytes = max_record_bytes
        self.torn_grace_s = torn_grace_s
        #: Records read from the file and not yet returned (a seal's batches past a call's
        #: budget), in order.
        self._held: list[Record | SkippedSpan] = []
        #: The directory's log files as last listed, and its mtime then (None: list it).
        self._files_cache: list[str] = []
        self._listed_mtime_ns: int | None = None
        self._dir_name = os.fspath(self.directory)
        #: The file read last and its size then: while reading stands before that size,
        #: more is known to be there without asking the file system (`lagscope run` asks
        #: every log twice a round: 8 steps of a 100,000-GPU job's backlog made 606,000
        #: stat calls, 391,000 with this).
        self._seen_size: tuple[str, int] | None = None

    def _files(self) -> list[str]:
        """The rank's log files, oldest first: listed again only when the directory
        changed since (or changed too recently to tell)."""
        try:
            mtime_ns = os.stat(self._dir_name).st_mtime_ns
        except FileNotFoundError:
            self._listed_mtime_ns = None
            return []
        if mtime_ns != self._listed_mtime_ns:
            self._files_cache = list_log_files(self.directory)
            settled = time.time_ns() - mtime_ns > _LISTING_SETTLE_NS
            self._listed_mtime_ns = mtime_ns if settled else None
        return self._files_cache

    def put_back(self, items: list[Record | SkippedSpan]) -> None:
        """Items `read` returned that the caller does not take yet: the next `read`
        returns them first, in order."""
        self._held = [*items, *self._held]

    def at_end(self) -> bool:
        """True when everything written to the rank's log so far has been read (a file
        now shorter than where reading stands is read again: not at its end)."""
        if self._held:
            return False
        seen, position = self._seen_size, self.position
        # (A file truncated since is read again from its start: not at its end either.)
        known_more = (
            seen is not None
            and position is not None
            and position.file == seen[0]
            and position.offset < seen[1]
        )
        if known_more:
            return False
        files = self._files()
        if not files:
            return True
        if self.position is None or self.position.file != files[-1]:
            return False
        try:
            size = os.stat(os.path.join(self._dir_name, files[-1])).st_size
        except FileNotFoundError:
            return True
        return size == self.position.offset

    def read(self, max_bytes: int = _READ_CHUNK) -> list[Record | SkippedSpan]:
        if not self._held and self.position is not None and self.at_end():
            return []
        self._seen_size = None  # known again from what this read finds (files may be gone)
        out, self._held = self._held, []
        budget = max_bytes - sum(_size(item) for item in out)
        while budget > 0:
            files = self._files()
            if not files:
                return out
            if self.position is None:
                self.position = Position(files[0], 0)
            current = self.position.file
            if current not in files:
                # Deleted (retention) or never seen: continue with the next newer file.
                later = [f for f in files if f > current]
                if not later:
                    return out
                self.position = Position(later[0], 0)
                continue
            is_newest = current == files[-1]
            consumed, items, at_end = self._read_file(current, is_newest, budget)
            out.extend(items)
            budget -= max(consumed, 1)
            if at_end and not is_newest:
                self.position = Position(files[files.index(current) + 1], 0)
                continue
            if not items and consumed == 0:
                break
        return self._within(out, max_bytes)

    def _within(
        self, items: list[Record | SkippedSpan], max_bytes: int
    ) -> list[Record | SkippedSpan]:
        """The first of `items` that fit `max_bytes` (one at least); the rest are held."""
        total = 0
        for i, item in enumerate(items):
            total += _size(item)
            if total > max_bytes and i:
                self._held = items[i:]
                return items[:i]
        return items

    def _read_file(
        self, name: str, is_newest: bool, budget: int
    ) -> tuple[int, list[Record | SkippedSpan], bool]:
        """Parse records from the current position; returns (bytes consumed, items, at end)."""
        assert self.position is not None
        try:
            chunk = self._read_chunk(name, self.position.offset, budget)
        except FileNotFoundError:
            return 0, [], True
        # A partial record at the end is final when the file is not the newest (its
        # writer moved on) or has not changed for the grace period (its writer died).
        tail_is_final = not is_newest or time.time() - chunk.mtime > self.torn_grace_s
        consumed = chunk.parse(self.max_record_bytes, tail_is_final)
        self.position = Position(name, chunk.start + consumed)
        self._seen_size = (name, chunk.size)
        return consumed, chunk.items, chunk.start + consumed >= chunk.size

    def _read_chunk(self, name: str, start: int, budget: int) -> _Chunk:
        """Up to `budget` bytes of file `name` from `start` (one whole record when the next
        record is larger than the budget); a file now shorter than `start` is re-read from
        its beginning, with a skipped span saying so."""
        path = os.path.join(self._dir_name, name)
        items: list[Record | SkippedSpan] = []
        with open(path, "rb") as handle:
            stat = os.fstat(handle.fileno())
            size = stat.st_size
            if size < start:
                items.append(
                    SkippedSpan(
                        path,
                        size,
                        0,
                        f"file truncated from at least {start} to {size} bytes; "
                        "re-reading it from the start",
                        # Resume at 0, not at `size`: what is there now is unread.
                        end=Position(name, 0),
                    )
                )
                start = 0
                self.position = Position(name, 0)
            handle.seek(start)
            data = handle.read(min(max(budget, HEADER_SIZE), size - start))
            whole = self._cut_record_size(data, size - start)
            if whole:
                handle.seek(start)
                data = handle.read(whole)
        return _Chunk(name, path, data, start, size, stat.st_mtime, items)

    def _cut_record_size(self, data: bytes, available: int) -> int:
        """One record larger than the read budget: the size of the record `data` begins
        with when the budget cut it short and the file holds all of it (a valid header),
        to read exactly that record; else 0."""
        if len(data) < HEADER_SIZE:
            return 0
        magic, version, _, _, length, _ = _HEADER.unpack_from(data, 0)
        whole = HEADER_SIZE + length
        if (
            magic == RECORD_MAGIC
            and version == RECORD_VERSION
            and length <= self.max_record_bytes
            and len(data) < whole <= available
        ):
            return whole
        return 0


def _size(item: Record | SkippedSpan) -> int:
    return len(item.payload) if isinstance(item, Record) else 0


class _Chunk:
    """Bytes read from one log file at offset `start`, parsed into records and skipped spans.

    `parse` keeps the common case, a whole valid record, in its loop; each kind of damage
    (a short tail, a bad header, a torn record, a checksum mismatch) has a method of its
    own that says what it becomes and where parsing goes on.
    """

    __slots__ = ("at_file_end", "items", "mtime", "n", "name", "size", "source", "start", "view")

    def __init__(
        self,
        name: str,
        source: str,
        data: bytes,
        start: int,
        size: int,
        mtime: float,
        items: list[Record | SkippedSpan],
    ) -> None:
        self.name = name
        self.source = source
        self.view = memoryview(data)
        self.n = len(data)
        self.start = start
        #: The file's size when it was read, and whether this chunk reaches it.
        self.size = size
        self.at_file_end = start + self.n == size
        self.mtime = mtime
        self.items = items

    def parse(self, max_record_bytes: int, tail_is_final: bool) -> int:
        """Append the chunk's records and skipped spans to `items`; returns the bytes
        consumed (what is left is a record to read whole on a later call)."""
        view, n, start, items, name = self.view, self.n, self.start, self.items, self.name
        pos = 0
        while pos < n:
            if n - pos < HEADER_SIZE:
                after = self._short_tail(pos, tail_is_final)
                if after is None:
                    break
                pos = after
                continue
            magic, version, kind, _reserved, length, crc = _HEADER.unpack_from(view, pos)
            if magic != RECORD_MAGIC or version != RECORD_VERSION or length > max_record_bytes:
                pos = self._bad_header(pos, magic, version, length, max_record_bytes)
                continue
            end = pos + HEADER_SIZE + length
            if end > n:
                if start + end <= self.size or not tail_is_final:
                    break  # more bytes on disk than we read, or still being written
                pos = self._torn_record(pos, length)
                continue
            payload = view[pos + HEADER_SIZE : end]
            if zlib.crc32(payload, zlib.crc32(view[pos + 4 : pos + 12])) != crc:
                pos = self._skip_to_next_magic(
                    pos, pos + 1, "record checksum mismatch (corrupted or torn)"
                )
                continue
            if kind in KNOWN_KINDS:
                items.append(Record(kind, bytes(payload), name, start + pos, start + end))
            elif kind == KIND_SEAL:
                items.extend(self._seal_batches(payload, pos, end))
            else:
                items.append(self._dead(pos, end - pos, f"unknown record kind {kind}"))
            pos = end
        return pos

    def _seal_batches(self, payload: memoryview, pos: int, end: int) -> list[Record | SkippedSpan]:
        """A seal record's batches, as the KIND_BATCH records the timer used to write.
        Each but the last resumes at the seal (a reader that stops after one of them makes
        them all again: the same bytes, deduplicated downstream); the last, after it."""
        try:
            batches = expand_seal(payload)
        except SchemaError as exc:
            return [self._dead(pos, end - pos, str(exc))]
        at, after = self.start + pos, self.start + end
        return [
            Record(KIND_BATCH, batch, self.name, at, after if i == len(batches) - 1 else at)
            for i, batch in enumerate(batches)
        ]

    def _short_tail(self, pos: int, tail_is_final: bool) -> int | None:
        """Fewer bytes than a header are left at `pos`: where parsing goes on (the chunk's
        end once they are set aside as a torn header), or None to stop at `pos` (they are
        read next time, or are a header still being written)."""
        if not self.at_file_end:
            return None  # header split by our read budget: read it next time
        remaining = self.n - pos
        if RECORD_MAGIC.startswith(bytes(self.view[pos : pos + min(4, remaining)])):
            if not tail_is_final:
                return None
            self.items.append(self._dead(pos, remaining, "torn record header at end of file"))
            return self.n
        return self._skip_to_next_magic(pos, pos, "garbage: bytes without a record header")

    def _bad_header(
        self, pos: int, magic: bytes, version: int, length: int, max_record_bytes: int
    ) -> int:
        """A header that is not a record's: set aside up to the next magic; returns where
        parsing goes on."""
        if magic != RECORD_MAGIC:
            reason = "garbage: bytes without a record header"
        elif version != RECORD_VERSION:
            reason = f"unknown log record version {version} (this build reads {RECORD_VERSION})"
        else:
            reason = f"record length {length} exceeds the limit of {max_record_bytes}"
        skip = self._resync(pos + 1)
        if skip == self.n and not self.at_file_end:
            skip = max(pos + 1, self.n - 3)  # the next magic may straddle our read
        self.items.append(self._dead(pos, skip - pos, reason))
        return skip

    def _torn_record(self, pos: int, length: int) -> int:
        """A record whose payload the file does not hold (its writer died mid-write, or
        its length is corrupt): resynchronise rather than drop the rest, so that a corrupt
        length does not hide the good records after it."""
        present = self.size - self.start - pos - HEADER_SIZE
        return self._skip_to_next_magic(
            pos,
            pos + 1,
            f"torn record: header says {length} payload bytes, only {present} present in the file",
        )

    def _skip_to_next_magic(self, pos: int, search_from: int, reason: str) -> int:
        """Set aside the bytes from `pos` to the next record magic found from
        `search_from` (or the chunk's end); returns where that magic is."""
        skip = self._resync(search_from)
        self.items.append(self._dead(pos, skip - pos, reason))
        return skip

    def _resync(self, search_from: int) -> int:
        found = bytes(self.view[search_from : self.n]).find(RECORD_MAGIC)
        return self.n if found < 0 else search_from + found

    def _dead(self, pos: int, length: int, reason: str) -> SkippedSpan:
        """The `length` bytes at `pos`, set aside with `reason`; reading resumes after them."""
        offset = self.start + pos
        sample = bytes(self.view[pos : pos + min(length, 64)])
        return SkippedSpan(
            self.source, offset, length, reason, sample, Position(self.name, offset + length)
        )


def read_all(
    directory: str | os.PathLike[str], *, torn_grace_s: float = 0.0
) -> Iterator[Record | SkippedSpan]:
    """Every record and skipped span of a rank directory, treating it as complete."""
    reader = RankLogReader(directory, torn_grace_s=torn_grace_s)
    while True:
        items = reader.read()
        if not items:
            return
        yield from items
