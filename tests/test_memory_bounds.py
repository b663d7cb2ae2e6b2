"""Bounded memory: the roll-up window is capped by bytes, and the embedded host reads a
backlog no faster than it can close steps (issue 16 item 3)."""

from __future__ import annotations

import time

import pytest

from lagscope.producers.events import JobInfo
from lagscope.producers.replay import iter_step_batches
from lagscope.simulator.generate import JobSpec, SlowWorker, generate_job
from lagscope.stream_app.processor import ProcessorSettings, StepProcessor
from tests.conftest import assert_same_result, straight_and_resumed

SPEC = JobSpec(
    dp=4,
    pp=2,
    microbatches=4,
    steps=24,
    stragglers=(SlowWorker(dp=1, stage=0, factor=1.6, start_step=8, end_step=18),),
    seed=5,
)


@pytest.fixture(scope="module")
def job_steps():
    job = generate_job(SPEC)
    info = JobInfo.from_meta(job.meta, job_id="capped")
    return info, list(iter_step_batches(job.trace, job.meta, job_id="capped", start_wall_ns=0))


def feed(processor, steps):
    outputs = []
    for _, _, batches in steps:
        for batch in batches:
            outputs.extend(processor.on_batch(batch))
    return outputs


def step_bytes(info, steps) -> int:
    probe = StepProcessor()
    probe.on_job(info)
    feed(probe, steps[:1])
    return probe.jobs[info.job_id, info.attempt].compute.step_bytes


def test_a_capped_rollup_is_the_analysis_of_the_steps_it_covers(job_steps):
    info, steps = job_steps
    budget = 5 * step_bytes(info, steps) + 1
    capped = StepProcessor(ProcessorSettings(rollup_budget_bytes=budget))
    capped.on_job(info)
    outputs = feed(capped, steps)
    assert all(o.complete and o.result is not None for o in outputs)
    job = capped.jobs[info.job_id, info.attempt]
    assert job.retained_capacity == 5
    assert len(job.retained) == 5
    assert sum(job.compute.step_bytes for _ in job.retained) <= budget
    rollup = capped.rollup(info.job_id)
    assert rollup.steps.tolist() == [s for _, s, _ in steps[-5:]]
    # The same five steps alone, with no cap: the same roll-up, bit for bit.
    alone = StepProcessor()
    alone.on_job(info)
    feed(alone, steps[-5:])
    assert_same_result(rollup, alone.rollup(info.job_id), "capped roll-up")
    # Below the cap nothing changes: the default budget keeps all 24 steps.
    whole = StepProcessor()
    whole.on_job(info)
    feed(whole, steps)
    assert len(whole.jobs[info.job_id, info.attempt].retained) == len(steps)


def test_a_capped_job_resumes_exactly(job_steps):
    info, steps = job_steps
    settings = ProcessorSettings(rollup_budget_bytes=4 * step_bytes(info, steps))
    want, got, straight, resumed = straight_and_resumed(info, steps, settings, cut=13)
    assert resumed.jobs[info.job_id, info.attempt].retained_capacity == 4
    for a, b in zip(got, want, strict=True):
        assert_same_result(a.result, b.result, f"step {a.step}")
    assert_same_result(resumed.rollup(info.job_id), straight.rollup(info.job_id), "roll-up")


def test_a_step_larger_than_the_budget_keeps_one(job_steps):
    info, steps = job_steps
    tiny = StepProcessor(ProcessorSettings(rollup_budget_bytes=1))
    tiny.on_job(info)
    feed(tiny, steps[:6])
    assert tiny.rollup(info.job_id).steps.tolist() == [steps[5][1]]


