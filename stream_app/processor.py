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

The processor is split by question. This module windows batches and closes steps (and
its settings, `ProcessorSettings`, the `processor` section of the config);
`job_state.py` holds what it keeps per job attempt and how that is saved;
`analysis_schedule.py` decides when closed steps are analysed and where their compute half
runs (`step_compute.py`, in this process or an analysis process); `live_analysis.py` is
the live half that makes each analysed step a `StepOutput` through the job's story
(`simulator/job_story.py`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from lagscope.producers.events import JobInfo, RankStepBatch
from lagscope.simulator.bocd import BocdConfig
from lagscope.simulator.diagnose import DiagnosisSettings
from lagscope.simulator.job_story import LiveJob, roll_up
from lagscope.simulator.online_episodes import OnlineEpisodeSettings
from lagscope.simulator.whatif import WhatIfResult
from lagscope.stream_app import admission
from lagscope.stream_app.analysis_schedule import AnalysisSchedule
from lagscope.stream_app.held_bytes import held_bytes
from lagscope.stream_app.job_state import (
    Closed,
    Held,
    JobState,
    Window,
    decode_step_inputs,
    encode_step_inputs,
    fingerprint,
)
from lagscope.stream_app.live_analysis import (
    DetectedChange,
    JobConclusion,
    LiveAnalysis,
    StepOutput,
    change_kind,
)

log = logging.getLogger("lagscope.processor")

__all__ = [
    "HOST_SETTINGS",
    "LATE_REASON",
    "DetectedChange",
    "JobConclusion",
    "ProcessorSettings",
    "StepOutput",
    "StepProcessor",
    "change_kind",
    "decode_step_inputs",
    "encode_step_inputs",
]


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


class StepProcessor:
    """Windows rank-step batches per (job, attempt, step) and analyses closed steps."""

    def __init__(
        self,
        settings: ProcessorSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings or ProcessorSettings()
        self.clock = clock
        self.jobs: dict[tuple[str, int], JobState] = {}
        self.windows: dict[tuple[str, int, int], Window] = {}
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
        #: The live half of each closed step's analysis, and when steps are analysed.
        self.analysis = LiveAnalysis(self.settings, self.counters)
        self.schedule = AnalysisSchedule(self.settings, self.analysis)

    @property
    def keep_diagnosed(self) -> bool:
        """Whether each job's last diagnosis' steps are held (`JobState.diagnosed`) until
        the host drops them (`forget_diagnosed`): a worker snapshots them, so that a
        resumed job makes that diagnosis again."""
        return self.analysis.keep_diagnosed

    @keep_diagnosed.setter
    def keep_diagnosed(self, keep: bool) -> None:
        self.analysis.keep_diagnosed = keep

    def forget_diagnosed(self) -> None:
        """Let go of the diagnosed steps held (a snapshot stored them)."""
        for job in self.jobs.values():
            job.diagnosed = ()

    @property
    def in_flight(self) -> int:
        """Calls whose closed steps' analysis has not come back yet (0: none)."""
        return self.schedule.in_flight

    def analysing(self, job_id: str, attempt: int = 0) -> bool:
        """Whether closed steps of the job are still being analysed (their outputs come
        with a later call)."""
        return self.schedule.analysing((job_id, attempt))

    def drain(self) -> list[StepOutput]:
        """Wait for every closed step's analysis; returns the outputs not returned yet."""
        return self.schedule.run([], wait=True)

    def _settle(self) -> None:
        """Finish every analysis under way (its outputs come with the next call), so the
        job's state is whole: before a roll-up, a conclusion or a snapshot."""
        self.schedule.settle()

    def close(self) -> None:
        """Let go of what the executor holds for this processor (it is dropped)."""
        self.schedule.close()

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
        job = self.jobs[key] = JobState(info, self.settings)
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

    def _evict_off_grid(self, window: Window, info: JobInfo) -> None:
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
        closing: list[Closed | StepOutput] = []
        times = iter(arrivals) if arrivals is not None else None
        for batch in batches:
            at, delay = next(times) if times is not None else (self.clock(), 0.0)
            self._add(batch, closing, admitted, at, delay)
        return self.schedule.run(closing)

    def _add(
        self,
        batch: RankStepBatch,
        closing: list[Closed | StepOutput],
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
            window = self.windows[key] = Window(first_seen=at)
            if job is not None:
                job.open_steps.add(batch.step)
        content = fingerprint(batch)
        if content in window.fingerprints:
            self.counters["duplicate_batches"] += 1
            return
        window.fingerprints.add(content)
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
        return self.schedule.run(closing)

    def _overdue_coordinates(self, job: JobState, now: float) -> list[tuple[int, int]]:
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
        window: Window,
        overdue: dict[tuple[str, int], list[tuple[int, int]]],
        now: float,
    ) -> bool:
        job = self.jobs.get(key[:2])
        if job is None:
            return now - window.first_seen >= self.settings.lateness_s
        return _lacks_only(window.batches, job.coordinates, overdue[key[:2]])

    # -- late batches -------------------------------------------------------------------
    def _late(self, job: JobState, batch: RankStepBatch, closing: list) -> None:
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

    def _reclose(self, job: JobState, held: Held) -> Closed:
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
            return Closed(job, held.step, held.start_ns, missing, [], [],
                           reason="no pipeline replica reported all its stages",
                           missing_reason=reason, version=held.version, held=held)  # fmt: skip
        batches = [b for dp in complete_dp for pp in range(info.pp_size)
                   for b in held.batches[dp, pp]]  # fmt: skip
        return Closed(job, held.step, held.start_ns, missing, complete_dp, batches,
                       missing_reason=reason, version=held.version, held=held)  # fmt: skip

    def close_through(self, job_id: str, attempt: int, step: int) -> list[StepOutput]:
        """Close the job's open windows up to `step`: its input has moved past them (every
        rank's log delivered a later step), so nothing more will come for them."""
        due = sorted(k for k in self.windows if k[:2] == (job_id, attempt) and k[2] <= step)
        return self.schedule.run([self._close(k) for k in due])

    def flush(self) -> list[StepOutput]:
        """Close every open window now (end of input) and wait for their analysis."""
        closing = [self._close(k, ended=True) for k in sorted(self.windows)]
        return self.schedule.run(closing, wait=True)

    # -- closing a step -----------------------------------------------------------------
    def _close(self, key: tuple[str, int, int], *, ended: bool = False) -> Closed | StepOutput:
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
            return self.analysis.unanalysed(
                None, info, step, start_ns, False, (), "no job metadata arrived for this job"
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
            job.hold(Held(step, start_ns, dict(window.batches), set(missing), ops))
        complete_dp = [
            dp
            for dp in range(info.dp_size)
            if all((dp, pp) in window.batches for pp in range(info.pp_size))
        ]
        if missing:
            self.counters["steps_incomplete"] += 1
        if not complete_dp:
            # Its output comes in closing order with the others (its job's live state).
            return Closed(job, step, start_ns, missing, [], [],
                           reason="no pipeline replica reported all its stages",
                           missing_reason=missing_reason,
                           received_at=window.received_at)  # fmt: skip
        batches = [
            b for dp in complete_dp for pp in range(info.pp_size) for b in window.batches[dp, pp]
        ]
        return Closed(job, step, start_ns, missing, complete_dp, batches,
                       missing_reason=missing_reason,
                       received_at=window.received_at)  # fmt: skip

    def _why_missing(
        self, job: JobState, step: int, missing: tuple[tuple[int, int], ...], ended: bool
    ) -> str:
        """Why the step closed without `missing` (the first few named, the rest counted)."""
        now = self.clock()
        shown = [
            job.arrivals.why_missing(c, step, now, ended=ended) for c in missing[:_MISSING_NAMED]
        ]
        if len(missing) > _MISSING_NAMED:
            shown.append(f"and {len(missing) - _MISSING_NAMED} more")
        return "; ".join(shown)

    # -- job level ----------------------------------------------------------------------
    def rollup(self, job_id: str, attempt: int = 0) -> WhatIfResult | None:
        """What-if analysis of the retained complete steps, ideals from those steps."""
        self._settle()
        job = self.jobs.get((job_id, attempt))
        if job is None or not job.retained:
            return None
        return roll_up(job.retained, decompose_threshold=self.settings.decompose_threshold)[1]

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
        """Bytes the job's structures hold between its steps (`JobState.held_bytes`),
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
                key: job.state_dict(
                    now=self.clock(),
                    with_retained_inputs=with_retained_inputs,
                    held=self.held_bytes(*key),
                )
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
            window = Window(first_seen=now - saved["age_s"])
            for batch in saved["batches"]:
                window.batches.setdefault((batch.dp_rank, batch.pp_rank), []).append(batch)
                window.fingerprints.add(fingerprint(batch))
            processor.windows[key] = window
        processor.rejected_jobs = dict(state.get("rejected_jobs", {}))
        for key, steps in state["closed"].items():
            processor.closed[key] = deque(steps, maxlen=processor.settings.closed_steps_remembered)
            processor._closed_sets[key] = set(steps)
        for key, saved in state["jobs"].items():
            open_steps = {step for j, a, step in processor.windows if (j, a) == key}
            job = JobState.from_state(saved, processor.settings, now, open_steps, retained_inputs)
            processor.jobs[key] = job
        return processor


def _lacks_only(batches: dict, coordinates: int, overdue: list[tuple[int, int]]) -> bool:
    """Whether a step with `batches` (per coordinate) of a job of `coordinates` lacks only
    `overdue` ones."""
    missing = coordinates - len(batches)
    if missing > len(overdue):
        return False
    return sum(1 for c in overdue if c not in batches) == missing
