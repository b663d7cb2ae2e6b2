"""Compatibility across versions (issue 27): records written as a newer producer would write
them are read by this build. A job record with fields this build does not know, of a newer
schema version, is kept and its job analysed; a version-1 batch with sections appended reads
as its columns; a batch of a newer encoding version, which cannot be read, is a dead letter
that names its version. Through both hosts: `lagscope run` (embedded) and `lagscope stream`
-> the real broker -> `lagscope worker`.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest

from lagscope.producers.events import (
    BATCH_VERSION,
    FLAG_SECTIONS,
    JOB_SCHEMA_VERSION,
    JobInfo,
    RankIdentity,
    SchemaError,
    decode_batch,
)
from lagscope.producers.log import KIND_BATCH, KIND_JOB, LogWriter
from lagscope.producers.reference_format import load_meta, load_trace
from lagscope.producers.replay import iter_step_batches
from tests.kafka_util import consume_all
from tests.worker_util import create_topics, query_store, start_worker

REFERENCE = Path(__file__).resolve().parent / "data" / "reference-traces"
NEWER = JOB_SCHEMA_VERSION + 1
JOB = "st-newer"
START_NS = 1_700_000_000 * 10**9


def newer_job_record(info: JobInfo, rank: int) -> bytes:
    """The job record a newer producer writes: its version, a field this build does not
    know at the top and one in the rank's identity."""
    record: dict[str, Any] = json.loads(info.model_dump_json())
    record["schema_version"] = NEWER
    record["accelerator"] = {"kind": "H200", "memory_gib": 141}
    record["rank_identity"] = {"rank": rank, "host": f"node-{rank}", "gpu_uuid": f"GPU-{rank}"}
    return json.dumps(record).encode()


def with_header(encoded: bytes, *, version: int = BATCH_VERSION, flags: int = 0) -> bytes:
    """`encoded` with another version and flags in its header, its checksum made good."""
    body = bytearray(encoded[:-4])
    struct.pack_into("<HH", body, 4, version, flags)
    return bytes(body) + struct.pack("<I", zlib.crc32(body))


def with_section(encoded: bytes, section: bytes) -> bytes:
    """A version-1 batch with a section appended after its columns, as a newer writer adds
    one (flag FLAG_SECTIONS set)."""
    body = bytearray(with_header(encoded, flags=FLAG_SECTIONS)[:-4]) + section
    return bytes(body) + struct.pack("<I", zlib.crc32(body))


def write_newer_logs(log_dir: Path) -> dict[str, int]:
    """The ST job's logs as a newer producer writes them: every batch of one step in a
    newer encoding version (unreadable), every other batch with a section appended."""
    trace = load_trace(REFERENCE / "trace-ST.parquet")
    meta = load_meta(REFERENCE / "meta-ST.yaml")
    unreadable_step = int(sorted(set(trace.step.tolist()))[10])
    info = JobInfo.from_meta(meta, job_id=JOB)
    writers: dict[int, LogWriter] = {}
    counts = {"batches": 0, "unreadable": 0, "steps": 0}
    for _, step, batches in iter_step_batches(trace, meta, job_id=JOB, start_wall_ns=START_NS):
        counts["steps"] += 1
        for batch in batches:
            writer = writers.get(batch.rank)
            if writer is None:
                writer = writers[batch.rank] = LogWriter(log_dir, batch.rank)
                writer.append(KIND_JOB, newer_job_record(info, batch.rank))
            if step == unreadable_step:
                writer.append(KIND_BATCH, with_header(batch.encode(), version=BATCH_VERSION + 1))
                counts["unreadable"] += 1
            else:
                writer.append(KIND_BATCH, with_section(batch.encode(), b"\x01\x00future\x00"))
            counts["batches"] += 1
    for writer in writers.values():
        writer.close()
    return counts


