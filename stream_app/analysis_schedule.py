"""When closed steps are analysed: each job's compute half goes to an executor (this
process, or the analysis processes for jobs large enough to pay for the hand-over), a
bounded number of calls and ops in flight, and each call's outputs come back in closing
order once all its jobs' computations did, through the live half (`live_analysis`).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from itertools import count
from typing import TYPE_CHECKING

from lagscope.stream_app.analysis_process import (
    ChildProcesses,
    InProcess,
    Outcome,
    shared_children,
)
from lagscope.stream_app.job_state import Closed, JobState
from lagscope.stream_app.live_analysis import LiveAnalysis, StepOutput

if TYPE_CHECKING:
    from lagscope.stream_app.processor import ProcessorSettings

log = logging.getLogger("lagscope.processor")

_OWNERS = count()
#: Memory an op in flight to a child holds on the host: its batch (~30 bytes an op on
#: the wire and in the decoded columns' buffer) and its packed copy until the child
#: reads it (27).
_IN_FLIGHT_BYTES_PER_OP = 60


@dataclass
class Submitted:
    """One call's closed steps, in closing order, and their jobs' computations."""

    closing: list[Closed | StepOutput]
    #: Per job: its state, its steps (index in `closing`), the ticket of their compute.
    jobs: list[tuple[JobState, list[tuple[int, Closed]], int | None]]
    #: Ops sent to be computed.
    ops: int = 0


class AnalysisSchedule:
    """The processor's closed steps on their way through the compute and live halves."""

    def __init__(self, settings: ProcessorSettings, live: LiveAnalysis) -> None:
        self.settings = settings
        self.live = live
        #: The analysis processes, started for the first job large enough to go to one.
        self._children: ChildProcesses | None = None
        self._here = InProcess()
        #: This processor among the others its executor serves (they share children).
        self._owner = next(_OWNERS)
        #: Calls whose analysis is under way, oldest first, and outputs finished since
        #: the last call returned them.
        self._submitted: deque[Submitted] = deque()
        self._finished: list[StepOutput] = []
        #: Outcomes polled before their call's other jobs came back, by (executor, ticket).
        self._outcomes: dict[tuple[int, int], Outcome] = {}

    @property
    def in_flight(self) -> int:
        """Calls whose closed steps' analysis has not come back yet (0: none)."""
        return len(self._submitted)

    def analysing(self, key: tuple[str, int]) -> bool:
        """Whether closed steps of the job `key` are still being analysed (their outputs
        come with a later call)."""
        return any(
            (job.info.job_id, job.info.attempt) == key
            for s in self._submitted
            for job, _, _ in s.jobs
        ) or any((out.job_id, out.attempt) == key for out in self._finished)

    def settle(self) -> None:
        """Finish every analysis under way; its outputs come with the next call."""
        finished = self.run([], wait=True)  # (it hands `_finished` over: first)
        self._finished.extend(finished)

    def close(self) -> None:
        """Let go of what the executor holds for this processor (it is dropped)."""
        if self._children is not None:
            self._children.forget(self._owner)

    def run(self, closing: list[Closed | StepOutput], *, wait: bool = False
                        ) -> list[StepOutput]:  # fmt: skip
        """Analyse closed steps as if one at a time, in order, but vectorized per job: each
        job's compute half goes to the executor, and the live half runs on what came back,
        in closing order. Returns the outputs finished by now (with `wait`: all)."""
        if closing:
            by_job: dict[int, tuple[JobState, list[tuple[int, Closed]]]] = {}
            for index, item in enumerate(closing):
                if isinstance(item, Closed):
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
            self._submitted.append(Submitted(closing, jobs, ops))
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

    def _executor_of(self, job: JobState, analysable: list[Closed]) -> InProcess | ChildProcesses:
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

    def _finish(self, submitted: Submitted, *, wait: bool) -> list[StepOutput]:
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
                done.update(self.live.take(job, items, outcome))
            except Exception as exc:
                # A bug must not take the job's steps (or the host) down: they are stored
                # unanalysed, with the error as the reason.
                log.exception("analysing %d step(s) of %s failed", len(items), job.info.key)
                for index, closed in items:
                    done.setdefault(index, self.live.failed(closed, f"analysis failed: {exc!r}"))
        return [done[index] for index in range(len(submitted.closing))]
