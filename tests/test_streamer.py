"""Streamer integration against a real broker: reference trace → logs → Kafka → back."""

from __future__ import annotations

import json
import logging
import struct
import time
from collections import Counter
from pathlib import Path

from lagscope.producers.events import (
    JobInfo,
    RankIdentity,
    RankStepBatch,
    batch_id_of,
    decode_batch,
)
from lagscope.producers.log import KIND_BATCH, KIND_JOB, LogWriter, frame_record, rank_dir
from lagscope.producers.reference_format import load_meta, load_trace
from lagscope.producers.replay import default_job_id, iter_step_batches, replay
from lagscope.producers.streamer import BATCH_ID_HEADER, SCHEMA_HEADER, Streamer
from tests.conftest import REFERENCE_TRACES
from tests.kafka_util import consume_all

START_NS = 1_750_000_000_000_000_000


def _op_keys(batches: list[RankStepBatch]) -> Counter:
    return Counter(tuple(record.values()) for batch in batches for record in batch.to_records())


def test_reference_trace_reaches_kafka_exactly_once_in_batches(
    tmp_path: Path, streamer_config, kafka_bootstrap: str, kafka_topics: dict[str, str]
) -> None:
    trace = load_trace(REFERENCE_TRACES / "trace-AR.parquet")
    meta = load_meta(REFERENCE_TRACES / "meta-AR.yaml")
    stats = replay(
        trace,
        meta,
        log_dir=tmp_path / "logs",
        start_wall_ns=START_NS,
        progress=None,
        max_file_bytes=256 << 10,
    )
    assert stats.ops == trace.n_rows == 117_216

    streamer = Streamer(streamer_config(tmp_path / "logs"))
    streamer.ensure_topics()
    result = streamer.run()
    assert result.ops == trace.n_rows
    assert result.dead_letters == 0

    messages = consume_all(kafka_bootstrap, kafka_topics["topic_ops"])
    assert len(messages) == stats.batches == 704  # 16 ranks x 44 steps, one message each
    batches = []
    for message in messages:
        assert message.key == default_job_id(meta).encode()
        assert message.headers[SCHEMA_HEADER] == b"1"
        assert message.headers[BATCH_ID_HEADER] == batch_id_of(message.value).encode()
        batches.append(decode_batch(message.value))
    assert all(len({b.step for b in [batch]}) == 1 for batch in batches)

    expected = [
        batch
        for _, _, step_batches in iter_step_batches(
            trace, meta, job_id=default_job_id(meta), start_wall_ns=START_NS
        )
        for batch in step_batches
    ]
    got = _op_keys(batches)
    assert got == _op_keys(expected)
    assert max(got.values()) == 1  # every op exactly once

    jobs = consume_all(kafka_bootstrap, kafka_topics["topic_jobs"])
    # The job's record, then each of its 64 ranks' end, once each (the logs in the
    # streamer's order).
    assert jobs[0].key == b"AR-0/0"
    assert sorted(m.key for m in jobs[1:]) == sorted(f"AR-0/0/{r}".encode() for r in range(64))
    info = JobInfo.model_validate_json(jobs[0].value)
    assert (info.job_id, info.world_size, info.pp_size) == ("AR-0", 64, 4)
    assert jobs[0].key == b"AR-0/0"
    from confluent_kafka.admin import AdminClient, ConfigResource

    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    resource = ConfigResource(ConfigResource.Type.TOPIC, kafka_topics["topic_jobs"])
    configs = admin.describe_configs([resource])[resource].result(timeout=10)
    assert configs["cleanup.policy"].value == "compact"
    assert consume_all(kafka_bootstrap, kafka_topics["topic_deadletter"]) == []


def _batch(step: int, n: int = 5) -> RankStepBatch:
    return RankStepBatch.build(
        job_id="dl-job", attempt=0, rank=7, dp_rank=1, pp_rank=1, step=step,
        optype=["forward-compute"] * n, microbatch=list(range(n)), chunk=[0] * n,
        seq=list(range(n)), start_ns=[START_NS + i * 1000 for i in range(n)],
        duration_ns=[500] * n,
    )  # fmt: skip


