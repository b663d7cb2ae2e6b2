"""Synthetic 3D-parallel training jobs with injected stragglers, and their ground truth.

A job is simulated forward with the same timeline engine the analysis uses: the schedule
(Megatron 1F1B, or interleaved 1F1B when vpp > 1) is laid out as a skeleton step whose op
order the dependency inference turns into the job's dependency model, then every
(step, DP rank) is simulated with sampled costs. The result is a `Trace` in the reference
format plus a `GroundTruth`: the same job simulated without the injections gives the true
slowdown of every step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from lagscope.simulator import optypes as ot
from lagscope.simulator.depmodel import DependencyModel, infer_dependency_model
from lagscope.simulator.engine import compile_model, simulate
from lagscope.simulator.trace import JobMeta, Trace


class _Injection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    #: First affected step index (0-based position in the generated run) and the first
    #: unaffected one; None = from the start / to the end.
    start_step: int = Field(default=0, ge=0)
    end_step: int | None = Field(default=None, ge=1)

    def active(self, n_steps: int) -> np.ndarray:
        steps = np.arange(n_steps)
        end = n_steps if self.end_step is None else self.end_step
        return (steps >= self.start_step) & (steps < end)


class SlowWorker(_Injection):
    """One worker's compute runs `factor` times slower (thermal throttling, bad GPU)."""

    kind: Literal["slow_worker"] = "slow_worker"
    dp: int = Field(ge=0)
    stage: int = Field(ge=0)
    factor: float = Field(gt=0)


class LastStageImbalance(_Injection):
    """The last stage's compute is `factor` times heavier (loss layer, uneven partition)."""

    kind: Literal["last_stage_imbalance"] = "last_stage_imbalance"
    factor: float = Field(gt=0)


class SequenceImbalance(_Injection):
    """Micro-batch cost follows the sum of squared document lengths it packs.

    Documents are drawn from a long-tailed (log-normal) length distribution; attention cost
    grows with the square of a document's length, so micro-batches holding a long document
    are slower in both forward and backward.
    """

    kind: Literal["sequence_imbalance"] = "sequence_imbalance"
    tokens_per_microbatch: PositiveInt = 4096
    mean_document_tokens: PositiveFloat = 600.0
    length_sigma: PositiveFloat = 1.2
    #: Share of compute that is attention (quadratic in length); the rest is linear.
    attention_share: float = Field(default=0.5, ge=0, le=1)


class GcPauses(_Injection):
    """Python GC pauses on random ranks, during forward compute only; with `dp` and
    `stage`, only that worker's (a rank whose heap grew: its collections, not its peers').
    With `between_ops`, a pause holds back the forward's launch instead of stretching it:
    ops timed on a GPU, whose kernels keep their time while the host collects."""

    kind: Literal["gc_pauses"] = "gc_pauses"
    #: Probability that a given forward compute is hit by a pause.
    probability: float = Field(default=0.05, ge=0, le=1)
    pause_s: PositiveFloat = 0.2
    dp: int | None = Field(default=None, ge=0)
    stage: int | None = Field(default=None, ge=0)
    between_ops: bool = False


class SlowLink(_Injection):
    """Transfers on one link are `factor` times slower.

    `stage` alone: the DP collectives of that stage (its DP group). With `dp` too: the
    pipeline link from (dp, stage) to (dp, stage + 1), both directions.
    """

    kind: Literal["slow_link"] = "slow_link"
    stage: int = Field(ge=0)
    dp: int | None = Field(default=None, ge=0)
    factor: float = Field(gt=0)
    #: Alternate slow and healthy every `flap_period` steps (0: always slow).
    flap_period: int = Field(default=0, ge=0)


class LaunchDelay(_Injection):
    """CPU contention on one worker: every op launches `delay_s` late (on average)."""

    kind: Literal["launch_delay"] = "launch_delay"
    dp: int = Field(ge=0)
    stage: int = Field(ge=0)
    delay_s: PositiveFloat = 0.005


Injection = Annotated[
    SlowWorker | LastStageImbalance | SequenceImbalance | GcPauses | SlowLink | LaunchDelay,
    Field(discriminator="kind"),
]


