"""A worker writes the steps of all its partitions in one write: a write costs mostly per
insert, and a worker owns a partition per job it follows (one job per partition). The
worker core runs in-process on a real chDB store with real encoded batches."""

from __future__ import annotations

import time

from lagscope.producers.events import JobInfo
from lagscope.producers.replay import iter_step_batches
from lagscope.simulator.generate import JobSpec, generate_job
from lagscope.store.errors import StoreError
from lagscope.store.sink import ClickHouseSink, RetryPolicy
from lagscope.stream_app.processor import ProcessorSettings
from lagscope.stream_app.worker_config import WorkerConfig, WorkerSettings
from lagscope.stream_app.worker_core import OpsMessage, WorkerCore

JOBS = ("job-a", "job-b", "job-c")
INTERVAL_S = 0.5


def _worker_with_jobs(chdb_dsn: str, now: list[float], **sink_options) -> WorkerCore:
    """A worker core with one small job on each of three partitions, every batch of the
    jobs delivered (their steps closed, not yet written)."""
    sink = ClickHouseSink(chdb_dsn, **sink_options)
    sink.ensure_schema()
    config = WorkerConfig(
        processor=ProcessorSettings(lateness_s=1_000.0),
        worker=WorkerSettings(write_interval_s=INTERVAL_S, write_every_steps=1_000),
    )
    core = WorkerCore(config, sink, publish=lambda key, value: None, clock=lambda: now[0])
    for partition, job_id in enumerate(JOBS):
        job = generate_job(JobSpec(dp=2, pp=2, microbatches=2, steps=4, seed=partition))
        info = JobInfo.from_meta(job.meta, job_id=job_id)
        core.on_job_record(info.model_dump_json().encode(), time.time(), "jobs@0")
        steps = iter_step_batches(job.trace, job.meta, job_id=job_id, start_wall_ns=time.time_ns())
        payloads = [batch.encode() for _, _, batches in steps for batch in batches]
        core.on_messages(
            [
                OpsMessage(partition, offset, job_id.encode(), payload, time.time())
                for offset, payload in enumerate(payloads)
            ]
        )
    # Caught up only now: a partition that has read all there is writes at once.
    for partition in range(len(JOBS)):
        core.set_behind(partition, False)
    return core


def _count_row_inserts(monkeypatch) -> list[tuple[str, int]]:
    """(table, rows) of each row insert (the checkpoints' inserts) from now on."""
    inserted: list[tuple[str, int]] = []
    insert_rows = ClickHouseSink.insert_rows

    def counted(self, table, columns, rows, token):
        inserted.append((table, len(rows)))
        insert_rows(self, table, columns, rows, token)

    monkeypatch.setattr(ClickHouseSink, "insert_rows", counted)
    return inserted


def test_partitions_are_written_together_and_a_failed_write_keeps_them_all(chdb_dsn, monkeypatch):
    now = [0.0]
    core = _worker_with_jobs(chdb_dsn, now, retry=RetryPolicy(attempts=1))
    sink = core.sink
    assert len(core.partitions) == 3
    inserts: list[str] = []
    insert = ClickHouseSink._insert

    def store_down(self, table, columns, token):
        inserts.append(table)
        raise StoreError("injected: the store is down")

    def counted(self, table, columns, token):
        inserts.append(table)
        insert(self, table, columns, token)

    # Due on the interval (the partitions' closed steps are no news): one write of all.
    now[0] = INTERVAL_S
    monkeypatch.setattr(ClickHouseSink, "_insert", store_down)
    core.tick()
    assert core.store_failing and inserts, "the injected failure did not happen"
    assert all(p.core.pending for p in core.partitions.values()), "a failed write lost steps"
    monkeypatch.setattr(ClickHouseSink, "_insert", counted)
    inserts.clear()
    assert core.retry_writes()
    assert inserts.count("steps") == 1, inserts
    assert not any(p.core.pending for p in core.partitions.values())
    _, rows = sink.query("SELECT job_id, count() FROM steps GROUP BY job_id ORDER BY job_id")
    assert rows == [(job_id, 4) for job_id in JOBS]
    _, rows = sink.query("SELECT count(), uniqExact(job_id, step, kind, name) FROM attribution")
    assert rows[0][0] == rows[0][1] > 0
    assert core.counters["steps_written"] == 12
    sink.close()


