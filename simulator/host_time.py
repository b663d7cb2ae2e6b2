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

from lagscope.simulator.prepare import PreparedTrace


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
    out = None
    for synced, backwards in prepared.model.hook_launched:
        nodes = synced[(delay[synced] > 0).any(axis=(1, 2))]
        if not nodes.size:
            continue
        launched = prepared.start[nodes][:, None]  # [node, 1, step, dp]
        began = prepared.start[backwards][None]  # [1, backward, step, dp]
        running = (began < launched) & (began + prepared.duration[backwards][None] > launched)
        busy_since = np.where(running, began, launched).min(axis=1)
        out = delay.copy() if out is None else out
        out[nodes] = np.clip(busy_since - (launched[:, 0] - delay[nodes]), 0.0, None)
    return delay if out is None else out