class CostModel(BaseModel):
    """Nominal costs (seconds) of one micro-batch and of the per-step collectives."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    forward_s: PositiveFloat = 0.06
    backward_factor: PositiveFloat = 2.0
    #: Extra compute of the first stage (embedding) and last stage (loss, output layer).
    first_stage_extra: float = Field(default=0.05, ge=0)
    last_stage_extra: float = Field(default=0.15, ge=0)
    p2p_s: PositiveFloat = 0.002
    params_all_gather_s: PositiveFloat = 0.02
    grads_reduce_scatter_s: PositiveFloat = 0.05
    embedding_all_reduce_s: PositiveFloat = 0.01
    layernorm_all_reduce_s: PositiveFloat = 0.0005
    clip_s: PositiveFloat = 0.002
    optimizer_s: PositiveFloat = 0.03
    #: Coefficient of variation of every sampled cost (log-normal noise).
    noise_cv: float = Field(default=0.02, ge=0, le=1)
    #: Mean launch gap between dependent ops (CPU-side work), exponential.
    launch_gap_s: float = Field(default=0.0002, ge=0)


class JobSpec(BaseModel):
    """Shape, costs and injected stragglers of a synthetic job."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "synthetic"
    dp: PositiveInt = 4
    pp: PositiveInt = 4
    tp: PositiveInt = 1
    vpp: PositiveInt = 1
    microbatches: PositiveInt = 8
    steps: PositiveInt = 20
    first_step_id: int = Field(default=0, ge=0)
    dp_comm: bool = True
    overlapped_dp: bool = False
    cost: CostModel = CostModel()
    stragglers: tuple[Injection, ...] = ()
    seed: int = 0
    model_flops_per_step: float | None = Field(default=None, gt=0)
    gpu_peak_flops: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _check_shape(self) -> JobSpec:
        if self.vpp > 1 and (self.pp < 2 or self.microbatches % self.pp):
            raise ValueError("interleaved schedules need pp >= 2 and microbatches % pp == 0")
        for inj in self.stragglers:
            if getattr(inj, "dp", None) is not None and inj.dp >= self.dp:
                raise ValueError(f"{inj.kind}: dp {inj.dp} outside 0..{self.dp - 1}")
            if getattr(inj, "stage", None) is not None and inj.stage >= self.pp:
                raise ValueError(f"{inj.kind}: stage {inj.stage} outside 0..{self.pp - 1}")
        return self

    def meta(self) -> JobMeta:
        return JobMeta(
            trial_name=self.name,
            dp_size=self.dp,
            pp_size=self.pp,
            tp_size=self.tp,
            dsp_size=1,
            vpp_size=self.vpp,
            world_size=self.dp * self.pp * self.tp,
            model_flops_per_step=self.model_flops_per_step,
            gpu_peak_flops=self.gpu_peak_flops,
        )


@dataclass(frozen=True)
class GroundTruth:
    step_ids: np.ndarray
    #: Simulated step time with and without the injections (same noise draws).
    t_injected: np.ndarray
    t_clean: np.ndarray
    injections: tuple[Injection, ...]

    @property
    def slowdown(self) -> float:
        return float(self.t_injected.mean() / self.t_clean.mean())

    @property
    def step_slowdown(self) -> np.ndarray:
        return self.t_injected / self.t_clean

    def to_dict(self) -> dict:
        return {
            "slowdown": self.slowdown,
            "steps": {
                str(int(s)): {"injected": float(a), "clean": float(b)}
                for s, a, b in zip(self.step_ids, self.t_injected, self.t_clean, strict=True)
            },
            "injections": [
                {
                    **inj.model_dump(),
                    "onset_step": int(self.step_ids[inj.start_step]),
                    "recovery_step": None
                    if inj.end_step is None or inj.end_step >= len(self.step_ids)
                    else int(self.step_ids[inj.end_step]),
                }
                for inj in self.injections
            ],
        }


@dataclass(frozen=True)
class GeneratedJob:
    spec: JobSpec
    trace: Trace
    model: DependencyModel
    truth: GroundTruth

    @property
    def meta(self) -> JobMeta:
        return self.spec.meta()


# -- schedule --------------------------------------------------------------------------


