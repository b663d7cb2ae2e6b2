"""Hostile input never crashes a host, never loses good data, and every bad record is a
dead letter with its origin and a reason a person understands (issue 16, rule 1)."""

from __future__ import annotations

import itertools
import shutil
import signal
import socket
import time

import pytest
from confluent_kafka import Producer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lagscope.cli import main
from lagscope.cli.demo import write_logs_with_timers
from lagscope.producers.log import KIND_BATCH, KIND_JOB, frame_record, list_rank_dirs
from lagscope.producers.replay import iter_step_batches
from lagscope.simulator.generate import generate_job
from lagscope.store.sink import ClickHouseSink
from lagscope.stream_app.embedded import EmbeddedRunner
from lagscope.stream_app.processor import ProcessorSettings
from tests.hostile import (
    GOOD_JOB,
    GOOD_SPEC,
    GOOD_STEPS,
    append_records,
    good_info,
    hostile_records,
    write_good_logs,
)
from tests.worker_util import create_topics, query_store, start_streamer, start_worker

KINDS = list(hostile_records())
_databases = itertools.count()


@pytest.fixture(scope="module")
def good_logs(tmp_path_factory):
    logs = tmp_path_factory.mktemp("good-logs")
    write_good_logs(logs)
    return logs


def assert_good_job_stored_complete(store: ClickHouseSink) -> None:
    _, rows = store.query(
        "SELECT step, complete, isFinite(slowdown) FROM steps FINAL "
        "WHERE job_id = {job:String} ORDER BY step",
        {"job": GOOD_JOB},
    )
    assert rows == [(step, True, True) for step in GOOD_STEPS]


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=1, unique=True),
    rank_index=st.integers(0, 3),
)
@pytest.mark.slow  # lagscope run over every kind of hostile record (~30 s)
def test_lagscope_run_sets_every_hostile_record_aside_and_keeps_the_good_job(
    good_logs, tmp_path_factory, chdb_dir, capsys, kinds, rank_index
):
    logs = tmp_path_factory.mktemp("logs")
    shutil.copytree(good_logs, logs, dirs_exist_ok=True)
    records = hostile_records()
    chosen = []
    for kind in kinds:
        chosen += records[kind] if isinstance(records[kind], list) else [records[kind]]
    placed = append_records(list_rank_dirs(logs)[rank_index], chosen)
    dsn = f"chdb://{chdb_dir}?database=hostile_run_{next(_databases)}"

    code = main(["run", "--logs", str(logs), "--dsn", dsn, "--lateness-s", "60"])

    out = capsys.readouterr()
    assert code == 0
    assert "Traceback" not in out.out + out.err
    with ClickHouseSink(dsn, create=False) as store:
        assert_good_job_stored_complete(store)
        _, letters = store.query("SELECT source, reason FROM dead_letters")
    for record, origin in placed:
        found = [(s, r) for s, r in letters if s == origin]
        assert len(found) == 1, f"{origin}: {letters}"
        assert record.reason in found[0][1]
    assert len(letters) == len(placed)


