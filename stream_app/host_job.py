"""What a host keeps about one job attempt beside its step processor's state: the
change points and incomplete steps its summaries and reports show, its first failed
analysis, when it last moved, the step its last conclusion covered, and which of its
episodes were open at the last step handed to the store.

One `HostJob` per (job, attempt), held by `HostCore.jobs`; it learns from every step the
processor closes (`took`), and tells when the job is due to be concluded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lagscope.stream_app.processor import DetectedChange, StepOutput

#: Changes of the change-point detectors kept per job for summaries and reports.
CHANGES_KEPT = 10_000
#: A job's latest steps closed incomplete kept, with their missing coordinates, for
#: summaries and reports (how many there were is the job's totals'; the steps table has
#: every one): a rank that died early in a day-long job leaves 17,000.
INCOMPLETE_KEPT = 1_000


@dataclass
class HostJob:
    """A host's own state of one job attempt.

    >>> job = HostJob()
    >>> job.concluded_by(5), job.idle_for(now=10.0)
    (False, 0.0)
    >>> job.concluded_step, job.last_input_at = 5, 4.0
    >>> job.concluded_by(5), job.idle_for(now=10.0)
    (True, 6.0)
    """

    #: The change points of its step series, the latest `CHANGES_KEPT`.
    changes: list[DetectedChange] = field(default_factory=list)
    #: Its latest steps closed incomplete, each with the coordinates it lacked.
    incomplete: list[tuple[int, tuple[tuple[int, int], ...]]] = field(default_factory=list)
    #: The first step whose analysis failed, and why.
    first_failure: tuple[int, str] | None = None
    #: When it last moved on the host's clock (a batch came, a step closed), for idle
    #: conclusions; when its last step closed in wall-clock time, for a report.
    last_input_at: float | None = None
    last_closed_wall: float | None = None
    #: The last step a conclusion covered (None: never concluded).
    concluded_step: int | None = None
    #: Each episode's id and whether it was open, as last handed to the store: an episode
    #: opening or closing is what the on-call acts on, so its step is written at once.
    episodes_open: dict[int, bool] = field(default_factory=dict)

    def took(self, out: StepOutput, now: float, wall: float) -> bool:
        """Learn from a closed step `out` (at `now` on the host's clock, `wall` in
        wall-clock time); whether it opened or closed an episode (news for the store)."""
        self.last_input_at, self.last_closed_wall = now, wall
        if out.changes:
            self.changes.extend(out.changes)
            del self.changes[:-CHANGES_KEPT]
        if out.version:  # closed again: it replaces the step's earlier closing
            self.incomplete = [entry for entry in self.incomplete if entry[0] != out.step]
        if not out.complete:
            self.incomplete.append((out.step, out.missing))
            del self.incomplete[:-INCOMPLETE_KEPT]
        if out.reason and self.first_failure is None:
            self.first_failure = (out.step, out.reason)
        news = False
        for state in out.episodes:
            episode = state.episode
            news |= self.episodes_open.get(episode.episode_id) is not episode.open
            self.episodes_open[episode.episode_id] = episode.open
        return news

    def concluded_by(self, last_step: int) -> bool:
        """Whether a conclusion covered the job up to `last_step`."""
        return self.concluded_step is not None and self.concluded_step >= last_step

    def idle_for(self, now: float) -> float:
        """Seconds since it last moved (none before it first did)."""
        return now - self.last_input_at if self.last_input_at is not None else 0.0
