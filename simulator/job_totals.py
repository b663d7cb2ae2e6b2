"""What a job attempt's steps add up to: GPU-seconds, the part above the straggler-free
step, MFU, and the latest steps' slowdowns for a step chart. Both hosts keep one per job
(`job_story.LiveJob.totals`), and a step closed again takes its first figures back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from lagscope.simulator.whatif import WhatIfResult


class JobSize(Protocol):
    """What the totals need to know of a job: its GPUs, and for MFU its model's FLOPs per
    step and one GPU's peak (a host's job record, or a trace's `JobMeta`)."""

    @property
    def world_size(self) -> int: ...

    @property
    def model_flops_per_step(self) -> float | None: ...

    @property
    def gpu_peak_flops(self) -> float | None: ...


#: Step ids and slowdowns kept for a job's step chart (the latest ones).
STEP_SERIES_KEPT = 4096


@dataclass
class JobTotals:
    """Sums over every closed step of a job attempt."""

    steps: int = 0
    analysed_steps: int = 0
    complete_steps: int = 0
    incomplete_steps: int = 0
    gpu_seconds: float = 0.0
    #: GPU-seconds above the straggler-free step time: stragglers and the job's jitter.
    gpu_seconds_above_ideal: float = 0.0
    mfu_actual_sum: float = 0.0
    mfu_ideal_sum: float = 0.0
    mfu_steps: int = 0
    last_step: int = -1
    last_step_start_ns: int = 0
    #: The latest analysed steps and their slowdown S, for a step chart.
    step_ids: list[int] = field(default_factory=list)
    step_slowdown: list[float] = field(default_factory=list)

    @property
    def mfu_actual(self) -> float | None:
        return self.mfu_actual_sum / self.mfu_steps if self.mfu_steps else None

    @property
    def mfu_ideal(self) -> float | None:
        return self.mfu_ideal_sum / self.mfu_steps if self.mfu_steps else None

    def add(self, step: int, start_ns: int, complete: bool, result: WhatIfResult | None,
            info: JobSize) -> None:  # fmt: skip
        self.steps += 1
        if step >= self.last_step:
            self.last_step, self.last_step_start_ns = step, start_ns
        figures = None
        if result is not None:
            figures = (
                float(result.t_actual[0]), float(result.t_ideal[0]),
                float(result.step_slowdown[0]),
            )  # fmt: skip
        self.count(figures, info, complete=complete)
        if figures is not None:
            self.step_ids = [*self.step_ids, step][-STEP_SERIES_KEPT:]
            self.step_slowdown = [*self.step_slowdown, figures[2]][-STEP_SERIES_KEPT:]

    def count(
        self,
        figures: tuple[float, float, float] | None,
        info: JobSize,
        *,
        complete: bool,
        sign: int = 1,
    ) -> None:
        """Count a step's (actual, ideal, slowdown) in (`sign` -1: take them back, when a
        step closed again replaces them)."""
        if complete:
            self.complete_steps += sign
        else:
            self.incomplete_steps += sign
        if figures is None:
            return
        self.analysed_steps += sign
        actual, ideal, slowdown = figures
        gpu_seconds = actual * info.world_size
        self.gpu_seconds += sign * gpu_seconds
        self.gpu_seconds_above_ideal += sign * gpu_seconds * (1 - 1 / slowdown)
        if info.model_flops_per_step and info.gpu_peak_flops:
            peak = info.world_size * info.gpu_peak_flops
            self.mfu_actual_sum += sign * info.model_flops_per_step / (actual * peak)
            self.mfu_ideal_sum += sign * info.model_flops_per_step / (ideal * peak)
            self.mfu_steps += sign
