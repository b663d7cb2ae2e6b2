"""One worker following many small jobs live: what its writes and checkpoints cost.

A worker owns a partition per job (one job is one partition). Followed live, it writes
what closed every `write_interval_s` (0.5 s) and snapshots its partitions every
`checkpoint_interval_s` (5 s); each insert is a round trip to the store, so their cost
grows with the jobs unless the jobs share their inserts. Here a worker core (in a
process of its own) follows 1, 10 and 30 jobs of dp 4 x pp 4, one step of each closing
per round, against the shared store of the multi-process tests (tests/chdb_http_server.py,
the real engine behind ClickHouse's HTTP protocol): per round, the time of the write of
every job's step and of the checkpoint of every partition (median of 12 rounds, three
runs each, interleaved). A real ClickHouse server answers faster; the count of round
trips is what these figures compare.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
JOB_COUNTS = (1, 10, 30)
ROUNDS = 12
RUNS = 3


def run() -> list[dict]:
    from tests.worker_util import start_store_server

    with tempfile.TemporaryDirectory(prefix="many-jobs-") as tmp:
        server = start_store_server(Path(tmp) / "store")
        try:
            runs: dict[int, list[dict]] = {n: [] for n in JOB_COUNTS}
            for index in range(RUNS):
                for n_jobs in JOB_COUNTS:
                    done = subprocess.run(
                        [sys.executable, "-m", "tests.bench.many_jobs_bench",
                         server.dsn(f"many_{n_jobs}_{index}"), str(n_jobs)],
                        cwd=REPO, capture_output=True, text=True, check=False, timeout=600,
                    )  # fmt: skip
                    if done.returncode != 0:
                        raise RuntimeError(f"many-jobs bench failed:\n{done.stderr[-4000:]}")
                    runs[n_jobs].append(json.loads(done.stdout.strip().splitlines()[-1]))
        finally:
            server.stop()
    rows = []
    for n_jobs, measured in runs.items():
        for key, what, target in (
            ("write_ms", "one write of a step of each", "well under the 500 ms between writes"),
            ("checkpoint_ms", "one checkpoint of every partition", "well under the 5 s between"),
        ):
            values = [m[key] for m in measured]
            rows.append(
                {
                    "benchmark": f"a worker following {n_jobs} job(s) live: {what}",
                    "value": statistics.median(values),
                    "spread": [min(values), max(values)],
                    "unit": "ms",
                    "target": target,
                    "runs": len(values),
                }
            )
    return rows


def follow(dsn: str, n_jobs: int) -> dict:
    """A worker core following `n_jobs` jobs, a partition each: per round one step of each
    closes, the core writes them and then checkpoints every partition."""
    from lagscope.producers.events import JobInfo
    from lagscope.producers.replay import iter_step_batches
    from lagscope.simulator.generate import JobSpec, generate_job
    from lagscope.store.sink import ClickHouseSink
    from lagscope.stream_app.processor import ProcessorSettings
    from lagscope.stream_app.worker_config import WorkerConfig
    from lagscope.stream_app.worker_core import OpsMessage, WorkerCore

    sink = ClickHouseSink(dsn)
    sink.ensure_schema()
    now = [0.0]
    config = WorkerConfig(processor=ProcessorSettings(lateness_s=1_000.0))
    core = WorkerCore(config, sink, publish=lambda key, value: None, clock=lambda: now[0])
    streams = []
    for index in range(n_jobs):
        job = generate_job(JobSpec(dp=4, pp=4, microbatches=4, steps=ROUNDS + 1, seed=index))
        info = JobInfo.from_meta(job.meta, job_id=f"job-{index}")
        core.on_job_record(info.model_dump_json().encode(), time.time(), "jobs@0")
        steps = iter_step_batches(job.trace, job.meta, job_id=info.job_id,
                                  start_wall_ns=time.time_ns())  # fmt: skip
        streams.append([[batch.encode() for batch in batches] for _, _, batches in steps])
    offsets = [0] * n_jobs
    writes, checkpoints = [], []
    for round_ in range(ROUNDS + 1):
        for partition, steps in enumerate(streams):
            payloads = steps[round_]
            core.on_messages(
                [OpsMessage(partition, offsets[partition] + i, f"job-{partition}".encode(),
                            payload, time.time()) for i, payload in enumerate(payloads)]
            )  # fmt: skip
            offsets[partition] += len(payloads)
            core.set_behind(partition, False)
        for part in core.partitions.values():
            part.core.settle()
        now[0] += config.worker.write_interval_s
        started = time.perf_counter()
        core.write(*core.partitions.values())  # what `write_due` does once it is due
        writes.append(time.perf_counter() - started)
        now[0] += config.worker.checkpoint_interval_s
        started = time.perf_counter()
        core.checkpoint_all_due(list(core.partitions))
        checkpoints.append(time.perf_counter() - started)
    stored = core.counters["steps_written"]
    if stored != n_jobs * (ROUNDS + 1):
        raise RuntimeError(f"{stored} of {n_jobs * (ROUNDS + 1)} steps stored")
    sink.close()
    # The first round creates the jobs' rows and reads the tables' types: left out.
    return {
        "write_ms": 1000 * statistics.median(writes[1:]),
        "checkpoint_ms": 1000 * statistics.median(checkpoints[1:]),
    }


if __name__ == "__main__":
    print(json.dumps(follow(sys.argv[1], int(sys.argv[2]))), flush=True)
