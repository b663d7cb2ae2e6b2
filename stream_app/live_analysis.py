"""The live half of a closed step's analysis: what the job's state makes of a step its
compute half (`step_compute`) analysed, in closing order. The step is retained for the
roll-up, fed to the change-point detectors and to the job's story (`LiveJob`: episodes,
their prices and, when due, the job's diagnosis), and becomes the `StepOutput` the
hosts store. A step closed again with late batches replaces its figures instead.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lagscope.producers.events import JobInfo
from lagscope.simulator.bocd import BocdBank
from lagscope.simulator.job_story import EpisodeState, JobDiagnosis
from lagscope.simulator.noise import series_names, step_series
from lagscope.simulator.prepare import PreparedTrace, with_entries
from lagscope.simulator.whatif import WhatIfResult
from lagscope.stream_app.analysis_process import Outcome
from lagscope.stream_app.job_state import Closed, JobState
from lagscope.stream_app.step_compute import StepComputed

if TYPE_CHECKING:
    from lagscope.stream_app.processor import ProcessorSettings


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


class LiveAnalysis:
    """The live half of the processor's analysis (`settings`: the processor's; `counters`:
    its counters, which count the steps left unanalysed)."""

    def __init__(self, settings: ProcessorSettings, counters: dict[str, int]) -> None:
        self.settings = settings
        self.counters = counters
        #: Hold each job's last diagnosis' steps (`JobState.diagnosed`) until the host
        #: drops them: a worker snapshots them, so that a resumed job makes that diagnosis
        #: again; its window no longer holds the oldest of them.
        self.keep_diagnosed = False

    def take(
        self, job: JobState, items: list[tuple[int, Closed]], outcome: Outcome | None
    ) -> dict[int, StepOutput]:
        """One job's closed steps (by index in the closing order) through its live state:
        retained, change points, episodes and (when due) the job's diagnosis, which sees
        the retained steps as they are at its step."""
        outputs: dict[int, StepOutput] = {}
        results = outcome if isinstance(outcome, list) else []
        analysable = [closed for _, closed in items if not closed.reason]
        chain_entries(job, results, analysable)
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
                outputs[index] = self.closed_again(job, closed, step, mirror)
                continue
            held = job.held.get(closed.step) if not closed.complete else None
            if held is not None and held.version == 0:
                held.figures = figures(step.result)
            if step.failure or step.alone is None:
                outputs[index] = self.failed(closed, step.failure)
                continue
            window = None
            if closed.complete:
                job.retain(step.alone, mirror=mirror)
                # `on_step` below counts this step: a diagnosis due here sees it retained.
                if job.live.since_diagnosis + 1 >= job.live.diagnosis_interval:
                    window = tuple(job.retained)
            changes = self.detect(job, closed.step, step.alone, complete=closed.complete)
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

    def closed_again(
        self, job: JobState, closed: Closed, step: StepComputed, mirror: bool
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
        held.figures = figures(result)
        episodes: list[EpisodeState] = []
        if closed.complete and result is not None and step.alone is not None:
            job.retain_at(step.alone, mirror=mirror)
            episodes = job.live.refine(tuple(job.retained), open_ones=False)
        job.live.retake(old, figures(result), complete=closed.complete)
        return StepOutput(
            job.info.job_id, job.info.attempt, closed.step, closed.start_ns, closed.complete,
            closed.missing, result, job.info,
            analysed_dp_ranks=() if closed.complete else tuple(closed.dp_ranks),
            reason=step.failure if result is None else "",
            episodes=tuple(episodes), missing_reason=closed.missing_reason,
            version=closed.version, received_at=time.time(),
        )  # fmt: skip

    def unanalysed(
        self,
        job: JobState | None,
        info: JobInfo,
        step: int,
        start_ns: int,
        complete: bool,
        missing: tuple[tuple[int, int], ...],
        reason: str,
        missing_reason: str = "",
    ) -> StepOutput:
        """The output of a step of `job` (None: its record never came) that closed but
        could not be analysed, and why."""
        self.counters["steps_unanalysed"] += 1
        if job is not None:
            job.live.on_step(step, start_ns, None, None, complete=complete)
        return StepOutput(
            info.job_id, info.attempt, step, start_ns, complete, missing, None, info,
            reason=reason, missing_reason=missing_reason,
        )  # fmt: skip

    def failed(self, closed: Closed, reason: str) -> StepOutput:
        out = self.unanalysed(
            closed.job, closed.job.info, closed.step, closed.start_ns, closed.complete,
            closed.missing, reason, closed.missing_reason,
        )  # fmt: skip
        return dataclasses.replace(out, received_at=closed.received_at)

    def detect(
        self,
        job: JobState,
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


def chain_entries(job: JobState, results: list[StepComputed], closed: list[Closed]) -> None:
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


def figures(result: WhatIfResult | None) -> tuple[float, float, float] | None:
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
