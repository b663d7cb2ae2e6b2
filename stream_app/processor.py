"""The step processor: rank-step batches in, per-step what-if results and change points out.

One engine-agnostic class serves both hosts (the faust worker and the embedded runner):

- **Windows per (job, attempt, step)**, kept by hand. A step closes when every expected
  (dp, pp) coordinate has reported, when every coordinate has sent a later step, or when
  its missing coordinates have been silent for the job's lateness
  (`stream_app/lateness.py`): then it is marked incomplete with the missing ranks and why,
  and the pipeline replicas (DP ranks) that are complete are still analysed. A late batch
  for a step closed without it closes the step again while the job holds its batches (a
  newer version of its rows), else it is set aside as a dead letter saying so.
- **Incremental what-if.** The job's dependency model is inferred once, from its first
  closed step. Each closed step is simulated with *running* ideal costs: the mean of every
  compute op type over all steps so far, and for communication the exact median over a
  bounded window of recent steps (each step contributes at most `median_values_per_step`
  values, an evenly strided sample). The job-level roll-up re-analyses the retained steps
  (the last `rollup_window_steps` complete ones, fewer when they would exceed
  `rollup_budget_bytes`) with ideals computed from exactly those steps, which is
  `lagscope analyze` on the same steps.
- **Change points.** One vectorized BOCD update per closed step over the job's step time
  and the own work (computes, optimizer, input wait) of every stage, DP rank and worker,
  each relative to the step's median of its kind.
- **State** (`state_dict` / `from_state`) holds the open windows, the running estimates,
  the retained steps and the detectors, so a host can checkpoint and resume.

Only TP/CP rank 0 batches are analysed (one representative per (dp, pp) coordinate); the
others are counted and dropped.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from lagscope.producers.events import JobInfo, RankStepBatch
from lagscope.simulator.bocd import BocdBank, BocdConfig
from lagscope.simulator.diagnose import DiagnosisSettings
from lagscope.simulator.noise import series_names, step_series
from lagscope.simulator.online_episodes import OnlineEpisodeSettings
from lagscope.simulator.prepare import PreparedTrace, concat_steps, with_entries
from lagscope.simulator.whatif import WhatIfResult, analyze
from lagscope.store.snapshot_format import SnapshotError, decode_state, encode_state
from lagscope.stream_app import admission
from lagscope.stream_app.analysis_process import (
    ChildProcesses,
    InProcess,
    Outcome,
    shared_children,
)
from lagscope.stream_app.held_bytes import held_bytes
from lagscope.stream_app.job_analysis import EpisodeState, JobDiagnosis, LiveJob
from lagscope.stream_app.lateness import JobArrivals
from lagscope.stream_app.step_compute import JobCompute, StepComputed

log = logging.getLogger("lagscope.processor")

_OWNERS = count()


#: Ops of a step from which its job's compute half goes to an analysis process.
ANALYSIS_PROCESS_MIN_OPS = 60_000


class ProcessorSettings(BaseModel):
    """How the step processor windows and estimates (section `processor` of the config)."""

    model_config = ConfigDict(extra="forbid")

    #: The most a step waits for a missing (dp, pp) coordinate: how long that one may send
    #: nothing before its steps close without it. A job's own lateness follows its pace
    #: below this (`stream_app/lateness.py`); a coordinate that never sent waits this.
    lateness_s: float = Field(default=30.0, gt=0)
    #: Steps whose inputs are kept for the job-level roll-up (and the comm medians).
    rollup_window_steps: int = Field(default=256, ge=1)
    #: Bytes the retained steps of one job may hold. A step holds 16 bytes per op and DP
    #: rank (4.5 MB for a 12,288-GPU job of dp 192 x pp 8 x tp 8), so a big job keeps
    #: fewer than `rollup_window_steps`: the last `budget // step bytes` (at least one),
    #: and its roll-up and comm medians cover just those (`retained_capacity`).
    rollup_budget_bytes: int = Field(default=96 << 20, ge=1)
    #: Cap on the transfer times one step adds to a comm op type's running median. With the
    #: roll-up window that is 262k values per op type, plenty for a median; 4,096 cost a
    #: 1,024-GPU job 3 ms per step keeping the window sorted (1.1 ms at 1,024).
    median_values_per_step: int = Field(default=1024, ge=16)
    #: Largest job (GPUs) whose record is taken on: a job's windows, detectors and roll-up
    #: grow with its grid, so a record beyond this is rejected before anything is allocated.
    max_world_size: int = Field(default=131_072, ge=1)
    #: Closed step ids remembered per job to recognise late batches.
    closed_steps_remembered: int = Field(default=100_000, ge=16)
    #: Attribution is reported from this slowdown on (the reference's 1.03).
    decompose_threshold: float = Field(default=1.03, gt=0)
    #: The job's first diagnosis (a roll-up of its retained steps) comes after this many
    #: complete steps, each next one after twice as many as the last, up to the retained
    #: window's length (and once more when the job ends): a roll-up of 256 steps of the
    #: AR job and its diagnosis take ~0.25 s, of a 12,288-GPU job's 17 steps ~3 s.
    diagnose_every_steps: int = Field(default=10, ge=1)
    #: When a worker's episode opens and closes (simulator/online_episodes.py).
    episodes: OnlineEpisodeSettings = OnlineEpisodeSettings()
    #: What names a cause, and what its actions cost (simulator/diagnose.py).
    diagnosis: DiagnosisSettings = DiagnosisSettings()
    bocd: BocdConfig = BocdConfig()
    #: Child processes that run the compute half of the steps' analysis (prepare, running
    #: ideals, engine) while the host decodes the next step: 0 runs it in the host's
    #: process; 1 gives one job a second core; more serve more jobs at once, each job on
    #: one child. The results are the same either way. What it gains depends on the
    #: host's own half (decoding, windowing, the live half, the store's writes): see
    #: deploy/README.md. A host's setting: a resumed worker takes its own, not its
    #: snapshot's.
    analysis_processes: int = Field(default=0, ge=0, le=64)
    #: With analysis processes, a job's steps go to one only when a step holds at least
    #: this many ops (its first analysable step, scaled to all its DP ranks): a smaller
    #: step costs the host more to hand over (pack, pickle, the results back, its own
    #: copy of the running ideals) than it takes to compute, so its job is computed in
    #: the host's process (measurements: deploy/README.md, "Workers"). 0 sends every job.
    analysis_process_min_ops: int = Field(default=ANALYSIS_PROCESS_MIN_OPS, ge=0)
    #: Calls' worth of closed steps in flight to the children before the host waits for
    #: the oldest, and the memory their ops may hold (their batches, and their copy on
    #: the way to a child, ~60 bytes an op); one call always goes. Deep enough that the
    #: host goes on decoding through its own roll-ups (a 34-step re-analysis at 12,288
    #: GPUs) while the child works through what was sent: two calls left the child idle
    #: then. The bytes keep a large job's at two steps of 100,000 GPUs, as two calls
    #: did: there the host's decoding is the bottleneck and a deeper queue gained
    #: nothing (measurements: deploy/README.md, "Workers").
    analysis_in_flight: int = Field(default=32, ge=1)
    analysis_in_flight_bytes: int = Field(default=192 << 20, ge=0)


#: Settings of the host that runs the analysis, not of the analysis: a resumed processor
#: takes them from its host, not from its snapshot.
HOST_SETTINGS = (
    "lateness_s", "analysis_processes", "analysis_process_min_ops", "analysis_in_flight",
    "analysis_in_flight_bytes",
)  # fmt: skip
#: How the reason of a late batch set aside begins (its dead letter's kind: `late`).
LATE_REASON = "late:"
#: Missing coordinates a step's `missing_reason` names one by one (the rest are counted).
_MISSING_NAMED = 4
#: Steps closed without some coordinates whose batches a job holds for late ones, and the
#: ops they may hold in all (~30 bytes each: 60 MB; a 100,000-GPU job's step alone is
#: more, and is not held).
_HELD_STEPS = 64
_HELD_OPS = 2_000_000
#: Steps closed without some coordinates remembered per job with those coordinates.
_CLOSED_WITHOUT_KEPT = 4096
#: Memory an op in flight to a child holds on the host: its batch (~30 bytes an op on
#: the wire and in the decoded columns' buffer) and its packed copy until the child
#: reads it (27).
_IN_FLIGHT_BYTES_PER_OP = 60


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
    #: Episodes this step opened, kept current or closed.
    episodes: tuple[EpisodeState, ...] = ()
    #: The job's diagnosis, when this step made one due.
    diagnosis: JobDiagnosis | None = None
    #: Why each missing coordinate's batch was not there when the step closed.
    missing_reason: str = ""
    #: 0, or how many times the step closed again after late batches came for it (its
    #: rows replace the stored ones of a lower version).
    version: int = 0
    #: When the host had the step's last batch (wall-clock seconds; 0: not known).
    received_at: float = 0.0


@dataclass(frozen=True)
class JobConclusion:
    """A job's end (its input ended or it fell idle): its final diagnosis and every
    episode with its bounds refined on the steps around it."""

    job_id: str
    attempt: int
    info: JobInfo
    diagnosis: JobDiagnosis | None
    episodes: tuple[EpisodeState, ...]


@dataclass
class _Window:
    first_seen: float
    #: When its latest batch came (wall-clock time: the steps' `received_at`).
    received_at: float = 0.0
    #: Batches per (dp, pp) coordinate: a rank-step may arrive in several parts (a huge
    #: step, or ops recorded after the step was sealed).
    batches: dict[tuple[int, int], list[RankStepBatch]] = field(default_factory=dict)
    fingerprints: set[tuple[int, int, bytes]] = field(default_factory=set)

    def all_batches(self) -> list[RankStepBatch]:
        return [b for parts in self.batches.values() for b in parts]


@dataclass
class _Closed:
    """A closed step waiting for its analysis."""

    job: _JobState
    step: int
    start_ns: int
    missing: tuple[tuple[int, int], ...]
    #: DP ranks whose every stage reported (the ones analysed).
    dp_ranks: list[int]
    batches: list[RankStepBatch]
    #: Why the step cannot be analysed ("": it can).
    reason: str = ""
    #: Why its missing coordinates were missing.
    missing_reason: str = ""
    #: > 0: the step closed again, with late batches, and what it held.
    version: int = 0
    held: _Held | None = None
    #: When the host had its last batch (wall clock).
    received_at: float = 0.0

    @property
    def complete(self) -> bool:
        return not self.missing


@dataclass
class _Held:
    """A step closed without some coordinates, its batches held for theirs: a late batch
    closes it again (`StepProcessor._reclose`), its rows replacing the stored ones."""

    step: int
    start_ns: int
    batches: dict[tuple[int, int], list[RankStepBatch]]
    missing: set[tuple[int, int]]
    ops: int
    version: int = 0
    #: The stored result's (actual, ideal, slowdown), taken back from the job's totals
    #: when it closes again (None: it had none).
    figures: tuple[float, float, float] | None = None
    #: Late batches came since it last closed.
    fresh: bool = False


@dataclass
class _Submitted:
    """One call's closed steps, in closing order, and their jobs' computations."""

    closing: list[_Closed | StepOutput]
    #: Per job: its state, its steps (index in `closing`), the ticket of their compute.
    jobs: list[tuple[_JobState, list[tuple[int, _Closed]], int | None]]
    #: Ops sent to be computed.
    ops: int = 0


def _fingerprint(batch: RankStepBatch) -> tuple[int, int, bytes]:
    """Identity of a batch's content: a re-sent batch has the same ops at the same times."""
    return (batch.dp_rank, batch.pp_rank, batch.start_ns.tobytes() + batch.seq.tobytes())


