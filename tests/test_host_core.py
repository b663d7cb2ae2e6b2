"""The host core's idea of a job that stopped: no batch of it arrived and no step of it
closed for the idle time, however long its steps take to fill."""

from __future__ import annotations

import time

import pytest

from lagscope.producers.events import RankIdentity
from lagscope.simulator.generate import JobSpec, SlowWorker, generate_job
from lagscope.store.errors import StoreError
from lagscope.store.sink import ClickHouseSink, RetryPolicy
from lagscope.stream_app.host_core import WRITE_MAX_SHARE, HostCore, JobRecords, LatenessClock
from lagscope.stream_app.processor import ProcessorSettings
from tests.test_episodes import NOISY
from tests.test_processor import stream_of

IDLE_S = 3.0


def test_a_job_whose_batches_still_arrive_is_not_concluded_until_they_stop() -> None:
    job = generate_job(JobSpec(dp=2, pp=2, microbatches=2, steps=2, seed=0))
    info, steps = stream_of(job)
    now = [0.0]
    settings = ProcessorSettings(lateness_s=1_000.0)
    clock = LatenessClock(wall=lambda: now[0])
    core = HostCore(settings, JobRecords(settings.max_world_size), clock=clock)
    core.on_job_record(info.model_dump_json().encode(), "jobs@0", 0.0)

    def arrive(batch) -> list:
        core.on_batches([(batch.encode(), "ops@0", now[0])])
        return core.conclude_idle(IDLE_S)

    (_, _, first), (_, _, second) = steps
    for batch in first:
        assert arrive(batch) == []
    assert len(core.pending) == 1, "the first step closes with its last batch"
    # The second step fills slowly: a batch every 2 s, 6 s and more after the first closed.
    for batch in second[:-1]:
        now[0] += 2.0
        assert arrive(batch) == [], f"concluded at {now[0]} s while its batches still arrive"
    now[0] += IDLE_S
    assert core.conclude_idle(IDLE_S) == [(info.job_id, info.attempt)]
    assert len(core.conclusions) == 1


def _caught_up_core(info, wall) -> HostCore:
    """A host core that knows the job and has read all there is (its clock on `wall`)."""
    clock = LatenessClock(wall=wall)
    clock.behind = False
    settings = ProcessorSettings(lateness_s=1_000.0)
    core = HostCore(settings, JobRecords(settings.max_world_size), clock=clock)
    core.on_job_record(info.model_dump_json().encode(), "jobs@0", 0.0)
    return core


