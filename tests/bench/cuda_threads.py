"""Where the monitor threads' CPU goes on a GPU, part by part (needs a CUDA device; run by
`tests/cuda_check.py --parts threads`).

    python -m tests.bench.cuda_threads OUT.json

One monitored block of `cuda_bench.STEADY_STEPS` steps per size of `cuda_bench.SIZES`, every
step recorded, with the timer's parts wrapped to read their callers' thread CPU clocks: the
CUDA resolver's passes (`resolve`: reading the events; `_write`: handing the finished steps
to the seal), its calibrations, the hand-overs and the seals (`_seal_pending`, of which
`_write_seal` is the packing). Times are inclusive (a pass's seal is in `resolve` too), per
thread, from the end of step `SKIP` on, divided by the steps since; each size once with
the resolver reading events through the CUDA runtime (`producers/cuda_runtime.py`) and once
through torch's calls. And the CPU of one call of each way on finished events, idle, on
the training thread and on a thread of its own, with the two ways' readings compared.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from tests.bench.cuda_bench import SIZES, SKIP, STEADY_STEPS, _block, _setup
from tests.torch_jobs.harness import dump_stacks_if_hung, free_port

#: The parts read: class name in producers/timer.py -> its methods.
PARTS = {
    "_CudaTimer": ("resolve", "_calibrate", "_write"),
    "OpTimer": ("_hand_over", "_seal_pending", "_write_seal"),
}


class _Meter:
    """Calls and thread CPU per (thread, part), counted while `on`."""

    def __init__(self) -> None:
        self.on = False
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.cpu_ns: dict[tuple[str, str], int] = defaultdict(int)
        self.items: dict[tuple[str, str], int] = defaultdict(int)

    def wrap(self, owner: type, name: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def metered(*args: Any, **kwargs: Any) -> Any:
            began = time.thread_time_ns()
            result = original(*args, **kwargs)
            if self.on:
                key = (threading.current_thread().name.rstrip("-0123456789"), name)
                self.calls[key] += 1
                self.cpu_ns[key] += time.thread_time_ns() - began
                if isinstance(result, int):  # resolve(): the ops it read
                    self.items[key] += result
            return result

        setattr(owner, name, metered)


def _calls(torch: Any, pairs: int = 400) -> dict[str, Any]:
    """µs of CPU per call reading finished events: torch's query and elapsed_time, and the
    runtime reader's read (two cudaEventElapsedTime); whether both read the same."""
    from lagscope.producers.cuda_runtime import event_reader

    base = torch._C._CudaEventBase
    reader = event_reader(torch.cuda.current_device())
    found: dict[str, Any] = {"runtime_reader": reader is not None}
    if reader is None:
        return found
    new = functools.partial(torch.cuda.Event, enable_timing=True)
    reference, events = new(), [(new(), new()) for _ in range(pairs)]
    x = torch.randn(512, 512, device="cuda")
    reference.record()
    for start, end in events:
        start.record()
        x = x @ x / 512
        end.record()
    torch.cuda.synchronize()

    def per_call_us(call: Any, calls_per_pair: int = 1) -> float:
        best = float("inf")
        for _ in range(5):
            began = time.thread_time_ns()
            for start, end in events:
                call(start, end)
            best = min(best, (time.thread_time_ns() - began) / pairs / calls_per_pair / 1e3)
        return round(best, 3)

    def measure(into: dict[str, Any]) -> None:
        into["torch query"] = per_call_us(lambda s, e: base.query(e))
        into["torch elapsed_time"] = per_call_us(lambda s, e: base.elapsed_time(s, e))
        into["runtime elapsed"] = per_call_us(lambda s, e: reader.read(reference, s, e), 2)

    measure(found.setdefault("training thread", {}))
    apart: dict[str, Any] = {}

    def on_own_thread() -> None:
        apart["bound"] = reader.bind_thread()
        measure(apart)

    thread = threading.Thread(target=on_own_thread, name="calls")
    thread.start()
    thread.join()
    found["own thread"] = apart
    found["same readings"] = all(
        reader.read(reference, s, e) == (base.elapsed_time(reference, s), base.elapsed_time(s, e))
        for s, e in events
    )
    return found


