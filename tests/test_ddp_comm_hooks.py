"""DDP's gradient buckets timed through its comm hook: the default all-reduce (lagscope's
own copy of torch's hook, with the bucket's end in the one `then` it needs) and a job's own
hook (`monitor(..., ddp_comm_hook=(hook, state))`) leave the gradients as DDP without the
monitor makes them, and record one op per bucket (on a GPU, the step's last bucket only).
A world of one gloo rank in this process."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from tests.torch_jobs.harness import free_port, recorded_ops  # noqa: E402

STEPS = 4


@pytest.fixture
def world_of_one() -> Iterator[None]:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Complex(torch.nn.Module):
    """Complex weights: DDP all-reduces their gradients as real views."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(64, 64, dtype=torch.cfloat))

    def forward(self, x: object) -> object:
        return (x.to(torch.cfloat) @ self.weight).abs()


def _gradients(
    log_dir: Path | None, hook: object = None, complex_layer: bool = False
) -> list[list[object]]:
    """Each step's gradients of a small DDP model with several buckets, monitored into
    `log_dir` when given, with `hook` as its comm hook when given."""
    from torch.nn.parallel import DistributedDataParallel

    import lagscope.torch

    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64) for _ in range(6)]
    model = torch.nn.Sequential(*layers, *([_Complex()] if complex_layer else []))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.02)  # about one layer a bucket
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    monitor = None
    if log_dir is not None:
        extra = {"ddp_comm_hook": (hook, None)} if hook is not None else {}
        monitor = lagscope.torch.monitor(
            model=ddp, optimizer=optimizer, job_id="hooks", log_dir=log_dir, gc_probe=False,
            mode="host", **extra,
        )  # fmt: skip
    elif hook is not None:
        ddp.register_comm_hook(None, hook)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    steps = []
    for _ in range(STEPS):
        ddp(x).square().mean().backward()
        steps.append([p.grad.clone() for p in ddp.parameters()])
        optimizer.step()
        optimizer.zero_grad()
    if monitor is not None:
        monitor.close()
    return steps


def _assert_same(monitored: list[list[object]], plain: list[list[object]]) -> None:
    for step, (ours, theirs) in enumerate(zip(monitored, plain, strict=True)):
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a, b), step


def _buckets_per_step(log_dir: Path) -> Counter[int]:
    ops = [op for op in recorded_ops(log_dir) if op["optype"] == "separate-grads-all-reduce"]
    assert all(op["duration_ns"] >= 0 for op in ops)
    return Counter(op["step"] for op in ops)


def test_the_default_all_reduce_leaves_the_gradients_and_records_every_bucket(
    world_of_one: None, tmp_path: Path
) -> None:
    _assert_same(_gradients(tmp_path / "logs"), _gradients(None))
    per_step = _buckets_per_step(tmp_path / "logs")
    # DDP's first step (re-bucketing) is not recorded; then the same buckets every step.
    assert sorted(per_step) == list(range(1, STEPS))
    assert len(set(per_step.values())) == 1 and per_step[1] >= 3, per_step


def test_complex_gradients_are_all_reduced_as_ddp_does(world_of_one: None, tmp_path: Path) -> None:
    _assert_same(
        _gradients(tmp_path / "logs", complex_layer=True), _gradients(None, complex_layer=True)
    )


def test_a_jobs_own_comm_hook_runs_and_its_buckets_are_recorded(
    world_of_one: None, tmp_path: Path
) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = default_hooks.fp16_compress_hook  # rounds the gradients: its effect shows
    monitored = _gradients(tmp_path / "logs", hook)
    _assert_same(monitored, _gradients(None, hook))
    with pytest.raises(AssertionError):
        _assert_same(monitored, _gradients(None))
    per_step = _buckets_per_step(tmp_path / "logs")
    assert sorted(per_step) == list(range(1, STEPS)) and per_step[1] >= 3, per_step


@pytest.mark.parametrize("own_hook", [False, True])
def test_on_the_device_clock_only_the_last_bucket_is_timed(
    world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_hook: bool
) -> None:
    """On a GPU each timed bucket costs the backward's launches two CUDA events: the step's
    last bucket alone is timed, from the end of backward to the gradient sync's end. Here
    the timer says it is on the device clock (its ops still read the host's)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from lagscope.producers.timer import OpTimer

    hook = default_hooks.allreduce_hook if own_hook else None
    monkeypatch.setattr(OpTimer, "on_host_clock", property(lambda self: False))
    _assert_same(_gradients(tmp_path / "logs", hook), _gradients(None, hook))
    ops = recorded_ops(tmp_path / "logs")
    for step in range(1, STEPS):
        of_step = {op["optype"]: op for op in ops if op["step"] == step}
        buckets = [
            o for o in ops if o["step"] == step and o["optype"] == "separate-grads-all-reduce"
        ]
        assert len(buckets) == 1, (step, buckets)
        (bucket,) = buckets
        assert bucket["microbatch"] >= 2  # DDP launches its buckets in index order
        backward, optimizer = of_step["backward-compute"], of_step["optimizer"]
        backward_end = backward["start_ns"] + backward["duration_ns"]
        assert backward_end - 1e6 <= bucket["start_ns"]
        assert bucket["start_ns"] + bucket["duration_ns"] <= optimizer["start_ns"]
