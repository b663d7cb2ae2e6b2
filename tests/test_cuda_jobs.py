"""`lagscope.torch` on a real CUDA device: what CUDA mode records is what the device did.

The job (tests/torch_jobs/cuda_ddp.py) times its own forward and backward with CUDA events
of its own; the ops lagscope recorded, through its hooks and its pooled events resolved off
the hot path, must match them step by step, follow a slowdown planted on the device, and
keep their durations when the host stalls between launches (that shows as launch delay
only). A job of one rank runs DDP on NCCL, whose buckets are timed by the process group on
the device; four ranks share the GPU over gloo.

These need a CUDA device and are skipped without one (as the timer's own CUDA test); the
straggler jobs they record are kept in tests/data/recorded-cuda and analysed on every
machine by tests/test_cuda_recordings.py.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from lagscope.producers.events import decode_batch
from lagscope.producers.log import KIND_BATCH, Record, list_rank_dirs, read_all
from tests.torch_jobs import cuda_ddp
from tests.torch_jobs.harness import Knobs, launch, recorded_ops

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.slow

WINDOW = {"steps": 30, "slow_start": 12, "slow_end": 22}


def _run(tmp: Path, **knobs: object) -> tuple[dict, list[dict]]:
    settings = Knobs(**{**cuda_ddp.DEFAULTS, "log_dir": str(tmp / "logs"), **knobs})
    launch(cuda_ddp.worker, settings, timeout_s=50)  # ~15 s on an H200
    truths = {
        int(path.stem.split("-")[1]): json.loads(path.read_text())
        for path in (tmp / "truth").glob("rank-*.json")
    }
    ops = recorded_ops(tmp / "logs")
    _show(truths, ops)
    # Each rank-step reaches the log whole, in one batch: its CUDA ops and its host clock's
    # (input waits, GC pauses) together, or the analysis would close the step without the
    # part that came second.
    parts = Counter(
        (directory.name, batch.step)
        for directory in list_rank_dirs(tmp / "logs")
        for batch in (
            decode_batch(item.payload)
            for item in read_all(directory)
            if isinstance(item, Record) and item.kind == KIND_BATCH
        )
    )
    assert set(parts.values()) == {1}, sorted(k for k, n in parts.items() if n > 1)[:5]
    return truths, ops


def _show(truths: dict, ops: list[dict]) -> None:
    """What was recorded, per rank and op type, beside the job's own times (in the log of
    a device run: the figures behind a failure)."""
    by: dict[tuple[int, str], list[float]] = defaultdict(list)
    for op in ops:
        by[op["rank"], op["optype"]].append(op["duration_ns"] / 1e6)
    for (rank, optype), ms in sorted(by.items()):
        print(
            f"rank {rank} {optype:<28} n={len(ms):<4} median {statistics.median(ms):9.3f} ms"
            f"  min {min(ms):9.3f}  max {max(ms):9.3f}"
        )
    for rank, truth in sorted(truths.items()):
        print(
            f"rank {rank} own events: forward {statistics.median(truth['forward_ms']):.3f} ms,"
            f" backward {statistics.median(truth['backward_ms']):.3f} ms, step "
            f"{statistics.median(truth['step_s']) * 1e3:.2f} ms"
        )


def _per_step_ms(ops: list[dict], rank: int, optype: str) -> dict[int, float]:
    """A rank's total recorded time of `optype` per step (ms)."""
    total: dict[int, float] = defaultdict(float)
    for op in ops:
        if op["rank"] == rank and op["optype"] == optype:
            total[op["step"]] += op["duration_ns"] / 1e6
    return dict(total)