#: Fields of a retained step that are its own (the model and meta are the job's).
_STEP_INPUTS = (
    "steps", "n_dp", "start", "duration", "cost", "launch_delay", "actual_step_time",
    "worker_rank", "source", "gc_pause", "gc_gap_pause", "entry",
)  # fmt: skip
#: ... less those a snapshot of an earlier version lacks (none recorded, or not known,
#: as then).
_STEP_INPUTS_ADDED = ("gc_gap_pause", "entry")
_ADDED_NONE = dict.fromkeys(_STEP_INPUTS_ADDED)


def encode_step_inputs(prepared: PreparedTrace) -> bytes:
    """A retained step's inputs, without the job's model (hosts persist these once), in the
    safe state format (`store.snapshot_format`: no pickle)."""
    return encode_state(_step_inputs(prepared))


def _step_inputs(prepared: PreparedTrace) -> dict[str, Any]:
    return {name: getattr(prepared, name) for name in _STEP_INPUTS}


def decode_step_inputs(payload: bytes, where: str = "retained step") -> dict[str, Any]:
    """The fields `encode_step_inputs` wrote; a payload of another shape is a
    SnapshotError."""
    inputs = decode_state(payload, where)
    if not isinstance(inputs, dict) or not (
        set(_STEP_INPUTS) - set(_STEP_INPUTS_ADDED) <= set(inputs) <= set(_STEP_INPUTS)
    ):
        raise SnapshotError(f"{where}: not the inputs of a retained step")
    return {name: None for name in _STEP_INPUTS_ADDED} | inputs