def test_bad_records_go_to_dead_letters_and_good_ones_are_delivered(
    tmp_path: Path, streamer_config, kafka_bootstrap: str, kafka_topics: dict[str, str]
) -> None:
    log_dir = tmp_path / "logs"
    good = [_batch(step) for step in range(6)]
    framed = [frame_record(KIND_BATCH, b.encode()) for b in good]
    oversized = b"LGRC" + struct.pack("<BBHII", 1, KIND_BATCH, 0, 1 << 30, 0) + b"z" * 40
    not_a_batch = frame_record(KIND_BATCH, b"this is not an encoded batch at all")
    corrupt_batch = bytearray(good[0].encode())
    corrupt_batch[-10] ^= 0xFF  # log checksum is fine, the batch's own checksum is not
    torn = framed[5][:30]
    directory = rank_dir(log_dir, 7)
    directory.mkdir(parents=True)
    (directory / "00000000000000000001-0001.lglog").write_bytes(
        framed[0] + b"\x13garbage!" * 5 + framed[1] + oversized + framed[2] + not_a_batch
        + frame_record(KIND_BATCH, bytes(corrupt_batch)) + framed[3] + torn
    )  # fmt: skip
    # A restarted writer's next file: makes the torn tail of the first file final.
    (directory / "00000000000000000002-0001.lglog").write_bytes(framed[4])
    (rank_dir(log_dir, 8)).mkdir()
    (rank_dir(log_dir, 8) / "00000000000000000001-0001.lglog").write_bytes(bytes(range(256)) * 8)
    with LogWriter(log_dir, 9) as writer:
        writer.append(KIND_BATCH, good[5].encode())

    result = Streamer(streamer_config(log_dir)).run()
    assert result.dead_letters == 6

    delivered = consume_all(kafka_bootstrap, kafka_topics["topic_ops"])
    assert sorted(decode_batch(m.value).step for m in delivered) == [0, 1, 2, 3, 4, 5]
    dead = [
        json.loads(m.value) for m in consume_all(kafka_bootstrap, kafka_topics["topic_deadletter"])
    ]
    reasons = " | ".join(d["reason"] for d in dead)
    for expected in (
        "garbage",
        "exceeds the limit",
        "too short for a batch",
        "checksum mismatch",
        "torn record",
    ):
        assert expected in reasons, reasons
    assert all(d["source"].endswith(".lglog") and d["length"] > 0 for d in dead)
    assert sum(d["length"] for d in dead if "rank-000008" in d["source"]) == 2048


def test_streamer_tails_live_logs_through_rotation_and_deletion(
    tmp_path: Path, streamer_config, kafka_bootstrap: str, kafka_topics: dict[str, str]
) -> None:
    log_dir = tmp_path / "logs"
    streamer = Streamer(streamer_config(log_dir, torn_grace_s=0.0))

    def pump() -> None:
        for _ in range(50):
            streamer.step()
            if not streamer._in_flight_bytes:
                return
            streamer._producer.poll(0.05)

    sent = []
    writer = LogWriter(log_dir, 7, max_file_bytes=2_000, flush_interval_s=0.01)
    for step in range(40):
        batch = _batch(step, n=10)
        writer.append(KIND_BATCH, batch.encode())
        sent.append(batch)
        if step % 5 == 4:
            writer.flush()
            pump()
    writer.flush()
    pump()
    files = sorted(rank_dir(log_dir, 7).iterdir())
    assert len(files) >= 6  # rotated
    # Retention deletes shipped files; a late rank appears; nothing breaks.
    for old in files[:5]:
        old.unlink()
    with LogWriter(log_dir, 8) as late:
        late.append(KIND_BATCH, _batch(99).encode())
    sent.append(_batch(99))
    pump()
    for step in range(40, 45):
        writer.append(KIND_BATCH, _batch(step, n=10).encode())
        sent.append(_batch(step, n=10))
    writer.close()
    pump()
    streamer.close()

    delivered = [
        decode_batch(m.value) for m in consume_all(kafka_bootstrap, kafka_topics["topic_ops"])
    ]
    assert sorted(b.batch_id for b in delivered) == sorted(b.batch_id for b in sent)
    checkpoint = json.loads((log_dir / ".streamer-checkpoint.json").read_text())
    assert set(checkpoint["positions"]) == {"rank-000007", "rank-000008"}


