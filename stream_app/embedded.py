"""The embedded host: per-rank logs -> step processor -> ClickHouse (chDB), in one process.

No Kafka: the runner reads every rank's log directory itself (the same reader the streamer
sidecar uses), hands job metadata and rank-step batches to the step processor, and writes
closed steps to the store in batches. Torn, garbage or undecodable records go to the
`dead_letters` table with their reason; the rest flows on. At the end (or on demand) the
job-level roll-up is analysed, diagnosed, and the diagnosis stored.

With a `LiveReport` the host keeps each job's HTML report current while it runs, for a
user without Grafana: rewritten (atomically) from the steps closed so far at most every
few seconds, the page refreshing itself, and a final one at the end.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lagscope.producers.events import JobInfo, RankStepBatch, SchemaError, batch_id_of, decode_batch
from lagscope.producers.log import KIND_BATCH, KIND_JOB, DeadLetter, RankLogReader, list_rank_dirs
from lagscope.simulator.diagnose import Diagnosis, diagnose
from lagscope.simulator.episodes import Episode, diagnosed_episodes
from lagscope.simulator.prepare import PreparedTrace, concat_steps
from lagscope.simulator.whatif import WhatIfResult, analyze
from lagscope.stream_app.identity import (
    MachineBook,
    name_episode_machines,
    name_machines,
    rank_identity_batch,
)
from lagscope.stream_app.processor import (
    DetectedChange,
    ProcessorSettings,
    StepOutput,
    StepProcessor,
)
from lagscope.stream_app.rows import diagnosis_rows, job_rows, rows_from_outputs
from lagscope.stream_app.sink import ClickHouseSink, SinkBatch

if TYPE_CHECKING:
    from lagscope.dashboards.report import ReportData


@dataclass
class JobReport:
    """What the embedded run learned about one job attempt."""

    info: JobInfo
    steps: int = 0
    incomplete_steps: list[tuple[int, tuple[tuple[int, int], ...]]] = field(default_factory=list)
    changes: list[DetectedChange] = field(default_factory=list)
    rollup: WhatIfResult | None = None
    diagnosis: Diagnosis | None = None
    gpu_seconds: float = 0.0
    gpu_seconds_wasted: float = 0.0
    mfu_actual: list[float] = field(default_factory=list)
    mfu_ideal: list[float] = field(default_factory=list)
    step_ids: list[int] = field(default_factory=list)
    step_slowdown: list[float] = field(default_factory=list)
    episodes: list[Episode] = field(default_factory=list)
    #: Each episode's worker scores S_w ([stage, dp]) over its own steps (the report draws
    #: them beside the whole run's), in the order of `episodes`.
    episode_worker_slowdown: list[np.ndarray | None] = field(default_factory=list)
    #: The last closed step: its id, when it ran (its first op's start, ns since the epoch)
    #: and when this host closed it (epoch seconds).
    last_step: int | None = None
    last_step_start_ns: int | None = None
    last_step_closed_at: float | None = None


@dataclass
class RunReport:
    jobs: dict[tuple[str, int], JobReport] = field(default_factory=dict)
    dead_letters: int = 0
    ops: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class LiveReport:
    """Where the embedded host keeps each job's HTML report current while it runs, and how
    often: at most every `every_s` seconds while steps close (and never more often than
    keeps rendering under a fifth of the host's time: an interval of at least four
    renders), the page refreshing itself every `every_s` seconds; a final page, which does
    not refresh, at the end. The first job reported writes `path`; any other job of the
    same logs a file beside it named after the job (`report-<job>-<attempt>.html`)."""

    path: Path
    every_s: float = 10.0


#: Rendering takes at most this share of the host's time: the interval between two live
#: reports is at least (1 / share - 1) renders long.
_REPORT_TIME_SHARE = 0.2


class EmbeddedRunner:
    """Feeds per-rank logs through a `StepProcessor` into a `ClickHouseSink`."""

    def __init__(
        self,
        sink: ClickHouseSink,
        settings: ProcessorSettings | None = None,
        *,
        write_every_steps: int = 32,
        store_raw_ops: bool = True,
        clock: Callable[[], float] = time.monotonic,
        live_report: LiveReport | None = None,
    ) -> None:
        self.sink = sink
        self.live_report = live_report
        #: Per job, the file its report is written to (with `live_report`).
        self.report_paths: dict[tuple[str, int], Path] = {}
        #: Per job, the closed steps its last live report covered; when the next may be due.
        self._reported_steps: dict[tuple[str, int], int] = {}
        self._next_report = 0.0
        #: The machine of every worker, from every rank's job record.
        self.machines = MachineBook()
        self._lateness_clock = _CaughtUpClock(clock)
        self.processor = StepProcessor(settings, self._lateness_clock)
        self.write_every_steps = write_every_steps
        self.store_raw_ops = store_raw_ops
        self.report = RunReport()
        self._pending: list[StepOutput] = []
        self._raw_ops: list[dict[str, np.ndarray | list]] = []
        self._dead: list[tuple[str, str, str, bytes]] = []
        self._writes = 0
        #: Per job, the latest step each rank's log delivered (the log's own progress).
        self._progress: dict[tuple[str, int], dict[str, int]] = {}

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
        until nothing new arrived for `idle_exit_s`), then close all open steps.

        Windows follow the logs' own progress, so a backlog of any size closes complete
        steps complete: a step closes once every rank's log has delivered a later step,
        and the lateness timeout only runs while every log is read to its end (time spent
        reading a backlog is not time a rank was late).

        A backlog is read no faster than its steps close (backpressure): each round reads at
        most `read_chunk_bytes` of each log, and a log more than `read_ahead_steps` steps
        ahead of another log of the same job that still has unread data waits a round. So
        open windows hold a few steps of every rank whatever the backlog's size, and a
        burst costs time, not memory."""
        started = time.monotonic()
        readers: dict[Path, RankLogReader] = {}
        last_data = time.monotonic()
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
            self._lateness_clock.paused(bool(behind))
            self._close_passed_steps(behind)
            self._emit(self.processor.tick())
            self._update_live_reports()
            if progress is not None:
                progress(self.report)
            if got_any:
                last_data = time.monotonic()
                continue
            if not follow or time.monotonic() - last_data >= idle_exit_s:
                break
            time.sleep(0.2)
        self.close_open_steps()
        self.report.seconds = time.monotonic() - started
        return self.report

    def close_open_steps(self) -> RunReport:
        """Analyse and write every step still open (the end of the input, or a user's
        Ctrl-C while following the logs): what was read is never dropped."""
        self._emit(self.processor.flush())
        self._write(force=True)
        self.finish()
        return self.report

    def _consume(self, source: str, item: object) -> None:
        if isinstance(item, DeadLetter):
            self._dead_letter("", f"{source}/{item.source}@{item.offset}", item.reason, item.sample)
            return
        if item.kind == KIND_JOB:
            try:
                info = JobInfo.model_validate_json(item.payload)
            except ValueError as exc:
                self._dead_letter(
                    "",
                    f"{source}/{item.file}@{item.offset}",
                    f"invalid job metadata: {exc}",
                    item.payload,
                )
                return
            where = f"{source}/{item.file}@{item.offset}"
            is_new = (info.job_id, info.attempt) not in self.processor.jobs
            problem = self.processor.on_job(info)
            self._take_rejected()
            if problem:
                self._dead_letter(info.job_id, where, problem, item.payload)
            elif is_new:
                self.report.jobs[info.job_id, info.attempt] = JobReport(info)
                batch = SinkBatch(f"jobs/{info.job_id}/{info.attempt}")
                batch.add("jobs", job_rows(info.job_id, info.attempt, info.to_meta(), time.time()))
                self.sink.write(batch)
            if not problem and self.machines.add(info):
                self.sink.write(rank_identity_batch(info))
            return
        if item.kind != KIND_BATCH:
            self._dead_letter(
                "",
                f"{source}/{item.file}@{item.offset}",
                f"unknown record kind {item.kind}",
                item.payload,
            )
            return
        try:
            batch = decode_batch(item.payload, where=f"{source}/{item.file}@{item.offset}")
        except SchemaError as exc:
            self._dead_letter("", f"{source}/{item.file}@{item.offset}", str(exc), item.payload)
            return
        self.report.ops += batch.n_ops
        kept, problem = self.processor.admit(batch)
        if problem:
            where = f"{source}/{item.file}@{item.offset}"
            self._dead_letter(batch.job_id, where, problem, item.payload)
        if kept is None:
            return
        job_progress = self._progress.setdefault((kept.job_id, kept.attempt), {})
        job_progress[source] = max(job_progress.get(source, kept.step), kept.step)
        if self.store_raw_ops and kept.tp_rank == 0 and kept.cp_rank == 0:
            self._raw_ops.append(_raw_op_rows(kept, batch_id_of(item.payload)))
        self._emit(self.processor.on_batch(kept))

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
        its first steps, so it holds the job's steps open."""
        for (job_id, attempt), by_rank in self._progress.items():
            if behind - set(by_rank):
                continue
            self._emit(self.processor.close_through(job_id, attempt, min(by_rank.values()) - 1))

    def _take_rejected(self) -> None:
        """Dead-letter what the processor set aside after windowing it."""
        for batch, reason in self.processor.take_rejected():
            where = f"{batch.job_id}/{batch.attempt} step {batch.step} rank {batch.rank}"
            self._dead_letter(batch.job_id, where, reason, batch.encode())

    def _dead_letter(self, job_id: str, source: str, reason: str, payload: bytes) -> None:
        self.report.dead_letters += 1
        self._dead.append((job_id, source, reason, payload))

    # -- output -------------------------------------------------------------------------
    def _emit(self, outputs: list[StepOutput]) -> None:
        self._take_rejected()
        for out in outputs:
            job = self.report.jobs.get((out.job_id, out.attempt))
            if job is None:
                job = self.report.jobs[out.job_id, out.attempt] = JobReport(out.info)
            job.steps += 1
            if job.last_step is None or out.step >= job.last_step:
                job.last_step, job.last_step_start_ns = out.step, out.start_ns
            job.last_step_closed_at = time.time()
            if not out.complete:
                job.incomplete_steps.append((out.step, out.missing))
            job.changes.extend(out.changes)
            if out.result is not None:
                r = out.result
                slowdown = float(r.step_slowdown[0])
                actual = float(r.t_actual[0])
                job.step_ids.append(out.step)
                job.step_slowdown.append(slowdown)
                gpu_seconds = actual * out.info.world_size
                job.gpu_seconds += gpu_seconds
                job.gpu_seconds_wasted += gpu_seconds * (1 - 1 / slowdown)
                meta = out.info
                if meta.model_flops_per_step and meta.gpu_peak_flops:
                    peak = meta.world_size * meta.gpu_peak_flops
                    job.mfu_actual.append(meta.model_flops_per_step / (actual * peak))
                    job.mfu_ideal.append(meta.model_flops_per_step / (float(r.t_ideal[0]) * peak))
            self._pending.append(out)
        self._write()

    def _write(self, *, force: bool = False) -> None:
        if self._pending and (force or len(self._pending) >= self.write_every_steps):
            by_job: dict[tuple[str, int], list[StepOutput]] = {}
            for out in self._pending:
                by_job.setdefault((out.job_id, out.attempt), []).append(out)
            for outputs in by_job.values():
                batch = rows_from_outputs(outputs)
                if self._raw_ops:
                    batch.add("ops", _join_rows(self._raw_ops))
                    self._raw_ops = []
                self.sink.write(batch)
            self._pending = []
        if self._dead and (force or len(self._dead) >= 64):
            # The token names the letters: a re-run over the same logs stores them once.
            digest = hashlib.blake2b(digest_size=16)
            for job_id, source, reason, _ in self._dead:
                digest.update(f"{job_id}\0{source}\0{reason}\0".encode())
            batch = SinkBatch(f"dead/{digest.hexdigest()}/{len(self._dead)}")
            batch.add(
                "dead_letters",
                {
                    "ts": [time.time()] * len(self._dead),
                    "job_id": [d[0] for d in self._dead],
                    "source": [d[1] for d in self._dead],
                    "reason": [d[2] for d in self._dead],
                    "payload": [d[3].hex() for d in self._dead],
                },
            )
            self.sink.write(batch)
            self._dead = []
        if force and self._raw_ops:
            batch = SinkBatch(f"ops/{self._writes}")
            batch.add("ops", _join_rows(self._raw_ops))
            self.sink.write(batch)
            self._raw_ops = []
        self._writes += 1

    def analyse_job(self, job_id: str, attempt: int = 0) -> bool:
        """Roll up, diagnose and find the episodes of one job from the steps the processor
        retains so far (the live report's and `finish`'s one analysis); False when no step
        of it could be analysed yet."""
        job = self.report.jobs[job_id, attempt]
        rollup = self.processor.rollup(job_id, attempt)
        if rollup is None:
            return False
        job.rollup = rollup
        state = self.processor.jobs[job_id, attempt]
        prepared = concat_steps(sorted(state.retained, key=lambda p: int(p.steps[0])))
        machines = self.machines.machines(job_id, attempt)
        job.diagnosis = name_machines(
            diagnose(rollup, prepared, wasted_gpu_s=job.gpu_seconds_wasted), machines
        )
        job.episodes = name_episode_machines(
            diagnosed_episodes(
                job.changes,
                prepared,
                rollup.ideal_cost,
                decompose_threshold=self.processor.settings.decompose_threshold,
            ),
            machines,
        )
        job.episode_worker_slowdown = [
            _episode_worker_slowdown(prepared, e, rollup.ideal_cost) for e in job.episodes
        ]
        return True

    def finish(self) -> None:
        """Roll up, diagnose and store the diagnosis of every job seen; with a live report,
        write each job's final page."""
        for (job_id, attempt), job in self.report.jobs.items():
            if not self.analyse_job(job_id, attempt):
                continue
            assert job.rollup is not None and job.diagnosis is not None
            last = int(job.rollup.steps[-1])
            batch = SinkBatch(f"diagnosis/{job_id}/{attempt}/{last}")
            batch.add(
                "diagnoses", diagnosis_rows(job_id, attempt, last, time.time_ns(), job.diagnosis)
            )
            self.sink.write(batch)
            if self.live_report is not None:
                self._write_report(job_id, attempt, final=True)

    # -- the live report ----------------------------------------------------------------
    def _update_live_reports(self) -> None:
        """Rewrite the report of every job with newly closed steps, when one is due."""
        live = self.live_report
        if live is None or time.monotonic() < self._next_report:
            return
        fresh = [
            key
            for key, job in self.report.jobs.items()
            if job.steps != self._reported_steps.get(key)
        ]
        if not fresh:
            return
        began = time.monotonic()
        for job_id, attempt in fresh:
            self._reported_steps[job_id, attempt] = self.report.jobs[job_id, attempt].steps
            if self.analyse_job(job_id, attempt):
                try:
                    self._write_report(job_id, attempt, final=False)
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

    def _write_report(self, job_id: str, attempt: int, *, final: bool) -> Path:
        """Render a job's report and replace its file atomically: a reader sees the old
        page or the new one, never a part."""
        from lagscope.dashboards.report import render_report

        assert self.live_report is not None
        job = self.report.jobs[job_id, attempt]
        page = render_report(
            report_data(job, refresh_s=None if final else self.live_report.every_s)
        )
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


