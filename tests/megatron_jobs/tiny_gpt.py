"""A tiny GPT-like model trained through megatron-core's real 1F1B schedule on CPU.

    python -m tests.megatron_jobs.tiny_gpt --log-dir DIR/logs [--steps 6] [--microbatches 4]

Launched by the torch job harness (`tests.torch_jobs.harness`: 4 gloo ranks on 127.0.0.1,
one thread each) as TP 1 x PP 2 x DP 2: stage 0 holds the word embedding
and a layer, stage 1 a layer and the output projection tied to the embedding (megatron's
`finalize_model_grads` all-reduces the tied weight's gradient over the embedding group).
The schedule is the unmodified `forward_backward_pipelining_without_interleaving`, the
DP gradient sync and the embedding all-reduce are megatron-core's `finalize_model_grads`
(the model chunk's `finish_grad_sync` all-reduces over the DP group), the optimizer is
megatron-core's `ChainedOptimizer` over an `FP32Optimizer` (SGD). The only instrumentation
is one `lagscope.megatron.monitor(...)` call per rank; the CPU work-arounds are in
`tests.megatron_jobs.cpu`. Each rank writes its lagscope log under DIR/logs and a summary
(losses, a parameter checksum) to DIR/rank-<r>.json.
"""

from __future__ import annotations

import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.torch_jobs.harness import Knobs, main_for

JOB_ID = "megatron-tiny-gpt"
VOCAB = 64
HIDDEN = 64
SEQ = 16
MICRO_BATCH = 2
WORLD = 4
PP = 2


class TinyGPTStage(torch.nn.Module):
    """One pipeline stage: [embedding] -> layer -> [tied output projection + loss]."""

    def __init__(
        self, config: Any, pre_process: bool, post_process: bool, hidden: int = HIDDEN
    ) -> None:
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.enums import ModelType

        super().__init__()
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.ddp_config = DistributedDataParallelConfig()
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = True
        shared = torch.nn.Parameter(torch.randn(VOCAB, hidden, generator=_seeded(1)) * 0.1)
        if pre_process:
            self.word_embeddings = shared
        else:
            self.output_weight = shared
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(hidden, 4 * hidden),
            torch.nn.GELU(),
            torch.nn.Linear(4 * hidden, hidden),
        )
        self.input_tensor: torch.Tensor | None = None
        #: A straggler's forward: `(knobs, rank)` when the job plants one, and the step.
        self.straggler: tuple[Knobs, int] | None = None
        self.step = 0

    def set_input_tensor(self, input_tensor: Any) -> None:
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def shared_embedding_or_output_weight(self) -> torch.nn.Parameter:
        return self.word_embeddings if self.pre_process else self.output_weight

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.pre_process:
            hidden = self.word_embeddings[tokens].transpose(0, 1).contiguous()  # [s, b, h]
        else:
            hidden = self.input_tensor
        began = time.perf_counter()
        hidden = hidden + self.layers(hidden)
        if self.straggler is not None:
            knobs, rank = self.straggler
            if knobs.slow(rank, self.step, "forward"):
                extra = knobs.stall_ms / 1e3 or (knobs.slow_factor - 1.0) * (
                    time.perf_counter() - began
                )
                knobs.pause(extra)
        if not self.post_process:
            return hidden
        logits = hidden @ self.shared_embedding_or_output_weight().t()
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), labels.transpose(0, 1).reshape(-1), reduction="none"
        )

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """The DP gradient sync megatron's finalize_model_grads asks each model chunk for."""
        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group()
        for param in self.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad, group=group)
                param.grad /= group.size()


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def batches(dp_rank: int, steps: int, microbatches: int):
    """The same tokens on both stages of a pipeline replica, different per DP rank."""
    for step in range(steps):
        for micro in range(microbatches):
            generator = _seeded(10_000 * step + 100 * micro + dp_rank)
            tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator)
            yield tokens[:, :-1], tokens[:, 1:]


def forward_step(data_iterator: Any, model: TinyGPTStage):
    tokens, labels = next(data_iterator)
    return model(tokens, labels), partial(_loss, model)


def _loss(model: TinyGPTStage, per_token: torch.Tensor):
    loss = per_token.mean()
    return loss, {"lm loss": loss.detach()}


def run_rank(rank: int, knobs: Knobs) -> None:
    """The 1F1B job: one model chunk per rank."""
    _train(rank, knobs, chunks=1)