def test_a_newer_job_record_is_kept_with_its_unknown_fields() -> None:
    meta = load_meta(REFERENCE / "meta-ST.yaml")
    info = JobInfo.from_meta(meta, job_id=JOB)
    assert json.loads(info.model_dump_json())["schema_version"] == JOB_SCHEMA_VERSION
    read = JobInfo.model_validate_json(newer_job_record(info, 3))
    assert read.schema_version == NEWER
    assert read.unknown_fields == ["accelerator"]
    assert read.rank_identity is not None and read.rank_identity.unknown_fields == ["gpu_uuid"]
    assert read.to_meta() == meta
    # kept, not dropped: what this build passes on still carries them
    assert json.loads(read.model_dump_json())["accelerator"] == {"kind": "H200", "memory_gib": 141}
    # ... while a field this build does not know, in code, is a mistake
    with pytest.raises(ValueError, match=r"unknown field.*dp_szie"):
        JobInfo(job_id=JOB, dp_size=2, pp_size=4, world_size=8, dp_szie=2)
    with pytest.raises(ValueError, match=r"unknown field.*gpu_uid"):
        RankIdentity(rank=0, gpu_uid="x")


def test_a_newer_record_that_cannot_be_read_names_its_version() -> None:
    record = {"schema_version": NEWER, "job_id": JOB, "layout": {"dp": 2}}
    newer_than = f"schema version {NEWER}, newer than the {JOB_SCHEMA_VERSION}"
    with pytest.raises(ValueError, match=newer_than):
        JobInfo.model_validate_json(json.dumps(record))
    meta = load_meta(REFERENCE / "meta-ST.yaml")
    batch = next(iter_step_batches(load_trace(REFERENCE / "trace-ST.parquet"), meta,
                                   job_id=JOB, start_wall_ns=START_NS))[2][0]  # fmt: skip
    with pytest.raises(SchemaError, match=f"version {BATCH_VERSION + 1}"):
        decode_batch(with_header(batch.encode(), version=BATCH_VERSION + 1))
    extended = decode_batch(with_section(batch.encode(), b"\x00" * 24))
    assert extended.to_records() == batch.to_records()
    # appended bytes without the flag are still a broken batch, not a section
    unflagged = bytearray(batch.encode()[:-4]) + b"\x00" * 8
    with pytest.raises(SchemaError, match="column bytes"):
        decode_batch(bytes(unflagged) + struct.pack("<I", zlib.crc32(unflagged)))


def test_a_seal_record_of_a_newer_version_is_a_dead_letter_naming_it(tmp_path: Path) -> None:
    """A timer newer than this reader writes seal records of a version it does not know:
    each is a dead letter naming that version, and the records around it are read (those
    of every version it knows, 1 and 2, among them)."""
    from lagscope.producers.log import KIND_SEAL, Record, SkippedSpan, rank_dir, read_all
    from lagscope.producers.seal_record import SEAL_VERSIONS, SealPacker

    names = ("forward-compute",)
    ops = [((0, step, 0, 0), 1_000 * step, 5) for step in range(3)]
    with LogWriter(tmp_path, rank=0) as writer:
        for version in SEAL_VERSIONS:
            identity = dict(job_id="j", attempt=0, rank=0, dp_rank=0, pp_rank=0, tp_rank=0)
            packer = SealPacker(**identity, cp_rank=0, optype_names=names, version=version)
            seal = packer.pack(ops, wall_offset_ns=10**18, current_step=3)
            writer.append(KIND_SEAL, seal)
            newer = bytearray(seal)
            struct.pack_into("<H", newer, 0, max(SEAL_VERSIONS) + 1)
            writer.append(KIND_SEAL, bytes(newer))
    items = list(read_all(rank_dir(tmp_path, 0)))
    steps = [decode_batch(i.payload).step for i in items if isinstance(i, Record)]
    assert steps == [0, 1, 2, 0, 1, 2]
    dead = [i.reason for i in items if isinstance(i, SkippedSpan)]
    assert dead == [f"seal record version {max(SEAL_VERSIONS) + 1} (this reader reads 1 and 2)"] * 2