def report_data(job: JobReport, *, refresh_s: float | None = None) -> ReportData:
    """What the HTML report shows of one job (`refresh_s`: a live page)."""
    from lagscope.dashboards.report import ReportData

    assert job.rollup is not None
    info = job.info
    return ReportData(
        title=f"lagscope: {info.job_id} (attempt {info.attempt})",
        subtitle=f"{info.world_size} GPUs: dp {info.dp_size} x pp {info.pp_size} x tp "
        f"{info.tp_size} x cp {info.dsp_size}, vpp {info.vpp_size}",
        result=job.rollup,
        diagnosis=job.diagnosis,
        step_ids=job.step_ids,
        step_slowdown=job.step_slowdown,
        changes=[
            {
                "step": c.step,
                "kind": c.kind,
                "series": c.series,
                "before_mean": c.before_mean,
                "after_mean": c.after_mean,
            }
            for c in job.changes
        ],
        gpu_hours=job.gpu_seconds / 3600,
        gpu_hours_wasted=job.gpu_seconds_wasted / 3600,
        mfu_actual=float(np.mean(job.mfu_actual)) if job.mfu_actual else None,
        mfu_ideal=float(np.mean(job.mfu_ideal)) if job.mfu_ideal else None,
        incomplete_steps=len(job.incomplete_steps),
        episodes=[(e.onset, e.recovery, e.diagnosis) for e in job.episodes],
        episode_worker_slowdown=list(job.episode_worker_slowdown),
        refresh_s=refresh_s,
        last_step=job.last_step,
        last_step_closed_at=job.last_step_closed_at,
        last_step_started_at=job.last_step_start_ns / 1e9 if job.last_step_start_ns else None,
    )


