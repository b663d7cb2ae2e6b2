"""Where a recorded CUDA step's extra time comes from: the monitor with one part at a time
taken away, each in a block that records every other step (needs a CUDA device; run by
`tests/cuda_check.py --parts ablation`).

    python -m tests.bench.cuda_ablation OUT.json

Variants (`$ABLATION_VARIANTS`, comma-separated, each run `$ABLATION_ROUNDS` times in turn
on the device-bound GPT of `cuda_bench.py`): `none` (no monitor: the contrast below read on
the odd steps, which says what the steps' own alternation gives), `full`, `no-resolver`
(the CUDA resolver thread idle until the block ends), `no-buckets` (the model's modules
hooked without DDP's comm hook), `no-data` (input waits not timed), `host` (host clocks
instead of CUDA events), `no-gc` (Python's collector off during the block).

Per variant, each recorded step against the mean of its two unrecorded neighbours (median
and its distribution-free 95 % interval): the step time (%), the training thread's CPU and
the time the host waited in the step's `loss.item()` (µs).

On an H100 (2026-11-27) this found the cost in the DDP buckets' CUDA events: `full` +1.4
to +1.6 %, `no-buckets` -0.1 %, `none` -0.3 %, the rest as `full`; timing the last bucket
only then read +0.2 to +0.3 %.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.bench.cuda_bench import SIZES, SKIP, _recorded_steps, _setup, train
from tests.bench.torch_bench import _median_ci, neighbour_contrast
from tests.torch_jobs.harness import dump_stacks_if_hung, free_port

STEPS = int(os.environ.get("ABLATION_STEPS", "160"))


def _block(job: dict[str, Any], variant: str, out: Path) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import lagscope.torch
    from lagscope.producers import timer as timer_module

    model, optimizer, loader = job["model"], job["optimizer"], job["loader"]
    ddp = DistributedDataParallel(model, device_ids=[0], broadcast_buffers=False,
                                  bucket_cap_mb=job["knobs"].bucket_mb)  # fmt: skip
    schedule = lagscope.torch.schedule(wait=1, active=1)
    kwargs: dict[str, Any] = dict(
        model=ddp, optimizer=optimizer, data=loader, job_id="ablation", log_dir=out,
        mode="cuda", gc_probe=False, schedule=schedule,
    )  # fmt: skip
    saved_loop = timer_module._CudaTimer._resolve_loop
    if variant == "host":
        kwargs["mode"] = "host"
    elif variant == "no-buckets":
        del kwargs["model"]
        kwargs.update(modules=[model], dp_group=dist.group.WORLD)
    elif variant == "no-data":
        del kwargs["data"]
    elif variant == "no-resolver":
        timer_module._CudaTimer._resolve_loop = lambda self: self._stop.wait()
    monitor = None
    if variant != "none":
        monitor = lagscope.torch.monitor(**kwargs)
    timer_module._CudaTimer._resolve_loop = saved_loop
    if variant == "no-gc":
        gc.disable()
    try:
        run = train(job, ddp, STEPS)
    finally:
        gc.enable()
    if monitor is not None:
        monitor.close()
        recorded = set(_recorded_steps(out))
    else:
        recorded = set(range(1, STEPS, 2))
    del ddp
    gc.collect()
    return {**run, "recorded": sorted(recorded)}


def main(path: Path) -> None:
    import torch
    import torch.distributed as dist

    dump_stacks_if_hung()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    variants = os.environ.get("ABLATION_VARIANTS", "none,full,no-resolver,no-buckets,no-data,host")
    rounds = int(os.environ.get("ABLATION_ROUNDS", "2"))
    plan = {"device-bound": variants.split(",") * rounds}
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for size, variants in plan.items():
            job = _setup(SIZES[size])
            _block(job, "none", Path(tmp))  # warm-up
            for variant in variants:
                out = Path(tempfile.mkdtemp(dir=tmp))
                run = _block(job, variant, out)
                recorded = set(run["recorded"])
                row: dict[str, Any] = {
                    "size": size,
                    "variant": variant,
                    "step_ms": statistics.median(run["step_s"]) * 1e3,
                }
                for key, relative in (("step_s", True), ("cpu_s", False), ("wait_s", False)):
                    median, low, high = _median_ci(
                        neighbour_contrast(run[key], recorded, skip=SKIP, relative=relative)
                    )
                    row[key] = [round(median, 3), round(low, 3), round(high, 3)]
                results.append(row)
                print(json.dumps(row), flush=True)
                path.write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
