"""Op type vocabulary shared by every stage of lagscope.

The strings are exactly those of the reference traces (and of docs/whatif.md §1.3). Which family an
op type belongs to decides how it is idealized (mean of durations for compute, median of
transfer times for communication) and how it is reported (send/recv merged per direction).
"""

from __future__ import annotations

FORWARD_COMPUTE = "forward-compute"
BACKWARD_COMPUTE = "backward-compute"
OPTIMIZER = "optimizer"
GC = "gc"
FORWARD_SEND = "forward-send"
FORWARD_RECV = "forward-recv"
BACKWARD_SEND = "backward-send"
BACKWARD_RECV = "backward-recv"
PARAMS_ALL_GATHER = "params-all-gather"
GRADS_REDUCE_SCATTER = "grads-reduce-scatter"
SEPARATE_GRADS_ALL_REDUCE = "separate-grads-all-reduce"
EMBEDDING_GRADS_ALL_REDUCE = "embedding-grads-all-reduce"
LAYERNORM_GRADS_ALL_REDUCE = "layernorm-grads-all-reduce"
OPTIMIZER_CLIP_MAIN_GRAD = "optimizer-clip-main-grad"
#: The wait for the step's next batch from the data loader, before its first forward: a
#: worker's own work, so a rank starved by its input pipeline is an input straggler.
INPUT_WAIT = "input-wait"
#: A Python garbage-collection pause recorded by the timer's GC probe. Pauses happen
#: *inside* other ops (on the training thread), any number per step and worker, so they
#: are evidence about those ops, never ops of the dependency model themselves. `gc` is
#: the reference traces' zero-length end-of-step anchor, which stays an op.
GC_PAUSE = "gc-pause"

#: Synthetic label of launch attribution: the first op of a pipeline, whose launch delay
#: is measured from the step start (data loading, CPU work before the step).
FIRST_OP = "first-op"

COMPUTE_OPTYPES: tuple[str, ...] = (FORWARD_COMPUTE, BACKWARD_COMPUTE, OPTIMIZER, GC, INPUT_WAIT)
P2P_OPTYPES: tuple[str, ...] = (FORWARD_SEND, FORWARD_RECV, BACKWARD_SEND, BACKWARD_RECV)
DP_OPTYPES: tuple[str, ...] = (
    PARAMS_ALL_GATHER,
    GRADS_REDUCE_SCATTER,
    SEPARATE_GRADS_ALL_REDUCE,
)
OTHER_COMM_OPTYPES: tuple[str, ...] = (
    EMBEDDING_GRADS_ALL_REDUCE,
    LAYERNORM_GRADS_ALL_REDUCE,
    OPTIMIZER_CLIP_MAIN_GRAD,
)
COMM_OPTYPES: tuple[str, ...] = P2P_OPTYPES + DP_OPTYPES + OTHER_COMM_OPTYPES
#: Measurements that overlap the ops they happen in (not nodes of the dependency model).
SIDE_OPTYPES: tuple[str, ...] = (GC_PAUSE,)
KNOWN_OPTYPES: tuple[str, ...] = COMPUTE_OPTYPES + COMM_OPTYPES + SIDE_OPTYPES

FORWARD_PP_COMM = "forward-pp-comm"
BACKWARD_PP_COMM = "backward-pp-comm"


def report_label(optype: str) -> str:
    """The name an op type is reported under: p2p send and recv merge per direction."""
    if optype in (FORWARD_SEND, FORWARD_RECV):
        return FORWARD_PP_COMM
    if optype in (BACKWARD_SEND, BACKWARD_RECV):
        return BACKWARD_PP_COMM
    return optype


def is_compute(optype: str) -> bool:
    """Compute ops (and any op type that is not communication) are idealized by the mean."""
    return optype not in COMM_OPTYPES
