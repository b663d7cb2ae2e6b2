"""Test-only work-arounds that let megatron-core 0.19's real schedule run on CPU.

Never part of the shipped adapter. Of the CUDA-only allocations megatron-core 0.19 makes,
the adapter's CPU test job needs two worked around:

- the schedules allocate one tensor with a hard-coded `device="cuda"` (the token count):
  `cuda_tensors_on_cpu()` maps that device argument to the CPU for the schedule call;
- `P2PCommunicator` allocates its receive buffers on `torch.cuda.current_device()`:
  `CpuP2PCommunicator` makes them on the CPU and moves them with megatron-core's own
  `_p2p_ops` (the job passes it as `p2p_communicator=`, a public argument).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator, _p2p_ops
from torch.overrides import TorchFunctionMode


class cuda_tensors_on_cpu(TorchFunctionMode):
    """Within the block, a tensor asked for on "cuda" is made on the CPU."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device == "cuda" or (isinstance(device, torch.device) and device.type == "cuda"):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


class CpuP2PCommunicator(P2PCommunicator):
    """megatron-core's communicator with CPU receive buffers (non-batched p2p only)."""

    def _communicate(
        self,
        *,
        tensor_send_next: torch.Tensor | None,
        tensor_send_prev: torch.Tensor | None,
        recv_prev: bool,
        recv_next: bool,
        tensor_shape: Any,
        wait_on_reqs: bool = True,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, Any]:
        def buffer() -> torch.Tensor:
            return torch.empty(tensor_shape, requires_grad=True, dtype=self.config.pipeline_dtype)

        tensor_recv_prev = buffer() if recv_prev else None
        tensor_recv_next = buffer() if recv_next else None
        requests = _p2p_ops(
            tensor_send_prev=tensor_send_prev,
            tensor_recv_prev=tensor_recv_prev,
            tensor_send_next=tensor_send_next,
            tensor_recv_next=tensor_recv_next,
            group=self.pp_group,
            prev_pipeline_rank=self.prev_rank,
            next_pipeline_rank=self.next_rank,
        )
        if wait_on_reqs:
            for request in requests.values():
                request.wait()
            requests = None
        return tensor_recv_prev, tensor_recv_next, requests
