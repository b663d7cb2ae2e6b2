"""The local log: rotation, resume positions, torn/garbage/oversized records never lose good
records around them."""

from __future__ import annotations

import contextlib
import os
import struct
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lagscope.producers.log import (
    HEADER_SIZE,
    KIND_BATCH,
    LogWriter,
    Position,
    RankLogReader,
    Record,
    SkippedSpan,
    frame_record,
    list_log_files,
    rank_dir,
    read_all,
)


def _payloads(n: int, size: int = 100) -> list[bytes]:
    return [(f"record-{i:05d}-".encode() * size)[:size] for i in range(n)]


def _records(items: list[Record | SkippedSpan]) -> list[bytes]:
    return [i.payload for i in items if isinstance(i, Record)]


def _dead(items: list[Record | SkippedSpan]) -> list[SkippedSpan]:
    return [i for i in items if isinstance(i, SkippedSpan)]


def test_writer_rotates_by_size_and_reader_returns_everything_in_order(tmp_path: Path) -> None:
    payloads = _payloads(200, 1000)
    with LogWriter(tmp_path, rank=5, max_file_bytes=20_000) as writer:
        for p in payloads:
            writer.append(KIND_BATCH, p)
    files = list_log_files(rank_dir(tmp_path, 5))
    assert len(files) >= 10
    for name in files:
        assert os.path.getsize(rank_dir(tmp_path, 5) / name) <= 20_000
    items = list(read_all(rank_dir(tmp_path, 5)))
    assert _records(items) == payloads
    assert not _dead(items)


def test_resume_from_any_position_yields_exactly_the_rest(tmp_path: Path) -> None:
    payloads = _payloads(50, 300)
    with LogWriter(tmp_path, rank=0, max_file_bytes=4000) as writer:
        for p in payloads:
            writer.append(KIND_BATCH, p)
    items = [i for i in read_all(rank_dir(tmp_path, 0)) if isinstance(i, Record)]
    for cut in (0, 1, 17, 49):
        reader = RankLogReader(rank_dir(tmp_path, 0), items[cut].position_after, torn_grace_s=0)
        rest = []
        while batch := reader.read(max_bytes=1000):
            rest.extend(batch)
        assert _records(rest) == payloads[cut + 1 :]