class _JobState:
    def __init__(self, info: JobInfo, settings: ProcessorSettings) -> None:
        self.info = info
        self.settings = settings
        #: The dependency model and running ideals: the compute half's own state (a child
        #: process holds its copy; this one is kept equal to it for snapshots).
        self.compute = JobCompute(info, settings)
        #: Where its compute half runs: chosen at its first analysable step (by its size).
        self.executor: InProcess | ChildProcesses | None = None
        self.retained: deque[PreparedTrace] = deque(maxlen=settings.rollup_window_steps)
        self.detector: BocdBank | None = None
        self.series_names: list[str] = []
        #: (update index, step id) of recent detector updates, to name change steps.
        self.fed_steps: deque[tuple[int, int]] = deque(maxlen=4096)
        #: Per series, the mean of its first regime: a change is an onset only when it
        #: rises above it (a stage that got relatively faster because another one slowed
        #: and came back is no onset).
        self.series_baseline: dict[str, float] = {}
        #: Totals, episodes and diagnosis, kept current step by step.
        self.live = LiveJob(
            info, settings.diagnose_every_steps, settings.episodes, settings.diagnosis
        )
        #: The steps of its last diagnosis, held while a snapshot may need them
        #: (`StepProcessor.keep_diagnosed`).
        self.diagnosed: tuple[PreparedTrace, ...] = ()
        #: What its coordinates delivered and when: how long its steps wait for one.
        self.arrivals = JobArrivals(settings.lateness_s)
        #: Its open windows' steps.
        self.open_steps: set[int] = set()
        #: Its (dp, pp) coordinates, and per step how many of them delivered it last (the
        #: lowest such step, once each delivered one, is the one all have reached).
        self.coordinates = info.dp_size * info.pp_size
        self._reached: dict[int, int] = {}
        self.passed_by_all: int | None = None
        #: Its latest steps closed without some coordinates, their batches held (at most
        #: `_HELD_STEPS`, `_HELD_OPS` ops in all), and the coordinates each closed without
        #: (more of them: a late batch beyond those held is a dead letter saying so).
        self.held: dict[int, _Held] = {}
        self.held_ops = 0
        self.closed_without: dict[int, frozenset[tuple[int, int]]] = {}

    def _fit_window(self) -> None:
        """The retained window as long as the compute half's (sized by the byte budget
        from the job's first complete step)."""
        capacity = self.compute.capacity
        if self.retained.maxlen == capacity:
            return
        self.retained = deque(self.retained, maxlen=capacity)
        if capacity < self.settings.rollup_window_steps:
            log.warning(
                "job %s/%d: a step holds %.1f MB, so its roll-up and comm medians cover the "
                "last %d complete steps (rollup_budget_bytes %d MB), not %d",
                self.info.job_id,
                self.info.attempt,
                self.compute.step_bytes / 1e6,
                capacity,
                self.settings.rollup_budget_bytes >> 20,
                self.settings.rollup_window_steps,
            )

    def retain(self, prepared: PreparedTrace, *, mirror: bool) -> None:
        """Keep a complete step for the roll-up; `mirror`: add it to this side's running
        ideals too (the compute half ran elsewhere)."""
        if mirror:
            self.compute.add_complete_step(prepared)
        self._fit_window()
        self.retained.append(prepared)

    def retain_at(self, prepared: PreparedTrace, *, mirror: bool) -> None:
        """Keep a step that became complete late among the retained ones, in step order
        (not when it is older than all of a full window)."""
        if mirror:
            self.compute.add_complete_step(prepared)
        self._fit_window()
        step = int(prepared.steps[0])
        kept = sorted([*self.retained, prepared], key=lambda p: int(p.steps[0]))
        if len(kept) > (self.retained.maxlen or len(kept)) and int(kept[0].steps[0]) == step:
            return
        self.retained = deque(kept, maxlen=self.retained.maxlen)

    def restore_retained(self, ideal_state: dict[str, Any], retained: list[PreparedTrace]) -> None:
        if retained:
            self.compute.size_window(retained[0])
            self._fit_window()
            # A snapshot taken under a larger budget keeps only what this one allows.
            retained = retained[-self.compute.capacity :]
        self.retained.extend(retained)
        self.compute.ideal.restore(ideal_state, retained)

    def delivered(self, coordinate: tuple[int, int], step: int, at: float, delay_s: float) -> bool:
        """Note a batch of `coordinate` for `step`; True when it moved the step that every
        coordinate has reached (the steps before it will get no more batches)."""
        arrivals = self.arrivals
        before = arrivals.latest_step.get(coordinate)
        arrivals.on_batch(coordinate, step, at, delay_s)
        after = arrivals.latest_step[coordinate]
        if before == after:
            return False
        reached = self._reached
        if before is not None:
            reached[before] -= 1
            if not reached[before]:
                del reached[before]
        reached[after] = reached.get(after, 0) + 1
        if len(arrivals.latest_step) < self.coordinates:
            return False
        lowest = self.passed_by_all
        if lowest is None or lowest not in reached:
            lowest = min(reached)
        if lowest != self.passed_by_all:
            self.passed_by_all = lowest
            return True
        return False

    def hold(self, held: _Held) -> None:
        """Hold a step closed without some coordinates, letting go of the oldest held."""
        self.closed_without[held.step] = frozenset(held.missing)
        while len(self.closed_without) > _CLOSED_WITHOUT_KEPT:
            del self.closed_without[next(iter(self.closed_without))]
        self.held[held.step] = held
        self.held_ops += held.ops
        while self.held and (len(self.held) > _HELD_STEPS or self.held_ops > _HELD_OPS):
            self.release(next(iter(self.held)))

    def release(self, step: int) -> None:
        held = self.held.pop(step, None)
        if held is not None:
            self.held_ops -= held.ops

    def restore_reached(self) -> None:
        """The steps reached, counted again from the arrivals (after a restore)."""
        self._reached = {}
        for step in self.arrivals.latest_step.values():
            self._reached[step] = self._reached.get(step, 0) + 1
        if len(self.arrivals.latest_step) >= self.coordinates and self._reached:
            self.passed_by_all = min(self._reached)

    def diagnosed_beyond_window(self) -> list[PreparedTrace]:
        """The held steps of the last diagnosis that the retained window no longer holds."""
        retained = {int(p.steps[0]) for p in self.retained}
        return [p for p in self.diagnosed if int(p.steps[0]) not in retained]

    @property
    def retained_capacity(self) -> int:
        """How many complete steps the roll-up covers at most (the budget's cap)."""
        return self.retained.maxlen or 0

    def held_bytes(self, seen: set[int] | None = None) -> dict[str, int]:
        """Bytes each structure the job keeps between its steps holds, each object counted
        once, where it is first met in this order (`held_bytes`). Each has its bound,
        whatever the job's length: the running ideals (with the dependency model) and the
        detectors the job's shape, the retained steps the roll-up budget
        (`rollup_budget_bytes`, on their arrays' bytes; a worker's twice, while the steps
        of its last diagnosis the window moved past wait for a snapshot to store them), its
        episodes `CLOSED_EPISODES_KEPT` closed ones and the detector's history, its
        arrivals `lateness._KEPT` observations, the steps held for late batches
        `_HELD_STEPS` and `_HELD_OPS`."""
        seen = set() if seen is None else seen
        parts = {
            # First: the dependency model its retained steps share is the compute's.
            "running_ideals": self.compute,
            "retained_steps": (self.retained, self.diagnosed),
            "change_points": (self.detector, self.fed_steps, self.series_baseline),
            "episodes_and_diagnosis": self.live,
            "arrivals": (self.arrivals, self._reached),
            "held_steps": (self.held, self.closed_without),
        }
        return {name: held_bytes(part, seen) for name, part in parts.items()}


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
        #: Jobs whose record was rejected, and why: their batches are rejected too.
        self.rejected_jobs: dict[tuple[str, int], str] = {}
        #: Batches set aside after they were windowed (their job's record came later and
        #: they do not fit it), with the reason; hosts take them as dead letters.
        self.rejected: list[tuple[RankStepBatch, str]] = []
        #: (job, attempt, op type) already reported as outside the analysis' vocabulary.
        self._unknown_optypes_reported: set[tuple[str, int, str]] = set()
        self.counters: dict[str, int] = {
            "batches": 0,
            "ops": 0,
            "batches_rejected": 0,
            "ops_of_unknown_type": 0,
            "late_batches": 0,
            "duplicate_batches": 0,
            "non_representative_batches": 0,
            "steps_closed": 0,
            "steps_incomplete": 0,
            "steps_unanalysed": 0,
            "steps_closed_again": 0,
            "late_batches_set_aside": 0,
        }
        #: The analysis processes, started for the first job large enough to go to one.
        self._children: ChildProcesses | None = None
        self._here = InProcess()
        #: This processor among the others its executor serves (they share children).
        self._owner = next(_OWNERS)
        #: Calls whose analysis is under way, oldest first, and outputs finished since
        #: the last call returned them.
        self._submitted: deque[_Submitted] = deque()
        self._finished: list[StepOutput] = []
        #: Outcomes polled before their call's other jobs came back, by (executor, ticket).
        self._outcomes: dict[tuple[int, int], Outcome] = {}
        #: Hold each job's last diagnosis' steps (`_JobState.diagnosed`) until the host
        #: drops them (`forget_diagnosed`): a worker snapshots them, so that a resumed job
        #: makes that diagnosis again; its window no longer holds the oldest of them.
        self.keep_diagnosed = False

    def forget_diagnosed(self) -> None:
        """Let go of the diagnosed steps held (a snapshot stored them)."""
        for job in self.jobs.values():
            job.diagnosed = ()

    @property
    def in_flight(self) -> int:
        """Calls whose closed steps' analysis has not come back yet (0: none)."""
        return len(self._submitted)

    def analysing(self, job_id: str, attempt: int = 0) -> bool:
        """Whether closed steps of the job are still being analysed (their outputs come
        with a later call)."""
        key = (job_id, attempt)
        return any(
            (job.info.job_id, job.info.attempt) == key
            for s in self._submitted
            for job, _, _ in s.jobs
        ) or any((out.job_id, out.attempt) == key for out in self._finished)

    def drain(self) -> list[StepOutput]:
        """Wait for every closed step's analysis; returns the outputs not returned yet."""
        return self._analyse_closed([], wait=True)

    def _settle(self) -> None:
        """Finish every analysis under way (its outputs come with the next call), so the
        job's state is whole: before a roll-up, a conclusion or a snapshot."""
        finished = self._analyse_closed([], wait=True)  # (it hands `_finished` over)
        self._finished.extend(finished)

    def close(self) -> None:
        """Let go of what the executor holds for this processor (it is dropped)."""
        if self._children is not None:
            self._children.forget(self._owner)

    # -- input ------------------------------------------------------------------------
    def on_job(self, info: JobInfo) -> str:
        """Take on a job's record; returns why it was not taken, or "".

        A job beyond `max_world_size` is rejected before anything is allocated for it; a
        record that differs from the one already taken leaves the first standing. Windows
        opened before the record came are checked against it (`take_rejected`).
        """
        key = (info.job_id, info.attempt)
        known = self.jobs.get(key)
        if known is not None:
            return admission.job_conflict(known.info, info)
        if key in self.rejected_jobs:
            return self.rejected_jobs[key]
        problem = admission.job_problem(info, self.settings.max_world_size)
        if problem:
            self.rejected_jobs[key] = problem
            return problem
        job = self.jobs[key] = _JobState(info, self.settings)
        for window_key, window in self.windows.items():
            if window_key[:2] == key:
                self._evict_off_grid(window, info)
                job.open_steps.add(window_key[2])
        return ""

    def admit(self, batch: RankStepBatch) -> tuple[RankStepBatch | None, str]:
        """The part of a decoded batch that may be windowed (None: no part), and why the
        rest, if any, was set aside ("" when nothing was). Hosts call this at the edge and
        dead-letter the batch with its origin when a reason comes back."""
        problem = admission.batch_problem(batch)
        job_key = (batch.job_id, batch.attempt)
        if not problem and job_key in self.rejected_jobs:
            problem = f"its job record was rejected: {self.rejected_jobs[job_key]}"
        job = self.jobs.get(job_key)
        if not problem and job is not None:
            problem = admission.grid_problem(batch, job.info)
        if problem:
            self.counters["batches_rejected"] += 1
            return None, problem
        unknown = admission.unknown_optypes(batch)
        if not unknown:
            return batch, ""
        kept = admission.without_optypes(batch, unknown)
        self.counters["ops_of_unknown_type"] += batch.n_ops - kept.n_ops
        first_seen = [n for n in unknown if (*job_key, n) not in self._unknown_optypes_reported]
        self._unknown_optypes_reported.update((*job_key, n) for n in unknown)
        reason = ""
        if first_seen:
            reason = (
                f"job {batch.job_id}/{batch.attempt} step {batch.step} rank {batch.rank}: op "
                f"type(s) {', '.join(map(repr, first_seen))} are not in the analysis' "
                "vocabulary; their ops are left out of the analysis (reported once per job)"
            )
        return (kept if kept.n_ops else None), reason

    def take_rejected(self) -> list[tuple[RankStepBatch, str]]:
        """Batches set aside since the last call, with their reasons."""
        rejected, self.rejected = self.rejected, []
        return rejected

    def _evict_off_grid(self, window: _Window, info: JobInfo) -> None:
        for coordinate, parts in list(window.batches.items()):
            kept = []
            for part in parts:
                problem = admission.grid_problem(part, info)
                if problem:
                    self.counters["batches_rejected"] += 1
                    self.rejected.append((part, problem))
                else:
                    kept.append(part)
            if kept:
                window.batches[coordinate] = kept
            else:
                del window.batches[coordinate]

    def on_batch(self, batch: RankStepBatch) -> list[StepOutput]:
        """Add one batch; returns the steps it completed (usually none or one)."""
        return self.on_batches((batch,))

    def on_batches(
        self,
        batches: Iterable[RankStepBatch],
        *,
        admitted: bool = False,
        arrivals: Iterable[tuple[float, float]] | None = None,
    ) -> list[StepOutput]:
        """Add batches; returns the steps they closed, in the order they closed: a step
        closes when its last coordinate's batch comes, or when every coordinate has sent
        a later step (`stream_app/lateness.py`). `admitted`: every batch came back from
        `admit` (a host's): not checked again. `arrivals`: per batch, when it came (the
        lateness clock) and how long after it was produced; default: now, at once.

        The closed steps are analysed together (one engine pass per job), each with the
        running estimates it would have had alone, so the numbers do not depend on how the
        input was cut into calls: a crash replay that regroups it gives the same rows.
        """
        closing: list[_Closed | StepOutput] = []
        times = iter(arrivals) if arrivals is not None else None
        for batch in batches:
            at, delay = next(times) if times is not None else (self.clock(), 0.0)
            self._add(batch, closing, admitted, at, delay)
        return self._analyse_closed(closing)

    def _add(
        self,
        batch: RankStepBatch,
        closing: list[_Closed | StepOutput],
        admitted: bool = False,
        at: float | None = None,
        delay_s: float = 0.0,
    ) -> None:
        """Window one batch, appending to `closing` the steps it closed."""
        self.counters["batches"] += 1
        if batch.tp_rank != 0 or batch.cp_rank != 0:
            self.counters["non_representative_batches"] += 1
            return
        job_key = (batch.job_id, batch.attempt)
        job = self.jobs.get(job_key)
        problem = (
            ""
            if admitted
            else admission.batch_problem(batch)
            or (admission.grid_problem(batch, job.info) if job is not None else "")
        )
        if problem:
            # Hosts `admit` first; this guards direct callers (a window must never hold
            # a batch that breaks its step).
            self.counters["batches_rejected"] += 1
            self.rejected.append((batch, problem))
            return
        if at is None:
            at = self.clock()
        coordinate = (batch.dp_rank, batch.pp_rank)
        if job is not None and job.delivered(coordinate, batch.step, at, delay_s):
            # Every coordinate has sent this step or a later one: the steps before it
            # have all they will get (in step order, before this batch's own step).
            passed = job.passed_by_all
            assert passed is not None
            for step in sorted(s for s in job.open_steps if s < passed):
                closing.append(self._close((*job_key, step)))
        if batch.step in self._closed_sets.get(job_key, ()):
            self.counters["late_batches"] += 1
            if job is not None:
                self._late(job, batch, closing)
            return
        key = (batch.job_id, batch.attempt, batch.step)
        window = self.windows.get(key)
        if window is None:
            window = self.windows[key] = _Window(first_seen=at)
            if job is not None:
                job.open_steps.add(batch.step)
        fingerprint = _fingerprint(batch)
        if fingerprint in window.fingerprints:
            self.counters["duplicate_batches"] += 1
            return
        window.fingerprints.add(fingerprint)
        window.batches.setdefault(coordinate, []).append(batch)
        window.received_at = time.time()
        self.counters["ops"] += batch.n_ops
        if job is not None and len(window.batches) == job.coordinates:
            closing.append(self._close(key))

    def tick(self) -> list[StepOutput]:
        """Close every window whose missing coordinates are all overdue: each sent nothing
        for its job's lateness (`stream_app/lateness.py`); a window of a job without its
        record waits `lateness_s` from its first batch. Oldest step first. A held step
        that took late batches closes again once the coordinates it still lacks are."""
        now = self.clock()
        overdue = {key: self._overdue_coordinates(job, now) for key, job in self.jobs.items()}
        due = sorted(k for k, w in self.windows.items() if self._overdue(k, w, overdue, now))
        closing = [self._close(k) for k in due]
        for key, job in self.jobs.items():
            for held in list(job.held.values()):
                if held.fresh and _lacks_only(held.batches, job.coordinates, overdue[key]):
                    closing.append(self._reclose(job, held))
        return self._analyse_closed(closing)

    def _overdue_coordinates(self, job: _JobState, now: float) -> list[tuple[int, int]]:
        """The job's coordinates that have been silent past their wait (one pass a tick,
        whatever the number of its windows: a 100,000-GPU job has 12,480)."""
        arrivals, info = job.arrivals, job.info
        lateness = arrivals.lateness_s(now)
        since_first = now - arrivals.first_at if arrivals.first_at is not None else 0.0
        never = since_first >= self.settings.lateness_s
        overdue = []
        for dp in range(info.dp_size):
            for pp in range(info.pp_size):
                at = arrivals.last_at.get((dp, pp))
                if at is None:
                    if never:
                        overdue.append((dp, pp))
                elif now - at >= lateness:
                    overdue.append((dp, pp))
        return overdue

    def _overdue(
        self,
        key: tuple[str, int, int],
        window: _Window,
        overdue: dict[tuple[str, int], list[tuple[int, int]]],
        now: float,
    ) -> bool:
        job = self.jobs.get(key[:2])
        if job is None:
            return now - window.first_seen >= self.settings.lateness_s
        return _lacks_only(window.batches, job.coordinates, overdue[key[:2]])

    # -- late batches -------------------------------------------------------------------
    def _late(self, job: _JobState, batch: RankStepBatch, closing: list) -> None:
        """A batch of a step that closed already. One of a coordinate the step closed
        without joins it while the job holds its batches, and closes it again once it
        lacks no other (or the others are overdue: `tick`); one whose step's batches are
        let go is a dead letter saying so (the step stands as stored). Anything else is
        a re-sent part of a step that closed whole: counted."""
        coordinate = (batch.dp_rank, batch.pp_rank)
        held = job.held.get(batch.step)
        if held is not None and coordinate in held.missing:
            held.missing.discard(coordinate)
            held.batches.setdefault(coordinate, []).append(batch)
            held.fresh = True
            if not held.missing:
                closing.append(self._reclose(job, held))
            return
        if coordinate in job.closed_without.get(batch.step, ()):
            self.counters["late_batches_set_aside"] += 1
            self.rejected.append((batch, (
                f"{LATE_REASON} step {batch.step} of {job.info.job_id}/{job.info.attempt} closed "
                f"without (dp {coordinate[0]}, pp {coordinate[1]}) and its batches are no "
                "longer held (too many steps closed incomplete since): it stands incomplete"
            )))  # fmt: skip

    def _reclose(self, job: _JobState, held: _Held) -> _Closed:
        """Close a held step again with the batches it has now (a new version of it)."""
        info = job.info
        held.version += 1
        held.fresh = False
        missing = tuple(sorted(held.missing))
        if not missing:
            job.release(held.step)
            job.closed_without.pop(held.step, None)
        self.counters["steps_closed_again"] += 1
        now = self.clock()
        reason = "; ".join(job.arrivals.why_missing(c, held.step, now)
                           for c in missing[:_MISSING_NAMED])  # fmt: skip
        complete_dp = [dp for dp in range(info.dp_size)
                       if all((dp, pp) in held.batches for pp in range(info.pp_size))]  # fmt: skip
        if not complete_dp:
            return _Closed(job, held.step, held.start_ns, missing, [], [],
                           reason="no pipeline replica reported all its stages",
                           missing_reason=reason, version=held.version, held=held)  # fmt: skip
        batches = [b for dp in complete_dp for pp in range(info.pp_size)
                   for b in held.batches[dp, pp]]  # fmt: skip
        return _Closed(job, held.step, held.start_ns, missing, complete_dp, batches,
                       missing_reason=reason, version=held.version, held=held)  # fmt: skip

    def close_through(self, job_id: str, attempt: int, step: int) -> list[StepOutput]:
        """Close the job's open windows up to `step`: its input has moved past them (every
        rank's log delivered a later step), so nothing more will come for them."""
        due = sorted(k for k in self.windows if k[:2] == (job_id, attempt) and k[2] <= step)
        return self._analyse_closed([self._close(k) for k in due])

    def flush(self) -> list[StepOutput]:
        """Close every open window now (end of input) and wait for their analysis."""
        closing = [self._close(k, ended=True) for k in sorted(self.windows)]
        return self._analyse_closed(closing, wait=True)

    # -- closing a step -----------------------------------------------------------------
    def _close(self, key: tuple[str, int, int], *, ended: bool = False) -> _Closed | StepOutput:
        """Close a window: a step to analyse, or its final output when nothing can be
        (`ended`: the input ended with it open)."""
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
        start_ns = min((int(b.start_ns.min()) for b in window.all_batches() if b.n_ops), default=0)
        job = self.jobs.get(job_key)
        if job is None:
            info = JobInfo(job_id=job_id, attempt=attempt, dp_size=1, pp_size=1, world_size=1)
            return self._unanalysed(
                info, step, start_ns, False, (), "no job metadata arrived for this job"
            )
        info = job.info
        job.open_steps.discard(step)
        if start_ns:
            job.arrivals.on_step_start(step, start_ns)
        missing: tuple[tuple[int, int], ...] = ()
        missing_reason = ""
        if len(window.batches) < job.coordinates:
            expected = {(dp, pp) for dp in range(info.dp_size) for pp in range(info.pp_size)}
            missing = tuple(sorted(expected - set(window.batches)))
            missing_reason = self._why_missing(job, step, missing, ended)
            ops = sum(b.n_ops for b in window.all_batches())
            job.hold(_Held(step, start_ns, dict(window.batches), set(missing), ops))
        complete_dp = [
            dp
            for dp in range(info.dp_size)
            if all((dp, pp) in window.batches for pp in range(info.pp_size))
        ]
        if missing:
            self.counters["steps_incomplete"] += 1
        if not complete_dp:
            # Its output comes in closing order with the others (its job's live state).
            return _Closed(job, step, start_ns, missing, [], [],
                           reason="no pipeline replica reported all its stages",
                           missing_reason=missing_reason,
                           received_at=window.received_at)  # fmt: skip
        batches = [
            b for dp in complete_dp for pp in range(info.pp_size) for b in window.batches[dp, pp]
        ]
        return _Closed(job, step, start_ns, missing, complete_dp, batches,
                       missing_reason=missing_reason,
                       received_at=window.received_at)  # fmt: skip

    def _why_missing(
        self, job: _JobState, step: int, missing: tuple[tuple[int, int], ...], ended: bool
    ) -> str:
        """Why the step closed without `missing` (the first few named, the rest counted)."""
        now = self.clock()
        shown = [
            job.arrivals.why_missing(c, step, now, ended=ended) for c in missing[:_MISSING_NAMED]
        ]
        if len(missing) > _MISSING_NAMED:
            shown.append(f"and {len(missing) - _MISSING_NAMED} more")
        return "; ".join(shown)

    def _analyse_closed(self, closing: list[_Closed | StepOutput], *, wait: bool = False
                        ) -> list[StepOutput]:  # fmt: skip
        """Analyse closed steps as if one at a time, in order, but vectorized per job: each
        job's compute half goes to the executor, and the live half runs on what came back,
        in closing order. Returns the outputs finished by now (with `wait`: all)."""
        if closing:
            by_job: dict[int, tuple[_JobState, list[tuple[int, _Closed]]]] = {}
            for index, item in enumerate(closing):
                if isinstance(item, _Closed):
                    by_job.setdefault(id(item.job), (item.job, []))[1].append((index, item))
            jobs = []
            ops = 0
            for job, items in by_job.values():
                analysable = [closed for _, closed in items if not closed.reason]
                ticket = (
                    self._executor_of(job, analysable).submit(self._owner, job.compute, analysable)
                    if analysable
                    else None
                )
                jobs.append((job, items, ticket))
                ops += sum(b.n_ops for closed in analysable for b in closed.batches)
            self._submitted.append(_Submitted(closing, jobs, ops))
        limit = 0 if wait else self.settings.analysis_in_flight
        ops_limit = self.settings.analysis_in_flight_bytes // _IN_FLIGHT_BYTES_PER_OP
        while len(self._submitted) > limit or (
            len(self._submitted) > 1 and sum(s.ops for s in self._submitted) > ops_limit
        ):
            self._finished.extend(self._finish(self._submitted.popleft(), wait=True))
        while self._submitted and (done := self._finish(self._submitted[0], wait=False)):
            self._submitted.popleft()
            self._finished.extend(done)
        finished, self._finished = self._finished, []
        return finished

    def _executor_of(self, job: _JobState, analysable: list[_Closed]) -> InProcess | ChildProcesses:
        """Where the job's compute half runs, chosen at its first analysable step: an
        analysis process when its steps are large enough to pay for the hand-over."""
        if job.executor is None:
            first = analysable[0]
            ops = sum(b.n_ops for b in first.batches) * job.info.dp_size / len(first.dp_ranks)
            job.executor = self._here
            if self.settings.analysis_processes and ops >= self.settings.analysis_process_min_ops:
                if self._children is None:
                    self._children = shared_children(self.settings.analysis_processes)
                job.executor = self._children
        return job.executor

    def _finish(self, submitted: _Submitted, *, wait: bool) -> list[StepOutput]:
        """The call's outputs in closing order, once every job's compute came back ([]
        while one has not and `wait` is False)."""
        outcomes: list[Outcome | None] = []
        for job, _, ticket in submitted.jobs:
            if ticket is None:
                outcomes.append(None)
                continue
            assert job.executor is not None
            key = (id(job.executor), ticket)
            outcome = self._outcomes.get(key)
            if outcome is None:
                outcome = job.executor.poll(ticket, wait)
                if outcome is None:
                    return []
                self._outcomes[key] = outcome
            outcomes.append(outcome)
        for job, _, ticket in submitted.jobs:
            if ticket is not None:
                self._outcomes.pop((id(job.executor), ticket), None)
        done = {i: o for i, o in enumerate(submitted.closing) if isinstance(o, StepOutput)}
        for (job, items, _), outcome in zip(submitted.jobs, outcomes, strict=True):
            try:
                done.update(self._live_half(job, items, outcome))
            except Exception as exc:
                # A bug must not take the job's steps (or the host) down: they are stored
                # unanalysed, with the error as the reason.
                log.exception("analysing %d step(s) of %s failed", len(items), job.info.key)
                for index, closed in items:
                    done.setdefault(index, self._failed(closed, f"analysis failed: {exc!r}"))
        return [done[index] for index in range(len(submitted.closing))]

    def _live_half(
        self, job: _JobState, items: list[tuple[int, _Closed]], outcome: Outcome | None
    ) -> dict[int, StepOutput]:
        """One job's closed steps (by index in the closing order) through its live state:
        retained, change points, episodes and (when due) the job's diagnosis, which sees
        the retained steps as they are at its step."""
        outputs: dict[int, StepOutput] = {}
        results = outcome if isinstance(outcome, list) else []
        analysable = [closed for _, closed in items if not closed.reason]
        _chain_entries(job, results, analysable)
        # No results (a failed computation) price nothing.
        job.live.price_ahead(
            [
                (r.alone, r.result)
                for r, c in zip(results, analysable, strict=False)
                if c.complete and r.alone is not None and r.result is not None
            ]
        )
        computed = iter(results)
        mirror = job.executor is not None and job.executor.mirrors
        for index, closed in items:
            step = StepComputed(failure=closed.reason) if closed.reason else None
            if step is None:
                step = StepComputed(failure=outcome) if isinstance(outcome, str) else next(computed)
            if closed.version:
                outputs[index] = self._closed_again(job, closed, step, mirror)
                continue
            held = job.held.get(closed.step) if not closed.complete else None
            if held is not None and held.version == 0:
                held.figures = _figures(step.result)
            if step.failure or step.alone is None:
                outputs[index] = self._failed(closed, step.failure)
                continue
            window = None
            if closed.complete:
                job.retain(step.alone, mirror=mirror)
                # `on_step` below counts this step: a diagnosis due here sees it retained.
                if job.live.since_diagnosis + 1 >= job.live.diagnosis_interval:
                    window = tuple(job.retained)
            changes = self._detect(job, closed.step, step.alone, complete=closed.complete)
            episodes = job.live.on_step(
                closed.step,
                closed.start_ns,
                step.result,
                step.alone if closed.complete else None,
                complete=closed.complete,
            )
            diagnosis = None
            if window is not None:
                diagnosis = job.live.diagnose(
                    window,
                    decompose_threshold=self.settings.decompose_threshold,
                    capacity=job.retained_capacity,
                )
                if self.keep_diagnosed:
                    job.diagnosed = window
                if diagnosis is not None:
                    episodes = [*episodes, *diagnosis.episodes]
            elif job.live.story_changed:
                diagnosis = job.live.recompose(closed.step)
            outputs[index] = StepOutput(
                closed.job.info.job_id,
                closed.job.info.attempt,
                closed.step,
                closed.start_ns,
                closed.complete,
                closed.missing,
                step.result,
                closed.job.info,
                changes=changes,
                analysed_dp_ranks=() if closed.complete else tuple(closed.dp_ranks),
                episodes=tuple(episodes),
                diagnosis=diagnosis,
                missing_reason=closed.missing_reason,
                received_at=closed.received_at,
            )
        return outputs

    def _closed_again(
        self, job: _JobState, closed: _Closed, step: StepComputed, mirror: bool
    ) -> StepOutput:
        """The output of a held step closed again with late batches: the job's totals
        take its old figures back and its new ones; complete now, it joins the retained
        steps (in step order) and every closed episode's bounds are fitted again on them.
        Its change points and the episodes' live detector stay as they were: they read
        the job's steps in order, and this one's place has passed."""
        held = closed.held
        assert held is not None
        old = held.figures
        result = None if step.failure or step.alone is None else step.result
        held.figures = _figures(result)
        episodes: list[EpisodeState] = []
        if closed.complete and result is not None and step.alone is not None:
            job.retain_at(step.alone, mirror=mirror)
            episodes = job.live.refine(tuple(job.retained), open_ones=False)
        job.live.retake(old, _figures(result), complete=closed.complete)
        return StepOutput(
            job.info.job_id, job.info.attempt, closed.step, closed.start_ns, closed.complete,
            closed.missing, result, job.info,
            analysed_dp_ranks=() if closed.complete else tuple(closed.dp_ranks),
            reason=step.failure if result is None else "",
            episodes=tuple(episodes), missing_reason=closed.missing_reason,
            version=closed.version, received_at=time.time(),
        )  # fmt: skip

    def _unanalysed(
        self,
        info: JobInfo,
        step: int,
        start_ns: int,
        complete: bool,
        missing: tuple[tuple[int, int], ...],
        reason: str,
        missing_reason: str = "",
    ) -> StepOutput:
        """The output of a step that closed but could not be analysed, and why."""
        self.counters["steps_unanalysed"] += 1
        job = self.jobs.get((info.job_id, info.attempt))
        if job is not None:
            job.live.on_step(step, start_ns, None, None, complete=complete)
        return StepOutput(
            info.job_id, info.attempt, step, start_ns, complete, missing, None, info,
            reason=reason, missing_reason=missing_reason,
        )  # fmt: skip

    def _failed(self, closed: _Closed, reason: str) -> StepOutput:
        out = self._unanalysed(
            closed.job.info, closed.step, closed.start_ns, closed.complete, closed.missing, reason,
            closed.missing_reason,
        )  # fmt: skip
        return dataclasses.replace(out, received_at=closed.received_at)

    def _detect(
        self,
        job: _JobState,
        step: int,
        prepared: PreparedTrace,
        *,
        complete: bool,
    ) -> tuple[DetectedChange, ...]:
        if not complete:
            return ()
        values = step_series(prepared)[0]
        if job.detector is None:
            job.series_names = series_names(prepared.n_stages, prepared.n_dp)
            job.detector = BocdBank(len(job.series_names), self.settings.bocd)
        index = job.detector.steps_seen
        job.fed_steps.append((index, step))
        found = job.detector.update(values)
        if not found:
            return ()
        step_of = dict(job.fed_steps)  # up to 4096 steps: only when a change was found
        detected = []
        for c in found:
            series = job.series_names[c.series]
            baseline = job.series_baseline.setdefault(series, c.before_mean)
            detected.append(
                DetectedChange(
                    series=series,
                    step=step_of.get(c.index, step),
                    kind=change_kind(c.kind, c.before_mean, c.after_mean, baseline,
                                     self.settings.bocd.min_relative_change),
                    before_mean=c.before_mean,
                    after_mean=c.after_mean,
                    probability=c.probability,
                    detected_at_step=step,
                )
            )  # fmt: skip
        return tuple(detected)

    # -- job level ----------------------------------------------------------------------
    def rollup(self, job_id: str, attempt: int = 0) -> WhatIfResult | None:
        """What-if analysis of the retained complete steps, ideals from those steps."""
        self._settle()
        job = self.jobs.get((job_id, attempt))
        if job is None or not job.retained:
            return None
        steps = sorted(job.retained, key=lambda p: int(p.steps[0]))
        return analyze(concat_steps(steps), decompose_threshold=self.settings.decompose_threshold)

    def conclude(
        self, job_id: str, attempt: int = 0, *, ended: bool = True
    ) -> JobConclusion | None:
        """The job's end: its final diagnosis and its episodes refined (None: no such
        job). Steps may still come after it (a job that only paused, not `ended`): its
        analysis goes on and a later conclusion supersedes this one."""
        self._settle()
        job = self.jobs.get((job_id, attempt))
        if job is None:
            return None
        diagnosis, episodes = job.live.conclude(
            tuple(job.retained), decompose_threshold=self.settings.decompose_threshold,
            ended=ended,
        )  # fmt: skip
        if self.keep_diagnosed:
            job.diagnosed = tuple(job.retained)
        return JobConclusion(job_id, attempt, job.info, diagnosis, tuple(episodes))

    def live_job(self, job_id: str, attempt: int = 0) -> LiveJob | None:
        job = self.jobs.get((job_id, attempt))
        return job.live if job is not None else None

    def held_bytes(self, job_id: str, attempt: int = 0) -> dict[str, int]:
        """Bytes the job's structures hold between its steps (`_JobState.held_bytes`),
        and its open windows' (as many steps as its ranks are apart, up to the host's
        read-ahead or the lateness); {} for a job this processor does not know."""
        job = self.jobs.get((job_id, attempt))
        if job is None:
            return {}
        seen: set[int] = set()
        held = job.held_bytes(seen)
        windows = [w for (j, a, _), w in self.windows.items() if (j, a) == (job_id, attempt)]
        held["open_windows"] = held_bytes(windows, seen)
        return held

    # -- state --------------------------------------------------------------------------
    def state_dict(self, *, with_retained_inputs: bool = True) -> dict[str, Any]:
        """Everything needed to resume. Without `with_retained_inputs` the retained steps
        appear as step ids only: the host persists their inputs (`encode_step_inputs`)
        once each and hands them back to `from_state`, so a snapshot costs what changed.
        Outputs of steps whose analysis finishes here come with the next call: a host
        drains (`drain`) and stores them before it snapshots."""
        self._settle()
        return {
            "settings": self.settings.model_dump(),
            "counters": dict(self.counters),
            "windows": {
                key: {"age_s": self.clock() - w.first_seen, "batches": w.all_batches()}
                for key, w in self.windows.items()
            },
            "closed": {key: list(steps) for key, steps in self.closed.items()},
            "rejected_jobs": dict(self.rejected_jobs),
            "jobs": {
                key: {
                    "info": job.info.model_dump(),
                    "model": job.compute.model,
                    "ideal": job.compute.ideal.state(),
                    "retained": [_step_inputs(p) for p in job.retained]
                    if with_retained_inputs
                    else [int(p.steps[0]) for p in job.retained],
                    # Its last diagnosis' steps the window no longer holds (ids: in its
                    # live state; the host persists them as it does the retained ones).
                    "diagnosed": [_step_inputs(p) for p in job.diagnosed_beyond_window()]
                    if with_retained_inputs
                    else [],
                    "detector": job.detector.state_dict() if job.detector else None,
                    "series_names": job.series_names,
                    "fed_steps": list(job.fed_steps),
                    "series_baseline": dict(job.series_baseline),
                    "live": job.live.state_dict(),
                    "arrivals": job.arrivals.state_dict(self.clock()),
                    # What it held when the snapshot was taken (not restored: counted again).
                    "held_bytes": self.held_bytes(*key),
                    "held": [
                        {
                            "step": h.step,
                            "start_ns": h.start_ns,
                            "batches": [b for parts in h.batches.values() for b in parts],
                            "missing": [list(c) for c in sorted(h.missing)],
                            "version": h.version,
                            "figures": list(h.figures) if h.figures else None,
                            "fresh": h.fresh,
                        }
                        for h in job.held.values()
                    ],
                    "closed_without": [
                        [step, [list(c) for c in sorted(without)]]
                        for step, without in job.closed_without.items()
                    ],
                }
                for key, job in self.jobs.items()
            },
        }

    @classmethod
    def from_state(
        cls,
        state: dict[str, Any],
        clock: Callable[[], float] = time.monotonic,
        retained_inputs: Callable[[tuple[str, int], list[int]], dict[int, bytes]] | None = None,
        host: ProcessorSettings | None = None,
    ) -> StepProcessor:
        """Resume from `state_dict()`. `retained_inputs(job, steps)` returns the encoded
        inputs of a job's retained steps when the state holds their ids only; a step it
        cannot return is left out of the roll-up window (logged). The analysis settings
        are the state's (changing them mid-job would change the numbers of re-processed
        steps); `host`'s settings of where and when it runs (`HOST_SETTINGS`) replace the
        state's."""
        settings = ProcessorSettings.model_validate(state["settings"])
        if host is not None:
            settings = settings.model_copy(
                update={name: getattr(host, name) for name in HOST_SETTINGS}
            )
        processor = cls(settings, clock)
        processor.counters.update(state["counters"])
        now = clock()
        for key, saved in state["windows"].items():
            window = _Window(first_seen=now - saved["age_s"])
            for batch in saved["batches"]:
                window.batches.setdefault((batch.dp_rank, batch.pp_rank), []).append(batch)
                window.fingerprints.add(_fingerprint(batch))
            processor.windows[key] = window
        processor.rejected_jobs = dict(state.get("rejected_jobs", {}))
        for key, steps in state["closed"].items():
            processor.closed[key] = deque(steps, maxlen=processor.settings.closed_steps_remembered)
            processor._closed_sets[key] = set(steps)
        for key, saved in state["jobs"].items():
            job = _JobState(JobInfo.model_validate(saved["info"]), processor.settings)
            job.compute.model = saved["model"]
            retained = list(saved["retained"])
            if retained and isinstance(retained[0], dict):
                meta = job.info.to_meta()
                retained = [
                    PreparedTrace(model=job.compute.model, meta=meta, **r) for r in retained
                ]
            elif retained:
                retained = _load_retained(job, key, retained, retained_inputs)
            job.restore_retained(saved["ideal"], retained)
            if saved["detector"] is not None:
                job.detector = BocdBank.from_state(saved["detector"])
            job.series_names = list(saved["series_names"])
            job.fed_steps.extend(tuple(x) for x in saved["fed_steps"])
            job.series_baseline = dict(saved["series_baseline"])
            if "arrivals" in saved:
                job.arrivals = JobArrivals.from_state(
                    saved["arrivals"], processor.settings.lateness_s, now
                )
                job.restore_reached()
            job.open_steps = {step for j, a, step in processor.windows if (j, a) == key}
            for step, without in saved.get("closed_without", []):
                job.closed_without[int(step)] = frozenset((int(d), int(p)) for d, p in without)
            for h in saved.get("held", []):
                batches: dict[tuple[int, int], list[RankStepBatch]] = {}
                for batch in h["batches"]:
                    batches.setdefault((batch.dp_rank, batch.pp_rank), []).append(batch)
                held = _Held(
                    int(h["step"]), int(h["start_ns"]), batches,
                    {(int(d), int(p)) for d, p in h["missing"]},
                    sum(b.n_ops for b in h["batches"]), int(h["version"]),
                    tuple(h["figures"]) if h["figures"] else None, bool(h["fresh"]),
                )  # fmt: skip
                job.held[held.step] = held
                job.held_ops += held.ops
            job.live.restore(
                saved["live"], list(job.retained),
                _diagnosed_steps(job, key, saved, retained_inputs),
            )  # fmt: skip
            processor.jobs[key] = job
        return processor


