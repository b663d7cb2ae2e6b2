"""Monitor a Megatron-core training job: one call, no timing lines.

    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import lagscope.megatron

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2,
                                             pipeline_model_parallel_size=4)
    model, optimizer = build_model_and_optimizer()        # your job's own, as usual
    monitor = lagscope.megatron.monitor(job_id="llama-70b", log_dir="/local/lagscope",
                                        optimizer=optimizer)
    forward_backward = get_forward_backward_func()        # after monitor(), never before
    for iteration in range(train_iters):
        optimizer.zero_grad()
        forward_backward(forward_step_func=forward_step, data_iterator=data, model=model,
                         num_microbatches=8, seq_length=4096, micro_batch_size=1)
        optimizer.step()
    monitor.close()                                       # also done at exit

The call order matters:

1. `parallel_state.initialize_model_parallel(...)` (the monitor reads the job's layout
   from its groups; before it, `monitor()` raises and says so);
2. the model and the optimizer;
3. `lagscope.megatron.monitor(...)`, on every rank;
4. `get_forward_backward_func()`: the schedule it returns is the timed one. A schedule
   fetched before `monitor()` runs untimed: the monitor warns at its first call
   (`RuntimeWarning`) and `lagscope run` on such logs fails saying the job recorded
   nothing. Megatron-LM's own training loop fetches it every iteration, so it is timed.

Every micro-batch's forward and backward (with its index and model chunk), every pipeline
transfer (by direction), the gradient sync (per Megatron DDP bucket group), the layernorm
and embedding all-reduces, the gradient-norm all-reduce and the optimizer step are
recorded on each rank into its local log, one batch per step; `lagscope run --log-dir DIR`
(or the streamer) analyses them. The job record (dp, pp, tp, cp and vpp sizes) comes from
`megatron.core.parallel_state`. Steps are numbered from `first_step` (pass the iteration
you resume from). Pass `optimizer` (megatron-core's or a torch optimizer) so a step ends
at its update; without it every training call of the schedule is a step, and nothing more
is needed. `monitor.step()` ends a step by hand (an update the monitor cannot see);
`monitor.step_id` is the step being recorded. Use either this module or `lagscope.torch`
in a job, not both: each records the transfers it sees.

Supports megatron-core 0.19.x only: another version, or a 0.19 release in which a hooked
function changed, is refused with `UnsupportedMegatronVersion` naming what differs.
Importing this module imports neither torch nor megatron-core.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from lagscope.producers.megatron_seams import SUPPORTED_SERIES, UnsupportedMegatronVersion

if TYPE_CHECKING:
    from lagscope.producers.megatron_adapter import MegatronMonitor
    from lagscope.producers.torch_sampling import Schedule

__all__ = ["SUPPORTED_SERIES", "UnsupportedMegatronVersion", "monitor"]


def monitor(
    *,
    job_id: str | None = None,
    log_dir: str | Path | None = None,
    optimizer: Any = None,
    attempt: int | None = None,
    first_step: int = 0,
    schedule: Schedule | None = None,
    mode: Literal["auto", "host", "cuda"] = "auto",
    gc_probe: bool = True,
    model_flops_per_step: float | None = None,
    gpu_peak_flops: float | None = None,
) -> MegatronMonitor:
    """Start recording this rank; call after `initialize_model_parallel` on every rank,
    and fetch the schedule with `get_forward_backward_func()` after this call.

    `job_id`/`log_dir` default to $LAGSCOPE_JOB_ID (else torchrun's run id or
    SLURM_JOB_ID) and $LAGSCOPE_LOG_DIR; `attempt` to torchrun's restart count.
    `schedule`: which steps to record, `lagscope.torch.schedule(wait=9, active=1)` for one
    in ten (default every step). `mode`: "auto" times with CUDA events when a GPU is
    present, host clocks otherwise. `gc_probe`: record Python GC pauses as ops.
    `model_flops_per_step` (all GPUs together) and `gpu_peak_flops` (one GPU) enable MFU
    figures in the analysis.
    """
    from lagscope.producers.megatron_adapter import MegatronMonitor
    from lagscope.producers.torch_sampling import EVERY_STEP

    return MegatronMonitor(
        job_id=job_id,
        log_dir=log_dir,
        optimizer=optimizer,
        attempt=attempt,
        first_step=first_step,
        schedule=schedule or EVERY_STEP,
        mode=mode,
        gc_probe=gc_probe,
        model_flops_per_step=model_flops_per_step,
        gpu_peak_flops=gpu_peak_flops,
    )