def compute_schedule(
    pp: int, vpp: int, microbatches: int, stage: int
) -> list[tuple[str, int, int]]:
    """Megatron's 1F1B order on one stage: ("F"|"B", chunk, microbatch) per compute."""
    total = microbatches * vpp

    def virtual(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // pp) % vpp
        if backward:
            chunk = vpp - 1 - chunk
        mb = (k // (pp * vpp)) * pp + k % pp if vpp > 1 else k
        return chunk, mb

    if vpp == 1:
        warmup = min(pp - stage - 1, total)
    else:
        warmup = min((pp - stage - 1) * 2 + (vpp - 1) * pp, total)
    order: list[tuple[str, int, int]] = [("F", *virtual(k, False)) for k in range(warmup)]
    for i in range(total - warmup):
        order.append(("F", *virtual(warmup + i, False)))
        order.append(("B", *virtual(i, True)))
    order.extend(("B", *virtual(k, True)) for k in range(total - warmup, total))
    return order


class _SkeletonStage:
    """Appends one stage's skeleton ops, numbering each op type's seq in order."""

    def __init__(self, stage: int, rows: list) -> None:
        self.stage = stage
        self.rows = rows
        self.seq = dict.fromkeys(ot.KNOWN_OPTYPES, 0)

    def add(
        self, optype: str, start: float, end: float, mc: int = -1, gmc: int = -1, mb: int = -1
    ) -> None:
        self.rows.append((self.stage, optype, self.seq[optype], start, end, mc, gmc, mb))
        self.seq[optype] += 1


def build_schedule_model(spec: JobSpec) -> tuple[DependencyModel, dict[str, np.ndarray]]:
    """The job's dependency model and per-node attributes (mc, gmc, mb_id, seq).

    A skeleton step with ops in schedule order is handed to the same inference the analysis
    uses, so generated traces and analysed traces share one definition of the model.
    """
    rows: list[tuple[int, str, int, float, float, int, int, int]] = []
    pp, vpp = spec.pp, spec.vpp
    for stage in range(pp):
        _add_skeleton_stage(spec, stage, rows)
    rows.sort(key=lambda r: (r[0], r[1], r[2]))
    cols = list(zip(*rows, strict=True))
    model = infer_dependency_model(
        np.array(cols[0]),
        list(cols[1]),
        np.array(cols[2]),
        np.array(cols[3]),
        np.array(cols[4]),
        np.array(cols[5]),
        np.array(cols[6]),
        n_stages=pp,
        vpp=vpp,
        has_dp_comm=spec.dp_comm and spec.dp > 1,
        overlapped_dp=spec.dp_comm and spec.overlapped_dp,
    )
    attrs = {
        "mc": np.array(cols[5], dtype=np.int32),
        "gmc": np.array(cols[6], dtype=np.int32),
        "mb_id": np.array(cols[7], dtype=np.int32),
    }
    return model, attrs


def _add_skeleton_stage(
    spec: JobSpec, stage: int, rows: list[tuple[int, str, int, float, float, int, int, int]]
) -> None:
    """One stage's ops of a skeleton step, in schedule order, added to `rows`."""
    pp, vpp = spec.pp, spec.vpp
    add = _SkeletonStage(stage, rows).add
    clock = 10.0

    if spec.dp_comm:
        for chunk in range(vpp):
            add(ot.PARAMS_ALL_GATHER, 1.0 + chunk, 1.5 + chunk, mc=chunk)
    has = {
        ot.FORWARD_RECV: vpp > 1 or stage > 0,
        ot.FORWARD_SEND: vpp > 1 or stage < pp - 1,
        ot.BACKWARD_RECV: vpp > 1 or stage < pp - 1,
        ot.BACKWARD_SEND: vpp > 1 or stage > 0,
    }
    if pp == 1:
        has = dict.fromkeys(has, False)
    schedule = compute_schedule(pp, vpp, spec.microbatches, stage)
    last_backward_of_chunk = {
        chunk: max(i for i, (d, c, _) in enumerate(schedule) if d == "B" and c == chunk)
        for chunk in range(vpp)
    }
    for i, (direction, chunk, mb) in enumerate(schedule):
        forward = direction == "F"
        recv = ot.FORWARD_RECV if forward else ot.BACKWARD_RECV
        send = ot.FORWARD_SEND if forward else ot.BACKWARD_SEND
        compute = ot.FORWARD_COMPUTE if forward else ot.BACKWARD_COMPUTE
        if has[recv]:
            add(recv, clock - 1.0, clock - 0.5)
        add(compute, clock, clock + 5.0, mc=chunk, gmc=stage + chunk * pp, mb=mb)
        if has[send]:
            add(send, clock + 6.0, clock + 6.5)
        if spec.dp_comm and spec.overlapped_dp and last_backward_of_chunk[chunk] == i:
            add(ot.GRADS_REDUCE_SCATTER, clock + 7.0, clock + 7.5, mc=chunk)
        clock += 10.0
    add(ot.GC, clock, clock)
    add(ot.LAYERNORM_GRADS_ALL_REDUCE, clock + 1, clock + 1.5)
    if stage in (0, pp - 1):
        add(ot.EMBEDDING_GRADS_ALL_REDUCE, clock + 2, clock + 2.5)
    if spec.dp_comm and not spec.overlapped_dp:
        for chunk in range(vpp):
            add(ot.GRADS_REDUCE_SCATTER, clock + 3 + chunk, clock + 3.5 + chunk, mc=chunk)
    if spec.dp_comm and spec.overlapped_dp:
        add(ot.SEPARATE_GRADS_ALL_REDUCE, clock + 3, clock + 3.5)
    add(ot.OPTIMIZER_CLIP_MAIN_GRAD, clock + 10, clock + 10.5)
    add(ot.OPTIMIZER, clock + 11, clock + 12)


# -- costs -----------------------------------------------------------------------------


def _nominal_costs(spec: JobSpec, model: DependencyModel) -> np.ndarray:
    c = spec.cost
    pp, vpp = spec.pp, spec.vpp
    out = np.zeros(model.n_nodes)
    for i, node in enumerate(model.nodes):
        stage_forward = c.forward_s / vpp
        if node.stage == 0:
            stage_forward += c.first_stage_extra * c.forward_s / vpp
        if node.stage == pp - 1:
            stage_forward += c.last_stage_extra * c.forward_s / vpp
        out[i] = {
            ot.FORWARD_COMPUTE: stage_forward,
            ot.BACKWARD_COMPUTE: stage_forward * c.backward_factor,
            ot.FORWARD_SEND: c.p2p_s,
            ot.FORWARD_RECV: c.p2p_s,
            ot.BACKWARD_SEND: c.p2p_s,
            ot.BACKWARD_RECV: c.p2p_s,
            ot.PARAMS_ALL_GATHER: c.params_all_gather_s / vpp,
            ot.GRADS_REDUCE_SCATTER: c.grads_reduce_scatter_s / vpp,
            ot.SEPARATE_GRADS_ALL_REDUCE: c.grads_reduce_scatter_s,
            ot.EMBEDDING_GRADS_ALL_REDUCE: c.embedding_all_reduce_s,
            ot.LAYERNORM_GRADS_ALL_REDUCE: c.layernorm_all_reduce_s,
            ot.OPTIMIZER_CLIP_MAIN_GRAD: c.clip_s,
            ot.OPTIMIZER: c.optimizer_s,
            ot.GC: 0.0,
        }[node.optype]
    return out


def _apply_injections(
    spec: JobSpec,
    model: DependencyModel,
    attrs: dict[str, np.ndarray],
    cost: np.ndarray,
    delay: np.ndarray,
    rng: np.random.Generator,
    first: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Scale `cost` / `delay` ([node, step, dp] of the job's steps `first` on) in place
    for every injected straggler; returns the GC pause added to each op ([node, step, dp],
    what the GC probe records): inside the op, and before it (`GcPauses.between_ops`)."""
    n_steps, n_dp = cost.shape[1], spec.dp
    positions = np.arange(first, first + n_steps)
    optype = np.array(model.node_optypes())
    stage = model.node_stage()
    is_compute = np.isin(optype, [ot.FORWARD_COMPUTE, ot.BACKWARD_COMPUTE])
    is_forward = optype == ot.FORWARD_COMPUTE
    gc_pause, gc_before = np.zeros_like(cost), np.zeros_like(cost)
    for inj in spec.stragglers:
        steps = inj.active(spec.steps)[positions]
        if isinstance(inj, SlowWorker):
            nodes = is_compute & (stage == inj.stage)
            cost[np.ix_(nodes, steps, [inj.dp])] *= inj.factor
        elif isinstance(inj, LastStageImbalance):
            nodes = is_compute & (stage == spec.pp - 1)
            cost[np.ix_(nodes, steps, np.arange(n_dp))] *= inj.factor
        elif isinstance(inj, SequenceImbalance):
            factor = _sequence_cost_factors(inj, spec, rng, n_steps)  # [step, dp, mb]
            for direction in (ot.FORWARD_COMPUTE, ot.BACKWARD_COMPUTE):
                nodes = np.flatnonzero(optype == direction)
                mb = attrs["mb_id"][nodes]
                scaled = cost[nodes] * factor[:, :, mb].transpose(2, 0, 1)
                cost[nodes] = np.where(steps[None, :, None], scaled, cost[nodes])
        elif isinstance(inj, GcPauses):
            hit = rng.random(cost.shape) < inj.probability
            hit &= is_forward[:, None, None] & steps[None, :, None]
            if inj.stage is not None:
                hit &= (stage == inj.stage)[:, None, None]
            if inj.dp is not None:
                hit &= (np.arange(n_dp) == inj.dp)[None, None, :]
            paused = np.where(hit, inj.pause_s, 0.0)
            if inj.between_ops:
                delay += paused
                gc_before += paused
            else:
                cost += paused
                gc_pause += paused
        elif isinstance(inj, SlowLink):
            if inj.flap_period:
                steps = steps & ((positions // inj.flap_period) % 2 == 0)
            if inj.dp is None:
                nodes = np.isin(optype, ot.DP_OPTYPES) & (stage == inj.stage)
                dps = np.arange(n_dp)
            else:
                nodes = (
                    np.isin(optype, [ot.FORWARD_SEND, ot.BACKWARD_RECV]) & (stage == inj.stage)
                ) | (
                    np.isin(optype, [ot.FORWARD_RECV, ot.BACKWARD_SEND])
                    & (stage == (inj.stage + 1) % spec.pp)
                )
                dps = np.array([inj.dp])
            cost[np.ix_(nodes, steps, dps)] *= inj.factor
        elif isinstance(inj, LaunchDelay):
            nodes = stage == inj.stage
            extra = rng.exponential(inj.delay_s, size=(int(nodes.sum()), int(steps.sum()), 1))
            delay[np.ix_(nodes, steps, [inj.dp])] += extra
    return gc_pause, gc_before


def _sequence_cost_factors(
    inj: SequenceImbalance, spec: JobSpec, rng: np.random.Generator, n_steps: int
) -> np.ndarray:
    """Cost multiplier of every micro-batch of `n_steps` steps ([step, dp, mb]), mean 1."""
    shape = (n_steps, spec.dp, spec.microbatches)
    mu = np.log(inj.mean_document_tokens) - inj.length_sigma**2 / 2
    budget = inj.tokens_per_microbatch
    squares = np.zeros(shape)
    n_draw = max(8, int(4 * budget / inj.mean_document_tokens))
    lengths = rng.lognormal(mu, inj.length_sigma, size=(*shape, n_draw)).clip(16, budget)
    filled = np.cumsum(lengths, axis=-1)
    # Pack documents until the micro-batch is full; the last one is truncated.
    taken = np.clip(budget - (filled - lengths), 0, lengths)
    squares = (taken**2).sum(axis=-1)
    quadratic = squares / squares.mean()
    return (1 - inj.attention_share) + inj.attention_share * quadratic


# -- generation ------------------------------------------------------------------------


def generate_job(spec: JobSpec) -> GeneratedJob:
    """Simulate the job and return its trace and ground truth (deterministic in the seed)."""
    generator = JobGenerator(spec)
    run = generator.steps(0, spec.steps)
    return GeneratedJob(spec=spec, trace=run.trace, model=generator.model, truth=generator.truth())


@dataclass(frozen=True)
class GeneratedSteps:
    """A run of a generated job's consecutive steps: their trace, and their step times
    simulated with and without the injections."""

    trace: Trace
    step_ids: np.ndarray
    t_injected: np.ndarray
    t_clean: np.ndarray


#: Ops a run of `JobGenerator.runs` holds at most (unless one step holds more): the
#: generator's arrays take ~300 bytes an op, so ~0.6 GB; a 12,288-GPU job's 2,000 steps
#: are 250 M ops.
RUN_OPS = 2_000_000


class JobGenerator:
    """A job's schedule and seeded draws, simulated a run of steps at a time, so that
    memory follows a run's ops rather than the job's.

    The draws come from one generator in the order of the runs: a single run of every
    step (`generate_job`) draws what the seed always gave; runs of fewer steps draw the
    same distributions, laid out run by run, so the same seed gives another job.

    >>> spec = JobSpec(dp=2, pp=2, microbatches=2, steps=5, seed=1)
    >>> whole = generate_job(spec)
    >>> runs = list(JobGenerator(spec).runs(max_ops=1))
    >>> [len(run.step_ids) for run in runs]
    [1, 1, 1, 1, 1]
    >>> sum(run.trace.n_rows for run in runs) == whole.trace.n_rows
    True
    """

    def __init__(self, spec: JobSpec) -> None:
        self.spec = spec
        self.rng = np.random.default_rng(spec.seed)
        self.model, self.attrs = build_schedule_model(spec)
        self.compiled = compile_model(self.model)
        self.nominal = _nominal_costs(spec, self.model)
        self.has_deps = np.array([bool(d) for d in self.model.deps])
        #: (step ids, injected, clean step times) of each run made so far.
        self._step_times: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    @property
    def ops_per_step(self) -> int:
        """The ops of one step, GC pauses left out."""
        return self.model.n_nodes * self.spec.dp

    def truth(self) -> GroundTruth:
        """The ground truth of the steps made so far (all of them, once `runs` is done)."""
        step_ids, injected, clean = (np.concatenate(c) for c in zip(*self._step_times, strict=True))
        return GroundTruth(step_ids, injected, clean, self.spec.stragglers)

    def runs(self, max_ops: int | None = None) -> Iterator[GeneratedSteps]:
        """Every step of the job, in runs of at most `max_ops` (default `RUN_OPS`) ops,
        one step at least."""
        per_run = max(1, (RUN_OPS if max_ops is None else max_ops) // self.ops_per_step)
        for first in range(0, self.spec.steps, per_run):
            yield self.steps(first, min(self.spec.steps, first + per_run))

    def steps(self, first: int, end: int) -> GeneratedSteps:
        """The job's steps `first` to `end` (excluded), positions in the generated run.
        Draws from the job's generator: call it for consecutive runs, in order."""
        spec, model, rng = self.spec, self.model, self.rng
        n, n_steps, n_dp = model.n_nodes, end - first, spec.dp
        noise = np.ones((n, n_steps, n_dp))
        if spec.cost.noise_cv > 0:
            sigma = np.sqrt(np.log1p(spec.cost.noise_cv**2))
            noise = rng.lognormal(-(sigma**2) / 2, sigma, size=(n, n_steps, n_dp))
        clean_cost = self.nominal[:, None, None] * noise
        del noise
        clean_delay = np.zeros((n, n_steps, n_dp))
        if spec.cost.launch_gap_s > 0:
            gaps = rng.exponential(spec.cost.launch_gap_s, size=(n, n_steps, n_dp))
            clean_delay = np.where(self.has_deps[:, None, None], gaps, 0.0)
            del gaps
        cost, delay = clean_cost.copy(), clean_delay.copy()
        gc_pause, gc_before = _apply_injections(spec, model, self.attrs, cost, delay, rng, first)

        segments = np.arange(0, n_steps * n_dp, n_dp, dtype=np.int64)
        injected = simulate(
            self.compiled, cost.reshape(n, -1), delay.reshape(n, -1), segments,
            record_timeline=True,
        )  # fmt: skip
        del cost, delay
        clean = simulate(
            self.compiled, clean_cost.reshape(n, -1), clean_delay.reshape(n, -1), segments
        )
        del clean_cost, clean_delay
        assert injected.timeline is not None
        start = injected.timeline.start.reshape(n, n_steps, n_dp)
        end_ts = injected.timeline.end.reshape(n, n_steps, n_dp)
        # Re-base every step on its earliest op, as recorded traces are.
        step_began = start.min(axis=(0, 2), keepdims=True)
        start, end_ts = start - step_began, end_ts - step_began

        step_ids = spec.first_step_id + np.arange(first, end)
        trace = _trace_from_timeline(
            spec, model, self.attrs, step_ids, start, end_ts, gc_pause, gc_before
        )
        self._step_times.append((step_ids, injected.step_time, clean.step_time))
        return GeneratedSteps(trace, step_ids, injected.step_time, clean.step_time)


def _trace_from_timeline(
    spec: JobSpec,
    model: DependencyModel,
    attrs: dict[str, np.ndarray],
    step_ids: np.ndarray,
    start: np.ndarray,
    end: np.ndarray,
    gc_pause: np.ndarray,
    gc_before: np.ndarray,
) -> Trace:
    """The trace of a simulated timeline; each GC pause is recorded as the probe records
    it: a `gc-pause` op at the start of the op it stalled, or ending where the op it held
    back starts (`gc_before`)."""
    n, n_steps, n_dp = start.shape
    optypes = {node.optype for node in model.nodes}
    paused = (gc_pause > 0) | (gc_before > 0)
    if paused.any():
        optypes.add(ot.GC_PAUSE)
    names = tuple(sorted(optypes))
    code = np.array([names.index(node.optype) for node in model.nodes])
    stage = model.node_stage()
    seq = np.array([node.seq for node in model.nodes])
    grid_node, grid_step, grid_dp = (
        a.ravel()
        for a in np.meshgrid(np.arange(n), np.arange(n_steps), np.arange(n_dp), indexing="ij")
    )
    is_compute = np.isin(np.array(model.node_optypes()), [ot.FORWARD_COMPUTE, ot.BACKWARD_COMPUTE])
    is_gc = np.array(model.node_optypes()) == ot.GC
    mb = np.where(is_compute, attrs["mb_id"], np.where(is_gc, 0, -1))
    gmc = np.where(is_compute, attrs["gmc"], -1)
    rank = (stage[grid_node] * spec.dp + grid_dp) * spec.tp
    columns = {
        "dp_rank": grid_dp,
        "stage": stage[grid_node],
        "rank": rank,
        "step": step_ids[grid_step],
        "optype": code[grid_node],
        "optype_names": names,
        "start_ts": start.ravel().astype(np.float32),
        "duration": np.maximum(end - start, 0.0).ravel().astype(np.float32),
        "seq_id": seq[grid_node],
        "mc": attrs["mc"][grid_node],
        "gmc": gmc[grid_node],
        "mb_id": mb[grid_node],
    }
    if paused.any():
        extra = _pause_rows(
            spec, stage, step_ids, start, gc_pause, gc_before, names.index(ot.GC_PAUSE)
        )
        for name, values in extra.items():
            columns[name] = np.concatenate([columns[name], values])
    order = np.lexsort((columns["seq_id"], columns["optype"], columns["rank"], columns["step"]))
    ordered = {k: (v[order] if isinstance(v, np.ndarray) else v) for k, v in columns.items()}
    return Trace.from_columns(ordered, source=f"<generated {spec.name}>")


def _pause_rows(
    spec: JobSpec,
    stage: np.ndarray,
    step_ids: np.ndarray,
    start: np.ndarray,
    gc_pause: np.ndarray,
    gc_before: np.ndarray,
    pause_code: int,
) -> dict[str, np.ndarray]:
    """The `gc-pause` rows of the pauses in `gc_pause` and `gc_before` ([node, step, dp]
    seconds): each at the start of the op it stalled, or ending where the op it held back
    starts, numbered in its worker's step."""
    cells = [(np.nonzero(gc_pause > 0), start, gc_pause),
             (np.nonzero(gc_before > 0), start - gc_before, gc_before)]  # fmt: skip
    p_node, p_step, p_dp = (np.concatenate([where[i] for where, _, _ in cells]) for i in range(3))
    p_start = np.concatenate([at[where] for where, at, _ in cells])
    p_duration = np.concatenate([seconds[where] for where, _, seconds in cells])
    p_stage = stage[p_node]
    # seq: order of the pause among its worker's pauses in the step.
    order = np.lexsort((p_start, p_dp, p_stage, p_step))
    key = np.stack([p_step, p_stage, p_dp])[:, order]
    new_group = np.concatenate(([True], (key[:, 1:] != key[:, :-1]).any(axis=0)))
    group_first = np.maximum.accumulate(np.where(new_group, np.arange(order.size), 0))
    p_seq = np.empty(order.size, dtype=np.int32)
    p_seq[order] = np.arange(order.size) - group_first
    return {
        "dp_rank": p_dp,
        "stage": p_stage,
        "rank": (p_stage * spec.dp + p_dp) * spec.tp,
        "step": step_ids[p_step],
        "optype": np.full(p_node.size, pause_code),
        "start_ts": p_start.astype(np.float32),
        "duration": p_duration.astype(np.float32),
        "seq_id": p_seq,
        "mc": np.full(p_node.size, -1),
        "gmc": np.full(p_node.size, -1),
        "mb_id": np.full(p_node.size, -1),
    }
