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

import logging
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lagscope.producers.dead_letters import DeadLetter
from lagscope.producers.events import JobInfo, RankStepBatch, SchemaError, peek_header
from lagscope.producers.log import (
    KIND_BATCH,
    KIND_JOB,
    RankDirs,
    RankLogReader,
    Record,
    SkippedSpan,
)
from lagscope.simulator.job_story import JobDiagnosis
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


log = logging.getLogger("lagscope.embedded")

#: Bytes a round of reading takes from all the logs together (a 100,000-GPU job's 12,480
#: logs at 64 KB each were 800 MB a round; a round now reads a step or a few of each).
READ_ROUND_BYTES = 16 << 20


class _LogsClock(LatenessClock):
    """The embedded host's lateness clock. While some logs have data to read, it stands
    where every one of them has got: the least of the starts of their newest batches
    (`advance`, after each round of reading), so neither a backlog's reading nor a log
    read ahead of another makes a rank late. A batch arrives when it began, or now if
    later (`arrival`): its step's window opens then, and its coordinate has been silent
    since. So a step times out once every log with data has delivered a batch that began
    the lateness after the missing coordinate's last one, which a log that has not
    delivered it yet never has: a rank's step began before any rank's next step began
    (the step's collectives and optimizer hold them together; the ends of two ranks'
    steps overlap by a fraction of a step). Caught up, it is wall-clock time, as a
    worker's: a rank that went silent times out."""

    def __call__(self) -> float:
        # While a log with data has not said how far it got (one that begins with
        # garbage), no time has passed, wall-clock time least of all.
        unknown = self.behind and self.newest_record_s is None
        return float("-inf") if unknown else super().__call__()

    def arrival(self, batch: RankStepBatch, sent_s: float) -> tuple[float, float]:
        """When `batch` arrives: its first op, or now if later; after no delay. The
        logs are read here, as they are written: what holds a batch between its rank
        and this host (the timer's seal, the poll) shows in the silences between a
        coordinate's arrivals; a backlog's age is no lateness of the job's."""
        now = self()
        return (max(now, float(batch.start_ns.min()) / 1e9) if batch.n_ops else now), 0.0

    def advance(self, log_times: dict[str, float], behind: set[str]) -> None:
        """After a round: up to where every log with data to read (`behind`) has got (one
        that delivered nothing yet holds the clock where it is); when none has, the
        newest op read."""
        if behind:
            if not behind <= log_times.keys():
                return
            newest = min(log_times[name] for name in behind)
        elif log_times:
            newest = max(log_times.values())
        else:
            return
        self.observe(newest)


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
        raw_ops_max_workers: int | None = None,
        clock: Callable[[], float] = time.time,
        live_report: LiveReport | None = None,
    ) -> None:
        self.sink = sink
        #: With `store_raw_ops`, the largest job (its dp x pp workers) whose raw ops are
        #: kept (None: every job's).
        self.raw_ops_max_workers = raw_ops_max_workers
        self.settings = settings or ProcessorSettings()
        self.live_report = live_report
        #: Per job, the file its report is written to (with `live_report`).
        self.report_paths: dict[tuple[str, int], Path] = {}
        #: Per job, the closed steps its last live report covered; when the next may be due.
        self._reported_steps: dict[tuple[str, int], int] = {}
        self._next_report = 0.0
        self.clock = _LogsClock(wall=clock)
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
        #: Per log, the start of the newest batch it delivered (epoch seconds).
        self._log_times: dict[str, float] = {}
        #: Per log, the job attempt of the batches it delivered last.
        self._job_of_log: dict[str, tuple[str, int]] = {}

    # -- input --------------------------------------------------------------------------
    def run_logs(
        self,
        log_dir: str | Path,
        *,
        follow: bool = False,
        idle_exit_s: float = 0.0,
        progress: Callable[[RunReport], None] | None = None,
        read_chunk_bytes: int = 64 << 10,
        read_round_bytes: int = READ_ROUND_BYTES,
        read_ahead_steps: int = 4,
    ) -> RunReport:
        """Read every rank's log under `log_dir` until it is exhausted (or, with `follow`,
        until nothing new arrived for `idle_exit_s` since the first record: a job that
        has not written yet, still loading its data, is waited for; or until every rank
        of every job in it said it ended, and was read to its end), then close all open
        steps and conclude every job.

        Windows follow the logs' own progress, so a backlog of any size closes complete
        steps complete: a step closes once every rank's log has delivered a later step,
        and while a log still has data to read, a step's lateness is counted on the
        records' own times, from its first record, up to where every log with data to
        read has got (`_LogsClock`): time spent reading a backlog is not time a rank was
        late, nor is a log read ahead of another.

        A backlog is read no faster than its steps close (backpressure): in a round, each
        log with data is read up to `read_ahead_steps` steps past the least step delivered
        by a log of its job that still has data (its batches beyond wait for a later
        round), and at most `read_chunk_bytes` of batches of it; a round reads about
        `read_round_bytes` of batches in all (the next one goes on where it stopped). So
        open windows hold a few steps of every rank whatever the backlog's size or the
        job's, and a burst costs time, not memory; a round's cost beyond what it reads is
        two `stat` calls a log."""
        started = time.monotonic()
        rank_dirs = RankDirs(log_dir)
        readers: dict[Path, RankLogReader] = {}
        last_data: float | None = None
        #: Where the next round starts (a round cut short by its bytes goes on there), and
        #: whether it reads past the horizons (the last one took nothing they allowed).
        resume_at, unbounded = 0, False
        while True:
            for directory in rank_dirs.current():
                if directory not in readers:
                    readers[directory] = RankLogReader(
                        directory, torn_grace_s=0.0 if not follow else 5.0
                    )
            unread = [(d, r) for d, r in readers.items() if not r.at_end()]
            horizons = {} if unbounded else self._horizons({d.name for d, _ in unread},
                                                           read_ahead_steps)  # fmt: skip
            share = max(min(read_chunk_bytes, read_round_bytes // max(len(unread), 1)), 1)
            resume_at %= max(len(unread), 1)
            left, took, got_any = read_round_bytes, 0, False
            for index, (directory, reader) in enumerate(unread[resume_at:] + unread[:resume_at]):
                if left <= 0:
                    resume_at += index
                    break
                taken, got = self._read_log(directory.name, reader, horizons, read_chunk_bytes,
                                            share)  # fmt: skip
                left -= taken
                took += taken
                got_any |= got
            else:
                resume_at = 0
            unbounded = bool(unread) and not took and not unbounded
            behind = {d.name for d, reader in readers.items() if not reader.at_end()}
            self.clock.behind = bool(behind)
            self.clock.advance(self._log_times, behind)
            self._close_passed_steps(behind)
            if behind or follow:
                # Read to their ends and not followed, the logs hold no more: their open
                # steps close as the input's end, each saying what its missing ranks
                # sent last (`close_open_steps`), not as timed out on the newest record.
                self.core.tick()
            self._write()
            self._update_live_reports()
            if progress is not None:
                progress(self._progress_report())
            if got_any or unbounded:
                last_data = time.monotonic() if got_any else last_data
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

    def _read_log(
        self,
        source: str,
        reader: RankLogReader,
        horizons: dict[tuple[str, int], int],
        most: int,
        unknown: int,
    ) -> tuple[int, bool]:
        """Read one log this round: each batch up to its job's horizon (`horizons`: the
        last step a log of the job may deliver now), at most `most` bytes of batches
        (`unknown` while the log's job has no horizon yet). Returns the batches' bytes and
        whether it took anything."""
        taken, got = 0, False
        while True:
            horizon = self._horizon_of(source, horizons)
            cap = unknown if horizon is None else most
            if taken >= cap:
                return taken, got
            items = reader.read(cap - taken)
            if not items:
                return taken, got
            batches: list[Record] = []
            for index, item in enumerate(items):
                key = _batch_key(item)
                if key is not None and key[2] > horizons.get(key[:2], key[2]):
                    reader.put_back(items[index:])
                    self._take_batches(source, batches)
                    return taken, got
                got = True
                if key is None:
                    # Its batches before it first: a job record comes before its job's.
                    self._take_batches(source, batches)
                    batches = []
                    self._consume(source, item)
                else:
                    batches.append(item)  # type: ignore[arg-type]
                    taken += len(item.payload)  # type: ignore[union-attr]
            self._take_batches(source, batches)

    def _horizon_of(self, source: str, horizons: dict[tuple[str, int], int]) -> int | None:
        """The horizon of the job `source` delivers batches of (None: not known yet)."""
        job = self._job_of_log.get(source)
        return horizons.get(job) if job is not None else None

    def close_open_steps(self) -> RunReport:
        """Analyse and write every step still open and conclude every job (the end of the
        input, or a user's Ctrl-C while following the logs): what was read is never
        dropped."""
        self.core.flush()
        self.finish()
        return self.report

    def _consume(self, source: str, item: Record | SkippedSpan) -> None:
        """A log's item other than a batch whose header reads: a dead letter, a job
        record, or a record of an unknown kind."""
        now = time.time()
        if isinstance(item, SkippedSpan):
            where = f"{source}/{Path(item.source).name}@{item.offset}"
            self.core.dead_letter(DeadLetter(where, item.reason, item.sample, "", now),
                                  "undecodable")  # fmt: skip
            return
        where = f"{source}/{item.file}@{item.offset}"
        if item.kind == KIND_JOB:
            info = self.core.on_job_record(item.payload, where, now)
            if info is not None:
                self._limit_raw_ops(info)
        elif item.kind == KIND_BATCH:
            self._take_batches(source, [item])  # the host names what is wrong with it
        else:
            reason = f"unknown record kind {item.kind}"
            self.core.dead_letter(DeadLetter(where, reason, item.payload, "", now), "undecodable")

    def _limit_raw_ops(self, info: JobInfo) -> None:
        """Leave out the raw ops of a job beyond `raw_ops_max_workers`, saying so once."""
        workers = info.dp_size * info.pp_size
        limit = self.raw_ops_max_workers
        if not self.core.store_raw_ops or limit is None or workers <= limit:
            return
        if (info.job_id, info.attempt) not in self.core.raw_ops_left_out:
            self.core.raw_ops_left_out.add((info.job_id, info.attempt))
            log.warning(
                "job %s/%d: its raw ops are not stored: %d workers (dp %d x pp %d) are more "
                "than %d, whose raw ops cost more to write than their steps to analyse; "
                "set store.raw_ops (LAGSCOPE_STORE__RAW_OPS=true) to keep them",
                info.job_id, info.attempt, workers, info.dp_size, info.pp_size, limit,
            )  # fmt: skip

    def _take_batches(self, source: str, records: list[Record]) -> None:
        """A log's batch records, in order, handed to the host in one call (one a call
        cost a 100,000-GPU job's 12,544 batches of a step ~30 us each in calls)."""
        if not records:
            return
        now = time.time()
        kept = self.core.on_batches([(r.payload, f"{source}/{r.file}@{r.offset}", now)
                                     for r in records])  # fmt: skip
        newest = None
        for batch in kept:
            if batch is None:
                continue
            newest = batch
            job = (batch.job_id, batch.attempt)
            job_progress = self._progress.setdefault(job, {})
            job_progress[source] = max(job_progress.get(source, batch.step), batch.step)
            self._coordinates.setdefault(job, set()).add((batch.dp_rank, batch.pp_rank))
        if newest is None:
            return
        self._job_of_log[source] = (newest.job_id, newest.attempt)
        if newest.n_ops:
            start_s = float(newest.start_ns.min()) / 1e9
            self._log_times[source] = max(start_s, self._log_times.get(source, start_s))

    def _horizons(self, unread: set[str], ahead_steps: int) -> dict[tuple[str, int], int]:
        """Per job, the last step its logs may deliver this round: `ahead_steps` past the
        least step delivered by a log of it that still has data to read (reading further
        would only open windows); a job none of whose logs has data has none."""
        horizons = {}
        for job, by_source in self._progress.items():
            lagging = [step for source, step in by_source.items() if source in unread]
            if lagging:
                horizons[job] = min(lagging) + ahead_steps
        return horizons

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
        self.report.dead_letters = self.core.records.dead_letters.total
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


def _batch_key(item: Record | SkippedSpan) -> tuple[str, int, int] | None:
    """The job, attempt and step of a log's batch record (None: another record, or one
    the host will set aside)."""
    if not isinstance(item, Record) or item.kind != KIND_BATCH:
        return None
    try:
        head = peek_header(item.payload)
    except SchemaError:
        return None
    return head["job_id"], head["attempt"], head["step"]
