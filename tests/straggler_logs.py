"""One small job with one straggler, written through the real timer API into per-rank
logs: a DP 4 x PP 2 job whose worker (dp 2, pp 1) is 1.8x slower in its computes for
steps 25-44 of 70. An episode under the default settings, in seconds of analysis."""

from __future__ import annotations

import time
from pathlib import Path


def write_straggler_logs(log_dir: Path, job_id: str, gpus_per_node: int | None = None) -> None:
    """The job's logs under `log_dir`, ending now (`gpus_per_node`: place its ranks on
    nodes of that many GPUs)."""
    from lagscope.cli.demo import write_logs_with_timers
    from lagscope.producers.events import JobInfo
    from lagscope.simulator.generate import JobSpec, SlowWorker, generate_job

    spec = JobSpec(
        name=job_id, dp=4, pp=2, microbatches=4, steps=70, seed=11,
        stragglers=(SlowWorker(dp=2, stage=1, factor=1.8, start_step=25, end_step=45),),
    )  # fmt: skip
    job = generate_job(spec)
    info = JobInfo.from_meta(job.meta, job_id=job_id)
    total_s = float(job.truth.t_injected.sum())
    start_ns = time.time_ns() - int(total_s * 1e9)
    write_logs_with_timers(job.trace, info, log_dir, start_ns, gpus_per_node=gpus_per_node)