def _diagnosed_steps(
    job: _JobState,
    key: tuple[str, int],
    saved: dict[str, Any],
    retained_inputs: Callable[[tuple[str, int], list[int]], dict[int, bytes]] | None,
) -> list[PreparedTrace]:
    """The steps of the job's last diagnosis its retained window no longer holds: in the
    state itself, or (a state without inputs) from `retained_inputs`."""
    meta = job.info.to_meta()
    kept = [PreparedTrace(model=job.compute.model, meta=meta, **{**_ADDED_NONE, **inputs})
            for inputs in saved.get("diagnosed", [])]  # fmt: skip
    made = saved["live"].get("last_diagnosis") or {}
    held = {int(p.steps[0]) for p in (*job.retained, *kept)}
    wanted = [int(step) for step in made.get("steps", []) if int(step) not in held]
    if wanted and retained_inputs is not None and job.compute.model is not None:
        kept += _load_retained(job, key, wanted, retained_inputs)
    return kept


def _load_retained(
    job: _JobState,
    key: tuple[str, int],
    steps: list[int],
    retained_inputs: Callable[[tuple[str, int], list[int]], dict[int, bytes]] | None,
) -> list[PreparedTrace]:
    if retained_inputs is None or job.compute.model is None:
        raise ValueError(f"state of job {key} holds retained step ids but no inputs were given")
    found = retained_inputs(key, steps)
    lost = [step for step in steps if step not in found]
    if lost:
        log.warning(
            "job %s: %d retained step(s) missing from the checkpoint store (%s...); the "
            "roll-up and comm medians go on without them",
            key,
            len(lost),
            lost[:5],
        )
    meta = job.info.to_meta()
    retained = []
    for step in steps:
        if step not in found:
            continue
        try:
            inputs = decode_step_inputs(found[step], f"retained step {step} of job {key}")
        except SnapshotError as exc:
            log.warning("%s; the roll-up goes on without it", exc)
            continue
        retained.append(PreparedTrace(model=job.compute.model, meta=meta, **inputs))
    return retained


