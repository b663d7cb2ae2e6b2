"""The part of each op's launch delay its worker's host is to blame for.

An op's launch delay is the time from the moment it could start (its predecessors in the
dependency model had ended) to its start. Most of it, when large, is the host late to
launch the op: slow Python, a busy or throttled CPU. But an op launched by a hook from
inside another op of its worker, while that op still ran, was not waiting for its host:
DDP launches each gradient bucket's all-reduce from a backward hook, part-way through the
backward, and the dependency model can only make the bucket follow the last compute that
had ended before it (the forward). Its delay then holds the backward up to the hook: on a
GPU job with dozens of buckets, a multiple of the backward's time a step. Counted as host
time, a healthy DDP rank's host read 25 ms a step in one run of a job and 2 ms in another
(the model is learnt from the first steps), and a rank slow in backward would read as a
slow host.

`host_delays` keeps the delay of a gradient-sync op (a DDP bucket's all-reduce, an
overlapped reduce-scatter: the ops backward hooks launch) up to the start of a backward of
its worker that still ran when the op started: before it the worker ran nothing and the op
could have started, which is the host's; the rest was the backward. Every other op keeps
its whole delay: the schedule launches it between computes, so a compute still running at
its start was launched before it, and a host late to launch it is late all the same.
"""

from __future__ import annotations

import numpy as np

from lagscope.simulator import optypes as ot
from lagscope.simulator.prepare import PreparedTrace

#: What backward hooks launch, part-way through a backward: gradient synchronisation.
_LAUNCHED_BY_BACKWARD_HOOKS = frozenset({ot.SEPARATE_GRADS_ALL_REDUCE, ot.GRADS_REDUCE_SCATTER})


def host_delays(prepared: PreparedTrace) -> np.ndarray:
    """[node, step, dp] seconds of each op's launch delay spent by its worker's host (never
    negative): the whole delay, or for a gradient-sync op launched while a backward of its
    worker ran, the delay up to that backward's start.

    >>> from lagscope.simulator.generate import JobSpec, generate_job
    >>> from lagscope.simulator.prepare import prepare
    >>> job = generate_job(JobSpec(dp=2, pp=2, microbatches=4, steps=3, seed=1))
    >>> prepared = prepare(job.trace, job.meta)
    >>> host = host_delays(prepared)
    >>> bool((host >= 0).all() and (host <= prepared.launch_delay.clip(0) + 1e-9).all())
    True
    """
    delay = np.clip(prepared.launch_delay, 0.0, None)
    optypes = prepared.node_optype
    stage = prepared.model.node_stage()
    synced = np.array([t in _LAUNCHED_BY_BACKWARD_HOOKS for t in optypes])
    backward = np.array([t == ot.BACKWARD_COMPUTE for t in optypes])
    candidates = synced & (delay > 0).any(axis=(1, 2))
    if not candidates.any():
        return delay
    out = delay.copy()
    start = prepared.start
    end = start + prepared.duration
    for at_stage in np.unique(stage[candidates]):
        nodes = np.flatnonzero(candidates & (stage == at_stage))
        launched = start[nodes]  # [node, step, dp]
        ready = launched - delay[nodes]
        busy_since = launched.copy()
        for node in np.flatnonzero(backward & (stage == at_stage)):
            running = (start[node] < launched) & (end[node] > launched)
            np.minimum(busy_since, np.where(running, start[node], launched), out=busy_since)
        out[nodes] = np.clip(busy_since - ready, 0.0, None)
    return out
