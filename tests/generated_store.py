"""A generated job stored as a worker stores it: its batches, encoded as a streamer sends
them, through a `WorkerCore` into a sink, and the job concluded (for tests and benches that
need a store holding a job of a given shape)."""

from __future__ import annotations

import time

from lagscope.simulator.generate import JobSpec

#: Messages per call, as a worker's pass hands them over.
PASS = 500


def store_generated_job(
    sink,
    spec: JobSpec,
    job_id: str,
    start_s: float,
    *,
    gpus_per_node: int | None = None,
    publish=None,
) -> None:
    """Generate `spec`'s job, its first step at `start_s` (Unix seconds), and store it in
    `sink` (its schema ensured) through a worker's core. With `gpus_per_node`, each
    reporting rank's job record also says which machine it runs on (`rank_identity`), the
    ranks placed on machines in order. `publish(key, value)` gets what the worker would
    publish to lagscope.results."""
    from lagscope.producers.events import JobInfo, RankIdentity
    from lagscope.producers.replay import iter_step_batches
    from lagscope.simulator.generate import generate_job
    from lagscope.stream_app.worker_config import WorkerConfig
    from lagscope.stream_app.worker_core import OpsMessage, WorkerCore

    job = generate_job(spec)
    info = JobInfo.from_meta(job.meta, job_id=job_id)
    start_ns = int(start_s * 1e9)
    steps = iter_step_batches(job.trace, job.meta, job_id=job_id, start_wall_ns=start_ns)
    payloads, reporting = [], {}
    for _, _, batches in steps:
        for batch in batches:
            payloads.append(batch.encode())
            reporting[batch.rank] = (batch.dp_rank, batch.pp_rank)
    del job, steps
    sink.ensure_schema()
    core = WorkerCore(WorkerConfig(), sink, publish=publish or (lambda key, value: None))
    records = [info]
    if gpus_per_node:
        records = [
            info.model_copy(update={"rank_identity": RankIdentity(
                rank=rank, dp_rank=dp, pp_rank=pp, local_rank=rank % gpus_per_node,
                gpu=rank % gpus_per_node, host=f"node-{rank // gpus_per_node:05d}",
                node=f"node-{rank // gpus_per_node:05d}",
            )})
            for rank, (dp, pp) in sorted(reporting.items())
        ]  # fmt: skip
    for record in records:
        core.on_job_record(record.model_dump_json().encode(), time.time(), "jobs@0")
    key = job_id.encode()
    for first in range(0, len(payloads), PASS):
        part = payloads[first : first + PASS]
        core.on_messages(
            [OpsMessage(0, first + i, key, payload, time.time()) for i, payload in enumerate(part)]
        )
    core.finish()
