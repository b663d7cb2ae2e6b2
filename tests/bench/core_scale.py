"""One generated job through a worker's core, without Kafka: the analysis' own scaling.

`python -m tests.bench.core_scale DP STEPS PROCESSES [START_S]` generates a job of dp DP
x pp 8 x tp 8 (16 micro-batches), its first step at START_S (Unix seconds; an hour ago by
default), encodes its batches as a streamer sends them, and feeds them to a `WorkerCore`
writing to an embedded chDB store, as a worker's passes do (500 messages a call), then
concludes the job and snapshots, as a worker does at its idle exit. Prints one JSON line:
the seconds from the first message to the end, the process' and its analysis processes'
peak memory and CPU seconds, and the digest of what it stored
(`tests/bench/stored_rows.py`: runs of the same job and START_S store the same rows
however many processes analysed it). The Kafka rows of stream_bench time a real worker
with its broker on the same two cores; these isolate the analysis.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

from lagscope.producers.events import JobInfo
from lagscope.producers.replay import iter_step_batches
from lagscope.simulator.generate import JobSpec, generate_job
from lagscope.store.sink import ClickHouseSink
from lagscope.stream_app.analysis_process import (
    analysis_cpu_seconds,
    analysis_peak_rss_mb,
    peak_rss_mb,
)
from lagscope.stream_app.worker_config import WorkerConfig
from lagscope.stream_app.worker_core import OpsMessage, WorkerCore
from tests.bench.stored_rows import stored_digest

#: Messages per call, as a worker's pass hands them over.
PASS = 500


def main(dp: int, steps: int, processes: int, start_s: int | None = None) -> dict:
    job = generate_job(JobSpec(dp=dp, pp=8, tp=8, microbatches=16, steps=steps, seed=11))
    info = JobInfo.from_meta(job.meta, job_id="core-scale")
    start_ns = (int(time.time()) - 3600 if start_s is None else start_s) * 10**9
    payloads = [
        batch.encode()
        for _, _, batches in iter_step_batches(
            job.trace, job.meta, job_id="core-scale", start_wall_ns=start_ns
        )
        for batch in batches
    ]
    del job
    with tempfile.TemporaryDirectory(prefix="core-scale-") as tmp:
        sink = ClickHouseSink(f"chdb://{tmp}/store")
        sink.ensure_schema()
        config = WorkerConfig()
        config.processor.analysis_processes = processes
        core = WorkerCore(config, sink, publish=lambda key, value: None)
        core.on_job_record(info.model_dump_json().encode(), time.time(), "jobs@0")
        began = time.perf_counter()
        cpu_began = time.process_time()
        sent_at = time.time() - 3600
        for first in range(0, len(payloads), PASS):
            core.on_messages(
                [
                    OpsMessage(0, first + i, b"core-scale", payload, sent_at)
                    for i, payload in enumerate(payloads[first : first + PASS])
                ]
            )
        core.finish()
        seconds = time.perf_counter() - began
        worker_cpu_s = time.process_time() - cpu_began
        stored = core.counters["steps_written"]
        digest = stored_digest(sink)
    if stored != steps:
        raise RuntimeError(f"{stored} of {steps} steps stored")
    return {
        "seconds": seconds,
        "steps": steps,
        "peak_rss_mb": peak_rss_mb("self") + analysis_peak_rss_mb(),
        # The worker's process (its main thread and the embedded store's threads), and
        # its analysis process: where the work ran, beside how long it took.
        "worker_cpu_s": worker_cpu_s,
        "analysis_cpu_s": analysis_cpu_seconds(),
        "stored_digest": digest,
    }


if __name__ == "__main__":
    print(json.dumps(main(*map(int, sys.argv[1:5]))), flush=True)