def _size_parts(name: str, size: dict[str, int], tmp: Path, meter: _Meter) -> list[dict]:
    import ctypes

    from lagscope.producers import cuda_runtime, timer

    job = _setup(size)
    _block(job, 20, None)  # warm-up, as cuda_bench's
    found = []
    # (2026-11-27, H200: the runtime's calls with the interpreter lock released around
    # each, ctypes.CDLL, read 1-2 µs a rank-step more than held; that variant is gone.)
    for reads, native, apart in (("runtime", True, False),
                                 ("runtime, resolver on a core of its own", True, True),
                                 ("torch", False, False)):  # fmt: skip
        timer._NATIVE_READS, cuda_runtime._LIBRARY = native, ctypes.PyDLL
        found.append({"reads": reads, **_block_parts(name, job, tmp, meter, apart)})
    timer._NATIVE_READS = True
    return found


def _block_parts(
    name: str, job: dict[str, Any], tmp: Path, meter: _Meter, resolver_apart: bool = False
) -> dict:
    """One metered block; with `resolver_apart`, the CUDA resolver thread pinned to the
    last CPU and the training process' other threads kept off it: whether a resolver
    call costs more under load for sharing the training thread's core or in the driver."""
    steps_done = 0
    everywhere = os.sched_getaffinity(0)
    last = max(everywhere)

    def each_step() -> None:
        nonlocal steps_done
        steps_done += 1
        meter.on = steps_done >= SKIP
        if resolver_apart and steps_done == 1 and len(everywhere) > 1:
            resolver = {t.native_id for t in threading.enumerate()
                        if t.name.startswith("lagscope-cuda-timer")}  # fmt: skip
            for tid in _threads():  # the C++ ones too: autograd's, NCCL's
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(tid, {last} if tid in resolver else everywhere - {last})

    try:
        run = _block(job, STEADY_STEPS, Path(tempfile.mkdtemp(dir=tmp)), after_step=each_step)
    finally:
        for tid in _threads():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, everywhere)
    meter.on = False
    steps = STEADY_STEPS - SKIP
    parts = [
        {"thread": thread, "part": part, "calls": meter.calls[thread, part],
         "cpu_us_per_step": round(meter.cpu_ns[thread, part] / steps / 1e3, 2),
         "us_per_call": round(meter.cpu_ns[thread, part] / meter.calls[thread, part] / 1e3, 1),
         "ops_read": meter.items.get((thread, part), 0)}
        for thread, part in sorted(meter.calls)
    ]  # fmt: skip
    for counts in (meter.calls, meter.cpu_ns, meter.items):
        counts.clear()
    steady = run["steady_cpu_s"]
    threads = {n: round(cpu / run["steady_steps"] * 1e6, 1) for n, cpu in steady.items()}
    return {"size": name, "steps": steps, "threads_us_per_step": threads, "apart": resolver_apart,
            "close_ms": round(run["close_cpu_s"] * 1e3, 2), "parts": parts,
            "step_ms": round(sorted(run["step_s"])[len(run["step_s"]) // 2] * 1e3, 3)}  # fmt: skip


def _threads() -> list[int]:
    """The ids of this process' threads."""
    return [int(tid) for tid in os.listdir("/proc/self/task")]


def main(out: Path) -> None:
    import torch
    import torch.distributed as dist

    from lagscope.producers import timer

    dump_stacks_if_hung()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    meter = _Meter()
    for owner, names in PARTS.items():
        for name in names:
            meter.wrap(getattr(timer, owner), name)
    found: list[Any] = []
    try:
        found.append(_calls(torch))
        print(json.dumps(found[-1]), flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            for name, size in SIZES.items():
                for parts in _size_parts(name, size, Path(tmp), meter):
                    found.append(parts)
                    print(json.dumps({k: v for k, v in parts.items() if k != "parts"}),
                          flush=True)  # fmt: skip
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    out.write_text(json.dumps(found, indent=2))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