def test_run_reads_a_newer_producers_logs(tmp_path: Path) -> None:
    counts = write_newer_logs(tmp_path / "logs")
    store = f"chdb://{tmp_path / 'store'}"
    done = subprocess.run(
        [sys.executable, "-m", "lagscope", "run", "--log-dir", str(tmp_path / "logs"),
         "--dsn", store],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # every step but the one whose batches a newer encoding made unreadable, complete
    analysed = counts["steps"] - 1
    assert f"job {JOB} attempt 0: {analysed} steps closed\n" in done.stdout
    steps = _query(store, "SELECT count() AS n, countIf(complete) AS c FROM steps FINAL")
    assert steps == [{"n": analysed, "c": analysed}]
    dead = _query(store, "SELECT reason FROM dead_letters")
    assert len(dead) == counts["unreadable"]
    assert all(f"unknown batch encoding version {BATCH_VERSION + 1}" in d["reason"] for d in dead)
    assert not [d for d in dead if "job metadata" in d["reason"]]
    machines = _query(store, "SELECT count() AS n FROM rank_identity FINAL")
    assert machines == [{"n": 8}]


def test_stream_and_worker_carry_a_newer_producers_records(
    tmp_path: Path, kafka_bootstrap: str, kafka_topics: dict[str, str]
) -> None:
    counts = write_newer_logs(tmp_path / "logs")
    create_topics(kafka_bootstrap, kafka_topics)
    topics = [f"--{name.replace('_', '-')}={topic}" for name, topic in kafka_topics.items()]
    shipped = subprocess.run(
        [sys.executable, "-m", "lagscope", "stream", "--log-dir", str(tmp_path / "logs"),
         "--bootstrap-servers", kafka_bootstrap, "--idle-exit-s", "1", *topics],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert shipped.returncode == 0, shipped.stderr
    stats = json.loads(shipped.stdout.splitlines()[-1])
    assert stats["unshipped_bytes"] == 0
    assert stats["dead_letters"] == counts["unreadable"]
    assert f"schema version {NEWER} with fields this build does not know" in shipped.stderr
    jobs = consume_all(kafka_bootstrap, kafka_topics["topic_jobs"])
    assert len(jobs) == 8
    assert {m.headers["lagscope-schema"] for m in jobs} == {f"job-{NEWER}".encode()}
    assert all(json.loads(m.value)["accelerator"]["kind"] == "H200" for m in jobs)
    dead = consume_all(kafka_bootstrap, kafka_topics["topic_deadletter"])
    assert len(dead) == counts["unreadable"]
    assert all(f"version {BATCH_VERSION + 1}" in json.loads(m.value)["reason"] for m in dead)

    worker = start_worker(kafka_bootstrap, kafka_topics, tmp_path / "w", group="newer")
    assert worker.wait(300) == 0, worker.log()[-4000:]
    assert "invalid job metadata" not in worker.log()
    steps = query_store(tmp_path / "w", "SELECT count() AS n FROM steps FINAL")
    # the unreadable step never reached the worker; every other one was analysed
    assert steps == [{"n": counts["steps"] - 1}]
    # The worker set nothing aside; it stored what the streamer did, once each.
    stored = query_store(tmp_path / "w", "SELECT reason FROM dead_letters")
    assert len(stored) == counts["unreadable"], stored
    assert all(f"version {BATCH_VERSION + 1}" in r["reason"] for r in stored), stored
    assert all("set aside by the streamer" in r["reason"] for r in stored), stored
    # The job record reaches the store whole: the newer writer's fields and its version.
    (job,) = query_store(tmp_path / "w", "SELECT meta FROM jobs FINAL")
    stored = json.loads(job["meta"])
    assert stored["accelerator"]["kind"] == "H200" and stored["schema_version"] == NEWER


def _query(dsn: str, sql: str) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "lagscope", "query", "--dsn", dsn, "--format", "json", sql],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