def test_worker_dead_letters_each_hostile_record_once_and_skips_it_on_restart(
    kafka_bootstrap, kafka_topics, tmp_path
):
    create_topics(kafka_bootstrap, kafka_topics)
    info = good_info()
    job = generate_job(GOOD_SPEC)
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    jobs_topic, ops_topic = kafka_topics["topic_jobs"], kafka_topics["topic_ops"]
    producer.produce(jobs_topic, key=info.key.encode(), value=info.model_dump_json().encode())
    producer.flush(30)
    expected: list[tuple[str, str]] = []  # (origin, reason)
    offsets = {jobs_topic: 1, ops_topic: 0}

    def send(topic: str, key: bytes, value: bytes, reason: str | None) -> None:
        producer.produce(topic, key=key, value=value)
        producer.flush(30)
        if reason is not None:
            expected.append((f"{topic}[0]@{offsets[topic]}", reason))
        offsets[topic] += 1

    records = hostile_records()
    steps = iter_step_batches(job.trace, job.meta, job_id=GOOD_JOB, start_wall_ns=time.time_ns())
    for index, (_, _, batches) in enumerate(steps):
        for batch in batches:
            send(ops_topic, GOOD_JOB.encode(), batch.encode(), None)
        if index == 2:  # hostile records in the middle of the good job
            for kind in KINDS:
                for record in records[kind] if isinstance(records[kind], list) else [records[kind]]:
                    topic = jobs_topic if record.kind == KIND_JOB else ops_topic
                    key = b"huge/0" if record.kind == KIND_JOB else GOOD_JOB.encode()
                    send(topic, key, record.payload, record.reason)
            # garbage under keys no job has: dead letters, and no wait for job metadata
            for garbage in range(20):
                send(ops_topic, f"nobody-{garbage}".encode(), b"\x00garbage" * 20, "bad magic")

    began = time.monotonic()
    worker = start_worker(kafka_bootstrap, kafka_topics, tmp_path / "w", group="hostile")
    assert worker.wait(180) == 0, worker.log()[-4000:]
    first_run_s = time.monotonic() - began
    assert "Traceback" not in worker.log()
    rows = query_store(
        tmp_path / "w",
        "SELECT step, complete, isFinite(slowdown) AS analysed FROM steps FINAL "
        f"WHERE job_id = '{GOOD_JOB}' ORDER BY step",
    )
    assert rows == [{"step": s, "complete": True, "analysed": True} for s in GOOD_STEPS]
    letters = query_store(tmp_path / "w", "SELECT source, reason FROM dead_letters")
    for origin, reason in expected:
        found = [letter for letter in letters if letter["source"] == origin]
        assert len(found) == 1 and reason in found[0]["reason"], (origin, reason, letters)
    assert len(letters) == len(expected)
    # 20 garbage keys would have cost 5 s of waiting each before.
    assert first_run_s < 60, first_run_s

    again = start_worker(
        kafka_bootstrap, kafka_topics, tmp_path / "w", group="hostile", log_name="again.log"
    )
    assert again.wait(180) == 0, again.log()[-4000:]
    assert "Traceback" not in again.log()
    assert query_store(tmp_path / "w", "SELECT count() AS n FROM dead_letters") == [
        {"n": len(expected)}
    ]


def _garble(rank_directory) -> int:
    """A last log file of the rank with what only a reader of the logs can set aside:
    garbage between records, a record that is no batch, a batch whose checksum fails.
    Returns how many dead letters it makes."""
    corrupt = bytearray(next(iter(_good_batches())).encode())
    corrupt[-10] ^= 0xFF  # the log record's checksum holds, the batch's own does not
    (rank_directory / "99999999999999999999-0001.lglog").write_bytes(
        b"\x13garbage!" * 5
        + frame_record(KIND_BATCH, b"this is not an encoded batch at all")
        + frame_record(KIND_BATCH, bytes(corrupt))
    )
    return 3


def _good_batches():
    job = generate_job(GOOD_SPEC)
    steps = iter_step_batches(job.trace, job.meta, job_id=GOOD_JOB, start_wall_ns=time.time_ns())
    for _, _, batches in steps:
        yield from batches


def _where_in_logs(source: str) -> str:
    """`rank-…/file@offset` of a dead letter's source, whichever host stored it."""
    return "/".join(source.split("/")[-2:])


@pytest.mark.slow  # lagscope run, a streamer and two workers over the same logs (~40 s)
def test_what_a_streamer_sets_aside_is_stored_as_lagscope_run_stores_it(
    kafka_bootstrap, kafka_topics, good_logs, tmp_path, chdb_dir
):
    """Garbage in a rank's log: `lagscope run` reads the logs itself and stores a dead
    letter for each stretch it set aside; through Kafka the streamer sets them aside on
    the dead-letter topic and the workers store them, naming the node, the file and the
    offset: the same places in the logs, each once, also after a worker restarts."""
    logs = tmp_path / "logs"
    shutil.copytree(good_logs, logs)
    expected = _garble(list_rank_dirs(logs)[1])
    dsn = f"chdb://{chdb_dir}?database=garbled_run"
    assert main(["run", "--log-dir", str(logs), "--dsn", dsn, "--lateness-s", "60"]) == 0
    with ClickHouseSink(dsn, create=False) as store:
        _, embedded = store.query("SELECT source FROM dead_letters FINAL")
    assert len(embedded) == expected, embedded

    create_topics(kafka_bootstrap, kafka_topics)
    streamer = start_streamer(kafka_bootstrap, kafka_topics, logs, tmp_path / "s")
    assert streamer.wait(120) == 0, streamer.log()[-4000:]
    worker = start_worker(kafka_bootstrap, kafka_topics, tmp_path / "w", group="garbled")
    assert worker.wait(180) == 0, worker.log()[-4000:]
    letters = query_store(tmp_path / "w", "SELECT source, reason FROM dead_letters")
    assert sorted(_where_in_logs(r["source"]) for r in letters) == sorted(
        _where_in_logs(source) for (source,) in embedded
    ), letters
    host = socket.gethostname()
    assert all(r["source"].startswith(f"{host}:") for r in letters), letters
    assert all("set aside by the streamer" in r["reason"] for r in letters), letters
    rows = query_store(tmp_path / "w", "SELECT count() AS n, countIf(complete) AS complete "
                       f"FROM steps FINAL WHERE job_id = '{GOOD_JOB}'")  # fmt: skip
    assert rows == [{"n": len(GOOD_STEPS), "complete": len(GOOD_STEPS)}]

    again = start_worker(
        kafka_bootstrap, kafka_topics, tmp_path / "w", group="garbled", log_name="again.log"
    )
    assert again.wait(180) == 0, again.log()[-4000:]
    assert query_store(tmp_path / "w", "SELECT count() AS n FROM dead_letters") == [{"n": expected}]