def test_partitions_due_are_checkpointed_in_one_insert_and_each_restores(chdb_dsn, monkeypatch):
    """Every partition is snapshotted each `checkpoint_interval_s`: the ones due go in one
    insert of their states (and one of their retained steps), and each restores alone."""
    now = [0.0]
    core = _worker_with_jobs(chdb_dsn, now)
    sink = core.sink
    inserted = _count_row_inserts(monkeypatch)
    now[0] = core.config.worker.checkpoint_interval_s
    committed = core.checkpoint_all_due(list(core.partitions))
    offsets = {number: part.next_offset for number, part in core.partitions.items()}
    assert committed == offsets and min(offsets.values()) > 0
    assert inserted == [("worker_retained", 12), ("worker_state", 3)], inserted
    inserted.clear()
    assert core.checkpoint_all_due(list(core.partitions)) == {}, "none is due again yet"
    assert inserted == []
    monkeypatch.undo()
    successor = WorkerCore(core.config, sink, publish=lambda key, value: None)
    for number, offset in offsets.items():
        part = successor.partition(number)
        assert part.next_offset == offset
        job = next(iter(part.core.processor.jobs.values()))
        assert len(job.retained) == 4, "the retained steps come back with the snapshot"
    # Partitions out of step (one woke up late) fall into step: the one half-way to due
    # is checkpointed with the one that is due.
    interval = core.config.worker.checkpoint_interval_s
    first, second, third = core.partitions.values()
    for part in (first, second):
        part.next_offset += 1  # as if each had taken a record since
    second.last_snapshot = now[0] + interval / 2
    third.last_snapshot = now[0] + interval * 0.9
    third.next_offset += 1
    now[0] += interval
    assert set(core.checkpoint_all_due(list(core.partitions))) == {first.number, second.number}
    sink.close()


def test_partitions_revoked_together_are_handed_over_in_one_insert(chdb_dsn, tmp_path,
                                                                    monkeypatch):  # fmt: skip
    """A worker leaving the group (or a rebalance taking several jobs away) snapshots the
    revoked partitions together, then forgets them; the others stay."""
    import asyncio

    from lagscope.stream_app.worker import FaustWorker

    now = [0.0]
    core = _worker_with_jobs(chdb_dsn, now)
    config = WorkerConfig(store={"dsn": chdb_dsn}, worker={"data_dir": str(tmp_path / "state")})
    worker = FaustWorker(config)
    worker.core = core
    inserted = _count_row_inserts(monkeypatch)
    offsets = {number: part.next_offset for number, part in core.partitions.items()}
    asyncio.run(worker._release({0, 2, 5}))  # 5: never taken a record here
    assert [table for table, _ in inserted] == ["worker_retained", "worker_state"]
    assert inserted[1] == ("worker_state", 2)
    assert list(core.partitions) == [1]
    monkeypatch.undo()
    successor = WorkerCore(core.config, core.sink, publish=lambda key, value: None)
    assert {n: successor.partition(n).next_offset for n in (0, 2)} == {0: offsets[0], 2: offsets[2]}
    worker.sink.close()
    core.sink.close()


def test_a_snapshot_writes_its_retained_steps_in_parts_of_bounded_bytes(chdb_dsn, monkeypatch):
    """A large job's window of new retained steps (~70 MB encoded at 12,288 GPUs) is
    encoded and inserted a part at a time, so a snapshot holds one part and the store's
    copies of it, not all of them; a successor restores every step. Here a part is as
    small as a step: one insert each."""
    from lagscope.stream_app import worker_core

    now = [0.0]
    core = _worker_with_jobs(chdb_dsn, now)
    monkeypatch.setattr(worker_core, "RETAINED_WRITE_BYTES", 1)
    inserted = _count_row_inserts(monkeypatch)
    now[0] = core.config.worker.checkpoint_interval_s
    offsets = core.checkpoint_all_due(list(core.partitions))
    assert inserted == [("worker_retained", 1)] * 12 + [("worker_state", 3)], inserted
    monkeypatch.undo()
    successor = WorkerCore(core.config, core.sink, publish=lambda key, value: None)
    for number, offset in offsets.items():
        part = successor.partition(number)
        assert part.next_offset == offset
        assert len(next(iter(part.core.processor.jobs.values())).retained) == 4
    core.sink.close()