def test_a_writer_without_its_thread_writes_on_flush_in_one_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`background=False` (the timer's sealer writes itself): nothing reaches the file until
    flush(), which writes every queued record in one `write` call, on the caller's thread;
    a failed write is raised by that flush and every later one."""
    import threading

    threads = threading.active_count()
    writer = LogWriter(tmp_path, rank=4, background=False)
    assert threading.active_count() == threads
    payloads = _payloads(5)
    for p in payloads:
        writer.append(KIND_BATCH, p)
    assert list(read_all(rank_dir(tmp_path, 4))) == []
    writes = []
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: (writes.append(fd), real_write(fd, data))[1])
    writer.flush()
    assert len(writes) == 1
    assert _records(list(read_all(rank_dir(tmp_path, 4)))) == payloads
    os.close(writer._fd)  # type: ignore[arg-type]
    writer.append(KIND_BATCH, b"lost")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="failed") as failed:
            writer.flush()
        assert isinstance(failed.value.__cause__, OSError)
    writer._fd = None


def test_a_released_writer_appends_to_its_newest_file_and_still_rotates(tmp_path: Path) -> None:
    """A writer that let go of its file (a replay of thousands of ranks keeps few open)
    appends to the same file on its next write, until that one is full; a file removed
    meanwhile (retention) is not made again."""
    writer = LogWriter(tmp_path, rank=2, background=False, max_file_bytes=3_000)
    payloads = _payloads(12, 500)
    for p in payloads[:4]:
        writer.append(KIND_BATCH, p)
        writer.release()
        assert not writer.holds_file
    assert len(list_log_files(rank_dir(tmp_path, 2))) == 1
    for p in payloads[4:10]:
        writer.append(KIND_BATCH, p)
        writer.release()
    files = list_log_files(rank_dir(tmp_path, 2))
    assert len(files) == 2
    assert all(os.path.getsize(rank_dir(tmp_path, 2) / f) <= 3_000 for f in files)
    (rank_dir(tmp_path, 2) / files[-1]).unlink()
    for p in payloads[10:]:
        writer.append(KIND_BATCH, p)
    writer.close()
    kept = [p for p in payloads[:10] if p in _records(list(read_all(rank_dir(tmp_path, 2))))]
    assert _records(list(read_all(rank_dir(tmp_path, 2)))) == [*kept, *payloads[10:]]
    assert len(list_log_files(rank_dir(tmp_path, 2))) == 2
    threaded = LogWriter(tmp_path, rank=3)
    with pytest.raises(RuntimeError, match="without its flusher thread"):
        threaded.release()
    threaded.close()


def test_a_reader_with_nothing_new_lists_nothing_and_still_sees_a_new_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower of 12,544 logs asks each of them every round: with nothing new, a reader
    costs two `stat` calls, not a directory listing; a file made since is still seen (the
    directory's mtime moved), and so is one made within a coarse timestamp's tick of the
    last listing (a listing is trusted only once the directory is a second old)."""
    directory = rank_dir(tmp_path, 0)
    with LogWriter(tmp_path, rank=0, background=False) as writer:
        writer.append(KIND_BATCH, b"first")
    reader = RankLogReader(directory, torn_grace_s=0)
    assert _records(reader.read()) == [b"first"]
    settled = time.time_ns() - 5_000_000_000
    os.utime(directory, ns=(settled, settled))
    listings = []
    real_listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path: (listings.append(path), real_listdir(path))[1])
    assert reader.at_end() and reader.read() == []
    listings.clear()
    for _ in range(5):
        assert reader.at_end() and reader.read() == []
    assert listings == []
    fresh = time.time_ns()
    _write_file(directory, "99999999999999999999-0001.lglog", frame_record(KIND_BATCH, b"new"))
    os.utime(directory, ns=(fresh, fresh))
    assert not reader.at_end()
    assert _records(reader.read()) == [b"new"]
    # Another file within the same timestamp tick: the directory's mtime did not move.
    _write_file(directory, "99999999999999999999-0002.lglog", frame_record(KIND_BATCH, b"tick"))
    os.utime(directory, ns=(fresh, fresh))
    assert _records(reader.read()) == [b"tick"]


def test_tailing_sees_records_as_they_are_appended(tmp_path: Path) -> None:
    writer = LogWriter(tmp_path, rank=1, flush_interval_s=0.01)
    reader = RankLogReader(rank_dir(tmp_path, 1))
    seen: list[bytes] = []
    for round_ in range(5):
        for p in _payloads(10):
            writer.append(KIND_BATCH, p + bytes([round_]))
        writer.flush()
        seen.extend(_records(reader.read()))
    writer.close()
    assert len(seen) == 50


def _write_file(directory: Path, name: str, data: bytes) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_bytes(data)


def test_torn_last_record_is_reported_and_earlier_records_kept(tmp_path: Path) -> None:
    good = _payloads(5)
    blob = b"".join(frame_record(KIND_BATCH, p) for p in good)
    torn = frame_record(KIND_BATCH, b"x" * 500)[:200]
    directory = tmp_path / "rank-000000"
    _write_file(directory, "00000000000000000001-0001.lglog", blob + torn)
    # While this is the newest file and fresh, the partial record may still be in flight.
    reader = RankLogReader(directory, torn_grace_s=3600)
    assert _records(reader.read()) == good
    assert reader.position == Position("00000000000000000001-0001.lglog", len(blob))
    assert reader.read() == []
    # A restarted writer starts a new file: now the tail is known to be torn.
    after = _payloads(3, 50)
    _write_file(
        directory,
        "00000000000000000002-0001.lglog",
        b"".join(frame_record(KIND_BATCH, p) for p in after),
    )
    items = reader.read()
    assert _records(items) == after
    (dead,) = _dead(items)
    assert "torn record" in dead.reason and dead.offset == len(blob) and dead.length == 200


