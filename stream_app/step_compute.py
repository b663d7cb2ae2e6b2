"""The compute half of a closed step's analysis: its batches prepared, its running ideal
costs, its engine pass.

This half needs nothing of the job's live state (detectors, episodes, retained steps),
only what it carries itself from step to step (`JobCompute`: the dependency model and the
running ideals), so it can run in another process (stream_app/analysis_process.py) while
the host decodes the next step. Both places call `compute_steps`: the numbers are the
same wherever it runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from lagscope.producers.events import JobInfo, RankStepBatch
from lagscope.simulator import optypes as ot
from lagscope.simulator.depmodel import DependencyModel
from lagscope.simulator.engine import CompiledModel
from lagscope.simulator.prepare import PreparedTrace, prepare
from lagscope.simulator.trace import Trace, TraceError
from lagscope.simulator.whatif import WhatIfResult, analyze_each_step
from lagscope.simulator.window_median import WindowMedian

if TYPE_CHECKING:
    from lagscope.stream_app.processor import ProcessorSettings

_CHUNKED_OPTYPES = frozenset(
    {ot.FORWARD_COMPUTE, ot.BACKWARD_COMPUTE, ot.PARAMS_ALL_GATHER, ot.GRADS_REDUCE_SCATTER}
)


class ClosedStep(Protocol):
    """What the compute half reads of a closed step."""

    step: int
    #: DP ranks whose every stage reported (the ones analysed).
    dp_ranks: list[int]
    batches: list[RankStepBatch]

    @property
    def complete(self) -> bool: ...


@dataclass
class StepToCompute:
    """A closed step as another process receives it."""

    step: int
    complete: bool
    dp_ranks: list[int]
    batches: list[RankStepBatch]


@dataclass
class StepComputed:
    """A step's prepared trace (that step alone) and what-if result, or why it has none."""

    alone: PreparedTrace | None = None
    result: WhatIfResult | None = None
    failure: str = ""


class RunningIdeal:
    """Running ideal costs: exact means for compute, windowed exact medians for comm
    (`simulator/window_median.py`: only the ranks around each median kept sorted)."""

    def __init__(self, window_steps: int, values_per_step: int) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.medians: dict[str, WindowMedian] = {}
        self.window_steps = window_steps
        self.values_per_step = values_per_step
        #: Nodes of each op type; the job's model is fixed, so computed once.
        self._nodes: dict[str, np.ndarray] | None = None

    def add_step(self, prepared: PreparedTrace) -> None:
        if self._nodes is None:
            self._nodes = _nodes_by_optype(prepared)
        for optype, nodes in self._nodes.items():
            if ot.is_compute(optype):
                values = prepared.duration[nodes]
                self.sums[optype] = self.sums.get(optype, 0.0) + float(values.sum(dtype=np.float64))
                self.counts[optype] = self.counts.get(optype, 0) + values.size
            else:
                self._add_comm(optype, prepared.cost[nodes].ravel())

    def _add_comm(self, optype: str, values: np.ndarray) -> None:
        if values.size > self.values_per_step:
            stride = values.size / self.values_per_step
            values = values[(np.arange(self.values_per_step) * stride).astype(int)]
        median = self.medians.get(optype)
        if median is None:
            median = self.medians[optype] = WindowMedian(self.window_steps)
        median.add(np.sort(values))

    def current(self) -> dict[str, float]:
        ideal = {t: self.sums[t] / self.counts[t] for t in self.sums if self.counts[t]}
        for optype, median in self.medians.items():
            ideal[optype] = median.value()
        return ideal

    def state(self) -> dict[str, Any]:
        # The comm window holds the retained steps' values: rebuilt from them on restore.
        return {"sums": dict(self.sums), "counts": dict(self.counts)}

    def restore(self, state: dict[str, Any], retained: Iterable[PreparedTrace]) -> None:
        self.sums = dict(state["sums"])
        self.counts = dict(state["counts"])
        for prepared in retained:
            self._nodes = self._nodes or _nodes_by_optype(prepared)
            for optype, nodes in self._nodes.items():
                if not ot.is_compute(optype):
                    self._add_comm(optype, prepared.cost[nodes].ravel())


