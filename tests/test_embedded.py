"""The embedded host end to end: timers -> per-rank logs -> step processor -> chDB."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from lagscope.cli.demo import demo_spec, write_logs_with_timers
from lagscope.producers.events import JobInfo
from lagscope.simulator.evidence import Worker
from lagscope.simulator.generate import JobSpec, SlowWorker, generate_job
from lagscope.store.sink import ClickHouseSink
from lagscope.stream_app.embedded import EmbeddedRunner
from lagscope.stream_app.processor import ProcessorSettings


@pytest.fixture(scope="module")
def demo_run(chdb_dir, tmp_path_factory):
    """A 60-step demo job through the whole embedded pipeline, once for this module."""
    logs = tmp_path_factory.mktemp("logs")
    spec = demo_spec(steps=60, seed=3)
    job = generate_job(spec)
    info = JobInfo.from_meta(
        dataclasses.replace(job.meta, model_flops_per_step=1e17, gpu_peak_flops=989e12),
        job_id="emb",
        attempt=0,
    )
    # Recent wall-clock times: the raw `ops` table keeps a few days only (TTL).
    n_ops = write_logs_with_timers(job.trace, info, logs, time.time_ns() - 3_600_000_000_000)
    # A garbage log file in one rank's directory: reported, the rest flows on.
    (sorted(logs.iterdir())[0] / "99999999999999999999-0001.lglog").write_bytes(b"\x00garbage" * 50)
    sink = ClickHouseSink(f"chdb://{chdb_dir}?database=embedded_demo")
    sink.ensure_schema()
    report = EmbeddedRunner(sink, ProcessorSettings(lateness_s=5.0)).run_logs(logs)
    return job, spec, n_ops, report, sink


def scalar(sink, sql):
    return sink.query(sql)[1][0][0]


def test_every_op_and_step_lands_in_the_store(demo_run):
    job, spec, n_ops, report, sink = demo_run
    assert report.ops == n_ops == job.trace.n_rows
    assert scalar(sink, "SELECT count() FROM ops") == n_ops
    assert scalar(sink, "SELECT count() FROM steps FINAL WHERE complete") == spec.steps
    assert scalar(sink, "SELECT count() FROM steps") == spec.steps  # no duplicates
    assert report.dead_letters >= 1
    assert scalar(sink, "SELECT count() FROM dead_letters") == report.dead_letters


def test_step_numbers_match_the_batch_analysis(demo_run):
    from lagscope.simulator.prepare import prepare
    from lagscope.simulator.whatif import analyze

    job, _, _, report, sink = demo_run
    batch = analyze(prepare(job.trace, job.meta))
    _, rows = sink.query("SELECT step, simulated_s FROM steps FINAL ORDER BY step")
    assert [r[0] for r in rows] == [int(s) for s in batch.steps]
    for (_, simulated), expected in zip(rows, batch.t_nodelay, strict=True):
        assert simulated == pytest.approx(expected, rel=1e-4)
    rollup = report.jobs["emb", 0].rollup
    assert rollup.slowdown == pytest.approx(batch.slowdown, rel=1e-3)


def test_change_points_and_episode_diagnosis(demo_run):
    _, spec, _, report, sink = demo_run
    slow = next(s for s in spec.stragglers if isinstance(s, SlowWorker))
    onset, recovery = 1000 + slow.start_step, 1000 + slow.end_step
    _, rows = sink.query(
        "SELECT kind, step FROM changepoints FINAL WHERE series = 'step_time' ORDER BY step"
    )
    kinds = [r[0] for r in rows]
    assert kinds == ["onset", "recovery"]
    assert abs(rows[0][1] - onset) <= 3 and abs(rows[1][1] - recovery) <= 3
    (episode,) = report.jobs["emb", 0].episodes
    assert episode.diagnosis.cause == "slow_workers"
    assert episode.diagnosis.evidence.named_workers == (Worker(slow.dp, slow.stage),)
    assert abs(episode.onset - onset) <= 3 and abs(episode.recovery - recovery) <= 3
    # Only the slow worker is named, not the heavy last stage's workers.
    assert episode.diagnosis.summary.startswith(f"worker(s) (dp {slow.dp}, pp {slow.stage}) ")
    # The store's latest diagnosis is the run's verdict (the job's end supersedes the live
    # ones).
    cause, advice = sink.query(
        "SELECT cause, advice FROM diagnoses FINAL ORDER BY step DESC, version DESC LIMIT 1"
    )[1][0]
    assert cause == report.jobs["emb", 0].diagnosis.cause
    assert "escalation" in json.loads(advice)


def test_mfu_and_waste_are_stored(demo_run):
    _, _, _, report, sink = demo_run
    mfu, mfu_ideal, wasted = sink.query(
        "SELECT avg(mfu_actual), avg(mfu_ideal), sum(gpu_seconds_wasted) FROM steps FINAL"
    )[1][0]
    assert 0 < mfu < mfu_ideal
    assert wasted == pytest.approx(report.jobs["emb", 0].gpu_seconds_wasted, rel=1e-6)


def test_a_silent_rank_makes_incomplete_steps(chdb_dir, tmp_path):
    spec = JobSpec(dp=2, pp=2, microbatches=4, steps=12, name="silent", seed=2)
    job = generate_job(spec)
    info = JobInfo.from_meta(job.meta, job_id="silent")
    keep = ~((job.trace.dp_rank == 1) & (job.trace.stage == 1) & (job.trace.step >= 6))
    write_logs_with_timers(job.trace.select(keep), info, tmp_path, time.time_ns())
    sink = ClickHouseSink(f"chdb://{chdb_dir}?database=embedded_silent")
    sink.ensure_schema()
    report = EmbeddedRunner(sink, ProcessorSettings(lateness_s=5.0)).run_logs(tmp_path)
    assert [s for s, _ in report.jobs["silent", 0].incomplete_steps] == list(range(6, 12))
    _, rows = sink.query(
        "SELECT step, missing_ranks, missing_reason FROM steps FINAL WHERE NOT complete "
        "ORDER BY step"
    )
    missing_rank = (1 * spec.dp + 1) * spec.tp
    assert [row[:2] for row in rows] == [(s, [missing_rank]) for s in range(6, 12)]
    # The logs ended without its batches: each row says so.
    reason = "(dp 1, pp 1) sent step 5 last: the input ended without this one"
    assert {row[2] for row in rows} == {reason}


def test_every_step_stores_its_discrepancy_and_an_unanalysed_one_its_reason(chdb_dir, tmp_path):
    spec = JobSpec(dp=2, pp=2, microbatches=4, steps=8, name="reasons", seed=4)
    job = generate_job(spec)
    info = JobInfo.from_meta(job.meta, job_id="reasons")
    trace = job.trace
    forward = trace.optype == trace.optype_names.index("forward-compute")
    # Step 5 loses one forward compute of (dp 1, stage 0): every rank reports, but the step
    # does not fit the job's dependency model.
    lost = forward & (trace.step == 5) & (trace.dp_rank == 1) & (trace.stage == 0)
    lost &= trace.seq_id == 2
    write_logs_with_timers(trace.select(~lost), info, tmp_path, time.time_ns())
    sink = ClickHouseSink(f"chdb://{chdb_dir}?database=embedded_reasons")
    sink.ensure_schema()
    EmbeddedRunner(sink, ProcessorSettings(lateness_s=5.0)).run_logs(tmp_path)
    _, rows = sink.query(
        "SELECT step, complete, analysed, reason, sim_discrepancy, trusted "
        "FROM steps FINAL ORDER BY step"
    )
    assert [r[0] for r in rows] == list(range(8))
    bad = rows[5]
    assert bad[1] is True and bad[2] is False and bad[5] is False
    assert "missing on (step 5, dp 1, stage 0)" in bad[3]
    for step, complete, analysed, reason, discrepancy, trusted in rows[:5] + rows[6:]:
        assert complete and analysed and reason == "", step
        # Generated steps follow their model: the replay misses them by launch gaps only.
        assert 0 <= discrepancy < 0.05 and trusted, (step, discrepancy)


def test_a_rank_whose_log_comes_late_still_makes_complete_steps(chdb_dir, tmp_path):
    """Followed live, one rank's log appears only after the others have written every
    step (its process, or its timer's first write, came late): the steps wait for it and
    are complete, as a worker reading Kafka closes them. Before, the others' log having
    moved past a step closed it without that rank."""
    import threading

    spec = JobSpec(dp=2, pp=2, microbatches=4, steps=8, name="late-rank", seed=4)
    job = generate_job(spec)
    info = JobInfo.from_meta(job.meta, job_id="late-rank")
    logs, aside = tmp_path / "logs", tmp_path / "aside"
    write_logs_with_timers(job.trace, info, logs, time.time_ns())
    late = sorted(logs.iterdir())[-1]
    aside.mkdir()
    late.rename(aside / late.name)
    threading.Timer(1.5, lambda: (aside / late.name).rename(late)).start()
    sink = ClickHouseSink(f"chdb://{chdb_dir}?database=embedded_late_rank")
    sink.ensure_schema()
    runner = EmbeddedRunner(sink, ProcessorSettings(lateness_s=30.0))
    report = runner.run_logs(logs, follow=True, idle_exit_s=3.0)
    assert report.jobs["late-rank", 0].incomplete_steps == []
    _, rows = sink.query("SELECT count(), countIf(complete) FROM steps FINAL")
    assert rows == [(spec.steps, spec.steps)]


def test_raw_ops_of_a_job_beyond_the_size_are_left_out_saying_so(chdb_dir, tmp_path, caplog):
    """`lagscope run` keeps raw ops unless told, up to a size: a 100,000-GPU job's cost
    ~2.5 s a step to write, against ~0.9 s to analyse. A job beyond it is analysed and
    stored as any, without its raw ops, and a line says why and how to keep them."""
    job = generate_job(JobSpec(dp=2, pp=2, microbatches=2, steps=3, seed=1))
    counts = {}
    for limit in (3, 4):
        logs = tmp_path / f"logs-{limit}"
        info = JobInfo.from_meta(job.meta, job_id=f"limit{limit}")
        write_logs_with_timers(job.trace, info, logs, time.time_ns() - 3_600_000_000_000)
        sink = ClickHouseSink(f"chdb://{chdb_dir}?database=raw_limit_{limit}")
        sink.ensure_schema()
        caplog.clear()
        report = EmbeddedRunner(sink, raw_ops_max_workers=limit).run_logs(logs)
        assert report.jobs[info.job_id, 0].steps == 3
        counts[limit] = scalar(sink, "SELECT count() FROM ops")
        if limit == 3:
            assert "job limit3/0: its raw ops are not stored: 4 workers" in caplog.text
            assert "LAGSCOPE_STORE__RAW_OPS=true" in caplog.text
    assert counts == {3: 0, 4: job.trace.n_rows}
