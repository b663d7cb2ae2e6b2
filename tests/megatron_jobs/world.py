"""A world of one rank in the test process: megatron's groups (all of size 1) on gloo, for
tests of the adapter that need no peers (hooks installed, steps, sampling, errors)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.torch_jobs.harness import free_port


@pytest.fixture(scope="module")
def megatron_world_of_one() -> Iterator[None]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this test process")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1
    )
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