def test_garbage_oversized_unknown_version_and_crc_errors_are_skipped(tmp_path: Path) -> None:
    good = _payloads(6)
    framed = [frame_record(KIND_BATCH, p) for p in good]
    bad_crc = bytearray(frame_record(KIND_BATCH, b"y" * 80))
    bad_crc[HEADER_SIZE + 3] ^= 0x55
    oversized = b"LGRC" + struct.pack("<BBHII", 1, KIND_BATCH, 0, 1 << 30, 0) + b"z" * 32
    future = b"LGRC" + struct.pack("<BBHII", 9, KIND_BATCH, 0, 4, 0) + b"abcd"
    blob = (
        framed[0]
        + b"\x00garbage\xff" * 7
        + framed[1]
        + bytes(bad_crc)
        + framed[2]
        + oversized
        + framed[3]
        + future
        + framed[4]
        + framed[5]
    )
    directory = tmp_path / "rank-000003"
    _write_file(directory, "00000000000000000001-0001.lglog", blob)
    items = list(read_all(directory))
    assert _records(items) == good
    reasons = [d.reason for d in _dead(items)]
    assert len(reasons) == 4
    assert "garbage" in reasons[0]
    assert "checksum mismatch" in reasons[1]
    assert "exceeds the limit" in reasons[2]
    assert "unknown log record version 9" in reasons[3]
    assert all(d.source.endswith(".lglog") for d in _dead(items))


def test_garbage_file_and_truncated_file_do_not_stop_the_reader(tmp_path: Path) -> None:
    directory = tmp_path / "rank-000002"
    _write_file(directory, "00000000000000000001-0001.lglog", os.urandom(5000))
    _write_file(directory, "00000000000000000002-0001.lglog", b"")
    good = _payloads(4)
    _write_file(
        directory,
        "00000000000000000003-0001.lglog",
        b"".join(frame_record(KIND_BATCH, p) for p in good),
    )
    items = list(read_all(directory))
    assert _records(items) == good
    assert sum(d.length for d in _dead(items)) == 5000
    # Truncation below the resume offset is reported and the file is re-read.
    reader = RankLogReader(
        directory, Position("00000000000000000003-0001.lglog", 10_000), torn_grace_s=0
    )
    items = reader.read()
    assert "truncated" in _dead(items)[0].reason
    # Resuming from the dead letter's position must re-read the file, not skip it.
    assert _dead(items)[0].end == Position("00000000000000000003-0001.lglog", 0)
    assert _records(items) == good


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    n=st.integers(1, 30),
    damage_at=st.floats(0, 1),
    damage_len=st.integers(1, 400),
    data=st.data(),
)
def test_damage_only_loses_records_it_overlaps(
    tmp_path: Path, n: int, damage_at: float, damage_len: int, data: st.DataObject
) -> None:
    payloads = [data.draw(st.binary(min_size=0, max_size=200)) for _ in range(n)]
    framed = [frame_record(KIND_BATCH, p) for p in payloads]
    blob = bytearray(b"".join(framed))
    lo = int(damage_at * (len(blob) - 1))
    hi = min(len(blob), lo + damage_len)
    blob[lo:hi] = data.draw(st.binary(min_size=hi - lo, max_size=hi - lo))
    directory = tmp_path / f"rank-{os.urandom(4).hex()}"
    _write_file(directory, "00000000000000000001-0001.lglog", bytes(blob))
    got = _records(list(read_all(directory)))
    offset = 0
    expected = []
    for p, f in zip(payloads, framed, strict=True):
        if offset + len(f) <= lo or offset >= hi:
            expected.append(p)
        offset += len(f)
    # Every untouched record survives, in order; a damaged one survives only if the
    # random bytes happened to equal the originals.
    it = iter(got)
    assert all(any(g == e for g in it) for e in expected)


