"""What every job of the harness shares: knobs, process launch, realistic compute, and
reading back what the ranks recorded.

Each rank pins torch to one thread (2 cores are shared by several jobs and tests). A
straggler is made by sleeping `(factor - 1)` times the op's own measured duration right
after it (inside the forward, inside the backward through an autograd function, or in the
data loader), so "2x slower" holds however loaded the machine is. A slow *host* (phase
`host`) sleeps as long after its forward and its backward have returned, in the job's own
code between two ops (slow Python, a slow CPU, data prepared outside the loader): its
recorded ops keep their durations, as a GPU's kernels do when its host launches them late.
A rank whose collections are slow (phase `gc`) runs one inside its forward, as a CPU job
whose ops the host clock times; phase `host_gc` runs it where `host` sleeps, between two
ops, as on a GPU, whose kernels keep their time while the host collects.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

PHASES = ("forward", "backward", "input", "host", "gc", "host_gc")
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.pipelining",
    "torch.utils.data",
    "lagscope.torch",
    "lagscope.producers.torch_setup",
    "tests.torch_jobs.harness",
]


@dataclass
class Knobs:
    log_dir: str = ""
    job_id: str = "torch-job"
    steps: int = 40
    world: int = 4
    #: Pipeline stages (the data-parallel size is world / pp).
    pp: int = 2
    microbatches: int = 4
    hidden: int = 256
    layers: int = 3
    batch: int = 32
    seed: int = 0
    #: Straggler: this rank is `slow_factor` x slower in `slow_phase` for steps
    #: [slow_start, slow_end).
    slow_rank: int = -1
    slow_phase: str = "forward"
    slow_factor: float = 2.0
    slow_start: int = 0
    slow_end: int = 1 << 30
    #: An input straggler's extra wait per batch (ms): its loader has no compute to scale.
    input_ms: float = 30.0
    #: A slow host (phase `host`) stalls this long (ms) at each of `stall_at` instead of
    #: `(slow_factor - 1)` times the op that just returned: a fixed +N ms of host work.
    stall_ms: float = 0.0
    #: Where a slow host stalls, of: `forward` (after its forward returned: its backward
    #: starts late, and in DDP every gradient bucket with it), `backward` (after its
    #: backward returned), `update` (after the schedule and the gradients' reduction
    #: returned, before its optimizer: a Megatron job's host work between
    #: `forward_backward` and the update), `step` (after its optimizer step, before the
    #: next step's data: the other ranks start the next step without it), `autograd`
    #: (`stall_ms` at the start of its backward pass, before any gradient).
    stall_at: str = "forward,backward"
    #: A planted delay spins the CPU instead of sleeping: on shared cores a sleeping rank
    #: frees its core for the others, which a slow GPU or a slow host never does.
    busy: bool = False
    #: Late sender: in steps [late_start, late_end) this rank sends every activation
    #: `late_ms` after its receiver posted the irecv for it.
    late_rank: int = -1
    late_ms: float = 0.0
    late_start: int = 0
    late_end: int = 1 << 30
    #: Emulated accelerator: each block's forward also takes this long (ms), its backward
    #: twice that, spent waiting as a host waits for its GPU. Real CPU compute of tens of
    #: ms per op would make 4 single-thread ranks fight over a few shared cores, and each
    #: op's time then depends on what the other ranks do at that moment, which no GPU job
    #: sees. 0: CPU compute only.
    block_ms: float = 0.0
    #: Extra blocks on the last pipeline stage (an output head): a really heavier stage.
    head_layers: int = 0
    gc_probe: bool = True
    #: Run the job without lagscope at all (the baseline of the overhead bench).
    monitor: bool = True
    #: Record the data loader's waits (`input-wait` ops) where the job reads data.
    record_input: bool = True
    #: Sampling: record `sample_active` steps of every `sample_wait + sample_active`.
    sample_wait: int = 0
    sample_active: int = 1
    #: DDP gradient bucket size (MB); small so that the model has several buckets.
    bucket_mb: float = 0.25
    #: pipelining schedule: gpipe, 1f1b or interleaved.
    schedule: str = "1f1b"
    #: Extra environment of every rank, "NAME=value,NAME=value" (e.g. a Slurm node name).
    env: str = ""
    #: "cpu", or "cuda": every rank on the machine's first GPU (tests/torch_jobs/cuda_ddp.py).
    device: str = "cpu"
    #: The process groups' backend: gloo carries CUDA tensors too, and NCCL refuses two
    #: ranks on one GPU, so "nccl" is for a job of one rank per GPU.
    backend: str = "gloo"
    #: The timer's clock: "host" on CPU; "cuda" times compute with CUDA events.
    timer_mode: str = "host"
    #: Tokens per sample of the CUDA job's language model.
    seq: int = 512

    def slow(self, rank: int, step: int, phase: str) -> bool:
        return (
            rank == self.slow_rank
            and phase == self.slow_phase
            and (self.slow_start <= step < self.slow_end)
        )

    def host_stall(self, rank: int, step: int, op_seconds: float, at: str = "forward") -> None:
        """A slow host's stall at `at` (`forward`, `backward`: after that op of
        `op_seconds` returned; `step`: after the optimizer) when the knobs plant one
        there (phase `host`): the job's own code between two ops takes `stall_ms`, or
        `(factor - 1)` times the op; or (`host_gc`) a garbage collection as long runs
        there."""
        if at not in self.stall_at.split(","):
            return
        extra = self.stall_ms / 1e3 if self.stall_ms else (self.slow_factor - 1.0) * op_seconds
        if self.slow(rank, step, "host"):
            self.pause(extra)
        if self.slow(rank, step, "host_gc"):
            collect_garbage(extra)

    def pause(self, seconds: float) -> None:
        """A planted delay: a sleep, or with `busy` the CPU spun as long."""
        if seconds <= 0:
            return
        if not self.busy:
            time.sleep(seconds)
            return
        until = time.perf_counter() + seconds
        while time.perf_counter() < until:
            pass

    def late(self, rank: int, step: int) -> bool:
        return rank == self.late_rank and self.late_start <= step < self.late_end

    def start_monitor(self, **job_objects: Any) -> Any:
        """`lagscope.torch.monitor(...)` with the job's objects and these knobs' settings;
        a stand-in that records nothing when the job runs without lagscope."""
        if not self.monitor:
            return _NoMonitor()
        import lagscope.torch

        if not self.record_input:
            job_objects.pop("data", None)
        return lagscope.torch.monitor(**job_objects, **self.monitor_kwargs())

    def monitor_kwargs(self) -> dict[str, Any]:
        import lagscope.torch

        return {
            "job_id": self.job_id,
            "log_dir": self.log_dir,
            "gc_probe": self.gc_probe,
            "mode": self.timer_mode,
            "schedule": lagscope.torch.schedule(wait=self.sample_wait, active=self.sample_active),
        }


class _NoMonitor:
    def close(self) -> None:
        pass


def parse_knobs(argv: list[str] | None, description: str, **defaults: Any) -> Knobs:
    parser = argparse.ArgumentParser(description=description)
    base = Knobs(**defaults)
    for f in fields(Knobs):
        flag = "--" + f.name.replace("_", "-")
        value = getattr(base, f.name)
        if isinstance(value, bool):
            parser.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"),
                                default=value, help=f"(default {value})")  # fmt: skip
        else:
            parser.add_argument(flag, type=type(value), default=value, help=f"(default {value})")
    parser.add_argument("--slow-steps", help="A-B: shorthand for --slow-start A --slow-end B+1")
    parser.add_argument("--late-steps", help="A-B: shorthand for --late-start A --late-end B+1")
    args = parser.parse_args(argv)
    values = {f.name: getattr(args, f.name) for f in fields(Knobs)}
    for name in ("slow", "late"):
        span = getattr(args, f"{name}_steps")
        if span:
            first, _, last = span.partition("-")
            values[f"{name}_start"], values[f"{name}_end"] = int(first), int(last or first) + 1
    if not values["log_dir"]:
        parser.error("--log-dir is required")
    if values["slow_phase"] not in PHASES:
        parser.error(f"--slow-phase must be one of {PHASES}")
    return Knobs(**values)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, target: Callable[[int, Knobs], None], knobs: dict, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(knobs["world"]),
        OMP_NUM_THREADS="1",
    )
    for assignment in filter(None, knobs["env"].split(",")):
        name, _, value = assignment.partition("=")
        os.environ[name] = value
    dump_stacks_if_hung()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if knobs["device"] == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(knobs["backend"], rank=rank, world_size=knobs["world"])
    try:
        target(rank, Knobs(**knobs))
    finally:
        dist.destroy_process_group()


def dump_stacks_if_hung() -> None:
    """With `$LAGSCOPE_STACKS_AFTER_S` set, every thread's stack goes to stderr if this
    process still runs that long after (what a hung job was waiting for, on a machine
    lent for minutes)."""
    after = os.environ.get("LAGSCOPE_STACKS_AFTER_S")
    if after:
        import faulthandler

        faulthandler.dump_traceback_later(float(after), exit=False)


def launch(target: Callable[[int, Knobs], None], knobs: Knobs, timeout_s: float = 300) -> None:
    """Run `target(rank, knobs)` in `knobs.world` processes; raise if one fails."""
    import multiprocessing

    import torch.multiprocessing as mp

    Path(knobs.log_dir).mkdir(parents=True, exist_ok=True)
    # A fork server imports torch once and forks every rank of every job from that clean,
    # thread-free process: ~1 s per job instead of one torch import per rank.
    multiprocessing.set_forkserver_preload(_PRELOAD)
    context = mp.start_processes(
        _entry, args=(target, asdict(knobs), free_port()), nprocs=knobs.world,
        join=False, start_method="forkserver",
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"torch job did not finish in {timeout_s} s ({knobs})")


def main_for(target: Callable[[int, Knobs], None], description: str, **defaults: Any) -> None:
    knobs = parse_knobs(sys.argv[1:], description, **defaults)
    started = time.monotonic()
    launch(target, knobs)
    print(
        f"{knobs.world} ranks, {knobs.steps} steps in {time.monotonic() - started:.1f} s; logs "
        f"in {knobs.log_dir}; analyse with: lagscope run --log-dir {knobs.log_dir}"
    )


# -- realistic compute ------------------------------------------------------------------


def make_straggler_function() -> Any:
    """An identity autograd function that makes one phase of a rank slower on demand."""
    import torch

    class Straggle(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Any, backward_extra: Any) -> Any:
            ctx.backward_extra = backward_extra
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            extra = ctx.backward_extra
            if extra is not None:
                extra()
            return grad, None

    return Straggle


def straggler_model(knobs: Knobs, rank: int, seed: int, layers: int | None = None) -> Any:
    """An MLP of `layers` (default `knobs.layers`) blocks that can be made slow in forward
    or backward, on an emulated accelerator when `knobs.block_ms` is set.

    The backward slowdown sleeps between the last and the first block, so it happens before
    the first block's parameter gradients: inside the backward compute, as a slow GPU's
    would be, not after it.
    """
    import torch

    straggle = make_straggler_function()
    n_blocks = knobs.layers if layers is None else layers
    device_forward_s = n_blocks * knobs.block_ms / 1e3

    class StragglerMLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.blocks = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(knobs.hidden, knobs.hidden), torch.nn.GELU())
                for _ in range(n_blocks)
            )
            self.step = 0
            self.backward_began = 0.0

        def _backward_starts(self) -> None:
            self.backward_began = time.perf_counter()

        def _device_backward(self) -> None:
            time.sleep(2 * device_forward_s)

        def _backward_extra(self) -> None:
            # Scale the CPU backward of blocks 1..n to all n blocks (the emulated device's
            # part is whole already), then sleep the difference.
            share = n_blocks / max(1, n_blocks - 1)
            elapsed = time.perf_counter() - self.backward_began
            device = 2 * device_forward_s
            whole = device + max(0.0, elapsed - device) * share
            knobs.pause((knobs.slow_factor - 1.0) * whole)

        def forward(self, x: Any) -> Any:
            slow_forward = knobs.slow(rank, self.step, "forward")
            slow_backward = knobs.slow(rank, self.step, "backward")
            began = time.perf_counter()
            for i, block in enumerate(self.blocks):
                x = block(x)
                if i == 0 and slow_backward:
                    x = straggle.apply(x, self._backward_extra)
            if device_forward_s > 0:
                time.sleep(device_forward_s)
                x = straggle.apply(x, self._device_backward)
            if slow_backward:
                x = straggle.apply(x, self._backward_starts)
            if knobs.slow(rank, self.step, "host") and "autograd" in knobs.stall_at:
                # Runs first in the backward pass: the rank's autograd waits before any
                # gradient (and, in DDP, before any bucket is ready).
                x = straggle.apply(x, lambda: knobs.pause(knobs.stall_ms / 1e3))
            if slow_forward:
                knobs.pause((knobs.slow_factor - 1.0) * (time.perf_counter() - began))
            if knobs.slow(rank, self.step, "gc"):
                collect_garbage((knobs.slow_factor - 1.0) * (time.perf_counter() - began))
            return x

    return StragglerMLP()


#: Long-lived container objects of a rank whose collections are slow (phase `gc`).
_HEAP: list[list[Any]] = []


def collect_garbage(at_least_s: float) -> None:
    """One full garbage collection of at least `at_least_s`: a job whose Python heap grew,
    each of its collections a pause its peers wait for. The first call freezes the
    process' heap so far (torch's own objects: a full collection of them alone takes
    ~150 ms here) and grows a heap of tracked objects until a collection takes that long."""
    import gc

    if not _HEAP:
        gc.freeze()
    while True:
        began = time.perf_counter()
        gc.collect()
        if (_HEAP and time.perf_counter() - began >= at_least_s) or len(_HEAP) >= 300:
            return
        _HEAP.append([[] for _ in range(10_000)])


def slow_input_collate(knobs: Knobs, rank: int, batches_per_step: int) -> Callable[[Any], Any]:
    """A DataLoader collate_fn that stalls `knobs.input_ms` on an input straggler's steps."""
    from torch.utils.data import default_collate

    fetched = [0]

    def collate(items: Any) -> Any:
        step = fetched[0] // batches_per_step
        fetched[0] += 1
        if knobs.slow(rank, step, "input"):
            knobs.pause(knobs.input_ms / 1e3)
        return default_collate(items)

    return collate