def test_a_ranks_end_is_shipped_once_after_its_start_record(
    tmp_path: Path, streamer_config, kafka_bootstrap: str, kafka_topics: dict[str, str]
) -> None:
    """A rank's job record and its end (the same record again, `ended_ns` set, as a closed
    monitor writes it) both reach the jobs topic under the rank's key, the end last, and a
    restarted streamer sends neither again."""
    meta = load_meta(REFERENCE_TRACES / "meta-ST.yaml")
    started = JobInfo.from_meta(meta, job_id="ends").model_copy(
        update={"rank_identity": RankIdentity(rank=0)}
    )
    ended = started.model_copy(update={"ended_ns": START_NS})
    writer = LogWriter(tmp_path / "logs", 0, background=False)
    for info in (started, ended):
        writer.append(KIND_JOB, info.model_dump_json().encode())
    writer.close()
    for _ in range(2):
        streamer = Streamer(streamer_config(tmp_path / "logs"))
        streamer.ensure_topics()
        streamer.run()
    jobs = consume_all(kafka_bootstrap, kafka_topics["topic_jobs"])
    assert [m.key for m in jobs] == [b"ends/0/0", b"ends/0/0"]
    read = [JobInfo.model_validate_json(m.value) for m in jobs]
    assert [info.ended_ns for info in read] == [None, START_NS]


def test_replay_straight_into_kafka(
    streamer_config, tmp_path: Path, kafka_bootstrap: str, kafka_topics: dict[str, str]
) -> None:
    trace = load_trace(REFERENCE_TRACES / "trace-ST.parquet")
    meta = load_meta(REFERENCE_TRACES / "meta-ST.yaml")
    config = streamer_config(tmp_path)
    stats = replay(trace, meta, kafka=config, progress=None, job_id="st-direct", attempt=3)
    messages = consume_all(kafka_bootstrap, kafka_topics["topic_ops"])
    assert len(messages) == stats.batches
    assert sum(decode_batch(m.value).n_ops for m in messages) == trace.n_rows
    job, *ended = consume_all(kafka_bootstrap, kafka_topics["topic_jobs"])
    assert job.key == b"st-direct/3"
    # Then every rank of its world says it ended, keyed per rank as a streamer ships it.
    assert [m.key for m in ended] == [f"st-direct/3/{r}".encode() for r in range(meta.world_size)]
    last_op_end_ns = max(
        int((b.start_ns + b.duration_ns).max())
        for b in map(decode_batch, (m.value for m in messages))
    )
    assert {JobInfo.model_validate_json(m.value).ended_ns for m in ended} == {last_op_end_ns}


def test_unreachable_kafka_keeps_memory_bounded_and_position_unconfirmed(tmp_path: Path) -> None:
    from lagscope.deploy.kafka_local import free_port
    from lagscope.producers.config import KafkaSettings, LagscopeConfig, StreamerSettings

    log_dir = tmp_path / "logs"
    with LogWriter(log_dir, 1) as writer:
        for step in range(400):
            writer.append(KIND_BATCH, _batch(step, n=50).encode())  # ~1.5 KB each
    limit = 20_000
    config = LagscopeConfig(
        kafka=KafkaSettings(bootstrap_servers=f"127.0.0.1:{free_port()}"),
        streamer=StreamerSettings(log_dir=log_dir, max_in_flight_bytes=limit),
    )
    streamer = Streamer(config)
    peak = 0
    for _ in range(30):
        streamer.step()
        peak = max(peak, streamer._in_flight_bytes)
        streamer._producer.poll(0.02)
    assert 0 < peak <= limit + 2_000
    assert streamer.stats.batches < 30  # it stopped reading, the log stays the buffer
    streamer.close(timeout_s=0.5)
    del streamer  # stop the client's reconnect attempts
    checkpoint = json.loads((log_dir / ".streamer-checkpoint.json").read_text())
    assert checkpoint["positions"] == {}  # nothing confirmed, nothing claimed


