"""The step processor: rank-step batches in, per-step what-if results and change points out.

One engine-agnostic class serves both hosts (the faust worker and the embedded runner):

- **Windows per (job, attempt, step)**, kept by hand. A step closes when every expected
  (dp, pp) coordinate has reported, or when its lateness timeout passes: then it is marked
  incomplete with the missing ranks listed, and the pipeline replicas (DP ranks) that are
  complete are still analysed. Batches for a step that already closed are counted as late,
  never silently merged into a finished result.
- **Incremental what-if.** The job's dependency model is inferred once, from its first
  closed step. Each closed step is simulated with *running* ideal costs: the mean of every
  compute op type over all steps so far, and for communication the exact median over a
  bounded window of recent steps (each step contributes at most `median_values_per_step`
  values, an evenly strided sample). The job-level roll-up re-analyses the retained steps
  (the last `rollup_window_steps` complete ones) with ideals computed from exactly those
  steps, which is `lagscope analyze` on the same steps.
- **Change points.** One vectorized BOCD update per closed step over the job's step time,
  every stage's and every DP rank's compute time.
- **State** (`state_dict` / `from_state`) holds the open windows, the running estimates,
  the retained steps and the detectors, so a host can checkpoint and resume.

Only TP/CP rank 0 batches are analysed (one representative per (dp, pp) coordinate); the
others are counted and dropped.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from producers.events import JobInfo, RankStepBatch
from simulator import optypes as ot
from simulator.bocd import BocdBank, BocdConfig
from simulator.depmodel import DependencyModel
from simulator.engine import CompiledModel, compile_model
from simulator.prepare import PreparedTrace, concat_steps, prepare
from simulator.trace import TRACE_ARRAYS, Trace, TraceError
from simulator.whatif import WhatIfResult, analyze

_CHUNKED_OPTYPES = frozenset(
    {ot.FORWARD_COMPUTE, ot.BACKWARD_COMPUTE, ot.PARAMS_ALL_GATHER, ot.GRADS_REDUCE_SCATTER}
)


class ProcessorSettings(BaseModel):
    """How the step processor windows and estimates (section `processor` of the config)."""

    model_config = ConfigDict(extra="forbid")

    #: Seconds after a step's first batch before it closes without its missing ranks.
    lateness_s: float = Field(default=30.0, gt=0)
    #: Steps whose inputs are kept for the job-level roll-up (and the comm medians).
    rollup_window_steps: int = Field(default=256, ge=1)
    #: Cap on the transfer times one step adds to a comm op type's running median.
    median_values_per_step: int = Field(default=4096, ge=16)
    #: Closed step ids remembered per job to recognise late batches.
    closed_steps_remembered: int = Field(default=100_000, ge=16)
    #: Attribution is reported from this slowdown on (the reference's 1.03).
    decompose_threshold: float = Field(default=1.03, gt=0)
    bocd: BocdConfig = BocdConfig()


@dataclass(frozen=True)
class DetectedChange:
    series: str
    step: int
    kind: str
    before_mean: float
    after_mean: float
    probability: float
    detected_at_step: int


@dataclass(frozen=True)
class StepOutput:
    """Everything the sink and the dashboards need about one closed step."""

    job_id: str
    attempt: int
    step: int
    #: Wall-clock start of the step (earliest op start), ns.
    start_ns: int
    complete: bool
    #: (dp, pp) coordinates that never reported.
    missing: tuple[tuple[int, int], ...]
    #: None when nothing of the step could be analysed.
    result: WhatIfResult | None
    info: JobInfo
    changes: tuple[DetectedChange, ...] = ()
    #: DP ranks (original numbering) the result covers, when some were left out.
    analysed_dp_ranks: tuple[int, ...] = ()
    reason: str = ""


@dataclass
class _Window:
    first_seen: float
    #: Batches per (dp, pp) coordinate: a rank-step may arrive in several parts (a huge
    #: step, or ops recorded after the step was sealed).
    batches: dict[tuple[int, int], list[RankStepBatch]] = field(default_factory=dict)
    fingerprints: set[tuple[int, int, bytes]] = field(default_factory=set)

    def all_batches(self) -> list[RankStepBatch]:
        return [b for parts in self.batches.values() for b in parts]


def _fingerprint(batch: RankStepBatch) -> tuple[int, int, bytes]:
    """Identity of a batch's content: a re-sent batch has the same ops at the same times."""
    return (batch.dp_rank, batch.pp_rank, batch.start_ns.tobytes() + batch.seq.tobytes())