def _chain_entries(job: _JobState, results: list[StepComputed], closed: list[_Closed]) -> None:
    """Each complete step's prepared inputs with when its workers ended the step before
    it (`with_entries`), where that step was complete too: the job's last retained step,
    or the one before it in `results`."""
    previous = job.retained[-1] if job.retained else None
    for computed, step in zip(results, closed, strict=False):
        if computed.alone is None or not step.complete:
            previous = None
            continue
        if step.version:  # closed again, late: its step before is among the retained
            previous = next(
                (p for p in reversed(job.retained) if int(p.steps[0]) == step.step - 1), None
            )
        if previous is not None and int(previous.steps[0]) == step.step - 1:
            began = job.live.step_start_ns.get(step.step - 1)
            if began is not None:
                computed.alone = with_entries(
                    computed.alone, previous, (step.start_ns - began) / 1e9
                )
        previous = computed.alone
        job.live.step_start_ns.setdefault(step.step, step.start_ns)


def _lacks_only(batches: dict, coordinates: int, overdue: list[tuple[int, int]]) -> bool:
    """Whether a step with `batches` (per coordinate) of a job of `coordinates` lacks only
    `overdue` ones."""
    missing = coordinates - len(batches)
    if missing > len(overdue):
        return False
    return sum(1 for c in overdue if c not in batches) == missing


def _figures(result: WhatIfResult | None) -> tuple[float, float, float] | None:
    """What a step's result added to its job's totals (`JobTotals.add`)."""
    if result is None:
        return None
    return (float(result.t_actual[0]), float(result.t_ideal[0]), float(result.step_slowdown[0]))


def change_kind(kind: str, before: float, after: float, baseline: float, min_rise: float) -> str:
    """What a verified change of a series means against the series' first regime: an
    `onset` rises above it, a `recovery` comes back from above it, and a `shift` does
    neither (a stage that looks faster while another one is slow, and its return).

    >>> change_kind("onset", 1.0, 1.3, 1.0, 0.1), change_kind("recovery", 1.3, 1.0, 1.0, 0.1)
    ('onset', 'recovery')
    >>> change_kind("onset", 0.8, 1.0, 1.0, 0.1), change_kind("recovery", 1.0, 0.8, 1.0, 0.1)
    ('shift', 'shift')
    """
    raised = baseline * (1 + min_rise)
    if kind == "onset" and after >= raised:
        return "onset"
    if kind == "recovery" and before >= raised:
        return "recovery"
    return "shift"
