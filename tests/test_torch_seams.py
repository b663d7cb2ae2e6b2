"""The torch functions lagscope.torch wraps, and the pipelining attributes it reads, are
still where and what it expects: an upgrade that moves one fails here, loudly."""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")

from lagscope.producers import torch_comm, torch_pipelining  # noqa: E402


def test_every_wrapped_torch_distributed_function_matches() -> None:
    assert torch_comm.check_seams() == []


def test_pipelining_attributes_match() -> None:
    assert torch_pipelining.check_pipelining_seams() == []


def test_public_hooks_exist() -> None:
    """The public seams the hooks use (no version check needed, but they must exist)."""
    module = torch.nn.Linear(2, 2)
    assert callable(module.register_forward_pre_hook)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    assert callable(optimizer.register_step_pre_hook)
    assert callable(optimizer.register_step_post_hook)
    assert callable(torch.autograd.graph.register_multi_grad_hook)
    ddp = torch.nn.parallel.DistributedDataParallel
    assert "hook" in inspect.signature(ddp.register_comm_hook).parameters


def test_a_moved_seam_is_reported_and_nothing_is_patched(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    def isend(tensor: object, destination: int, group: object = None) -> None:  # renamed dst
        raise AssertionError("never called")

    monkeypatch.setattr(c10d, "isend", isend)
    monkeypatch.setattr(dist, "isend", isend)
    problems = torch_comm.check_seams()
    assert len(problems) == 1 and "torch.distributed.isend" in problems[0]
    all_reduce = dist.all_reduce
    with pytest.raises(torch_comm.SeamError, match="isend"):
        torch_comm.install(object())  # type: ignore[arg-type]
    assert dist.all_reduce is all_reduce
