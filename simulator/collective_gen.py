"""Seeded collective-call sequences of one rank of a 1F1B pipeline-parallel job.

What a communication tracer sees on one rank, without step ids: the pipeline's p2p calls
(activations forward, gradients backward) in 1F1B order, then the data-parallel
collectives of the step (gradient reduce-scatter per bucket, the embedding all-reduce on
the first and last stage, the gradient-norm all-reduce, the parameter all-gather per
bucket under a distributed optimizer). Compute between calls carries jitter, a stretch of
steps can run slow, and the tracer may miss calls at random. The trace starts and ends
mid-iteration, as a real capture window does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from lagscope.simulator import optypes as ot


class PipelineRankShape(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    pp_size: int = Field(ge=1)
    stage: int = Field(ge=0)
    microbatches: int = Field(ge=1)
    #: Gradient buckets, each reduce-scattered once per step (sizes differ by bucket).
    dp_buckets: int = Field(default=2, ge=1)
    distributed_optimizer: bool = True
    activation_bytes: int = Field(default=16 * 2**20, ge=1)
    bucket_bytes: int = Field(default=256 * 2**20, ge=1)

    @model_validator(mode="after")
    def _stage_in_pipeline(self) -> PipelineRankShape:
        if self.stage >= self.pp_size:
            raise ValueError(f"stage {self.stage} outside a {self.pp_size}-stage pipeline")
        return self


@dataclass(frozen=True)
class CollectiveCalls:
    call_types: np.ndarray
    sizes: np.ndarray
    timestamps: np.ndarray
    #: Iteration each captured call belongs to (ground truth a tracer does not record).
    true_step: np.ndarray
    #: Start time of every iteration, plus the end of the last one.
    true_step_starts: np.ndarray


def _step_calls(shape: PipelineRankShape) -> list[tuple[str, int, float]]:
    """One iteration as (call type, size, compute seconds before the call, in forward units)."""
    first = shape.stage == 0
    last = shape.stage == shape.pp_size - 1
    warmup = min(shape.pp_size - shape.stage - 1, shape.microbatches)
    calls: list[tuple[str, int, float]] = []
    pending = 0.2 + shape.stage  # data loading, then waiting for the pipeline to fill

    def forward() -> None:
        nonlocal pending
        if not first:
            calls.append((ot.FORWARD_RECV, shape.activation_bytes, pending))
            pending = 0.0
        pending += 1.0
        if not last:
            calls.append((ot.FORWARD_SEND, shape.activation_bytes, pending))
            pending = 0.0

    def backward() -> None:
        nonlocal pending
        if not last:
            calls.append((ot.BACKWARD_RECV, shape.activation_bytes, pending))
            pending = 0.0
        pending += 2.0
        if not first:
            calls.append((ot.BACKWARD_SEND, shape.activation_bytes, pending))
            pending = 0.0

    for _ in range(warmup):
        forward()
    for _ in range(shape.microbatches - warmup):
        forward()
        backward()
    for _ in range(warmup):
        backward()
    pending += shape.stage * 0.5  # the pipeline drains
    bucket_sizes = [shape.bucket_bytes // (1 + b) for b in range(shape.dp_buckets)]
    for size in bucket_sizes:
        calls.append((ot.GRADS_REDUCE_SCATTER, size, pending))
        pending = 0.3
    if shape.pp_size > 1 and (first or last):
        calls.append((ot.EMBEDDING_GRADS_ALL_REDUCE, shape.bucket_bytes // 8, pending))
        pending = 0.1
    calls.append((ot.OPTIMIZER_CLIP_MAIN_GRAD, 4, pending))
    pending = 0.5  # the optimizer step
    if shape.distributed_optimizer:
        for size in bucket_sizes:
            calls.append((ot.PARAMS_ALL_GATHER, size, pending))
            pending = 0.3
    calls.append(("", 0, pending))  # time left until the next iteration starts
    return calls


def generate_collective_calls(
    rng: np.random.Generator,
    shape: PipelineRankShape,
    *,
    n_steps: int = 200,
    forward_s: float = 0.02,
    jitter_cv: float = 0.02,
    missing_fraction: float = 0.0,
    slow_steps: tuple[int, int, float] | None = None,
) -> CollectiveCalls:
    """`n_steps` iterations of one rank; `slow_steps` = (first, end, slowdown) of a slow stretch."""
    template = _step_calls(shape)
    per_step = len(template) - 1
    compute = np.array([units for _, _, units in template]) * forward_s
    types, sizes, times, steps, starts = [], [], [], [], []
    clock = 0.0
    for step in range(n_steps):
        starts.append(clock)
        factor = 1.0
        if slow_steps is not None and slow_steps[0] <= step < slow_steps[1]:
            factor += slow_steps[2]
        waits = compute * factor * (1.0 + jitter_cv * rng.standard_normal(compute.size))
        offsets = np.cumsum(np.maximum(waits, 0.0))
        for (call_type, size, _), offset in zip(template[:-1], offsets[:-1], strict=True):
            types.append(call_type)
            sizes.append(size)
            times.append(clock + offset)
            steps.append(step)
        clock += offsets[-1]
    starts.append(clock)
    # The capture window opens and closes mid-iteration.
    first = int(rng.integers(0, per_step))
    end = len(types) - int(rng.integers(0, per_step))
    kept = np.arange(first, end)
    kept = kept[rng.random(kept.size) >= missing_fraction]
    return CollectiveCalls(
        call_types=np.array(types)[kept],
        sizes=np.array(sizes, dtype=np.int64)[kept],
        timestamps=np.array(times)[kept],
        true_step=np.array(steps, dtype=np.int64)[kept],
        true_step_starts=np.array(starts),
    )