def test_delete_shipped_removes_only_confirmed_files(
    tmp_path: Path, streamer_config, kafka_bootstrap: str, kafka_topics: dict[str, str]
) -> None:
    log_dir = tmp_path / "logs"
    with LogWriter(log_dir, 2, max_file_bytes=3_000) as writer:
        for step in range(30):
            writer.append(KIND_BATCH, _batch(step, n=10).encode())
    files_before = sorted(p.name for p in rank_dir(log_dir, 2).iterdir())
    assert len(files_before) > 3
    Streamer(streamer_config(log_dir, delete_shipped=True)).run()
    left = sorted(p.name for p in rank_dir(log_dir, 2).iterdir())
    assert left == files_before[-1:]  # the newest file may still grow: kept
    delivered = consume_all(kafka_bootstrap, kafka_topics["topic_ops"])
    assert sorted(decode_batch(m.value).step for m in delivered) == list(range(30))


def test_back_off_after_a_rewind_resets_once_a_delivery_succeeds(
    tmp_path: Path, streamer_config, kafka_bootstrap: str, kafka_topics: dict[str, str]
) -> None:
    log_dir = tmp_path / "logs"
    streamer = Streamer(streamer_config(log_dir, torn_grace_s=0.0))
    # A long outage: rewind after rewind, the back-off grows to its 5 s cap.
    for _ in range(12):
        streamer._rewind_failed()
    assert streamer._backoff_s - time.monotonic() > 4.5
    streamer._backoff_s = 0.0  # the outage ends
    with LogWriter(log_dir, 3, flush_interval_s=0.01) as writer:
        writer.append(KIND_BATCH, _batch(1).encode())
    deadline = time.monotonic() + 30
    while streamer.stats.batches == 0 or streamer._in_flight_bytes:
        assert time.monotonic() < deadline, "the batch was not delivered"
        streamer.step()
        streamer._producer.poll(0.05)
    # The next failure is the first of a new outage: it waits the first back-off, not 5 s.
    streamer._rewind_failed()
    assert streamer._backoff_s - time.monotonic() <= 0.5
    assert streamer.stats.rewinds == 13
    streamer.close()


def test_a_sidecar_started_before_the_job_waits_for_its_log_dir(
    tmp_path: Path, streamer_config, kafka_bootstrap: str, kafka_topics: dict[str, str], caplog
) -> None:
    """The log directory does not exist yet: one line says so, nothing is created, and the
    batches the job then writes are shipped."""
    log_dir = tmp_path / "not-yet" / "logs"
    streamer = Streamer(streamer_config(log_dir))
    with caplog.at_level(logging.WARNING, logger="lagscope.streamer"):
        for _ in range(3):
            assert not streamer.step()
        assert not log_dir.parent.exists()
        sent = [_batch(step) for step in range(3)]
        with LogWriter(log_dir, 7) as writer:
            for batch in sent:
                writer.append(KIND_BATCH, batch.encode())
        for _ in range(50):
            streamer.step()
            if not streamer._in_flight_bytes and streamer.stats.batches == len(sent):
                break
            streamer._producer.poll(0.05)
        streamer.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        f"{log_dir} does not exist yet; waiting for the training job to create it",
        f"{log_dir} appeared; shipping its logs",
    ]
    delivered = [
        decode_batch(m.value) for m in consume_all(kafka_bootstrap, kafka_topics["topic_ops"])
    ]
    assert sorted(b.batch_id for b in delivered) == sorted(b.batch_id for b in sent)


def test_a_log_dir_that_never_appears_is_not_created(tmp_path: Path, streamer_config) -> None:
    log_dir = tmp_path / "typo" / "logs"
    stats = Streamer(streamer_config(log_dir, idle_exit_s=0.3)).run()
    assert stats.batches == 0
    assert not (tmp_path / "typo").exists()
