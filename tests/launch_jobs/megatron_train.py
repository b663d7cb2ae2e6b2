"""A megatron-core training script: its real 1F1B schedule over a tiny GPT-like model
(`tests.megatron_jobs.tiny_gpt`'s stages, with the CPU work-arounds of
`tests.megatron_jobs.cpu`), 2 pipeline stages, data parallel over the rest of the world
(gloo): run it with torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 4 megatron_train.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.*

import torch
import torch.distributed as dist
from straggler import Accelerator, parse, rank

MICROBATCHES = 4
PP = 2


def main() -> None:
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    from tests.megatron_jobs.cpu import CpuP2PCommunicator, cuda_tensors_on_cpu
    from tests.megatron_jobs.tiny_gpt import HIDDEN, MICRO_BATCH, SEQ, TinyGPTStage, batches
    from tests.megatron_jobs.tiny_gpt import _process_groups as process_groups

    args = parse(__doc__.splitlines()[0])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    pp = PP
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    config = TransformerConfig(
        num_layers=pp, hidden_size=HIDDEN, num_attention_heads=1,
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, batch_p2p_comm=False,
        finalize_model_grads_func=finalize_model_grads,
    )  # fmt: skip
    stage = parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(stage)
    model = TinyGPTStage(config, pre_process=stage == 0, post_process=stage == pp - 1)
    accelerator = Accelerator(args, rank())
    with cuda_tensors_on_cpu():
        optimizer = ChainedOptimizer([FP32Optimizer(
            torch.optim.SGD(model.parameters(), lr=0.05),
            OptimizerConfig(optimizer="sgd", lr=0.05, clip_grad=0.0), init_state_fn=None,
        )])  # fmt: skip

    def forward_step(data_iterator, chunk):
        tokens, labels = next(data_iterator)
        output = accelerator(chunk(tokens, labels))
        return output, lambda per_token: (per_token.mean(), {"lm loss": per_token.mean()})

    communicator = CpuP2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config)
    groups = process_groups()
    data = batches(parallel_state.get_data_parallel_rank(), args.steps, MICROBATCHES)
    forward_backward = get_forward_backward_func()
    for iteration in range(args.steps):
        accelerator.step = iteration
        optimizer.zero_grad()
        with cuda_tensors_on_cpu():
            forward_backward(
                forward_step_func=forward_step, data_iterator=data, model=[model],
                num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
                p2p_communicator=communicator, pg_collection=groups,
            )  # fmt: skip
            optimizer.step()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