@pytest.mark.parametrize("after_s", [0.5, 6.0])
def test_worker_honours_sigterm_within_10_s(kafka_bootstrap, kafka_topics, tmp_path, after_s):
    """Starting up, or busy with a backlog that holds a huge job record: SIGTERM ends it."""
    create_topics(kafka_bootstrap, kafka_topics)
    huge = hostile_records()["huge job record"]
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    producer.produce(kafka_topics["topic_jobs"], key=b"huge/0", value=huge[0].payload)
    info = good_info()
    producer.produce(kafka_topics["topic_jobs"], key=info.key.encode(),
                     value=info.model_dump_json().encode())  # fmt: skip
    job = generate_job(GOOD_SPEC.model_copy(update={"steps": 200}))
    for _, _, batches in iter_step_batches(
        job.trace, job.meta, job_id=GOOD_JOB, start_wall_ns=time.time_ns()
    ):
        producer.produce(kafka_topics["topic_ops"], key=b"huge", value=huge[1].payload)
        for batch in batches:
            producer.produce(kafka_topics["topic_ops"], key=GOOD_JOB.encode(), value=batch.encode())
        producer.poll(0)
    producer.flush(30)
    worker = start_worker(
        kafka_bootstrap, kafka_topics, tmp_path / "w", group="sigterm", exit_when_idle_s=None
    )
    time.sleep(after_s)
    sent = time.monotonic()
    worker.process.send_signal(signal.SIGTERM)
    worker.wait(10)
    assert time.monotonic() - sent < 10


@pytest.mark.parametrize("dead_rank", [None, (1, 1)])
def test_a_backlog_larger_than_the_lateness_closes_complete_steps_complete(
    chdb_dir, tmp_path, dead_rank
):
    """Logs read in small chunks, a lateness far below the time to read them: a step is
    complete when its ranks' logs hold it, however long reading the backlog takes; a rank
    that never wrote still leaves its steps incomplete."""
    spec = GOOD_SPEC.model_copy(update={"steps": 40})
    job = generate_job(spec)
    trace = job.trace
    if dead_rank is not None:
        trace = trace.select(~((trace.dp_rank == dead_rank[0]) & (trace.stage == dead_rank[1])))
    write_logs_with_timers(trace, good_info(), tmp_path / "logs", time.time_ns() - 10**12)
    # One rank's log starts with 64 KiB of garbage: reading it lags the others by many
    # chunks, as a rank with more ops per step (or a longer log) does in a real backlog.
    lagging = list_rank_dirs(tmp_path / "logs")[0] / "00000000000000000000-0000.lglog"
    lagging.write_bytes(b"\xff" * 65536)
    sink = ClickHouseSink(f"chdb://{chdb_dir}?database=backlog_{dead_rank is None}")
    sink.ensure_schema()
    runner = EmbeddedRunner(sink, ProcessorSettings(lateness_s=0.001))
    report = runner.run_logs(tmp_path / "logs", read_chunk_bytes=2048)
    assert report.jobs[GOOD_JOB, 0].steps == spec.steps
    _, rows = sink.query("SELECT step, complete FROM steps FINAL ORDER BY step")
    assert rows == [(step, dead_rank is None) for step in range(spec.steps)]