def test_a_job_every_rank_of_which_ended_is_concluded_at_once(chdb_dsn: str) -> None:
    """Its final answer is in the store when the job ends, not after the idle time: once
    every rank said it ended, the host read all there is, no step of it is open and its
    steps are stored (they come first: a conclusion takes a while)."""
    job = generate_job(JobSpec(dp=2, pp=2, microbatches=2, steps=3, seed=0))
    info, steps = stream_of(job)
    # Caught up: only its ranks' ends and its open step hold it.
    core = _caught_up_core(info, lambda: 0.0)
    clock = core.clock
    for _, _, batches in steps[:-1]:
        core.on_batches([(b.encode(), "ops@0", 0.0) for b in batches])
    # As a rank's monitor closes: after its last op.
    ended_ns = max(int((b.start_ns + b.duration_ns).max()) for b in steps[-1][2])
    for rank in range(info.world_size):
        identity = RankIdentity(rank=rank, dp_rank=rank // 2, pp_rank=rank % 2, host="h")
        ended = info.model_copy(update={"rank_identity": identity, "ended_ns": ended_ns})
        core.on_job_record(ended.model_dump_json().encode(), f"jobs@{rank + 1}", 0.0)
        if rank < info.world_size - 1:
            core.tick()
            assert core.conclusions == [], f"concluded with {rank + 1} ranks ended"
    *_, last = steps
    core.on_batches([(b.encode(), "ops@0", 0.0) for b in last[2][:-1]])
    core.tick()
    assert core.conclusions == [], "concluded while its last step was open"
    clock.behind = True
    core.on_batches([(last[2][-1].encode(), "ops@0", 0.0)])
    core.tick()
    assert core.conclusions == [], "concluded while its host was behind"
    clock.behind = False
    core.tick()
    assert core.conclusions == [], "concluded before its last steps were stored"
    sink = ClickHouseSink(chdb_dsn)
    sink.ensure_schema()
    core.write(sink)
    core.tick()
    assert [c.diagnosis.step for c in core.conclusions] == [last[1]]
    # Concluded at its last step: neither a tick, the idle time nor the input's end (a
    # `lagscope run` that stops reading) concludes it again.
    core.tick()
    core.conclude_idle(0.0)
    core.conclude_all()
    assert len(core.conclusions) == 1


def test_steps_after_every_rank_ended_are_concluded_when_idle_not_each_at_once(
    chdb_dsn: str,
) -> None:
    """A job that opened its monitors again after they all closed (a second phase in the
    same attempt): its ranks' ends are behind its new steps, so they do not conclude it
    at every step; its idle time does."""
    job = generate_job(JobSpec(dp=2, pp=2, microbatches=2, steps=6, seed=0))
    info, steps = stream_of(job)
    now = [0.0]
    core = _caught_up_core(info, lambda: now[0])

    sink = ClickHouseSink(chdb_dsn)
    sink.ensure_schema()

    concluded: list[int] = []  # the step of every conclusion stored

    def tick_and_write() -> None:
        core.tick()
        concluded.extend(c.diagnosis.step for c in core.write(sink).conclusions)

    def arrive(batches: list) -> None:
        now[0] += 1.0
        core.on_batches([(b.encode(), "ops@0", now[0]) for b in batches])
        core.settle()
        tick_and_write()

    for _, _, batches in steps[:3]:
        arrive(batches)
    # The monitors closed before the second phase's first op.
    first_phase_end = min(int(b.start_ns.min()) for b in steps[3][2]) - 1
    for rank in range(info.world_size):
        identity = RankIdentity(rank=rank, dp_rank=rank // 2, pp_rank=rank % 2)
        ended = info.model_copy(update={"rank_identity": identity, "ended_ns": first_phase_end})
        core.on_job_record(ended.model_dump_json().encode(), f"jobs@{rank + 1}", 0.0)
    tick_and_write()
    assert concluded == [2]
    for _, _, batches in steps[3:]:
        arrive(batches)
        tick_and_write()
    assert concluded == [2]
    now[0] += IDLE_S
    assert core.conclude_idle(IDLE_S) == [(info.job_id, info.attempt)]
    tick_and_write()
    assert concluded == [2, steps[-1][1]]


@pytest.mark.parametrize("seed", range(3))
def test_a_pause_leaves_an_open_episode_as_it_stands_and_the_end_refines_it(seed) -> None:
    """The worker is back from step 30 but 1.7x slow again every other step: the live
    rule never closes its episode, the end of the input does (its whole series shows it
    came back). A pause at step 40 (a checkpoint's save) is no end: the job resumes it, so
    the conclusion there leaves the open episode as it stands; closed at the pause and
    open again at the next step, its alert would resolve and fire again."""
    slow = [SlowWorker(dp=1, stage=0, factor=2.0, start_step=15, end_step=30)]
    slow += [SlowWorker(dp=1, stage=0, factor=1.7, start_step=s, end_step=s + 1)
             for s in range(31, 50, 2)]  # fmt: skip
    job = generate_job(
        JobSpec(dp=2, pp=2, microbatches=4, steps=50, cost=NOISY, stragglers=tuple(slow),
                seed=seed)
    )  # fmt: skip
    info, steps = stream_of(job)
    now = [0.0]
    core = _caught_up_core(info, lambda: now[0])
    shown = []  # (step, open) of the episode's every stored state, in write order
    for _, step, batches in steps:
        now[0] += 1.0
        core.on_batches([(b.encode(), "ops@0", now[0]) for b in batches])
        core.settle()
        if step == 40:
            now[0] += IDLE_S
            assert core.conclude_idle(IDLE_S) == [(info.job_id, info.attempt)]
        shown += [(out.step, s.episode.open) for out in core.pending for s in out.episodes]
        shown += [(c.diagnosis.step, s.episode.open) for c in core.conclusions for s in c.episodes]
        assert all("(ongoing)" in c.diagnosis.verdict.summary for c in core.conclusions), step
        core.pending.clear()
        core.conclusions.clear()
    assert shown and all(is_open for _, is_open in shown), shown
    core.conclude_all()
    (final,) = core.conclusions[0].episodes
    assert final.episode.recovery is not None and abs(final.episode.recovery - 30) <= 3


def _core_with_closed_steps(steps: list, info) -> HostCore:
    settings = ProcessorSettings(lateness_s=1_000.0)
    core = HostCore(settings, JobRecords(settings.max_world_size))
    core.on_job_record(info.model_dump_json().encode(), "jobs@0", 0.0)
    for _, _, batches in steps:
        core.on_batches([(b.encode(), "ops@0", 0.0) for b in batches])
    core.settle()
    return core


@pytest.mark.parametrize(
    "redo",
    ["the same host, with more steps", "a restarted host, with more steps",
     "a restarted host, the same steps"],
    ids=["same-host", "restarted", "restarted-same-batch"],
)  # fmt: skip
def test_a_cut_short_write_is_stored_once_later(chdb_dsn, monkeypatch, redo):
    """A write that stored a step's attribution but not its `steps` row (the store failed
    past the retries, or the host was killed) is done again later: in a batch of other
    steps, under another dedup token, the half-stored rows are replaced, not doubled; in
    the same batch, they are not lost to the dedup of a repeated insert."""
    job = generate_job(JobSpec(dp=2, pp=2, microbatches=2, steps=6, seed=0))
    info, steps = stream_of(job)
    sink = ClickHouseSink(chdb_dsn, retry=RetryPolicy(attempts=1))
    sink.ensure_schema()
    insert = ClickHouseSink._insert

    def steps_insert_fails(self, table, columns, token):
        if table == "steps":
            raise StoreError("injected: the store went away before the steps insert")
        insert(self, table, columns, token)

    core = _core_with_closed_steps(steps[:3], info)
    with monkeypatch.context() as patch:
        patch.setattr(ClickHouseSink, "_insert", steps_insert_fails)
        with pytest.raises(StoreError):
            core.write(sink)
    rows = "SELECT count() AS n, uniqExact(step, kind, name) AS unique_rows FROM attribution"
    half = query(sink, rows)
    assert half["n"] == half["unique_rows"] > 0, "the first write stored no attribution"
    redone = steps if "more steps" in redo else steps[:3]
    if redo.startswith("a restarted host"):
        core = _core_with_closed_steps(redone, info)
    else:
        core.on_batches([(b.encode(), "ops@0", 0.0) for _, _, bs in steps[3:] for b in bs])
        core.settle()
    assert len(core.pending) == len(redone)
    core.write(sink)
    stored = query(sink, rows)
    per_step = half["n"] // 3
    assert stored["n"] == stored["unique_rows"] == per_step * len(redone), stored
    assert query(sink, "SELECT count() AS n FROM steps")["n"] == len(redone)
    sink.close()


def query(sink: ClickHouseSink, sql: str) -> dict:
    names, rows = sink.query(sql)
    return dict(zip(names, rows[0], strict=True))


def test_slow_writes_are_spaced_to_their_share_of_the_hosts_time(chdb_dsn):
    """A backlog written every `interval_s` spent a sixth of its time on the store's fixed
    cost per write: a write that took long is followed by the next no sooner than keeps
    writes to `WRITE_MAX_SHARE` of the time; a quick one keeps the interval."""
    job = generate_job(JobSpec(dp=2, pp=2, microbatches=2, steps=4, seed=0))
    info, steps = stream_of(job)
    sink = ClickHouseSink(chdb_dsn)
    sink.ensure_schema()
    core = _core_with_closed_steps(steps[:2], info)
    core.write(sink)
    assert core.write_seconds > 0
    core.on_batches([(b.encode(), "ops@0", 0.0) for _, _, bs in steps[2:] for b in bs])
    core.settle()
    interval, every = 0.5, 100
    core.write_seconds = interval * WRITE_MAX_SHARE / 2  # quick
    assert core.write_due(10.0 + interval, 10.0, every, interval)
    core.write_seconds = 0.2  # slow: 2 s apart
    spaced = core.write_seconds / WRITE_MAX_SHARE
    assert not core.write_due(10.0 + interval, 10.0, every, interval)
    assert not core.write_due(10.0 + 0.99 * spaced, 10.0, every, interval)
    assert core.write_due(10.0 + spaced, 10.0, every, interval)
    assert core.write_due(10.0, 10.0, len(core.pending), interval), "a full batch waits not"
    sink.close()


def test_a_write_of_many_jobs_is_one_lookup_and_one_insert_a_table(chdb_dsn, monkeypatch):
    """A worker following many jobs live writes all their steps every half second: the
    write asks the store which are stored once (the sink's version check runs on that
    answer) and inserts each table once, for all the jobs. It was a lookup, plus a lookup
    and an insert per table for each job: ~30 ms a job against the shared test store.
    A retried write looks again, as its failed try may have stored some steps."""
    from lagscope.producers.events import JobInfo
    from lagscope.producers.replay import iter_step_batches

    settings = ProcessorSettings(lateness_s=1_000.0)
    core = HostCore(settings, JobRecords(settings.max_world_size))
    streams = []
    for seed, job_id in enumerate(("job-a", "job-b", "job-c")):
        job = generate_job(JobSpec(dp=2, pp=2, microbatches=2, steps=4, seed=seed))
        info = JobInfo.from_meta(job.meta, job_id=job_id)
        core.on_job_record(info.model_dump_json().encode(), "jobs@0", 0.0)
        streams.append(
            iter_step_batches(job.trace, job.meta, job_id=job_id, start_wall_ns=17 * 10**17)
        )

    def next_steps(n: int) -> None:
        for stream in streams:
            for _, _, batches in [next(stream) for _ in range(n)]:
                core.on_batches([(b.encode(), "ops@0", 0.0) for b in batches])
        core.settle()

    sink = ClickHouseSink(chdb_dsn, retry=RetryPolicy(attempts=2, first_wait_s=0.0))
    sink.ensure_schema()
    lookups, inserts, failed = [], [], []
    query, insert = ClickHouseSink.query, ClickHouseSink._insert

    def counted_query(self, sql, parameters=None):
        if "FROM steps" in sql:
            lookups.append(sql)
        return query(self, sql, parameters)

    def counted_insert(self, table, columns, token):
        inserts.append(table)
        if table == "steps" and not failed:
            failed.append(token)
            raise StoreError("injected: the first steps insert failed")
        insert(self, table, columns, token)

    monkeypatch.setattr(ClickHouseSink, "query", counted_query)
    monkeypatch.setattr(ClickHouseSink, "_insert", counted_insert)
    next_steps(3)
    core.write(sink)
    assert failed, "the injected failure did not happen"
    assert len(lookups) == 2, "one lookup for the write, one more for its retry"
    next_steps(1)
    lookups.clear()
    inserts.clear()
    core.write(sink)
    assert len(lookups) == 1
    assert sorted(inserts) == sorted(set(inserts)), f"a table inserted twice: {inserts}"
    # Every job ends at once (a worker's idle exit): their conclusions are one batch too.
    core.conclude_all()
    inserts.clear()
    written = core.write(sink)
    assert len(written.conclusions) == 3
    assert inserts == ["diagnoses"], inserts
    monkeypatch.undo()
    _, rows = sink.query("SELECT job_id, count() FROM steps GROUP BY job_id ORDER BY job_id")
    assert rows == [("job-a", 4), ("job-b", 4), ("job-c", 4)]
    _, rows = sink.query("SELECT job_id, max(step) FROM diagnoses GROUP BY job_id ORDER BY job_id")
    assert rows == [("job-a", 3), ("job-b", 3), ("job-c", 3)]
    _, rows = sink.query("SELECT count(), uniqExact(job_id, step, kind, name) FROM attribution")
    assert rows[0][0] == rows[0][1] > 0
    sink.close()


def test_raw_ops_are_stored_once_across_a_failed_write_and_a_restart(chdb_dsn, monkeypatch):
    """Raw ops (the timeline drill-down) are their own batch, after the steps, named by
    their batches' ids. Before, a write that failed after inserting them stored them again
    under the next write's token, and raw ops written without steps were named by a count
    of the host's writes, which a restart resets: the store dropped a restarted host's
    first raw ops as a repeat of the old host's."""
    from lagscope.producers.events import JobInfo
    from lagscope.producers.replay import iter_step_batches

    job = generate_job(JobSpec(dp=2, pp=2, microbatches=2, steps=3, seed=4))
    info = JobInfo.from_meta(job.meta, job_id="raw")
    # Recent ops: the table's TTL deletes old ones.
    steps = [b for _, _, b in iter_step_batches(job.trace, job.meta, job_id="raw",
                                                start_wall_ns=time.time_ns())]  # fmt: skip
    settings = ProcessorSettings(lateness_s=1_000.0)
    sink = ClickHouseSink(chdb_dsn, retry=RetryPolicy(attempts=1))
    sink.ensure_schema()

    def host() -> HostCore:
        core = HostCore(settings, JobRecords(settings.max_world_size), store_raw_ops=True)
        core.on_job_record(info.model_dump_json().encode(), "jobs@0", 0.0)
        return core

    def stored_ops() -> int:
        return sink.query("SELECT count() FROM ops")[1][0][0]

    def deliver(core: HostCore, batches: list) -> None:
        core.on_batches([(b.encode(), "ops@0", 0.0) for b in batches])

    # Raw ops without a closed step (one batch short of it), by a host and then by its
    # restarted successor: as many batches each.
    first = host()
    deliver(first, steps[0][:-1])
    first.write(sink)
    successor = host()
    deliver(successor, steps[1][:-1])
    successor.write(sink)
    expected = sum(b.n_ops for b in steps[0][:-1] + steps[1][:-1])
    assert stored_ops() == expected, "a restarted host's raw ops were dropped as a repeat"
    # A write that fails after the raw ops of step 1's last batch could be stored, and
    # is retried with step 2 in it.
    deliver(successor, steps[1][-1:])
    insert = ClickHouseSink._insert

    def steps_insert_fails(self, table, columns, token):
        if table == "steps":
            raise StoreError("injected: the steps insert failed")
        insert(self, table, columns, token)

    monkeypatch.setattr(ClickHouseSink, "_insert", steps_insert_fails)
    with pytest.raises(StoreError):
        successor.write(sink)
    monkeypatch.undo()
    deliver(successor, steps[2])
    successor.write(sink)
    expected += sum(b.n_ops for b in steps[1][-1:] + steps[2])
    assert stored_ops() == expected, "raw ops stored twice"
    sink.close()


def test_raw_ops_waiting_for_a_write_are_bounded_by_their_bytes(chdb_dsn, monkeypatch):
    """A backlog's raw ops waited for the write of 256 steps: a 12,288-GPU job's took the
    embedded host to 3.6 GB. Their bytes make a write due, and it stores them in parts,
    each op once."""
    from lagscope.producers.events import JobInfo
    from lagscope.producers.replay import iter_step_batches
    from lagscope.stream_app import host_core

    job = generate_job(JobSpec(dp=2, pp=2, microbatches=2, steps=6, seed=4))
    info = JobInfo.from_meta(job.meta, job_id="rawbytes")
    steps = [b for _, _, b in iter_step_batches(job.trace, job.meta, job_id="rawbytes",
                                                start_wall_ns=time.time_ns())]  # fmt: skip
    step_bytes = sum(len(b.encode()) for b in steps[0])
    monkeypatch.setattr(host_core, "RAW_OPS_PENDING_BYTES", 2 * step_bytes, raising=False)
    monkeypatch.setattr(host_core, "RAW_OPS_WRITE_BATCHES", 3, raising=False)
    settings = ProcessorSettings(lateness_s=1_000.0)
    sink = ClickHouseSink(chdb_dsn)
    sink.ensure_schema()
    core = HostCore(settings, JobRecords(settings.max_world_size), store_raw_ops=True)
    core.on_job_record(info.model_dump_json().encode(), "jobs@0", 0.0)
    writes = 0
    for batches in steps:
        core.on_batches([(b.encode(), "ops@0", 0.0) for b in batches])
        # Neither the steps waiting nor the time since the last write make one due.
        if core.write_due(0.0, 0.0, every_steps=1_000, interval_s=1e9):
            core.write(sink)
            writes += 1
    assert writes == 3
    assert sink.query("SELECT count() FROM ops")[1][0][0] == sum(
        b.n_ops for batches in steps for b in batches
    )
    assert sink.query("SELECT count() FROM (SELECT DISTINCT * FROM ops)")[1][0][0] == sum(
        b.n_ops for batches in steps for b in batches
    )
    sink.close()


@pytest.mark.parametrize("cut_at", ["DELETE FROM attribution", "INSERT"])
def test_a_replacement_cut_short_is_replaced_again(chdb_dsn, monkeypatch, cut_at):
    """The write that replaces a cut-short write's rows is itself cut short after it
    deleted some of them (a kill between its deletes, or before its inserts): the next
    write must still store every row once, not drop its inserts as repeats of the first
    write's, whose rows are gone. (Seen in CI: a step's worker_slowdown rows lost.)"""
    job = generate_job(JobSpec(dp=2, pp=2, microbatches=2, steps=3, seed=0))
    info, steps = stream_of(job)
    sink = ClickHouseSink(chdb_dsn, retry=RetryPolicy(attempts=1))
    sink.ensure_schema()
    insert, command = ClickHouseSink._insert, ClickHouseSink._command

    def steps_insert_fails(self, table, columns, token):
        if table == "steps":
            raise StoreError("injected: the store went away before the steps insert")
        insert(self, table, columns, token)

    def cut_after_deleting(self, sql, *args, **kwargs):
        if sql.startswith(cut_at):
            raise StoreError("injected: the host was killed mid-replacement")
        return command(self, sql, *args, **kwargs)

    def insert_after_deleting(self, table, columns, token):
        if table in ("worker_slowdown", "attribution", "steps"):
            raise StoreError("injected: the host was killed before its inserts")
        insert(self, table, columns, token)

    core = _core_with_closed_steps(steps, info)
    with monkeypatch.context() as patch:
        patch.setattr(ClickHouseSink, "_insert", steps_insert_fails)
        with pytest.raises(StoreError):
            core.write(sink)
    per_table = {t: query(sink, f"SELECT count() AS n FROM {t}")["n"]
                 for t in ("worker_slowdown", "attribution")}  # fmt: skip
    assert all(per_table.values())
    core = _core_with_closed_steps(steps, info)  # restarted
    with monkeypatch.context() as patch:
        if cut_at == "INSERT":
            patch.setattr(ClickHouseSink, "_insert", insert_after_deleting)
        else:
            patch.setattr(ClickHouseSink, "_command", cut_after_deleting)
        with pytest.raises(StoreError):
            core.write(sink)
    assert query(sink, "SELECT count() AS n FROM worker_slowdown")["n"] == 0
    core = _core_with_closed_steps(steps, info)  # restarted again
    core.write(sink)
    for table, n in per_table.items():
        assert query(sink, f"SELECT count() AS n FROM {table}")["n"] == n, table
    assert query(sink, "SELECT count() AS n FROM steps")["n"] == len(steps)
    sink.close()


def test_a_job_ends_once_every_rank_said_so_and_each_end_counts_once(chdb_dsn) -> None:
    """Each rank's end writes the job's row again, one more rank ended; a record read again
    (Kafka re-delivers, a worker re-reads the jobs topic) changes nothing; `ended_at` is
    the last rank's end, set only once all of the world ended. A job set aside gets no row
    from its ends either."""
    from lagscope.producers.events import JobInfo, RankIdentity

    def record(job: str, rank: int, world: int, ended_ns: int | None = None) -> bytes:
        info = JobInfo(job_id=job, dp_size=world, pp_size=1, tp_size=1, world_size=world,
                       rank_identity=RankIdentity(rank=rank, dp_rank=rank),
                       ended_ns=ended_ns)  # fmt: skip
        return info.model_dump_json().encode()

    sink = ClickHouseSink(chdb_dsn)
    sink.ensure_schema()
    records = JobRecords(max_world_size=8)
    ends = [1_790_000_000_000_000_000 + rank * 10**9 for rank in range(4)]

    def stored() -> tuple:
        records.write(sink)
        _, rows = sink.query(
            "SELECT ranks_ended, toUnixTimestamp64Milli(ended_at) FROM jobs FINAL "
            "WHERE job_id = 'done'"
        )
        return rows[0]

    for rank in range(4):
        records.take(record("done", rank, 4), "test", 0.0)
    assert stored() == (0, None)
    for rank in (2, 0, 2, 1):
        records.take(record("done", rank, 4, ends[rank]), "test", 1.0)
    assert stored() == (3, None)
    records.take(record("done", 3, 4, ends[3]), "test", 1.0)
    records.take(record("done", 0, 4, ends[0]), "test", 1.0)
    assert stored() == (4, ends[3] // 10**6)
    # Too large for this host: set aside, its ends too.
    records.take(record("huge", 0, 16), "test", 1.0)
    records.take(record("huge", 0, 16, ends[0]), "test", 1.0)
    records.write(sink)
    _, rows = sink.query("SELECT count() FROM jobs WHERE job_id = 'huge'")
    assert rows == [(0,)] and records.dead_letters.by_kind["job_metadata"] == 1


def test_a_large_jobs_rank_records_are_stored_in_one_insert(chdb_dsn, monkeypatch) -> None:
    """Each rank of a job sends its record as it starts and again as it ends: at 100,000
    GPUs one insert each was 200,000 inserts (a replayed 99,840-GPU job held its worker
    for over 10 minutes). What the records make between two writes is one insert, with
    every rank's machine (once: its end record repeats it) and the job's latest row."""
    from lagscope.producers.events import JobInfo, RankIdentity

    world = 4096
    sink = ClickHouseSink(chdb_dsn)
    sink.ensure_schema()
    records = JobRecords(max_world_size=world)
    for ended_ns in (None, 1_790_000_000_000_000_000):
        for rank in range(world):
            who = RankIdentity(rank=rank, dp_rank=rank, host=f"node-{rank // 8}", gpu=rank % 8)
            info = JobInfo(job_id="big", dp_size=world, pp_size=1, world_size=world,
                           rank_identity=who, ended_ns=ended_ns)  # fmt: skip
            records.take(info.model_dump_json().encode(), "test", 0.0)
    writes = []
    write = sink.write
    monkeypatch.setattr(sink, "write", lambda batch: writes.append(batch) or write(batch))
    records.write(sink)
    assert len(writes) == 1
    # A rank's end record names the machine its start did: one row a rank, not two.
    assert writes[0].row_count("rank_identity") == world
    _, rows = sink.query("SELECT ranks_ended, ended_at IS NOT NULL FROM jobs FINAL")
    assert rows == [(world, True)]
    _, rows = sink.query("SELECT count(), uniqExact(host) FROM rank_identity FINAL")
    assert rows == [(world, world // 8)]


def test_a_known_jobs_rank_record_reads_as_its_full_validation_does(monkeypatch) -> None:
    """A rank's record of a job whose record stands is read by its own fields alone (the
    job's were validated with the first): the same record as a full validation's, and a
    record with a wrong own field, or with job fields of its own, is still set aside and
    named as the full validation names it."""
    from lagscope.producers.events import JobInfo, RankIdentity

    job = JobInfo(job_id="j", dp_size=4, pp_size=2, world_size=8, gpu_peak_flops=989e12)

    def record(rank: int, **update) -> bytes:
        who = RankIdentity(rank=rank, dp_rank=rank // 2, pp_rank=rank % 2, host="n0", gpu=rank)
        return job.model_copy(update={"rank_identity": who, **update}).model_dump_json().encode()

    records = JobRecords(max_world_size=8)
    payloads = [record(rank, ended_ns=end) for rank, end in [(1, None), (5, None), (5, 10**18)]]
    expected = [JobInfo.model_validate_json(payload) for payload in payloads]
    validated = []
    validate = JobInfo.model_validate_json

    def counted(payload: bytes) -> JobInfo:
        validated.append(payload)
        return validate(payload)

    monkeypatch.setattr(JobInfo, "model_validate_json", counted)
    assert records.take(record(0), "jobs@0", 0.0) is not None
    taken = [records.take(payload, "jobs@1", 1.0) for payload in payloads]
    assert len(validated) == 1  # the first record only
    assert taken == expected
    assert [t.model_dump_json() for t in taken] == [e.model_dump_json() for e in expected]
    # JSON's 1.0 for an int reads as 1 in both ways.
    as_float = record(3).replace(b'"dp_rank":1', b'"dp_rank":1.0')
    assert records.take(as_float, "jobs@2", 1.0).rank_identity.dp_rank == 1
    assert records.dead_letters.waiting == []

    wrong_end = record(6, ended_ns=-5)
    other_job = record(7, dp_size=2, world_size=4)
    for payload in (wrong_end, other_job, b'{"job_id": "j", "attempt": [0]}', b"[1]"):
        assert records.take(payload, "jobs@3", 2.0) is None
    reasons = [letter.reason for letter in records.dead_letters.waiting]
    assert "ended_ns" in reasons[0] and "greater than or equal to 0" in reasons[0]
    assert "conflicts with the first" in reasons[1] and "dp_size 4 (kept) vs 2" in reasons[1]
    assert all(r.startswith("invalid job metadata") for r in reasons[2:]), reasons
    assert records.ended[("j", 0)] == {5: 10**18}


def test_an_episodes_estimated_loss_is_stored_beside_its_whole_loss(chdb_dsn) -> None:
    """A job retaining one step finds a worker slow from step 0 at its 10th step: the
    store's episode row says how much of its loss (and over how many steps) was estimated,
    as its summary does, so SQL over `lost_s` can tell."""
    from lagscope.simulator.generate import SlowWorker

    slow = SlowWorker(dp=1, stage=0, factor=1.6, start_step=0)
    job = generate_job(JobSpec(dp=2, pp=2, microbatches=4, steps=14, name="standing", seed=5,
                               stragglers=(slow,)))  # fmt: skip
    info, steps = stream_of(job)
    settings = ProcessorSettings(lateness_s=1_000.0, rollup_budget_bytes=1)
    core = HostCore(settings, JobRecords(settings.max_world_size))
    core.on_job_record(info.model_dump_json().encode(), "jobs@0", 0.0)
    for _, _, batches in steps:
        core.on_batches([(b.encode(), "ops@0", 0.0) for b in batches])
    core.settle()
    sink = ClickHouseSink(chdb_dsn)
    sink.ensure_schema()
    core.write(sink)
    row = query(sink, "SELECT lost_s, estimated_lost_s, estimated_steps, summary, last_step "
                      "FROM episodes FINAL")  # fmt: skip
    assert row["last_step"] == 13 and row["estimated_steps"] == 9
    assert 0 < row["estimated_lost_s"] < row["lost_s"]
    assert f"{row['estimated_lost_s']:.2f} s of it estimated for its first 9" in row["summary"]
    sink.close()


def test_a_step_closed_again_replaces_its_stored_rows(chdb_dsn: str) -> None:
    """(dp 1)'s batch of step 2 comes after its step 3: step 2 closed without it, and is
    stored so, saying why. Then the batch comes: the step closes again, whole, and its
    rows (the step, its workers and attributions) replace the stored ones."""
    job = generate_job(JobSpec(dp=2, pp=1, microbatches=2, steps=6, seed=0, name="again"))
    info, steps = stream_of(job)
    now = [0.0]
    settings = ProcessorSettings(lateness_s=1_000.0)
    clock = LatenessClock(wall=lambda: now[0])
    core = HostCore(settings, JobRecords(settings.max_world_size), clock=clock)
    core.on_job_record(info.model_dump_json().encode(), "jobs@0", 0.0)
    sink = ClickHouseSink(chdb_dsn)
    sink.ensure_schema()
    owed = None
    for index, (_, _, batches) in enumerate(steps):
        for batch in batches:
            if index == 2 and batch.dp_rank == 1:
                owed = batch
                continue
            core.on_batches([(batch.encode(), "ops@0", now[0])])
    core.write(sink)

    def stored() -> tuple:
        _, rows = sink.query("SELECT complete, missing_ranks, missing_reason, version FROM "
                             "steps FINAL WHERE step = 2")  # fmt: skip
        _, workers = sink.query("SELECT count(), min(version) FROM worker_slowdown FINAL "
                                "WHERE step = 2")  # fmt: skip
        return rows[0], workers[0]

    assert stored() == ((False, [1], "(dp 1, pp 0) sent step 3 but not this one", 0), (1, 0))
    assert owed is not None
    core.on_batches([(owed.encode(), "ops@0", now[0])])
    core.write(sink)
    assert stored() == ((True, [], "", 1), (2, 1))
    _, rows = sink.query("SELECT count() FROM steps FINAL")
    assert rows[0][0] == len(steps)
    sink.close()