@pytest.mark.parametrize("version", [1, 2])
def test_a_seal_record_reads_as_its_batches_and_a_resume_mid_seal_makes_them_all_again(
    tmp_path: Path, version: int
) -> None:
    """A timer's seal record (its ops not yet encoded) reads as the rank-step batches it
    holds. Each batch but the last resumes at the seal: a reader stopped after one of them
    makes the whole seal's batches again (the same bytes: deduplicated downstream), never
    skips the rest. A seal record that does not hold what its header says is a dead letter
    naming why, and the records around it are kept."""
    from lagscope.producers.events import decode_batch
    from lagscope.producers.log import KIND_SEAL
    from lagscope.producers.seal_record import SealPacker

    names = ("forward-compute", "backward-compute")
    packer = SealPacker(job_id="j", attempt=0, rank=0, dp_rank=0, pp_rank=0, tp_rank=0,
                        cp_rank=0, optype_names=names, version=version)  # fmt: skip
    ops = [((code, step, mb, 0), 1_000 * step + 10 * mb + code, 5)
           for step in range(3) for mb in range(2) for code in range(2)]  # fmt: skip
    seal = packer.pack(ops, wall_offset_ns=10**18, current_step=3)
    with LogWriter(tmp_path, rank=0) as writer:
        writer.append(KIND_BATCH, b"before")
        writer.append(KIND_SEAL, seal)
        writer.append(KIND_SEAL, seal[:-8])  # its last duration cut off
        writer.append(KIND_BATCH, b"after")
    items = list(read_all(rank_dir(tmp_path, 0)))
    records = [i for i in items if isinstance(i, Record)]
    assert records[0].payload == b"before" and records[-1].payload == b"after"
    batches = records[1:-1]
    assert [decode_batch(b.payload).step for b in batches] == [0, 1, 2]
    assert all(decode_batch(b.payload).n_ops == 4 for b in batches)
    (dead,) = _dead(items)
    if version == 1:
        assert "seal record of" in dead.reason and "its header says" in dead.reason
    else:
        assert "seal record's ops do not unpickle" in dead.reason

    resumed = RankLogReader(rank_dir(tmp_path, 0), batches[0].position_after, torn_grace_s=0)
    again = [i.payload for i in resumed.read() if isinstance(i, Record)]
    assert again[:3] == [b.payload for b in batches]
    resumed = RankLogReader(rank_dir(tmp_path, 0), batches[-1].position_after, torn_grace_s=0)
    assert [i.payload for i in resumed.read() if isinstance(i, Record)] == [b"after"]


def test_a_seal_of_many_steps_comes_out_over_several_reads_within_their_budget(
    tmp_path: Path,
) -> None:
    """A read returns about its byte budget even when one seal record holds 40 steps: the
    seal's other batches wait for the next reads, in order, and the reader is not at its
    end until they are out (a backlog is read no faster than its steps close)."""
    from lagscope.producers.events import decode_batch
    from lagscope.producers.log import KIND_SEAL
    from lagscope.producers.seal_record import SealPacker

    packer = SealPacker(job_id="j", attempt=0, rank=0, dp_rank=0, pp_rank=0, tp_rank=0,
                        cp_rank=0, optype_names=("forward-compute",))  # fmt: skip
    ops = [((0, step, mb, 0), 1_000 * step + 10 * mb, 5) for step in range(40) for mb in range(4)]
    with LogWriter(tmp_path, rank=0) as writer:
        writer.append(KIND_SEAL, packer.pack(ops, wall_offset_ns=10**18, current_step=40))
        writer.append(KIND_BATCH, b"after")
    reader = RankLogReader(rank_dir(tmp_path, 0), torn_grace_s=0)
    batch_bytes = len(RankLogReader(rank_dir(tmp_path, 0)).read()[0].payload)
    reads = []
    while not reader.at_end():
        got = reader.read(3 * batch_bytes)
        assert 1 <= len(got) <= 3
        reads.append(got)
    payloads = [r.payload for got in reads for r in got]
    assert payloads[-1] == b"after"
    assert [decode_batch(p).step for p in payloads[:-1]] == list(range(40))
    assert len(reads) >= 40 / 3


@pytest.mark.parametrize("version", [1, 2])
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_damaged_seal_record_is_a_schema_error_or_batches_never_a_crash(
    data: st.DataObject, version: int
) -> None:
    from lagscope.producers.events import SchemaError
    from lagscope.producers.seal_record import SealPacker, expand_seal

    packer = SealPacker(job_id="j", attempt=0, rank=1, dp_rank=1, pp_rank=0, tp_rank=0,
                        cp_rank=0, optype_names=("forward-compute", "optimizer"),
                        version=version)  # fmt: skip
    ops = [((code, step, 0, 0), step * 100 + code, 7) for step in range(2) for code in range(2)]
    payload = bytearray(packer.pack(ops, wall_offset_ns=0))
    for _ in range(data.draw(st.integers(1, 6))):
        payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    with contextlib.suppress(SchemaError):
        expand_seal(bytes(payload[: data.draw(st.integers(0, len(payload)))]))