def run_rank_interleaved(rank: int, knobs: Knobs) -> None:
    """The interleaved job: two model chunks per rank (virtual pipeline size 2), with the
    p2p transfers overlapped with compute (megatron waits for their handles later)."""
    _train(rank, knobs, chunks=2)


def _train(rank: int, knobs: Knobs, chunks: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    import lagscope.megatron
    from tests.megatron_jobs.cpu import CpuP2PCommunicator, cuda_tensors_on_cpu

    interleaved = chunks > 1
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=knobs.pp,
        virtual_pipeline_model_parallel_size=chunks if interleaved else None,
    )
    config = TransformerConfig(
        num_layers=knobs.pp * chunks,
        hidden_size=knobs.hidden,
        num_attention_heads=1,
        pipeline_model_parallel_size=knobs.pp,
        virtual_pipeline_model_parallel_size=chunks if interleaved else None,
        overlap_p2p_comm=interleaved,
        pipeline_dtype=torch.float32,
        batch_p2p_comm=False,
        finalize_model_grads_func=finalize_model_grads,
    )
    stage = parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(stage)  # DP replicas of a stage start equal
    model = [
        TinyGPTStage(
            config,
            pre_process=stage == 0 and chunk == 0,
            post_process=stage == knobs.pp - 1 and chunk == chunks - 1,
            hidden=knobs.hidden,
        )
        for chunk in range(chunks)
    ]
    for chunk in model:
        chunk.straggler = (knobs, rank)
    parameters = [p for chunk in model for p in chunk.parameters()]
    with cuda_tensors_on_cpu():
        optimizer = ChainedOptimizer(
            [
                FP32Optimizer(
                    torch.optim.SGD(parameters, lr=0.05),
                    OptimizerConfig(optimizer="sgd", lr=0.05, clip_grad=0.0),
                    init_state_fn=None,
                )
            ]
        )
    monitor = lagscope.megatron.monitor(
        job_id=knobs.job_id, log_dir=knobs.log_dir, optimizer=optimizer, gc_probe=False
    )
    communicator = CpuP2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config)
    pg_collection = _process_groups()
    steps, microbatches = knobs.steps, knobs.microbatches
    dp_rank = parallel_state.get_data_parallel_rank()
    # Every chunk reads one batch per micro-batch (the first uses the tokens, the last the
    # labels), so each has its own copy of the stream.
    data = [batches(dp_rank, steps, microbatches) for _ in range(chunks)]
    losses = []
    forward_backward = get_forward_backward_func()
    for step in range(steps):
        for chunk in model:
            chunk.step = step
        optimizer.zero_grad()
        with cuda_tensors_on_cpu():
            outputs = forward_backward(
                forward_step_func=forward_step,
                data_iterator=data if interleaved else data[0],
                model=model,
                num_microbatches=microbatches,
                seq_length=SEQ,
                micro_batch_size=MICRO_BATCH,
                p2p_communicator=communicator,
                pg_collection=pg_collection,
            )
            # A slow host after the schedule returned (its update starts late), or after
            # the update (its next step starts late while its peers' have begun).
            knobs.host_stall(rank, step, 0.0, "update")
            optimizer.step()
            knobs.host_stall(rank, step, 0.0, "step")
        losses.append([float(o["lm loss"]) for o in outputs])
    monitor.close()
    checksum = float(sum(p.detach().double().sum() for p in parameters))
    summary = {
        "rank": rank,
        "stage": stage,
        "dp_rank": dp_rank,
        "losses": losses,
        "checksum": checksum,
    }
    (Path(knobs.log_dir).parent / f"rank-{rank}.json").write_text(json.dumps(summary))


def _process_groups() -> Any:
    """The groups the schedule would build itself (it needs them with a communicator)."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = ProcessGroupCollection()
    groups.tp = ps.get_tensor_model_parallel_group()
    groups.cp = ps.get_context_parallel_group()
    groups.pp = ps.get_pipeline_model_parallel_group()
    groups.embd = ps.get_embedding_group(check_initialized=False)
    groups.pos_embd = ps.get_position_embedding_group(check_initialized=False)
    groups.dp = ps.get_data_parallel_group()
    groups.dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
    return groups


def main() -> None:
    main_for(
        run_rank, __doc__.splitlines()[0], job_id=JOB_ID, world=WORLD, pp=PP, steps=6,
        microbatches=4, hidden=HIDDEN,
    )  # fmt: skip


if __name__ == "__main__":
    main()