@pytest.mark.slow  # a backlog read through the embedded host (~7 s)
def test_a_backlog_is_read_no_faster_than_its_steps_close(chdb_dir, tmp_path):
    from lagscope.cli.demo import write_logs_with_timers
    from lagscope.store.sink import ClickHouseSink
    from lagscope.stream_app.embedded import EmbeddedRunner

    job = generate_job(JobSpec(dp=2, pp=2, microbatches=2, steps=120, seed=2))
    info = JobInfo.from_meta(job.meta, job_id="burst")
    write_logs_with_timers(job.trace, info, tmp_path / "logs", time.time_ns() - 3_600_000_000_000)
    sink = ClickHouseSink(f"chdb://{chdb_dir}?database=backpressure")
    sink.ensure_schema()
    runner = EmbeddedRunner(sink, ProcessorSettings(lateness_s=600.0))
    open_windows = []
    report = runner.run_logs(
        tmp_path / "logs",
        progress=lambda _: open_windows.append(len(runner.processor.windows)),
        read_chunk_bytes=1024,
        read_ahead_steps=3,
    )
    # Every step closed complete, and never more than a few windows were open at once,
    # although the whole 120-step backlog was readable from the start.
    assert report.jobs["burst", 0].steps == 120
    assert report.jobs["burst", 0].incomplete_steps == []
    assert len(open_windows) > 10
    assert max(open_windows) <= 12


def test_a_log_read_behind_the_others_makes_no_step_late(chdb_dir, tmp_path):
    """A middle pipeline stage's records are larger (its sends and receives both ways), so
    a round's bytes take it through fewer steps than the other logs: it is behind, not
    late. Steps of 1.3 s, a lateness of 3 s, and logs laid from now on (a replay just
    written lies ahead of the clock): every step closes complete. Counted on the newest
    record read, steps 3 rounds ahead of the middle stage's log timed out without it."""
    from lagscope.producers.log import KIND_BATCH, KIND_JOB, LogWriter
    from lagscope.store.sink import ClickHouseSink
    from lagscope.stream_app.embedded import EmbeddedRunner

    job = generate_job(JobSpec(dp=2, pp=3, microbatches=4, steps=30, seed=1))
    info = JobInfo.from_meta(job.meta, job_id="behind")
    writers = {}
    for _, _, batches in iter_step_batches(
        job.trace, job.meta, job_id="behind", start_wall_ns=time.time_ns()
    ):
        for batch in batches:
            if batch.rank not in writers:
                writers[batch.rank] = LogWriter(tmp_path / "logs", batch.rank, background=False)
                writers[batch.rank].append(KIND_JOB, info.model_dump_json().encode())
            writers[batch.rank].append(KIND_BATCH, batch.encode())
    for writer in writers.values():
        writer.close()
    sink = ClickHouseSink(f"chdb://{chdb_dir}?database=behind")
    sink.ensure_schema()
    runner = EmbeddedRunner(sink, ProcessorSettings(lateness_s=3.0), store_raw_ops=False)
    report = runner.run_logs(tmp_path / "logs", read_chunk_bytes=3_500, read_ahead_steps=4)
    assert report.jobs["behind", 0].steps == 30
    assert report.jobs["behind", 0].incomplete_steps == []
    # None closed without a rank first and again when it came, and the job learned no
    # delay from reading a backlog: its lateness is its pace.
    assert runner.processor.counters["steps_closed_again"] == 0
    arrivals = runner.processor.jobs["behind", 0].arrivals
    assert not arrivals.delays
    assert 0 < max(gap for _, gap in arrivals.gaps) < 10


