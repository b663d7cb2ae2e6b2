"""The demo job's output in a chDB store, for tests that run dashboard and alert queries:
the demo's generated job (dp 8 x pp 4 x tp 4, a slow worker, GC pauses, a heavier last
stage) recorded through the timers into per-rank logs and analysed by the embedded
pipeline, as `lagscope demo` does."""

from __future__ import annotations

import time
from pathlib import Path

DEMO_JOB = "demo-llm"


def fill_demo_store(
    dsn: str,
    log_dir: Path,
    *,
    steps: int = 40,
    missing_worker_at_last_step: tuple[int, int] | None = None,
    garbage_record: bool = False,
):
    """A `ClickHouseSink` on `dsn` holding the demo job of `steps` steps, ending now.

    `missing_worker_at_last_step` (dp, pp) never reports the last step (one incomplete
    step); `garbage_record` appends bytes that are no log record (one dead letter).
    """
    from lagscope.cli.demo import (
        demo_job_info,
        demo_spec,
        write_logs_with_timers,
    )
    from lagscope.simulator.generate import generate_job
    from lagscope.store.sink import ClickHouseSink
    from lagscope.stream_app.embedded import EmbeddedRunner
    from lagscope.stream_app.processor import ProcessorSettings

    job = generate_job(demo_spec(steps, seed=7))
    info = demo_job_info(job, DEMO_JOB)
    trace = job.trace
    if missing_worker_at_last_step is not None:
        dp, pp = missing_worker_at_last_step
        last = int(trace.step.max())
        trace = trace.select(~((trace.step == last) & (trace.dp_rank == dp) & (trace.stage == pp)))
    total_s = float(job.truth.t_injected.sum())
    write_logs_with_timers(trace, info, log_dir, time.time_ns() - int(total_s * 1e9))
    if garbage_record:
        with sorted(log_dir.glob("rank-*/*"))[0].open("ab") as log:
            log.write(b"this is not a log record\n")
    sink = ClickHouseSink(dsn)
    sink.ensure_schema()
    report = EmbeddedRunner(sink, ProcessorSettings(lateness_s=600.0)).run_logs(log_dir)
    assert not garbage_record or report.dead_letters >= 1
    return sink
