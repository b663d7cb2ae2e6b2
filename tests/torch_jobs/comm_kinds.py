"""Every collective and p2p call of torch.distributed, once each, on a DP 2 x PP 2 layout
with explicit groups and no model or optimizer (the step marker ends the step).

`EXPECTED` says what `lagscope.torch` must record for each call on each stage: data-
parallel collectives by kind, p2p by direction, and nothing for calls on other groups.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tests.torch_jobs.harness import Knobs, main_for

#: (call, op type recorded on stage 0, on stage 1); None: not recorded.
EXPECTED: list[tuple[str, str | None, str | None]] = [
    ("all_reduce dp", "separate-grads-all-reduce", "separate-grads-all-reduce"),
    ("all_reduce dp async", "separate-grads-all-reduce", "separate-grads-all-reduce"),
    ("reduce_scatter dp", "grads-reduce-scatter", "grads-reduce-scatter"),
    ("reduce_scatter_tensor dp", "grads-reduce-scatter", "grads-reduce-scatter"),
    ("all_gather dp", "params-all-gather", "params-all-gather"),
    ("all_gather_into_tensor dp async", "params-all-gather", "params-all-gather"),
    ("broadcast dp", None, None),
    ("all_reduce pp", None, None),
    ("send/recv forward", "forward-send", "forward-recv"),
    ("send/recv backward", "backward-recv", "backward-send"),
    ("isend/irecv forward", "forward-send", "forward-recv"),
    ("isend/irecv backward", "backward-recv", "backward-send"),
    ("batch_isend_irecv both ways", "forward-send", "forward-recv"),
    ("batch_isend_irecv both ways", "backward-recv", "backward-send"),
]


def worker(rank: int, knobs: Knobs) -> None:
    import torch
    import torch.distributed as dist

    pp = 2
    dp = knobs.world // pp
    stage, dp_rank = rank % pp, rank // pp
    pp_groups = [dist.new_group([d * pp + s for s in range(pp)]) for d in range(dp)]
    dp_groups = [dist.new_group([d * pp + s for d in range(dp)]) for s in range(pp)]
    pp_group, dp_group = pp_groups[dp_rank], dp_groups[stage]
    monitor = knobs.start_monitor(dp_group=dp_group, pp_group=pp_group)
    n = 1024
    t = torch.ones(n)
    dist.all_reduce(t, group=dp_group)
    dist.all_reduce(t, group=dp_group, async_op=True).wait()
    dist.reduce_scatter(torch.empty(n), [torch.ones(n) for _ in range(dp)], group=dp_group)
    dist.reduce_scatter_tensor(torch.empty(n), torch.ones(n * dp), group=dp_group)
    dist.all_gather([torch.empty(n) for _ in range(dp)], t, group=dp_group)
    dist.all_gather_into_tensor(torch.empty(n * dp), t, group=dp_group, async_op=True).wait()
    dist.broadcast(t, src=dist.get_global_rank(dp_group, 0), group=dp_group)
    dist.all_reduce(t, group=pp_group)
    peer = rank + 1 if stage == 0 else rank - 1
    buffer = torch.empty(n)
    for sender in (0, 1):  # stage 0 -> 1 is forward, stage 1 -> 0 backward
        if stage == sender:
            dist.send(t, peer)
        else:
            dist.recv(buffer, peer)
    for sender in (0, 1):
        if stage == sender:
            dist.isend(t, peer).wait()
        else:
            dist.irecv(buffer, peer).wait()
    ops = [
        dist.P2POp(dist.isend, t, peer, pp_group),
        dist.P2POp(dist.irecv, buffer, peer, pp_group),
    ]
    if stage == 1:
        ops.reverse()
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if stage == 1:
        _record_p2p_completion_fact(monitor, buffer, peer, pp_group, knobs)
    else:
        dist.isend(t, peer).wait()
        dist.barrier(group=pp_group)
    monitor.step()
    monitor.close()


def _record_p2p_completion_fact(
    monitor: Any, buffer: Any, peer: int, group: Any, knobs: Knobs
) -> None:
    """Whether a gloo irecv whose data has arrived says so before it is waited on: the
    monitor polls only works that can (it does not track CPU p2p works at all)."""
    import torch.distributed as dist

    work = dist.irecv(buffer, peer)
    dist.barrier(group=group)  # the sender's isend has completed
    time.sleep(0.05)
    fact = {"completed_before_wait": work.is_completed(), "tracked": bool(monitor.pending_works)}
    work.wait()
    fact["completed_after_wait"] = work.is_completed()
    out = Path(knobs.log_dir).parent / f"p2p-completion-{dist.get_rank()}.json"
    out.write_text(json.dumps(fact))


if __name__ == "__main__":
    main_for(worker, __doc__.splitlines()[0], steps=1)