def test_forward_times_are_the_devices_and_follow_a_device_slowdown(tmp_path: Path) -> None:
    """One rank on NCCL, forward 3x slower on the device in steps 12-21: every recorded
    forward equals the job's own event pair around it, slow steps included."""
    truths, ops = _run(tmp_path, world=1, backend="nccl", slow_rank=0, slow_phase="forward",
                       slow_factor=3.0, **WINDOW)  # fmt: skip
    truth = truths[0]
    recorded = _per_step_ms(ops, 0, "forward-compute")
    assert sorted(recorded) == list(range(1, WINDOW["steps"])), sorted(recorded)
    # The job's own events are the first and last thing the model's forward does, inside
    # lagscope's wrapper: the same interval but for the two events' records.
    for step, ms in recorded.items():
        own = truth["forward_ms"][step]
        assert own - 0.02 <= ms <= 1.03 * own + 0.1, (step, ms, own)
    slow = statistics.median(recorded[s] for s in range(12, 22))
    healthy = statistics.median(recorded[s] for s in range(3, 12))
    assert 2.5 < slow / healthy < 3.5, (slow, healthy)
    # DDP's gradient sync timed on the device: the step's last bucket, one op a step,
    # never longer than a step.
    buckets = [op for op in ops if op["optype"] == "separate-grads-all-reduce"]
    per_step = Counter(op["step"] for op in buckets)
    assert buckets and set(per_step.values()) == {1}, per_step
    step_ns = statistics.median(truth["step_s"]) * 1e9
    assert all(0 < op["duration_ns"] < step_ns for op in buckets), buckets[:3]


def test_a_host_stall_leaves_the_device_times_alone(tmp_path: Path) -> None:
    """One rank whose host stalls after forward and backward in steps 12-21: its recorded
    forward and backward keep their durations (as a GPU's kernels do when launched late);
    the step gets longer."""
    truths, ops = _run(tmp_path, world=1, backend="nccl", slow_rank=0, slow_phase="host",
                       slow_factor=3.0, **WINDOW)  # fmt: skip
    truth = truths[0]
    step_s = truth["step_s"]
    assert statistics.median(step_s[12:22]) > 1.5 * statistics.median(step_s[3:12]), step_s
    # Not read as slow compute: the stall planted after each op is not in it. An op whose
    # kernels the host then launches one by one into an idle device lasts as long as their
    # launches, which can be shorter or longer than its device time with a queue (one H100
    # run read backward 8.1 -> 11.6 ms beside a 16 ms stall), never the stall itself.
    stall_ms = statistics.median(truth["planted_ms"][12:22]) / 2  # after forward, backward
    for optype in ("forward-compute", "backward-compute"):
        recorded = _per_step_ms(ops, 0, optype)
        stalled = statistics.median(recorded[s] for s in range(12, 22))
        healthy = statistics.median(recorded[s] for s in range(3, 12))
        assert stalled - healthy < 0.4 * stall_ms, (optype, stalled, healthy, stall_ms)
    # The stall is where it happened: between forward's end and backward's start.
    for step in range(12, 22):
        (forward,) = [o for o in ops if o["step"] == step and o["optype"] == "forward-compute"]
        (backward,) = [o for o in ops if o["step"] == step and o["optype"] == "backward-compute"]
        gap_ms = (backward["start_ns"] - forward["start_ns"] - forward["duration_ns"]) / 1e6
        # (less what the device still had queued when the host began to stall)
        assert gap_ms >= 0.5 * truth["planted_ms"][step] / 2, (step, gap_ms, truth["planted_ms"])


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_four_ranks_on_one_gpu_record_the_straggler_on_the_device(
    tmp_path: Path, phase: str
) -> None:
    """Four ranks over gloo, rank 1 2x slower on the device in `phase` for steps 12-21:
    its recorded op grows by the device time planted in it.

    Its peers' ops are not asserted on: on one GPU shared by four processes their kernels
    wait for the straggler's time slices (one H200 run of two read a peer's forward 2.1x
    its earlier level there), which a GPU of its own per rank does not do."""
    op = f"{phase}-compute"
    truths, ops = _run(tmp_path, world=4, slow_rank=1, slow_phase=phase, **WINDOW)
    assert sorted(truths) == [0, 1, 2, 3]
    recorded = _per_step_ms(ops, 1, op)
    before = statistics.median(recorded[s] for s in range(3, 12))
    during = statistics.median(recorded[s] for s in range(12, 22))
    planted = statistics.median(truths[1]["planted_ms"][12:22])
    assert during - before >= 0.6 * planted, (before, during, planted)
