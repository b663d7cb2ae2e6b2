"""The embedded host: per-rank logs -> the host pipeline -> ClickHouse (chDB), in one process.

No Kafka: the runner reads every rank's log directory itself (the same reader the streamer
sidecar uses) and hands job records and rank-step batches to the host pipeline
(`stream_app/host_core.py`, the same one `lagscope worker` drives), which windows and
analyses the steps, finds episodes while they happen, keeps the job's diagnosis current,
and writes every table. Torn, garbage or undecodable records go to the `dead_letters`
table with their reason; the rest flows on. When the logs end (or, following them, fall
idle), every job is concluded: its episodes' bounds refined, its final diagnosis stored.

With a `LiveReport` the host keeps each job's HTML report current while it runs, for a
user without Grafana: rewritten (atomically) from the steps closed so far at most every
few seconds, the page refreshing itself, and a final one at the end. What the page looks
like is not the host's business: the command that starts the host passes the renderer
(`lagscope/cli/job_page.py`), so the hosts never import the dashboards.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lagscope.producers.dead_letters import DeadLetter
from lagscope.producers.log import (
    KIND_BATCH,
    KIND_JOB,
    RankLogReader,
    SkippedSpan,
    list_rank_dirs,
)
from lagscope.simulator.prepare import PreparedTrace
from lagscope.store.sink import ClickHouseSink
from lagscope.stream_app.host_core import (
    WRITE_EVERY_STEPS,
    WRITE_INTERVAL_S,
    HostCore,
    JobRecords,
    JobReport,
    LatenessClock,
)
from lagscope.stream_app.job_analysis import JobDiagnosis
from lagscope.stream_app.processor import ProcessorSettings


@dataclass
class RunReport:
    """What an embedded run did: ops read, dead letters, steps closed, and each job."""

    jobs: dict[tuple[str, int], JobReport] = field(default_factory=dict)
    dead_letters: int = 0
    ops: int = 0
    steps: int = 0
    seconds: float = 0.0


#: Renders a job's HTML page: the job as it stands, the steps retained for its roll-up,
#: and how often a live page refreshes itself (None: the final page, which does not).
PageRenderer = Callable[[JobReport, Sequence[PreparedTrace], float | None], str]


@dataclass(frozen=True)
class LiveReport:
    """Where the embedded host keeps each job's HTML report current while it runs, how it
    renders it, and how often: at most every `every_s` seconds while steps close (and
    never more often than keeps rendering under a fifth of the host's time: an interval of
    at least four renders), the page refreshing itself every `every_s` seconds; a final
    page, which does not refresh, at the end. The first job reported writes `path`; any
    other job of the same logs a file beside it named after the job
    (`report-<job>-<attempt>.html`)."""

    path: Path
    render: PageRenderer
    every_s: float = 10.0


#: Rendering takes at most this share of the host's time: the interval between two live
#: reports is at least (1 / share - 1) renders long.
_REPORT_TIME_SHARE = 0.2
#: Seconds a follower waits after a round that found no new data, as the streamer polls
#: its logs (producers/config.py, `poll_interval_s`): a step that opens an episode waits
#: half of it on average before this host reads it, and an idle round costs a directory
#: listing and a stat per log.
_IDLE_POLL_S = 0.1


class EmbeddedRunner:
    """Feeds per-rank logs through a `HostCore` into a `ClickHouseSink`."""

    def __init__(
        self,
        sink: ClickHouseSink,
        settings: ProcessorSettings | None = None,
        *,
        write_every_steps: int = WRITE_EVERY_STEPS,
        write_interval_s: float = WRITE_INTERVAL_S,
        store_raw_ops: bool = True,
        clock: Callable[[], float] = time.time,
        live_report: LiveReport | None = None,
    ) -> None:
        self.sink = sink
        self.settings = settings or ProcessorSettings()
        self.live_report = live_report
        #: Per job, the file its report is written to (with `live_report`).
        self.report_paths: dict[tuple[str, int], Path] = {}
        #: Per job, the closed steps its last live report covered; when the next may be due.
        self._reported_steps: dict[tuple[str, int], int] = {}
        self._next_report = 0.0
        self.clock = LatenessClock(wall=clock)
        self.core = HostCore(
            self.settings,
            JobRecords(self.settings.max_world_size),
            clock=self.clock,
            store_raw_ops=store_raw_ops,
        )
        self.processor = self.core.processor
        self.write_every_steps = write_every_steps
        self.write_interval_s = write_interval_s
        self._last_write = time.monotonic()
        self.report = RunReport()
        #: Per job, the latest step each rank's log delivered (the log's own progress).
        self._progress: dict[tuple[str, int], dict[str, int]] = {}
        #: Per job attempt, the (dp, pp) coordinates whose batches have been read.
        self._coordinates: dict[tuple[str, int], set[tuple[int, int]]] = {}

    # -- input --------------------------------------------------------------------------
    def run_logs(
        self,
        log_dir: str | Path,
        *,
        follow: bool = False,
        idle_exit_s: float = 0.0,
        progress: Callable[[RunReport], None] | None = None,
        read_chunk_bytes: int = 64 << 10,
        read_ahead_steps: int = 4,
    ) -> RunReport:
        """Read every rank's log under `log_dir` until it is exhausted (or, with `follow`,
        until nothing new arrived for `idle_exit_s` since the first record: a job that
        has not written yet, still loading its data, is waited for; or until every rank
        of every job in it said it ended, and was read to its end), then close all open
        steps and conclude every job.

        Windows follow the logs' own progress, so a backlog of any size closes complete
        steps complete: a step closes once every rank's log has delivered a later step,
        and the lateness timeout runs on the records' own times while a log still has
        data (time spent reading a backlog is not time a rank was late).

        A backlog is read no faster than its steps close (backpressure): each round reads at
        most `read_chunk_bytes` of each log, and a log more than `read_ahead_steps` steps
        ahead of another log of the same job that still has unread data waits a round. So
        open windows hold a few steps of every rank whatever the backlog's size, and a
        burst costs time, not memory."""
        started = time.monotonic()
        readers: dict[Path, RankLogReader] = {}
        last_data: float | None = None
        while True:
            for directory in list_rank_dirs(log_dir):
                readers.setdefault(
                    directory, RankLogReader(directory, torn_grace_s=0.0 if not follow else 5.0)
                )
            got_any = False
            unread = {d.name for d, reader in readers.items() if not reader.at_end()}
            held = self._held_back(unread, read_ahead_steps)
            if unread and unread <= held:
                held = set()  # jobs holding each other back: nobody waits
            for directory, reader in readers.items():
                if directory.name in held:
                    continue
                for item in reader.read(read_chunk_bytes):
                    got_any = True
                    self._consume(directory.name, item)
            behind = {d.name for d, reader in readers.items() if not reader.at_end()}
            self.clock.behind = bool(behind)
            self._close_passed_steps(behind)
            self.core.tick()
            self._write()
            self._update_live_reports()
            if progress is not None:
                progress(self._progress_report())
            if got_any:
                last_data = time.monotonic()
                continue
            if not follow or (
                last_data is not None and time.monotonic() - last_data >= idle_exit_s
            ):
                break
            if not behind and self.core.records.all_ended():
                break  # every rank of every job said it ended: nothing more will come
            time.sleep(_IDLE_POLL_S)
        self.close_open_steps()
        self.report.seconds = time.monotonic() - started
        return self.report

    def close_open_steps(self) -> RunReport:
        """Analyse and write every step still open and conclude every job (the end of the
        input, or a user's Ctrl-C while following the logs): what was read is never
        dropped."""
        self.core.flush()
        self.finish()
        return self.report

    def _consume(self, source: str, item: object) -> None:
        now = time.time()
        if isinstance(item, SkippedSpan):
            where = f"{source}/{Path(item.source).name}@{item.offset}"
            self.core.dead_letter(DeadLetter(where, item.reason, item.sample, "", now),
                                  "undecodable")  # fmt: skip
            return
        where = f"{source}/{item.file}@{item.offset}"
        if item.kind == KIND_JOB:
            self.core.on_job_record(item.payload, where, now)
            return
        if item.kind != KIND_BATCH:
            reason = f"unknown record kind {item.kind}"
            self.core.dead_letter(DeadLetter(where, reason, item.payload, "", now), "undecodable")
            return
        (kept,) = self.core.on_batches([(item.payload, where, now)])
        if kept is None:
            return
        self.clock.observe(float(kept.start_ns.max() + kept.duration_ns.max()) / 1e9)
        job_progress = self._progress.setdefault((kept.job_id, kept.attempt), {})
        job_progress[source] = max(job_progress.get(source, kept.step), kept.step)
        self._coordinates.setdefault((kept.job_id, kept.attempt), set()).add(
            (kept.dp_rank, kept.pp_rank)
        )

    def _held_back(self, unread: set[str], ahead_steps: int) -> set[str]:
        """Logs to skip this round: those more than `ahead_steps` past a log of the same job
        that still has data to read (reading them on would only open windows)."""
        held: set[str] = set()
        for by_source in self._progress.values():
            lagging = [step for source, step in by_source.items() if source in unread]
            if not lagging:
                continue
            horizon = min(lagging) + ahead_steps
            held.update(source for source, step in by_source.items() if step > horizon)
        return held

    def _close_passed_steps(self, behind: set[str]) -> None:
        """Close the steps every rank's log has moved past: nothing more comes for them.
        A log with unread data that has delivered nothing of a job yet may still hold
        its first steps, so it holds the job's steps open; so does a worker coordinate
        whose log has delivered nothing yet at all: its rank may not have written its
        first steps (each rank's timer writes them at its own pace) or made its log
        directory, and closing the others' first steps without it leaves them incomplete
        here and complete on a worker (its episodes' baselines then differ). A rank that
        never writes is left to the lateness clock."""
        for (job_id, attempt), by_rank in self._progress.items():
            if behind - set(by_rank):
                continue
            job = self.processor.jobs.get((job_id, attempt))
            seen = self._coordinates.get((job_id, attempt), set())
            if job is None or len(seen) < job.info.dp_size * job.info.pp_size:
                continue
            self.core.close_through(job_id, attempt, min(by_rank.values()) - 1)

    # -- output -------------------------------------------------------------------------
    def _write(self, *, force: bool = False) -> None:
        """Write what is pending: at once when forced or when an episode opened or closed
        (`HostCore.news_due`), when `write_every_steps` steps wait (a backlog is written in
        batches), or `write_interval_s` after the last write (a job followed live shows in
        the store within that)."""
        now = time.monotonic()
        every, interval = self.write_every_steps, self.write_interval_s
        if force or self.core.write_due(now, self._last_write, every, interval):
            self.core.write(self.sink)
            self._last_write = now

    def _progress_report(self) -> RunReport:
        self.report.ops = self.core.counters["ops"]
        self.report.dead_letters = sum(self.core.records.dead_by_kind.values())
        self.report.steps = self.processor.counters["steps_closed"]
        return self.report

    def finish(self) -> None:
        """Conclude every job (episodes refined, final diagnosis), write everything, and
        with a live report write each job's final page."""
        self.core.conclude_all()
        self._write(force=True)
        self._progress_report()
        for key in self.core.job_keys():
            job = self.core.job_report(*key)
            if job is None:
                continue
            self.report.jobs[key] = job
            if self.live_report is not None and job.rollup is not None:
                self._write_report(*key, final=True)

    def analyse_job(self, job_id: str, attempt: int = 0) -> JobReport | None:
        """What the job's report shows now; None before its first diagnosis."""
        job = self.core.job_report(job_id, attempt)
        if job is None or job.rollup is None:
            return None
        return job

    # -- the live report ----------------------------------------------------------------
    def _update_live_reports(self) -> None:
        """Rewrite the report of every job with newly closed steps, when one is due."""
        live = self.live_report
        if live is None or time.monotonic() < self._next_report:
            return
        fresh = []
        for key in self.core.job_keys():
            job_live = self.processor.live_job(*key)
            if job_live is not None and job_live.totals.steps != self._reported_steps.get(key):
                fresh.append(key)
        if not fresh:
            return
        began = time.monotonic()
        for job_id, attempt in fresh:
            job_live = self.processor.live_job(job_id, attempt)
            assert job_live is not None
            provisional = None
            if job_live.last_diagnosis is None:
                # A short job has no diagnosis yet: make one now, for the page only.
                retained = tuple(self.processor.jobs[job_id, attempt].retained)
                provisional = job_live.rolled_up(
                    retained, decompose_threshold=self.settings.decompose_threshold
                )
            self._reported_steps[job_id, attempt] = job_live.totals.steps
            if provisional is not None or job_live.last_diagnosis is not None:
                try:
                    self._write_report(job_id, attempt, final=False, provisional=provisional)
                except OSError as exc:  # the next one may succeed; the final one must
                    print(f"lagscope: live report not written: {exc}", file=sys.stderr)
        took = time.monotonic() - began
        self._next_report = time.monotonic() + max(
            live.every_s, took * (1 / _REPORT_TIME_SHARE - 1)
        )

    def report_path(self, job_id: str, attempt: int = 0) -> Path:
        """The file of a job's report: the live report's path for the first job, a file
        named after the job beside it for any other."""
        assert self.live_report is not None
        path = self.report_paths.get((job_id, attempt))
        if path is None:
            base = self.live_report.path
            if self.report_paths:
                name = re.sub(r"[^A-Za-z0-9_.-]+", "_", job_id)[:80]
                base = base.with_name(f"{base.stem}-{name}-{attempt}{base.suffix}")
            path = self.report_paths[job_id, attempt] = base
        return path

    def _write_report(
        self, job_id: str, attempt: int, *, final: bool, provisional: JobDiagnosis | None = None
    ) -> Path:
        """Render a job's report and replace its file atomically: a reader sees the old
        page or the new one, never a part."""
        assert self.live_report is not None
        job = self.core.job_report(job_id, attempt, provisional=provisional)
        assert job is not None
        retained = list(self.processor.jobs[job_id, attempt].retained)
        page = self.live_report.render(job, retained, None if final else self.live_report.every_s)
        path = self.report_path(job_id, attempt)
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(
            prefix=f".{path.name}.", suffix=".tmp", dir=path.parent
        )
        try:
            with os.fdopen(descriptor, "w", encoding="utf-8") as file:
                file.write(page)
            os.chmod(temporary, 0o644)
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        return path
