"""The worker's windows follow event time (the records' own timestamps) while a partition
is behind, and wall-clock time once it has caught up: a worker held back mid-backlog
closes complete steps complete, and a rank that went silent still times out. A partition
handed over reads on from its snapshot, in offset order: a run fetched before its
assignment is dropped, records past the analysis are read again after a seek back, and
only offsets Kafka deleted are counted and named. The worker core runs
in-process here on a real chDB store with real encoded batches."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from lagscope.producers.events import JobInfo
from lagscope.producers.replay import iter_step_batches
from lagscope.simulator.generate import JobSpec, generate_job
from lagscope.store.sink import ClickHouseSink
from lagscope.stream_app.processor import ProcessorSettings
from lagscope.stream_app.worker_config import WorkerConfig
from lagscope.stream_app.worker_core import OpsMessage, WorkerCore

SPEC = JobSpec(dp=2, pp=2, microbatches=2, steps=3, name="held", seed=3)
LATENESS_S = 0.5


def _setup(chdb_dsn: str):
    job = generate_job(SPEC)
    info = JobInfo.from_meta(job.meta, job_id="held")
    sink = ClickHouseSink(chdb_dsn)
    sink.ensure_schema()
    config = WorkerConfig(processor=ProcessorSettings(lateness_s=LATENESS_S))
    core = WorkerCore(config, sink, publish=lambda key, value: None)
    core.on_job_record(info.model_dump_json().encode(), time.time(), "jobs@0")
    start_ns = time.time_ns() - 3600 * 10**9
    steps = [
        batches
        for _, _, batches in iter_step_batches(
            job.trace, job.meta, job_id="held", start_wall_ns=start_ns
        )
    ]
    return core, sink, steps


def _messages(batches, first_offset: int, timestamp_s: float) -> list[OpsMessage]:
    return [
        OpsMessage(0, first_offset + i, b"held", batch.encode(), timestamp_s)
        for i, batch in enumerate(batches)
    ]


def _stored(sink: ClickHouseSink) -> list[tuple[int, bool]]:
    _, rows = sink.query("SELECT step, complete FROM steps FINAL ORDER BY step")
    return [(int(step), bool(complete)) for step, complete in rows]


@pytest.mark.slow  # a backlog through the worker core (~5 s)
def test_a_held_back_worker_closes_a_complete_step_complete(chdb_dsn):
    core, sink, steps = _setup(chdb_dsn)
    produced_at = time.time() - 3600  # a backlog: produced an hour ago
    first = steps[0]
    # three of the four ranks' batches of step 0, then the worker is held back (a store
    # outage, a slow pass) for longer than the lateness, with more records waiting
    core.on_messages(_messages(first[:-1], 0, produced_at))
    core.set_behind(0, True)
    time.sleep(2 * LATENESS_S)
    core.tick()
    assert core.open_windows() == 1  # event time has not moved: not late
    # the last rank's batch, produced 0.1 s after the others
    core.on_messages(_messages(first[-1:], len(first) - 1, produced_at + 0.1))
    core.tick()
    core.write(core.partitions[0])
    assert _stored(sink) == [(0, True)]
    sink.close()


@pytest.mark.slow  # waits out the lateness timeout (~6 s)
def test_a_silent_rank_still_times_out_once_caught_up(chdb_dsn):
    core, sink, steps = _setup(chdb_dsn)
    first = steps[0]
    core.on_messages(_messages(first[:-1], 0, time.time()))
    core.set_behind(0, False)  # nothing more in Kafka: the rank really is silent
    time.sleep(2 * LATENESS_S)
    core.tick()
    core.write(core.partitions[0])
    assert core.open_windows() == 0
    assert _stored(sink) == [(0, False)]
    sink.close()


@pytest.mark.slow  # a worker core on chDB, two snapshots (~6 s)
def test_snapshots_are_spaced_by_their_cost(chdb_dsn):
    """A large job's snapshot (84 MB at 100,000 GPUs) must not take the worker's time:
    the next one waits for checkpoint_interval_s or cost / checkpoint_max_share."""
    core, sink, steps = _setup(chdb_dsn)
    now = [1_000.0]
    core.clock = lambda: now[0]
    core.on_messages(_messages(steps[0], 0, time.time()))
    core.checkpoint(0)
    part = core.partitions[0]
    assert part.snapshot_cost_s > 0 and core.counters["snapshots"] == 1
    core.on_messages(_messages(steps[1], len(steps[0]), time.time()))
    interval = core.config.worker.checkpoint_interval_s
    now[0] += interval
    assert core.checkpoint_due(0), "a cheap snapshot comes every checkpoint_interval_s"
    part.snapshot_cost_s = 2.0  # as a 100,000-GPU job's would
    assert not core.checkpoint_due(0)
    now[0] += 2.0 / core.config.worker.checkpoint_max_share - interval
    assert core.checkpoint_due(0)
    sink.close()


@pytest.mark.slow  # two worker cores on chDB (~5 s)
def test_a_successor_reads_on_past_its_snapshot_and_the_first_owner_lets_go(chdb_dsn):
    """The hand-over of a partition: its successor restores the newest snapshot and reads
    on from Kafka's committed offset (never past the snapshot), skipping what the
    snapshot holds; the first owner, its partition dropped, checkpoints nothing more."""
    core, sink, steps = _setup(chdb_dsn)
    core.on_messages(_messages(steps[0], 0, time.time()))
    offset = core.checkpoint(0)
    assert offset == len(steps[0])
    core.drop_partition(0)  # revoked
    assert core.checkpoint_if_due(0) is None

    successor = WorkerCore(core.config, sink, publish=lambda key, value: None)
    part = successor.partition(0)
    assert part.next_offset == offset
    assert successor.take_seeks() == {}  # the newest snapshot: no seek
    # Records Kafka delivers again from an older committed offset are skipped, the rest
    # taken: step 0 is stored once, step 1 after it.
    successor.on_messages(_messages(steps[0], 0, time.time()))
    successor.on_messages(_messages(steps[1], offset, time.time()))
    assert successor.counters["replayed_skipped"] == len(steps[0])
    successor.write(successor.partitions[0])
    assert _stored(sink) == [(0, True), (1, True)]
    sink.close()


@pytest.mark.slow  # a worker core on chDB (~5 s)
def test_records_past_the_analysis_are_read_again_and_only_those_kafka_deleted_are_lost(
    chdb_dsn, caplog
):
    """A partition's offsets are contiguous: records handed over past the analysis' next
    offset are held and the host is asked to move the consumer back, once, however many
    stale ones still come; where Kafka deleted the records in between (retention), the
    gap is a count and one line naming the offsets, and the records around it are
    analysed as ever. Before, the first record past a gap was taken and the ones before
    it counted as deleted, whether Kafka still held them or not."""
    core, sink, steps = _setup(chdb_dsn)
    core.on_messages(_messages(steps[0], 0, time.time()))
    first_lost = len(steps[0])
    after_gap = first_lost + len(steps[1])  # step 1's records are deleted by retention
    core.on_messages(_messages(steps[2], after_gap, time.time()))
    assert core.counters["held_for_seek"] == len(steps[2])
    assert core.counters["records_never_read"] == 0
    assert core.take_seeks() == {0: first_lost}
    # Runs fetched before the seek still come: held again, and no second seek.
    core.on_messages(_messages(steps[2], after_gap, time.time()))
    assert core.take_seeks() == {}
    # The host finds Kafka's first record at `after_gap`, and seeks there.
    core.records_gone(0, after_gap)
    assert core.counters["records_never_read"] == len(steps[1])
    assert f"[0]: records at offsets {first_lost}..{after_gap - 1} were never read" in (caplog.text)
    core.on_messages(_messages(steps[2], after_gap, time.time()))
    core.finish()
    assert [step for step, _ in _stored(sink)] == [0, 2]
    sink.close()


@pytest.mark.slow  # a worker core on chDB (~5 s)
def test_a_seek_whose_record_does_not_come_is_asked_for_again(chdb_dsn, monkeypatch):
    """A seek that failed (or went to a record Kafka deleted right after the host looked)
    brings nothing: after `REWIND_RETRY_S` the core asks for it again, and the worker
    does not count itself idle meanwhile."""
    from lagscope.stream_app import worker_core

    core, sink, steps = _setup(chdb_dsn)
    core.on_messages(_messages(steps[1], len(steps[0]), time.time()))
    assert core.take_seeks() == {0: 0}
    assert core.busy()
    assert core.take_seeks() == {}
    monkeypatch.setattr(worker_core, "REWIND_RETRY_S", 0.0)
    assert core.take_seeks() == {0: 0}
    core.on_messages(_messages(steps[0] + steps[1], 0, time.time()))
    monkeypatch.setattr(worker_core, "REWIND_RETRY_S", -1.0)
    assert core.take_seeks() == {}  # the record came: nothing more to ask
    core.finish()
    assert [step for step, _ in _stored(sink)] == [0, 1]
    sink.close()


@pytest.mark.slow  # a worker core on chDB (~5 s)
def test_an_offset_kafka_never_delivers_is_passed_after_a_few_seeks(chdb_dsn, monkeypatch,
                                                                    caplog):  # fmt: skip
    """An offset Kafka holds but never hands over (a transaction marker, where a
    transactional producer such as a mirroring one wrote the topic) would send the
    worker back for it for good: after `REWIND_TRIES` seeks that bring only records past
    it, the analysis goes on from the first of them, and the gap is counted and named."""
    from lagscope.stream_app import worker_core

    core, sink, steps = _setup(chdb_dsn)
    core.on_messages(_messages(steps[0], 0, time.time()))
    marker = len(steps[0])
    after = _messages(steps[1] + steps[2], marker + 1, time.time())
    monkeypatch.setattr(worker_core, "REWIND_RETRY_S", -1.0)  # every seek stalls at once
    core.on_messages(after)
    for _ in range(worker_core.REWIND_TRIES):
        assert core.take_seeks() == {0: marker}
        core.on_messages(after)  # what each seek back brings: the records past the marker
    assert core.counters["records_never_read"] == 0
    assert core.take_seeks() == {0: marker + 1}
    assert core.counters["records_never_read"] == 1
    assert f"records at offsets {marker}..{marker} were not delivered by Kafka" in caplog.text
    core.on_messages(after)
    core.finish()
    assert [step for step, _ in _stored(sink)] == [0, 1, 2]
    sink.close()


@pytest.mark.slow  # two worker cores on chDB (~5 s)
def test_records_past_an_older_snapshot_wait_for_the_hosts_seek(chdb_dsn):
    """A partition restored from an older snapshot than Kafka's committed offset (the
    newest did not decode) is read again from that snapshot: records fetched before the
    host moved the consumer back are held, not a gap, and nothing is lost."""
    from lagscope.store.schema import WORKER_STATE_TABLE

    core, sink, steps = _setup(chdb_dsn)
    core.on_messages(_messages(steps[0], 0, time.time()))
    snapshot_at = core.checkpoint(0)
    sink.client.insert(
        WORKER_STATE_TABLE,
        [[core.group, core.topic, 0, 10**6, 0, b"not a snapshot"]],
        column_names=["group_id", "topic", "partition", "next_offset", "written_at", "state"],
    )
    successor = WorkerCore(core.config, sink, publish=lambda key, value: None)
    assert successor.partition(0).next_offset == snapshot_at
    # Fetched from the committed offset, before the seek: held back.
    step_2_at = snapshot_at + len(steps[1])
    successor.on_messages(_messages(steps[2], step_2_at, time.time()))
    assert successor.counters["held_for_seek"] == len(steps[2])
    assert successor.counters["records_never_read"] == 0
    assert successor.take_seeks() == {0: snapshot_at}
    successor.on_messages(_messages(steps[1], snapshot_at, time.time()))
    successor.on_messages(_messages(steps[2], step_2_at, time.time()))
    successor.finish()
    assert [step for step, _ in _stored(sink)] == [0, 1, 2]
    sink.close()


def _run(partition: int, generation: int, first_offset: int) -> Any:
    """A run message as RunConsumer hands it over: faust's own message type."""
    from aiokafka.structs import ConsumerRecord
    from faust.transport.drivers.aiokafka import ConsumerMessage
    from faust.types import TP

    records = tuple(
        ConsumerRecord("ops", partition, offset, 0, 0, b"k", b"v", None, 1, 1, [])
        for offset in range(first_offset, first_offset + 3)
    )
    tp = TP("ops", partition)
    return SimpleNamespace(message=ConsumerMessage(
        "ops", partition, records[-1].offset, 0.0, 0, None, None, records, None, 0, 3, tp,
        generation_id=generation,
    ))  # fmt: skip