def _seal_of(ops_bytes: bytes, n: int) -> bytes:
    """A version 2 seal record around `ops_bytes`, its header saying `n` ops."""
    from lagscope.producers.seal_record import _SEAL_HEADER

    context = b'{"job_id":"j","attempt":0,"rank":0,"dp_rank":0,"pp_rank":0,"tp_rank":0,' \
              b'"cp_rank":0,"optype_names":["forward-compute"]}'  # fmt: skip
    return _SEAL_HEADER.pack(2, n, 0, 0, len(context)) + context + ops_bytes


def test_a_seal_record_that_names_a_global_is_refused_and_nothing_is_called(
    tmp_path: Path,
) -> None:
    """A version 2 record's ops are pickled: bytes that name a function to call (as a
    hostile or broken writer's could) are a schema error, and the function is never
    imported nor called."""
    import pickle

    from lagscope.producers.events import SchemaError
    from lagscope.producers.seal_record import expand_seal

    marker = tmp_path / "called"
    for crafted in (
        b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.",
        pickle.dumps([((0, 0, 0, 0), 1, 1), marker]),  # a Path: its class is a global
    ):
        with pytest.raises(SchemaError, match="a seal record names no global"):
            expand_seal(_seal_of(crafted, 2))
    assert not marker.exists()


@pytest.mark.parametrize(
    ("ops", "n", "reason"),
    [
        ([((0, 0, 0, 0), 1, 1)], 2, "holds 1 ops, its header says 2 ops"),
        ({"ops": 1}, 1, "holds a dict, its header says 1 ops"),
        ([((0, 0, 0), 1, 1)], 1, "not \\(head of four, start, duration\\) of integers"),
        ([((0, 0, 0, 0), 1)], 1, "not \\(head of four, start, duration\\) of integers"),
        ([((0, 0, 0, 0), 1, 1), 7], 2, "not \\(head of four, start, duration\\) of integers"),
        ([{0: 1, 1: 2, 2: 3}], 1, "not \\(head of four, start, duration\\) of integers"),
        ([((0, 0, 0, 0), "1", 1)], 1, "not \\(head of four, start, duration\\) of integers"),
        ([((0, 0, 0, 0), 1.5, 1)], 1, "a value its batch column cannot hold"),
        ([((0, 0.5, 0, 0), 1, 1)], 1, "a value its batch column cannot hold"),
        ([((1, 0, 0, 0), 1, 1)], 1, "op type code outside its 1"),
        ([((0, 0, 0, 0), 1, -(2**63) - 5)], 1, "a value its batch column cannot hold"),
    ],
)
def test_a_seal_record_of_other_values_is_a_schema_error_naming_them(
    ops: object, n: int, reason: str
) -> None:
    import pickle

    from lagscope.producers.events import SchemaError
    from lagscope.producers.seal_record import expand_seal

    with pytest.raises(SchemaError, match=reason):
        expand_seal(_seal_of(pickle.dumps(ops, protocol=5), n))
    with pytest.raises(SchemaError, match="3 bytes after its ops"):
        expand_seal(_seal_of(pickle.dumps([((0, 0, 0, 0), 1, 1)]) + b"abc", 1))


def test_a_reader_knows_more_is_there_without_asking_and_not_once_the_log_is_gone(
    tmp_path, monkeypatch
):
    """A backlog's reader stands before the size it last saw: not at its end, without a
    stat (12,544 logs asked twice a round). Once its files are deleted it reads nothing
    and is at its end again, not waiting on a size it saw before."""
    import shutil

    writer = LogWriter(tmp_path, 0, background=False)
    for index in range(20):
        writer.append(KIND_BATCH, bytes([index]) * 100)
    writer.close()
    directory = rank_dir(tmp_path, 0)
    reader = RankLogReader(directory)
    assert len(reader.read(300)) < 20
    stats = []
    real_stat = os.stat

    def counted(path, *args, **kwargs):
        stats.append(path)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", counted)
    assert not reader.at_end()
    monkeypatch.undo()
    assert stats == []
    shutil.rmtree(directory)
    assert reader.read(300) == []
    assert reader.at_end()