def synthetic_loader(knobs: Knobs, rank: int, batches_per_step: int, seed: int) -> Any:
    """A real DataLoader (main process) over random regression data, endless by re-iterating."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(seed)
    n = knobs.batch * batches_per_step * 8
    data = TensorDataset(
        torch.randn(n, knobs.hidden, generator=generator),
        torch.randn(n, knobs.hidden, generator=generator),
    )
    return DataLoader(data, batch_size=knobs.batch, shuffle=False, drop_last=True,
                      collate_fn=slow_input_collate(knobs, rank, batches_per_step))  # fmt: skip


def endless(loader: Any) -> Any:
    while True:
        yield from loader


# -- reading back -------------------------------------------------------------------------


def recorded_ops(log_dir: str | Path) -> list[dict[str, Any]]:
    """Every op every rank wrote, as dicts (producers.events.OP_FIELDS)."""
    from lagscope.producers.events import decode_batch
    from lagscope.producers.log import KIND_BATCH, Record, list_rank_dirs, read_all

    ops = []
    for directory in list_rank_dirs(log_dir):
        for item in read_all(directory):
            if isinstance(item, Record) and item.kind == KIND_BATCH:
                ops.extend(decode_batch(item.payload).to_records())
    return ops


def chained_logs(log_dir: str | Path) -> Any:
    """Every step every rank wrote, prepared one step at a time as the hosts do, each
    with when its workers ended the step before (`with_entries`: its period known), as
    one prepared trace."""
    from lagscope.producers.events import decode_batch
    from lagscope.producers.log import KIND_BATCH, Record, list_rank_dirs, read_all
    from lagscope.simulator.prepare import concat_steps, prepare, with_entries
    from lagscope.stream_app.step_compute import batches_to_trace

    info = job_records(log_dir)[0]
    by_step: dict[int, list[Any]] = {}
    for directory in list_rank_dirs(log_dir):
        for item in read_all(directory):
            if isinstance(item, Record) and item.kind == KIND_BATCH:
                batch = decode_batch(item.payload)
                by_step.setdefault(batch.step, []).append(batch)
    steps, model, previous, began = [], None, None, 0
    for step in sorted(by_step):
        batches = by_step[step]
        origin = min(int(b.start_ns.min()) for b in batches if b.n_ops)
        prepared = prepare(batches_to_trace(batches, info.pp_size), info.to_meta(), model=model)
        model = prepared.model
        if previous is not None and int(previous.steps[0]) == step - 1:
            prepared = with_entries(prepared, previous, (origin - began) / 1e9)
        steps.append(prepared)
        previous, began = prepared, origin
    return concat_steps(steps)


def prepared_logs(log_dir: str | Path) -> Any:
    """Every step every rank wrote, prepared for the what-if analysis as one trace (the
    job's record gives its layout)."""
    from lagscope.producers.events import decode_batch
    from lagscope.producers.log import KIND_BATCH, Record, list_rank_dirs, read_all
    from lagscope.simulator.prepare import prepare
    from lagscope.stream_app.step_compute import batches_to_trace

    info = job_records(log_dir)[0]
    batches = [
        decode_batch(item.payload)
        for directory in list_rank_dirs(log_dir)
        for item in read_all(directory)
        if isinstance(item, Record) and item.kind == KIND_BATCH
    ]
    return prepare(batches_to_trace(batches, info.pp_size), info.to_meta())


def job_records(log_dir: str | Path) -> list[Any]:
    """The job record (JobInfo) each rank wrote at its start, in rank order."""
    return [_job_records(records)[0] for records in _records_by_rank(log_dir)]


def rank_ends(log_dir: str | Path) -> list[tuple[int | None, bool]]:
    """Per rank, in rank order: when its last job record says it ended (None: it did not
    say), and whether that record came after every batch of its log."""
    from lagscope.producers.log import KIND_JOB

    return [
        (_job_records(records)[-1].ended_ns, records[-1].kind == KIND_JOB)
        for records in _records_by_rank(log_dir)
    ]


def _records_by_rank(log_dir: str | Path) -> list[list[Any]]:
    from lagscope.producers.log import Record, list_rank_dirs, read_all

    return [
        [item for item in read_all(directory) if isinstance(item, Record)]
        for directory in list_rank_dirs(log_dir)
    ]


def _job_records(records: list[Any]) -> list[Any]:
    from lagscope.producers.events import JobInfo
    from lagscope.producers.log import KIND_JOB

    return [JobInfo.model_validate_json(r.payload) for r in records if r.kind == KIND_JOB]


def analyse_archive(archive: Path, tmp_path: Path) -> Any:
    """The one job of a recorded run (a `.tar.xz` holding its `logs/`), analysed as
    `analyse` does, unpacked under `tmp_path`."""
    import tarfile

    with tarfile.open(archive) as packed:
        packed.extractall(tmp_path, filter="data")
    (job,) = analyse(tmp_path / "logs", tmp_path / "store").jobs.values()
    return job


def analyse(log_dir: str | Path, store: str | Path | None = None) -> Any:
    """`lagscope run --logs` in-process: the embedded host into chDB; its RunReport."""
    from lagscope.store.sink import ClickHouseSink
    from lagscope.stream_app.embedded import EmbeddedRunner
    from lagscope.stream_app.processor import ProcessorSettings

    store = Path(store) if store is not None else Path(log_dir).parent / "chdb"
    sink = ClickHouseSink(f"chdb://{store}")
    sink.ensure_schema()
    runner = EmbeddedRunner(sink, ProcessorSettings(lateness_s=5.0))
    return runner.run_logs(log_dir)
