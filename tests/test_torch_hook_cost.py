"""The backward's end costs one hook call per backward, whatever the number of parameters:
a hook on every parameter cost ~1.5 us each per micro-batch (300 us for a 200-parameter
chunk). A world of one gloo rank in this process; and the Python calls a recorded step
makes, in a two-rank pipeline (`tests/torch_jobs/hook_calls.py`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.torch_jobs.harness import free_port, recorded_ops  # noqa: E402


def test_after_the_first_backward_one_hook_ends_each_backward(tmp_path: Path) -> None:
    import torch.distributed as dist

    import lagscope.torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(50)])
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        monitor = lagscope.torch.monitor(
            modules=[model], optimizer=optimizer, job_id="hooks", log_dir=tmp_path / "logs",
            gc_probe=False, mode="host",
        )  # fmt: skip
        (hooks,) = monitor.module_hooks
        calls = []
        last_gradient = hooks._last_gradient
        hooks._last_gradient = lambda grad: (calls.append(1), last_gradient(grad))[1]
        x = torch.ones(4, 8)
        for _ in range(4):
            for _ in range(2):  # two micro-batches
                model(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        n_handles = len(hooks.handles)
        monitor.close()
    finally:
        dist.destroy_process_group()
    assert n_handles == 1  # one hook, on the parameter whose gradient comes last
    # The first backward learns; each later one ends through that single hook.
    assert len(calls) == 4 * 2 - 1
    backward = [op for op in recorded_ops(tmp_path / "logs") if op["optype"] == "backward-compute"]
    assert sorted((op["step"], op["microbatch"]) for op in backward) == [
        (step, m) for step in range(4) for m in range(2)
    ]
    assert all(op["duration_ns"] > 0 for op in backward)


def test_one_chunk_backward_starts_from_the_backward_call_not_a_hook_per_forward(
    tmp_path: Path,
) -> None:
    """With one chunk on the rank, no tensor hook is registered per forward (~2 us each):
    the wrapped `torch.autograd.backward` starts each backward, in forward order. A job
    whose backward bypasses the wrapper (a reference taken before the monitor started)
    loses that one backward op and is caught by tensor hooks from the next forward on.
    Closing the monitor gives torch its own function back."""
    import torch.distributed as dist

    import lagscope.torch

    original_backward = torch.autograd.backward
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        monitor = lagscope.torch.monitor(
            modules=[model], optimizer=optimizer, job_id="calls", log_dir=tmp_path / "logs",
            gc_probe=False, mode="host",
        )  # fmt: skip
        assert torch.autograd.backward is not original_backward
        x = torch.ones(4, 8)
        outputs = []
        for step in range(4):
            forwards = [model(x) for _ in range(2)]  # two forwards, then their backwards
            outputs += forwards
            for loss in [out.sum() for out in forwards]:
                if step == 2:
                    original_backward(loss)  # not seen by the wrapper
                else:
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        (hooks,) = monitor.module_hooks
        by_call_after = hooks.by_call
        monitor.close()
    finally:
        dist.destroy_process_group()
    assert torch.autograd.backward is original_backward
    # Steps 0 and 1 registered no hook on their forwards' outputs.
    assert [out._backward_hooks for out in outputs[:4]] == [None] * 4
    assert all(out._backward_hooks for out in outputs[6:])
    assert by_call_after is False
    backward = sorted(
        (op["step"], op["microbatch"])
        for op in recorded_ops(tmp_path / "logs")
        if op["optype"] == "backward-compute"
    )
    assert backward == [(0, 0), (0, 1), (1, 0), (1, 1), (3, 0), (3, 1)], backward


def test_a_recorded_pipeline_step_costs_its_training_thread_few_python_calls(
    tmp_path: Path,
) -> None:
    """Python calls are the unit of what recording costs the training thread: about a
    microsecond each in a real job. A recorded step of a two-stage pipeline (forward,
    backward, a send, a receive and the optimizer: 5 ops a rank) makes at most 2 calls into
    lagscope per op more than an unrecorded one: 6 a rank-step (each p2p work's wrapping
    and its wait, the backward's start from its call), 7 when the step-time check
    refreshes. With each
    p2p op timed
    through helper methods (its code, begin, the work's wrapping, its completion, end: 7
    calls) and the backward's start and end through two more each, it made 22."""
    import json
    import statistics

    from tests.torch_jobs import hook_calls
    from tests.torch_jobs.harness import Knobs, launch

    knobs = Knobs(log_dir=str(tmp_path / "logs"), job_id="calls", world=2, pp=2, steps=12,
                  hidden=8)  # fmt: skip
    launch(hook_calls.worker, knobs)
    ops = recorded_ops(tmp_path / "logs")
    for rank in range(2):
        steps = json.loads((tmp_path / "calls" / f"rank-{rank}.json").read_text())
        # After the first steps: the first backward learns whose gradient comes last.
        later = steps[4:]
        recorded = [sum(s["calls"].values()) for s in later if s["recorded"]]
        unrecorded = [sum(s["calls"].values()) for s in later if not s["recorded"]]
        assert len(recorded) == len(unrecorded) == 4
        per_step = {op["step"] for op in ops if op["rank"] == rank}
        op_count = len([op for op in ops if op["rank"] == rank]) / len(per_step)
        assert op_count == 5, op_count
        extra = statistics.median(recorded) - statistics.median(unrecorded)
        assert extra <= 2 * op_count, (rank, extra, later[4]["calls"], later[5]["calls"])
