"""The job record and sampling of lagscope.torch, in one process (a world of one rank on
gloo, and the schedule alone); the multi-rank layouts are in test_torch_jobs.py."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

import lagscope.torch  # noqa: E402
from lagscope.producers.torch_layout import LayoutError, derive_layout  # noqa: E402
from lagscope.producers.torch_sampling import Schedule  # noqa: E402
from tests.torch_jobs.harness import free_port, job_records, recorded_ops  # noqa: E402


@pytest.fixture
def world_of_one(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_schedule_matches_torch_profiler_words() -> None:
    assert Schedule().recorded_steps(3) == [0, 1, 2]
    assert Schedule(wait=2, active=1).recorded_steps(9) == [2, 5, 8]
    assert Schedule(skip_first=2, wait=1, active=2, repeat=2).recorded_steps(12) == [3, 4, 6, 7]
    with pytest.raises(ValueError, match="active must be >= 1, got 0"):
        Schedule(active=0)
    with pytest.raises(ValueError, match="wait must be >= 0, got -1"):
        Schedule(wait=-1)


def test_monitor_needs_process_groups(tmp_path: Path) -> None:
    with pytest.raises(LayoutError, match="after init_process_group"):
        lagscope.torch.monitor(job_id="j", log_dir=tmp_path)


def test_monitor_needs_a_job_id(world_of_one: None, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    for name in ("LAGSCOPE_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="needs a job id shared by every rank"):
        lagscope.torch.monitor(log_dir=tmp_path)


def test_sizes_that_do_not_multiply_to_the_world_are_named(world_of_one: None) -> None:
    with pytest.raises(LayoutError, match="unknown group role"):
        derive_layout({"xp": dist.group.WORLD})
    layout = derive_layout({})
    assert (layout.dp_size, layout.pp_size, layout.coords["dp"]) == (1, 1, 0)


def test_single_process_job_without_optimizer_uses_the_step_marker(
    world_of_one: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LAGSCOPE_JOB_ID", "from-env")
    monkeypatch.setenv("LAGSCOPE_LOG_DIR", str(tmp_path / "logs"))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    data = [torch.randn(4, 8) for _ in range(3)]
    monitor = lagscope.torch.monitor(model=model, data=data, gc_probe=False,
                                     schedule=lagscope.torch.schedule(skip_first=1))  # fmt: skip
    for x in monitor.data:  # a list cannot be changed in place: iterate what monitor gives
        model(x).sum().backward()
        dist.all_reduce(torch.ones(1))  # the world is the data-parallel group here
        monitor.step()
    monitor.close()
    ops = recorded_ops(tmp_path / "logs")
    assert {op["step"] for op in ops} == {1, 2}
    kinds = sorted((op["step"], op["optype"]) for op in ops)
    per_step = ["backward-compute", "forward-compute", "input-wait", "separate-grads-all-reduce"]
    assert kinds == [(s, t) for s in (1, 2) for t in per_step]
    (info,) = job_records(tmp_path / "logs")
    assert info.job_id == "from-env" and info.world_size == 1
    # close() removed every wrapper and hook.
    assert not hasattr(dist.all_reduce, "__wrapped_by_lagscope__")
    assert not model._forward_pre_hooks
