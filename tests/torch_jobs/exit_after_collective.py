"""A two-rank gloo job that exits right after a collective it never waited on.

Rank 1 joins the all-reduce late; rank 0 holds the interpreter lock (a long sort, C code
that never yields) across the moment it completes, so gloo's thread, which runs the
monitor's callback and drops the work, is still waiting for the lock when the script ends.
Argument: the log directory.
"""

import sys
import time

import torch
import torch.distributed as dist

import lagscope.torch

dist.init_process_group("gloo")
monitor = lagscope.torch.monitor(
    model=torch.nn.Linear(4, 4), job_id="exit-after-collective", log_dir=sys.argv[1]
)
if dist.get_rank() == 1:
    time.sleep(0.5)
dist.all_reduce(torch.ones(1000), async_op=True)
if dist.get_rank() == 0:
    sorted(range(20_000_000, 0, -1))
monitor.close()
dist.destroy_process_group()
