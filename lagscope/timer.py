"""The training-side timer: record ops of one rank into its local log.

    import time

    from lagscope.timer import JobInfo, OpTimer

    # The job's layout, written once into the log: what `lagscope run` analyses against.
    job = JobInfo(job_id="my-job", dp_size=1, pp_size=1, world_size=1)
    timer = OpTimer(job_id="my-job", rank=0, dp_rank=0, pp_rank=0, log_dir="lagscope-logs",
                    job_info=job)
    for iteration in range(20):
        timer.step(iteration)                    # before the step's first op
        for m in range(4):
            with timer.op("forward-compute", microbatch=m):
                time.sleep(0.002)                # output = model(batch)
            with timer.op("backward-compute", microbatch=m):
                time.sleep(0.004)                # loss.backward()
    timer.close()

Then `lagscope run --log-dir lagscope-logs` analyses it. This module needs only numpy and
pydantic (the plain `pip install lagscope`). See `lagscope.producers.timer.OpTimer` for
every option: CUDA events, the GC probe, the lighter mode for ranks the analysis does not
need; every rank of a job passes the same `JobInfo` (dp, pp, tp, cp sizes).
"""

from lagscope.producers.events import JobInfo
from lagscope.producers.timer import OpTimer, UnknownOpTypeError
from lagscope.simulator.optypes import KNOWN_OPTYPES

__all__ = ["KNOWN_OPTYPES", "JobInfo", "OpTimer", "UnknownOpTypeError"]