def test_a_round_reads_every_log_to_its_horizon_whatever_its_records(chdb_dir, tmp_path):
    """A replay writes the end of every rank its trace does not hold (the TP ranks: 504
    of 512 here, 87,808 at 100,000 GPUs) into its first log. Those records open no
    window, and a round reads each log up to the read-ahead's step, whatever its share of
    the round's bytes: a round a record made a 100,000-GPU job's 4 steps take 6 minutes.
    Here a round's 4 KB take 4 of the 8 logs 2 steps on."""
    from lagscope.producers.replay import replay
    from lagscope.store.sink import ClickHouseSink
    from lagscope.stream_app.embedded import EmbeddedRunner

    job = generate_job(JobSpec(dp=4, pp=2, tp=64, microbatches=2, steps=12, seed=4))
    replay(job.trace, job.meta, log_dir=tmp_path / "logs", job_id="ends", start_wall_ns=0)
    sink = ClickHouseSink(f"chdb://{chdb_dir}?database=ends")
    sink.ensure_schema()
    runner = EmbeddedRunner(sink, store_raw_ops=False)
    open_windows = []
    report = runner.run_logs(
        tmp_path / "logs",
        progress=lambda _: open_windows.append(len(runner.processor.windows)),
        read_round_bytes=4096,
        read_ahead_steps=2,
    )
    assert report.jobs["ends", 0].steps == 12
    assert report.jobs["ends", 0].incomplete_steps == []
    assert runner.core.records.has_ended(("ends", 0))
    assert max(open_windows) <= 3
    assert len(open_windows) <= 16


def test_what_a_job_holds_is_counted_in_its_snapshot_and_its_retained_steps_keep_the_budget(
    job_steps,
):
    """Every structure a job keeps between steps is counted (`held_bytes`), in its
    snapshot too; its retained steps, the bulk of it, stay within the roll-up budget
    however many steps came (here 3 steps' worth, 24 steps)."""
    info, steps = job_steps
    budget = 3 * step_bytes(info, steps)
    processor = StepProcessor(ProcessorSettings(rollup_budget_bytes=budget))
    processor.on_job(info)
    feed(processor, steps[:12])
    at_12 = processor.held_bytes(info.job_id)
    feed(processor, steps[12:])
    held = processor.held_bytes(info.job_id)
    assert set(held) == {
        "retained_steps", "running_ideals", "change_points", "episodes_and_diagnosis",
        "arrivals", "held_steps", "open_windows",
    }  # fmt: skip
    # The budget counts the steps' arrays; these steps are tiny (12 ops a worker), and
    # their arrays' headers weigh about as much as their data.
    assert 0.5 * budget < held["retained_steps"] <= 2 * budget
    assert held["retained_steps"] <= 1.2 * at_12["retained_steps"]
    assert processor.state_dict()["jobs"][info.job_id, info.attempt]["held_bytes"] == held
    assert processor.held_bytes("no such job") == {}


def test_a_job_keeps_its_latest_incomplete_steps_and_counts_them_all(monkeypatch):
    """A rank that died early in a day-long job closes every later step incomplete: the
    host keeps the latest `INCOMPLETE_KEPT` of them for its summary, which counts all."""
    from lagscope.cli.job_summary import print_job_summary
    from lagscope.stream_app import host_job
    from lagscope.stream_app.host_core import HostCore, JobRecords

    monkeypatch.setattr(host_job, "INCOMPLETE_KEPT", 2)
    job = generate_job(JobSpec(dp=2, pp=2, microbatches=2, steps=8, seed=2))
    info = JobInfo.from_meta(job.meta, job_id="dies")
    settings = ProcessorSettings()
    core = HostCore(settings, JobRecords(settings.max_world_size))
    core.on_job_record(info.model_dump_json().encode(), "jobs@0", 0.0)
    for _, step, batches in iter_step_batches(job.trace, job.meta, job_id="dies", start_wall_ns=0):
        kept = [b for b in batches if step < 3 or (b.dp_rank, b.pp_rank) != (1, 1)]
        core.on_batches([(b.encode(), "ops@0", 0.0) for b in kept])
    core.flush()
    report = core.job_report("dies")
    assert [step for step, _ in report.incomplete_steps] == [6, 7]
    assert report.totals.incomplete_steps == 5
    lines: list[str] = []
    print_job_summary(report, say=lines.append)
    assert "8 steps closed, 5 incomplete" in lines[0]
