"""The training-side timer: record ops of one rank into its local log.

    from lagscope.timer import OpTimer

    timer = OpTimer(job_id="llama-70b", rank=rank, dp_rank=dp, pp_rank=pp,
                    log_dir="/local/lagscope")
    timer.step(iteration)
    with timer.op("forward-compute", microbatch=m):
        output = model(batch)
    timer.close()

This module needs only numpy and pydantic (the plain `pip install lagscope`). See
`lagscope.producers.timer.OpTimer` for every option: CUDA events, the GC probe, the lighter
mode for ranks the analysis does not need.
"""

from lagscope.producers.timer import OpTimer, UnknownOpTypeError
from lagscope.simulator.optypes import KNOWN_OPTYPES

__all__ = ["KNOWN_OPTYPES", "OpTimer", "UnknownOpTypeError"]