def _episode_worker_slowdown(
    prepared: PreparedTrace, episode: Episode, ideal: dict[str, float]
) -> np.ndarray | None:
    """S_w of every worker over an episode's own steps, with the whole run's ideal (as the
    episode was diagnosed); None when it has no retained step."""
    end = episode.recovery if episode.recovery is not None else np.inf
    inside = (prepared.steps >= episode.onset) & (prepared.steps < end)
    if not inside.any():
        return None
    # S_w needs the attributions only: no explanation passes, no launch decomposition.
    part = prepared.select_steps(inside)
    return analyze(part, ideal=ideal, decompose_threshold=np.inf, explain=False).worker_slowdown


class _CaughtUpClock:
    """The lateness clock of the embedded host: wall-clock time less the time spent
    behind a backlog, so a step's timeout counts only time the logs had nothing more."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._paused_s = 0.0
        self._since = clock()

    def __call__(self) -> float:
        return self._clock() - self._paused_s

    def paused(self, behind: bool) -> None:
        """Account the time since the last call: paused when the host was behind."""
        now = self._clock()
        if behind:
            self._paused_s += now - self._since
        self._since = now


def _raw_op_rows(batch: RankStepBatch, batch_id: str) -> dict[str, np.ndarray | list]:
    n = batch.n_ops
    names = np.array(batch.optype_names, dtype=object)
    return {
        "job_id": [batch.job_id] * n,
        "attempt": np.full(n, batch.attempt, np.uint32),
        "step": np.full(n, batch.step, np.uint64),
        "rank": np.full(n, batch.rank, np.uint32),
        "dp_rank": np.full(n, batch.dp_rank, np.uint32),
        "pp_rank": np.full(n, batch.pp_rank, np.uint32),
        "tp_rank": np.full(n, batch.tp_rank, np.uint32),
        "cp_rank": np.full(n, batch.cp_rank, np.uint32),
        "optype": names[batch.optype].tolist(),
        "seq": batch.seq.astype(np.uint32),
        "microbatch": np.maximum(batch.microbatch, 0).astype(np.uint32),
        "chunk": np.maximum(batch.chunk, 0).astype(np.uint32),
        "start": batch.start_ns.astype("datetime64[ns]"),
        "duration_ns": batch.duration_ns.astype(np.uint64),
        "batch_id": [batch_id] * n,
    }


def _join_rows(parts: list[dict[str, np.ndarray | list]]) -> dict[str, np.ndarray | list]:
    joined: dict[str, np.ndarray | list] = {}
    for name in parts[0]:
        values = [p[name] for p in parts]
        if isinstance(values[0], np.ndarray):
            joined[name] = np.concatenate(values)
        else:
            joined[name] = [v for part in values for v in part]
    return joined