def test_a_pass_keeps_only_runs_fetched_since_their_partitions_assignment(chdb_dsn, tmp_path):
    """A partition revoked and assigned back to the same worker starts again from its
    snapshot: a run fetched before (faust's take buffer holds one) must not be its first
    records, or the records before it, fetched again, are skipped as processed (the
    first steps of a job were lost so in a scale-out run). Runs of partitions the worker
    does not own are dropped too."""
    from lagscope.stream_app.worker import FaustWorker

    config = WorkerConfig(store={"dsn": chdb_dsn}, worker={"data_dir": str(tmp_path / "state")})
    worker = FaustWorker(config)
    worker._owned = {0: 2, 1: 1}  # partition 0 assigned back in generation 2
    stale, fresh, older_owner, not_owned = (
        _run(0, 1, 40), _run(0, 2, 0), _run(1, 1, 7), _run(2, 2, 0)
    )  # fmt: skip
    kept = worker._current_runs([stale, fresh, older_owner, not_owned])
    assert kept == [fresh, older_owner]
    worker.sink.close()


@pytest.mark.slow  # two worker cores on chDB (~10 s)
def test_a_successor_tells_the_story_on_its_predecessors_last_diagnosis(chdb_dsn):
    """A partition handed over between two diagnoses: its successor makes the last one
    again from its steps (the retained window no longer holds the oldest: the snapshot
    stored them), so the episode that closes after the hand-over is told in a diagnosis
    of its step, as an uninterrupted worker tells it. The stored rows are the same."""
    from lagscope.simulator.generate import SlowWorker

    slow = SlowWorker(dp=1, stage=0, factor=1.8, start_step=25, end_step=45)
    job = generate_job(JobSpec(dp=2, pp=2, microbatches=4, steps=60, name="story", seed=5,
                               stragglers=(slow,)))  # fmt: skip
    info = JobInfo.from_meta(job.meta, job_id="story")
    start_ns = time.time_ns() - 3600 * 10**9
    stream = iter_step_batches(job.trace, job.meta, job_id="story", start_wall_ns=start_ns)
    steps = [batches for _, _, batches in stream]
    # A window of 8 steps: at the hand-over (step 42) the last diagnosis' (39: steps
    # 32-39) oldest steps have left it.
    config = WorkerConfig(processor=ProcessorSettings(lateness_s=1_000.0, rollup_window_steps=8))

    def feed(core: WorkerCore, first: int, last: int) -> None:
        offset = sum(len(batches) for batches in steps[:first])
        for batches in steps[first:last]:
            core.on_messages(_messages(batches, offset, time.time()))
            offset += len(batches)

    def diagnoses(sink: ClickHouseSink) -> list[tuple]:
        _, rows = sink.query("SELECT step, cause, version, evidence, advice FROM diagnoses "
                             "FINAL ORDER BY step, version")  # fmt: skip
        return [tuple(row) for row in rows]

    stores = {}
    for name, cut in (("straight", None), ("handed", 42)):
        sink = ClickHouseSink(f"{chdb_dsn}_{name}")
        sink.ensure_schema()
        core = WorkerCore(config, sink, publish=lambda key, value: None)
        core.on_job_record(info.model_dump_json().encode(), time.time(), "jobs@0")
        if cut is not None:
            feed(core, 0, cut)
            core.checkpoint(0)
            core.drop_partition(0)
            core = WorkerCore(config, sink, publish=lambda key, value: None)
            core.on_job_record(info.model_dump_json().encode(), time.time(), "jobs@0")
            feed(core, cut, len(steps))
        else:
            feed(core, 0, len(steps))
        core.finish()
        stores[name] = diagnoses(sink)
        sink.close()
    told = [step for step, *_ in stores["straight"]]
    assert 47 in told and 39 in told, told  # the episode closed at 47, the roll-up of 39
    assert stores["handed"] == stores["straight"]
