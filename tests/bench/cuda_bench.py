"""The monitor's cost on a real CUDA model (needs a CUDA device; elsewhere it says so and
gives no rows): the small GPT of tests/torch_jobs/cuda_ddp.py trained with DDP on NCCL,
one rank, `lagscope.torch.monitor(model=ddp, optimizer=..., data=loader)` in CUDA mode.

Two sizes of the same model: one whose steps the device bounds (the host launches ahead
and waits at the step's `loss.item()`), and one small enough that the host's launches bound
it, where every µs the monitor spends on the training thread is a µs of step time.

Step-time overhead, in one process (no start-up between runs, the same device state):

- paired blocks: `LAGSCOPE_BENCH_CUDA_PAIRS` pairs of blocks of steps with and without the
  monitor (a fresh DDP wrapper per block, alternating which runs first), each block's
  median step time; the mean of the pairs' ratios and its 95 % t-interval;
- recorded against unrecorded steps in one monitored block that records every other step
  (each recorded step less the mean of its two neighbours, in % of the median step;
  median, distribution-free interval), beside the same contrast read on a block without
  the monitor (a job whose step times alternate on their own reads non-zero there: the
  device-bound GPT -0.3 %).

Also: the monitor threads' CPU per recorded step (the sealer and the CUDA resolver, on
their own thread clocks), read as the CPU bench reads it on the CPU jobs: in a long block,
from the end of step `SKIP` to the end of the last step, each thread apart; the start-up
before it and the seal that `close()` makes on the training thread after it are one-time
costs, reported apart (over a 50-step block they read as ~100 µs a step on an H100). And
the training thread's CPU per op timed with CUDA events (`OpTimer.op` around no work: two
pooled events recorded) against the host clock's.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.bench.timed_jobs import lagscope_threads_cpu
from tests.bench.torch_bench import _ci_text, _mean_ci, _median_ci, neighbour_contrast
from tests.torch_jobs.harness import Knobs, dump_stacks_if_hung, free_port

#: The two sizes (Knobs of tests/torch_jobs/cuda_ddp.py).
SIZES = {
    "device-bound": {"hidden": 2048, "layers": 4, "batch": 4, "seq": 1024},
    "launch-bound": {"hidden": 128, "layers": 12, "batch": 2, "seq": 64},
}
#: Steps of a block; the first ones of each block (DDP's first step re-buckets, the
#: monitor skips it) are left out of its median.
BLOCK_STEPS = 50
SKIP = 5
#: Steps of the block that reads the monitor threads' steady CPU per step.
STEADY_STEPS = int(os.environ.get("LAGSCOPE_BENCH_CUDA_STEADY_STEPS", "400"))


def _setup(size: dict[str, int]) -> dict[str, Any]:
    import torch

    from tests.torch_jobs import cuda_ddp

    knobs = Knobs(**{**cuda_ddp.DEFAULTS, "log_dir": "-", **size})
    plan = cuda_ddp.Plan(knobs, 0)
    model = cuda_ddp.make_model(torch, knobs, plan).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = cuda_ddp.token_loader(knobs, plan)
    return {"knobs": knobs, "model": model, "optimizer": optimizer, "loader": loader}


def _block(job: dict[str, Any], steps: int, monitor_dir: Path | None,
           every_other: bool = False, after_step: Any = None) -> dict[str, Any]:  # fmt: skip
    """`steps` steps with a fresh DDP wrapper, monitored into `monitor_dir` when given;
    `after_step()` is called after each (a profiler's step)."""
    from torch.nn.parallel import DistributedDataParallel

    import lagscope.torch

    model, optimizer, loader = job["model"], job["optimizer"], job["loader"]
    ddp = DistributedDataParallel(model, device_ids=[0], broadcast_buffers=False,
                                  bucket_cap_mb=job["knobs"].bucket_mb)  # fmt: skip
    monitor = None
    if monitor_dir is not None:
        schedule = lagscope.torch.schedule(wait=1 if every_other else 0, active=1)
        monitor = lagscope.torch.monitor(
            model=ddp, optimizer=optimizer, data=loader, job_id="cuda-bench",
            log_dir=monitor_dir, mode="cuda", gc_probe=False, schedule=schedule,
        )  # fmt: skip
    cpu_at: dict[str, dict[str, float]] = {"start": lagscope_threads_cpu()}
    steps_done = 0

    def each_step() -> None:
        nonlocal steps_done
        steps_done += 1
        if steps_done == SKIP:
            cpu_at["steady"] = lagscope_threads_cpu()
        if after_step is not None:
            after_step()

    times = train(job, ddp, steps, each_step)["step_s"]
    cpu_at["end"] = lagscope_threads_cpu()
    close_cpu_s = 0.0
    if monitor is not None:
        # close() seals what the threads had not yet: the same work, on this thread.
        closing = time.thread_time()
        monitor.close()
        close_cpu_s = time.thread_time() - closing
    del ddp
    gc.collect()

    def spent(since: str) -> dict[str, float]:
        return {name: cpu - cpu_at[since].get(name, 0.0) for name, cpu in cpu_at["end"].items()}

    steady = spent("steady") if "steady" in cpu_at else {}
    return {"step_s": times, "threads_cpu_s": sum(spent("start").values()) + close_cpu_s,
            "steady_cpu_s": steady, "steady_steps": steps - SKIP,
            "close_cpu_s": close_cpu_s}  # fmt: skip


def train(job: dict[str, Any], ddp: Any, steps: int, after_step: Any = None) -> dict[str, list]:
    """`steps` training steps of `ddp` (the job's model wrapped); per step: its time (from
    the previous step's end, s), the training thread's CPU (s) and the host's wait in the
    step's closing `loss.item()` (s). `after_step()` is called after each (a profiler's
    step)."""
    import torch

    optimizer, loader = job["optimizer"], job["loader"]
    times, cpu, waits = [], [], []
    began, cpu_began = time.perf_counter(), time.thread_time()
    step = 0
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    while step < steps:
        for (batch,) in loader:
            batch = batch.cuda(non_blocking=True)
            with autocast:
                logits = ddp(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.float().flatten(0, 1), batch[:, 1:].flatten()
            )
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            before_item = time.perf_counter()
            loss.item()
            now, cpu_now = time.perf_counter(), time.thread_time()
            times.append(now - began)
            cpu.append(cpu_now - cpu_began)
            waits.append(now - before_item)
            began, cpu_began = now, cpu_now
            if after_step is not None:
                after_step()
            step += 1
            if step == steps:
                break
    return {"step_s": times, "cpu_s": cpu, "wait_s": waits}


def _recorded_steps(log_dir: Path) -> list[int]:
    from tests.torch_jobs.harness import recorded_ops

    return sorted({op["step"] for op in recorded_ops(log_dir)})


def _size_rows(name: str, size: dict[str, int], tmp: Path, pairs: int) -> list[dict]:
    job = _setup(size)
    _block(job, 20, None)  # warm-up: cuBLAS plans, the allocator, NCCL's first collective
    ratios, plain_medians, threads_us = [], [], []
    for pair in range(pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        medians = {}
        for monitored in order:
            out = Path(tempfile.mkdtemp(dir=tmp)) if monitored else None
            run = _block(job, BLOCK_STEPS, out)
            medians[monitored] = statistics.median(run["step_s"][SKIP:])
            if monitored:
                threads_us.append(run["threads_cpu_s"] / (BLOCK_STEPS - 1) * 1e6)
        ratios.append((medians[True] / medians[False] - 1) * 100)
        plain_medians.append(medians[False])
    mean, low, high = _mean_ci(ratios)
    out = Path(tempfile.mkdtemp(dir=tmp))
    every_other = _block(job, 4 * BLOCK_STEPS, out, every_other=True)
    recorded = set(_recorded_steps(out))
    times = every_other["step_s"]
    # times[i] is step i's time (from the previous step's end); the monitor skips step 0.
    contrasts = neighbour_contrast(times, recorded, skip=SKIP)
    median, m_low, m_high = _median_ci(contrasts)
    # The same contrast with no monitor, on the same steps' parity: what the job's own
    # alternation of step times reads (-0.3 % on the device-bound GPT, H100).
    plain = _block(job, 4 * BLOCK_STEPS, None)["step_s"]
    control, c_low, c_high = _median_ci(neighbour_contrast(plain, recorded, skip=SKIP))
    step_ms = statistics.median(plain_medians) * 1e3
    steady = _block(job, STEADY_STEPS, Path(tempfile.mkdtemp(dir=tmp)))
    per_thread_us = {name: round(cpu / steady["steady_steps"] * 1e6, 1)
                     for name, cpu in sorted(steady["steady_cpu_s"].items())}  # fmt: skip
    return [
        {"benchmark": f"cuda {name}: step time without the monitor", "value": round(step_ms, 3),
         "unit": "ms", "target": "", "spread": [min(plain_medians) * 1e3,
                                                max(plain_medians) * 1e3], "runs": pairs},
        {"benchmark": f"cuda {name}: step-time overhead, paired blocks", "value": round(mean, 3),
         "unit": "%", "target": f"< 0.5 %  ({_ci_text(low, high)}, {pairs} pairs)",
         "pairs": ratios},
        {"benchmark": f"cuda {name}: step-time overhead, recorded vs unrecorded steps",
         "value": round(median, 3), "unit": "%",
         "target": f"< 0.5 %  ({_ci_text(m_low, m_high)}, {len(contrasts)} steps)"},
        {"benchmark": f"cuda {name}: same contrast, no monitor (the steps' own alternation)",
         "value": round(control, 3), "unit": "%",
         "target": f"~0  ({_ci_text(c_low, c_high)})"},
        {"benchmark": f"cuda {name}: monitor threads' CPU per rank-step",
         "value": round(sum(per_thread_us.values()), 1), "unit": "us",
         "target": f"<= 20 us  (steps {SKIP}-{STEADY_STEPS} of one block: "
                   + ", ".join(f"{n} {v}" for n, v in per_thread_us.items()) + ")",
         "threads": per_thread_us},
        {"benchmark": f"cuda {name}: monitor's CPU per step of a {BLOCK_STEPS}-step block",
         "value": round(statistics.median(threads_us), 1), "unit": "us",
         "target": f"start-up and close() included (close: "
                   f"{steady['close_cpu_s'] * 1e3:.1f} ms)",
         "spread": [min(threads_us), max(threads_us)], "runs": pairs},
    ]  # fmt: skip


def _per_op_rows(tmp: Path) -> list[dict]:
    """Training-thread CPU of one timed op with no work inside: CUDA events vs host clock."""
    from lagscope.producers.timer import OpTimer

    rows = []
    for mode in ("cuda", "host"):
        timer = OpTimer(job_id="bench", rank=0, dp_rank=0, pp_rank=0, log_dir=tmp / mode,
                        mode=mode, gc_probe=False)  # fmt: skip
        import torch

        calls = "host clock"
        if not timer.on_host_clock:
            public = timer.backend._current_stream is torch.cuda.current_stream  # type: ignore[attr-defined]
            calls = "torch's public CUDA calls" if public else "torch._C's event calls"
        op = timer.op
        best = float("inf")
        for round_ in range(21):
            timer.step(round_)
            began = time.thread_time_ns()
            for _ in range(200):  # within the event pool, as a seal interval's ops are
                with op("forward-compute"):
                    pass
            best = min(best, (time.thread_time_ns() - began) / 200)
            timer.flush()  # gives the events back, as the resolver does between seals
        timer.close()
        rows.append({"benchmark": f"cuda: training-thread CPU per op, {mode} clock",
                     "value": round(best / 1e3, 2), "unit": "us",
                     "target": f"least of 21 rounds of 200 ops; {calls}"})  # fmt: skip
    return rows


def run() -> list[dict]:
    import torch

    if not torch.cuda.is_available():
        print("  cuda_bench: no CUDA device here, no rows (deploy/README.md has the last "
              "figures measured on one)", file=sys.stderr)  # fmt: skip
        return []
    import torch.distributed as dist

    dump_stacks_if_hung()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    pairs = int(os.environ.get("LAGSCOPE_BENCH_CUDA_PAIRS", "4"))
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for name, size in SIZES.items():
                rows += _size_rows(name, size, Path(tmp), pairs)
            rows += _per_op_rows(Path(tmp))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    device = torch.cuda.get_device_name(0)
    for row in rows:
        row["device"] = device
    return rows


def profile(out: Path) -> None:
    """torch.profiler over 12 steps of the device-bound size, recording every other step,
    after 24 to warm up: where a recorded step's extra time goes (which thread, which
    frames, what the GPU waited for). Writes `profile.json.gz` (a Chrome/Perfetto trace
    with Python stacks) and `profile.txt` (the ops by self CPU time, and each profiled
    step's recorded flag and time)."""
    import gzip
    import shutil

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, schedule

    dump_stacks_if_hung()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    out.mkdir(parents=True, exist_ok=True)
    try:
        job = _setup(SIZES["device-bound"])
        _block(job, 10, None)
        with (
            tempfile.TemporaryDirectory() as tmp,
            torch.profiler.profile(
                activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                schedule=schedule(wait=20, warmup=4, active=12, repeat=1),
                with_stack=True,
            ) as prof,
        ):
            run = _block(job, 40, Path(tmp), every_other=True, after_step=prof.step)
            recorded = set(_recorded_steps(Path(tmp)))
        trace = out / "profile.json"
        prof.export_chrome_trace(str(trace))
        with trace.open("rb") as raw, gzip.open(out / "profile.json.gz", "wb") as packed:
            shutil.copyfileobj(raw, packed)
        trace.unlink()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60)
        steps = "\n".join(
            f"step {s}: {'recorded' if s in recorded else 'unrecorded'} "
            f"{run['step_s'][s] * 1e3:.3f} ms"
            for s in range(24, 36)
        )
        (out / "profile.txt").write_text(f"{steps}\n\n{table}\n")
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


if __name__ == "__main__":
    profile(Path(sys.argv[1]))