class _RunningIdeal:
    """Running ideal costs: exact means for compute, windowed medians for comm."""

    def __init__(self, window_steps: int, values_per_step: int) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.recent: dict[str, deque[np.ndarray]] = {}
        self.window_steps = window_steps
        self.values_per_step = values_per_step

    def add_step(self, prepared: PreparedTrace) -> None:
        by_optype: dict[str, list[int]] = {}
        for node, optype in enumerate(prepared.node_optype):
            by_optype.setdefault(optype, []).append(node)
        for optype, nodes in by_optype.items():
            if ot.is_compute(optype):
                values = prepared.duration[nodes]
                self.sums[optype] = self.sums.get(optype, 0.0) + float(values.sum(dtype=np.float64))
                self.counts[optype] = self.counts.get(optype, 0) + values.size
            else:
                values = prepared.cost[nodes].ravel()
                if values.size > self.values_per_step:
                    stride = values.size / self.values_per_step
                    values = values[(np.arange(self.values_per_step) * stride).astype(int)]
                self.recent.setdefault(optype, deque(maxlen=self.window_steps)).append(
                    values.copy()
                )

    def current(self) -> dict[str, float]:
        ideal = {t: self.sums[t] / self.counts[t] for t in self.sums if self.counts[t]}
        for optype, values in self.recent.items():
            ideal[optype] = float(np.median(np.concatenate(list(values))))
        return ideal

    def state(self) -> dict[str, Any]:
        return {
            "sums": dict(self.sums),
            "counts": dict(self.counts),
            "recent": {k: list(v) for k, v in self.recent.items()},
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.sums = dict(state["sums"])
        self.counts = dict(state["counts"])
        self.recent = {k: deque(v, maxlen=self.window_steps) for k, v in state["recent"].items()}


class _JobState:
    def __init__(self, info: JobInfo, settings: ProcessorSettings) -> None:
        self.info = info
        self.model: DependencyModel | None = None
        self.compiled: CompiledModel | None = None
        self.ideal = _RunningIdeal(settings.rollup_window_steps, settings.median_values_per_step)
        self.retained: deque[PreparedTrace] = deque(maxlen=settings.rollup_window_steps)
        self.detector: BocdBank | None = None
        self.series_names: list[str] = []
        #: (update index, step id) of recent detector updates, to name change steps.
        self.fed_steps: deque[tuple[int, int]] = deque(maxlen=4096)


class StepProcessor:
    """Windows rank-step batches per (job, attempt, step) and analyses closed steps."""

    def __init__(
        self,
        settings: ProcessorSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings or ProcessorSettings()
        self.clock = clock
        self.jobs: dict[tuple[str, int], _JobState] = {}
        self.windows: dict[tuple[str, int, int], _Window] = {}
        #: Recently closed step ids per (job, attempt), oldest first.
        self.closed: dict[tuple[str, int], deque[int]] = {}
        self._closed_sets: dict[tuple[str, int], set[int]] = {}
        self.counters: dict[str, int] = {
            "batches": 0,
            "ops": 0,
            "late_batches": 0,
            "duplicate_batches": 0,
            "non_representative_batches": 0,
            "steps_closed": 0,
            "steps_incomplete": 0,
            "steps_unanalysed": 0,
        }

    # -- input ------------------------------------------------------------------------
    def on_job(self, info: JobInfo) -> None:
        key = (info.job_id, info.attempt)
        if key not in self.jobs:
            self.jobs[key] = _JobState(info, self.settings)

    def on_batch(self, batch: RankStepBatch) -> list[StepOutput]:
        """Add one batch; returns the steps it completed (usually none or one)."""
        self.counters["batches"] += 1
        if batch.tp_rank != 0 or batch.cp_rank != 0:
            self.counters["non_representative_batches"] += 1
            return []
        job_key = (batch.job_id, batch.attempt)
        if batch.step in self._closed_sets.get(job_key, ()):
            self.counters["late_batches"] += 1
            return []
        key = (batch.job_id, batch.attempt, batch.step)
        window = self.windows.get(key)
        if window is None:
            window = self.windows[key] = _Window(first_seen=self.clock())
        fingerprint = _fingerprint(batch)
        if fingerprint in window.fingerprints:
            self.counters["duplicate_batches"] += 1
            return []
        window.fingerprints.add(fingerprint)
        window.batches.setdefault((batch.dp_rank, batch.pp_rank), []).append(batch)
        self.counters["ops"] += batch.n_ops
        job = self.jobs.get(job_key)
        if job is not None and len(window.batches) == job.info.dp_size * job.info.pp_size:
            return [self._close(key)]
        return []

    def tick(self) -> list[StepOutput]:
        """Close every window whose lateness timeout has passed (oldest step first)."""
        now = self.clock()
        due = sorted(
            (k for k, w in self.windows.items() if now - w.first_seen >= self.settings.lateness_s),
            key=lambda k: (k[0], k[1], k[2]),
        )
        return [self._close(k) for k in due]

    def flush(self) -> list[StepOutput]:
        """Close every open window now (end of input)."""
        return [self._close(k) for k in sorted(self.windows)]

    # -- closing a step -----------------------------------------------------------------
    def _close(self, key: tuple[str, int, int]) -> StepOutput:
        window = self.windows.pop(key)
        job_id, attempt, step = key
        job_key = (job_id, attempt)
        remembered = self.closed.setdefault(
            job_key, deque(maxlen=self.settings.closed_steps_remembered)
        )
        closed_set = self._closed_sets.setdefault(job_key, set())
        if len(remembered) == remembered.maxlen:
            closed_set.discard(remembered[0])
        remembered.append(step)
        closed_set.add(step)
        self.counters["steps_closed"] += 1
        start_ns = min(int(b.start_ns.min()) for b in window.all_batches() if b.n_ops)
        job = self.jobs.get(job_key)
        if job is None:
            self.counters["steps_unanalysed"] += 1
            info = JobInfo(job_id=job_id, attempt=attempt, dp_size=1, pp_size=1, world_size=1)
            return StepOutput(
                job_id,
                attempt,
                step,
                start_ns,
                False,
                (),
                None,
                info,
                reason="no job metadata arrived for this job",
            )
        info = job.info
        expected = {(dp, pp) for dp in range(info.dp_size) for pp in range(info.pp_size)}
        missing = tuple(sorted(expected - set(window.batches)))
        complete_dp = [
            dp
            for dp in range(info.dp_size)
            if all((dp, pp) in window.batches for pp in range(info.pp_size))
        ]
        if missing:
            self.counters["steps_incomplete"] += 1
        if not complete_dp:
            self.counters["steps_unanalysed"] += 1
            return StepOutput(
                job_id,
                attempt,
                step,
                start_ns,
                False,
                missing,
                None,
                info,
                reason="no pipeline replica reported all its stages",
            )
        batches = [
            b for dp in complete_dp for pp in range(info.pp_size) for b in window.batches[dp, pp]
        ]
        try:
            result, prepared = self._analyse(job, batches, complete_dp)
        except TraceError as exc:
            self.counters["steps_unanalysed"] += 1
            return StepOutput(
                job_id, attempt, step, start_ns, not missing, missing, None, info, reason=str(exc)
            )
        changes = self._detect(job, step, result, prepared, complete=not missing)
        analysed = tuple(complete_dp) if missing else ()
        return StepOutput(
            job_id,
            attempt,
            step,
            start_ns,
            not missing,
            missing,
            result,
            info,
            changes=changes,
            analysed_dp_ranks=analysed,
        )

    def _analyse(
        self, job: _JobState, batches: list[RankStepBatch], dp_ranks: list[int]
    ) -> tuple[WhatIfResult, PreparedTrace]:
        trace = batches_to_trace(batches, job.info.pp_size, dp_ranks)
        meta = job.info.to_meta()
        prepared = prepare(trace, meta, model=job.model)
        complete = len(dp_ranks) == job.info.dp_size
        if job.model is None:
            job.model = prepared.model
        if complete:
            job.ideal.add_step(prepared)
            job.retained.append(prepared)
        ideal = job.ideal.current()
        for optype in set(prepared.node_optype) - set(ideal):
            # A first step that is incomplete: its own values are the best estimate.
            ideal[optype] = _own_ideal(prepared, optype)
        if job.compiled is None:
            job.compiled = compile_model(job.model)
        # M_W/M_S and the launch-delay fit are for roll-ups: a streamed step needs one pass.
        result = analyze(
            prepared,
            ideal=ideal,
            compiled=job.compiled,
            decompose_threshold=self.settings.decompose_threshold,
            explain=False,
        )
        return result, prepared

    def _detect(
        self,
        job: _JobState,
        step: int,
        result: WhatIfResult,
        prepared: PreparedTrace,
        *,
        complete: bool,
    ) -> tuple[DetectedChange, ...]:
        if not complete:
            return ()
        compute = np.isin(np.array(prepared.node_optype), [ot.FORWARD_COMPUTE, ot.BACKWARD_COMPUTE])
        stage = prepared.model.node_stage()
        per_worker = np.zeros((prepared.n_stages, prepared.n_dp))
        np.add.at(per_worker, stage[compute], prepared.duration[compute, 0, :])
        values = np.concatenate(
            [[result.t_actual[0]], per_worker.max(axis=1), per_worker.sum(axis=0)]
        )
        if job.detector is None:
            job.series_names = (
                ["step_time"]
                + [f"stage/{s}" for s in range(prepared.n_stages)]
                + [f"dp/{d}" for d in range(prepared.n_dp)]
            )
            job.detector = BocdBank(len(job.series_names), self.settings.bocd)
        index = job.detector.steps_seen
        job.fed_steps.append((index, step))
        found = job.detector.update(values)
        step_of = dict(job.fed_steps)
        return tuple(
            DetectedChange(
                series=job.series_names[c.series],
                step=step_of.get(c.index, step),
                kind=c.kind,
                before_mean=c.before_mean,
                after_mean=c.after_mean,
                probability=c.probability,
                detected_at_step=step,
            )
            for c in found
        )

    # -- job level ----------------------------------------------------------------------
    def rollup(self, job_id: str, attempt: int = 0) -> WhatIfResult | None:
        """What-if analysis of the retained complete steps, ideals from those steps."""
        job = self.jobs.get((job_id, attempt))
        if job is None or not job.retained:
            return None
        steps = sorted(job.retained, key=lambda p: int(p.steps[0]))
        return analyze(concat_steps(steps), decompose_threshold=self.settings.decompose_threshold)

    # -- state --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings.model_dump(),
            "counters": dict(self.counters),
            "windows": {
                key: {"age_s": self.clock() - w.first_seen, "batches": w.all_batches()}
                for key, w in self.windows.items()
            },
            "closed": {key: list(steps) for key, steps in self.closed.items()},
            "jobs": {
                key: {
                    "info": job.info.model_dump(),
                    "model": job.model,
                    "ideal": job.ideal.state(),
                    "retained": list(job.retained),
                    "detector": job.detector.state_dict() if job.detector else None,
                    "series_names": job.series_names,
                    "fed_steps": list(job.fed_steps),
                }
                for key, job in self.jobs.items()
            },
        }

    @classmethod
    def from_state(
        cls, state: dict[str, Any], clock: Callable[[], float] = time.monotonic
    ) -> StepProcessor:
        processor = cls(ProcessorSettings.model_validate(state["settings"]), clock)
        processor.counters.update(state["counters"])
        now = clock()
        for key, saved in state["windows"].items():
            window = _Window(first_seen=now - saved["age_s"])
            for batch in saved["batches"]:
                window.batches.setdefault((batch.dp_rank, batch.pp_rank), []).append(batch)
                window.fingerprints.add(_fingerprint(batch))
            processor.windows[key] = window
        for key, steps in state["closed"].items():
            processor.closed[key] = deque(steps, maxlen=processor.settings.closed_steps_remembered)
            processor._closed_sets[key] = set(steps)
        for key, saved in state["jobs"].items():
            job = _JobState(JobInfo.model_validate(saved["info"]), processor.settings)
            job.model = saved["model"]
            job.ideal.restore(saved["ideal"])
            job.retained.extend(saved["retained"])
            if saved["detector"] is not None:
                job.detector = BocdBank.from_state(saved["detector"])
            job.series_names = list(saved["series_names"])
            job.fed_steps.extend(tuple(x) for x in saved["fed_steps"])
            processor.jobs[key] = job
        return processor


def _own_ideal(prepared: PreparedTrace, optype: str) -> float:
    nodes = [i for i, t in enumerate(prepared.node_optype) if t == optype]
    if ot.is_compute(optype):
        return float(prepared.duration[nodes].mean(dtype=np.float64))
    return float(np.median(prepared.cost[nodes]))


def batches_to_trace(
    batches: Iterable[RankStepBatch], pp_size: int, dp_ranks: list[int] | None = None
) -> Trace:
    """One step's batches as a trace: seconds from the step's earliest op, float32.

    `dp_ranks` renumbers the given DP ranks 0..k-1 (the complete replicas of a step).
    """
    batches = list(batches)
    renumber = {dp: i for i, dp in enumerate(dp_ranks)} if dp_ranks is not None else None
    names = sorted({n for b in batches for n in b.optype_names})
    code_of = {n: i for i, n in enumerate(names)}
    origin = min(int(b.start_ns.min()) for b in batches if b.n_ops)
    parts: dict[str, list[np.ndarray]] = {name: [] for name in TRACE_ARRAYS}
    for b in batches:
        n = b.n_ops
        remap = np.array([code_of[x] for x in b.optype_names], dtype=np.int16)
        codes = remap[b.optype] if n else np.zeros(0, np.int16)
        chunked = (
            np.isin(np.array(b.optype_names)[b.optype], list(_CHUNKED_OPTYPES))
            if n
            else np.zeros(0, bool)
        )
        compute = (
            np.isin(np.array(b.optype_names)[b.optype], [ot.FORWARD_COMPUTE, ot.BACKWARD_COMPUTE])
            if n
            else np.zeros(0, bool)
        )
        chunk = np.maximum(b.chunk.astype(np.int32), 0)
        dp = renumber[b.dp_rank] if renumber is not None else b.dp_rank
        parts["dp_rank"].append(np.full(n, dp, np.int32))
        parts["stage"].append(np.full(n, b.pp_rank, np.int32))
        parts["rank"].append(np.full(n, b.rank, np.int64))
        parts["step"].append(np.full(n, b.step, np.int64))
        parts["optype"].append(codes)
        parts["start_ts"].append(((b.start_ns - origin) / 1e9).astype(np.float32))
        parts["duration"].append((b.duration_ns / 1e9).astype(np.float32))
        parts["seq_id"].append(b.seq.astype(np.int32))
        parts["mc"].append(np.where(chunked, chunk, -1).astype(np.int32))
        parts["gmc"].append(np.where(compute, b.pp_rank + chunk * pp_size, -1).astype(np.int32))
        parts["mb_id"].append(b.microbatch.astype(np.int32))
    columns: dict[str, Any] = {k: np.concatenate(v) for k, v in parts.items()}
    columns["optype_names"] = tuple(names)
    job = batches[0]
    return Trace.from_columns(columns, source=f"{job.job_id}/{job.attempt} step {job.step}")