class JobCompute:
    """What a job's compute half carries from step to step: the dependency model (from
    its first analysable step) and the running ideals over its complete steps, whose comm
    window is as long as the job's retained window (`capacity`)."""

    def __init__(self, info: JobInfo, settings: ProcessorSettings) -> None:
        self.info = info
        self.decompose_threshold = settings.decompose_threshold
        self.window_steps = settings.rollup_window_steps
        self.budget_bytes = settings.rollup_budget_bytes
        self.model: DependencyModel | None = None
        self.compiled: CompiledModel | None = None
        self.ideal = RunningIdeal(settings.rollup_window_steps, settings.median_values_per_step)
        #: Bytes of one retained step; known from the first (a job's steps share a shape).
        self.step_bytes = 0
        self.capacity = settings.rollup_window_steps

    def size_window(self, prepared: PreparedTrace) -> None:
        """Fit the window to the byte budget, from the job's first complete step."""
        if self.step_bytes:
            return
        self.step_bytes = step_bytes(prepared)
        self.capacity = max(1, min(self.window_steps, self.budget_bytes // self.step_bytes))
        self.ideal.window_steps = self.capacity

    def add_complete_step(self, prepared: PreparedTrace) -> None:
        self.size_window(prepared)
        self.ideal.add_step(prepared)

    def prepare(self, closed: Sequence[ClosedStep]) -> PreparedTrace:
        """One prepared trace of closed steps that cover the same DP ranks."""
        trace = batches_to_trace(
            [b for c in closed for b in c.batches], self.info.pp_size, closed[0].dp_ranks
        )
        return prepare(trace, self.info.to_meta(), model=self.model)


def compute_steps(job: JobCompute, closed: Sequence[ClosedStep]) -> list[StepComputed]:
    """Each closed step (in closing order) prepared alone, added to the running ideals
    when complete, and simulated with the ideals it sees there: one engine pass per
    prepared trace (the complete steps share one), so the numbers do not depend on how
    many steps one call holds."""
    out = [StepComputed() for _ in closed]
    todo = list(range(len(closed)))
    ready: list[tuple[int, PreparedTrace, int]] = []
    while job.model is None and todo:
        # The job's first analysable step gives it its dependency model.
        first = todo.pop(0)
        try:
            prepared = job.prepare([closed[first]])
        except TraceError as exc:
            out[first].failure = str(exc)
            continue
        job.model = prepared.model
        job.compiled = job.model.compiled
        ready.append((first, prepared, 0))
    for i, done in zip(todo, _prepare_each(job, [closed[i] for i in todo]), strict=True):
        if isinstance(done, str):
            out[i].failure = done
        else:
            ready.append((i, *done))
    ready.sort(key=lambda r: r[0])
    alone = [prepared.select_steps([column]) for _, prepared, column in ready]
    ideals = []
    for (i, _, _), step in zip(ready, alone, strict=True):
        if closed[i].complete:
            job.add_complete_step(step)
        ideal = job.ideal.current()
        for optype in set(step.node_optype) - set(ideal):
            # A first step that is incomplete: its own values are the best estimate.
            ideal[optype] = _own_ideal(step, optype)
        ideals.append(ideal)
    results = _engine_passes(job, ready, ideals)
    for position, (i, _, _) in enumerate(ready):
        out[i].alone = alone[position]
        out[i].result = results[position]
    return out


def _prepare_each(
    job: JobCompute, closed: list[ClosedStep]
) -> list[tuple[PreparedTrace, int] | str]:
    """(prepared trace, its column) per closed step, or why it cannot be analysed.

    Complete steps are prepared in one go; a failure there is narrowed down by preparing
    them one by one, so one bad step never loses the others.
    """
    out: list[tuple[PreparedTrace, int] | str] = [""] * len(closed)
    joint = [i for i, c in enumerate(closed) if c.complete]
    if len({closed[i].step for i in joint}) == len(joint) > 1:
        try:
            prepared = job.prepare([closed[i] for i in joint])
        except TraceError:
            pass
        else:
            column = {int(step): col for col, step in enumerate(prepared.steps)}
            for i in joint:
                out[i] = (prepared, column[closed[i].step])
    for i, c in enumerate(closed):
        if out[i] == "":
            try:
                out[i] = (job.prepare([c]), 0)
            except TraceError as exc:
                out[i] = str(exc)
    return out


def _engine_passes(
    job: JobCompute, ready: list[tuple[int, PreparedTrace, int]], ideals: list[dict[str, float]]
) -> dict[int, WhatIfResult]:
    """Each step's what-if result, by position in `ready`: one engine pass per prepared
    trace."""
    passes: dict[int, tuple[PreparedTrace, list[int]]] = {}
    for position, (_, prepared, _) in enumerate(ready):
        passes.setdefault(id(prepared), (prepared, []))[1].append(position)
    results: dict[int, WhatIfResult] = {}
    for prepared, positions in passes.values():
        step_ideals: list[dict[str, float]] = [{}] * prepared.n_steps
        for position in positions:
            step_ideals[ready[position][2]] = ideals[position]
        analysed = analyze_each_step(
            prepared,
            step_ideals,
            compiled=job.compiled,
            decompose_threshold=job.decompose_threshold,
        )
        for position in positions:
            results[position] = analysed[ready[position][2]]
    return results


def without_model(computed: list[StepComputed]) -> list[StepComputed]:
    """The results with their prepared steps' model left out, to cross a process boundary
    (the receiving side holds the job's model already, or gets it once)."""
    return [
        dataclasses.replace(c, alone=dataclasses.replace(c.alone, model=None))  # type: ignore[arg-type]
        if c.alone is not None
        else c
        for c in computed
    ]


def with_model(computed: list[StepComputed], model: DependencyModel) -> list[StepComputed]:
    """`without_model` undone with the receiving side's copy of the job's model."""
    for c in computed:
        if c.alone is not None:
            c.alone = dataclasses.replace(c.alone, model=model)
    return computed


def _nodes_by_optype(prepared: PreparedTrace) -> dict[str, np.ndarray]:
    node_optype = np.array(prepared.node_optype)
    return {t: np.flatnonzero(node_optype == t) for t in sorted(set(prepared.node_optype))}


def step_bytes(prepared: PreparedTrace) -> int:
    """Bytes a retained step holds, counting a GC-pause array whether or not this step has
    one (a later step may), so the window never outgrows the budget."""
    arrays = (prepared.start, prepared.duration, prepared.cost, prepared.launch_delay)
    return sum(a.nbytes for a in arrays) + prepared.duration.size * 4


def _own_ideal(prepared: PreparedTrace, optype: str) -> float:
    nodes = [i for i, t in enumerate(prepared.node_optype) if t == optype]
    if ot.is_compute(optype):
        return float(prepared.duration[nodes].mean(dtype=np.float64))
    return float(np.median(prepared.cost[nodes]))


def batches_to_trace(
    batches: Iterable[RankStepBatch], pp_size: int, dp_ranks: list[int] | None = None
) -> Trace:
    """Steps' batches as a trace: float32 seconds from each step's earliest op.

    Each step keeps its own origin, so a step's values are the same whether it is turned
    into a trace alone or with others. `dp_ranks` renumbers the given DP ranks 0..k-1 (the
    complete replicas of a step).
    """
    batches = [b for b in batches if b.n_ops]
    if not batches:
        raise TraceError("no ops in the step's batches")
    names = sorted({n for b in batches for n in b.optype_names})
    code_of = {n: i for i, n in enumerate(names)}
    name_array = np.array(names)
    chunked_code = np.isin(name_array, list(_CHUNKED_OPTYPES))
    compute_code = np.isin(name_array, [ot.FORWARD_COMPUTE, ot.BACKWARD_COMPUTE])
    remaps: dict[tuple[str, ...], np.ndarray] = {}
    for b in batches:
        if b.optype_names not in remaps:
            remaps[b.optype_names] = np.array([code_of[x] for x in b.optype_names], np.int16)
    n_ops = np.array([b.n_ops for b in batches])
    renumber = {dp: i for i, dp in enumerate(dp_ranks)} if dp_ranks is not None else None

    def per_batch(values: list[int], dtype: type) -> np.ndarray:
        return np.repeat(np.array(values, dtype=dtype), n_ops)

    # Each step's origin, its earliest op: one reduction over the batches' starts.
    start_ns = np.concatenate([b.start_ns for b in batches])
    first_of_batch = np.minimum.reduceat(start_ns, np.cumsum(n_ops) - n_ops)
    steps, step_of_batch = np.unique([b.step for b in batches], return_inverse=True)
    origin_of_step = np.full(steps.size, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(origin_of_step, step_of_batch, first_of_batch)
    codes = np.concatenate([remaps[b.optype_names][b.optype] for b in batches])
    stage = per_batch([b.pp_rank for b in batches], np.int32)
    chunk = np.maximum(np.concatenate([b.chunk for b in batches]).astype(np.int32), 0)
    origin = np.repeat(origin_of_step[step_of_batch], n_ops)
    columns: dict[str, Any] = {
        "dp_rank": per_batch(
            [renumber[b.dp_rank] if renumber else b.dp_rank for b in batches], np.int32
        ),
        "stage": stage,
        "rank": per_batch([b.rank for b in batches], np.int64),
        "step": per_batch([b.step for b in batches], np.int64),
        "optype": codes,
        "start_ts": ((start_ns - origin) / 1e9).astype(np.float32),
        "duration": (np.concatenate([b.duration_ns for b in batches]) / 1e9).astype(np.float32),
        "seq_id": np.concatenate([b.seq for b in batches]).astype(np.int32),
        "mc": np.where(chunked_code[codes], chunk, -1).astype(np.int32),
        "gmc": np.where(compute_code[codes], stage + chunk * pp_size, -1).astype(np.int32),
        "mb_id": np.concatenate([b.microbatch for b in batches]).astype(np.int32),
        "optype_names": tuple(names),
    }
    job = batches[0]
    shown = f"step {steps[0]}" if steps.size == 1 else f"steps {steps[0]}..{steps[-1]}"
    return Trace.from_columns(columns, source=f"{job.job_id}/{job.attempt} {shown}")
