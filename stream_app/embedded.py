"""The embedded host: per-rank logs -> step processor -> ClickHouse (chDB), in one process.

No Kafka: the runner reads every rank's log directory itself (the same reader the streamer
sidecar uses), hands job metadata and rank-step batches to the step processor, and writes
closed steps to the store in batches. Torn, garbage or undecodable records go to the
`dead_letters` table with their reason; the rest flows on. At the end (or on demand) the
job-level roll-up is analysed, diagnosed, and the diagnosis stored.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lagscope.producers.events import JobInfo, RankStepBatch, SchemaError, batch_id_of, decode_batch
from lagscope.producers.log import KIND_BATCH, KIND_JOB, DeadLetter, RankLogReader, list_rank_dirs
from lagscope.simulator.diagnose import Diagnosis, diagnose
from lagscope.simulator.episodes import Episode, diagnosed_episodes
from lagscope.simulator.prepare import concat_steps
from lagscope.simulator.whatif import WhatIfResult
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


@dataclass
class RunReport:
    jobs: dict[tuple[str, int], JobReport] = field(default_factory=dict)
    dead_letters: int = 0
    ops: int = 0
    seconds: float = 0.0


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
    ) -> None:
        self.sink = sink
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

    def finish(self) -> None:
        """Roll up, diagnose and store the diagnosis of every job seen."""
        for (job_id, attempt), job in self.report.jobs.items():
            rollup = self.processor.rollup(job_id, attempt)
            if rollup is None:
                continue
            job.rollup = rollup
            state = self.processor.jobs[job_id, attempt]
            prepared = concat_steps(sorted(state.retained, key=lambda p: int(p.steps[0])))
            job.diagnosis = name_machines(
                diagnose(rollup, prepared, wasted_gpu_s=job.gpu_seconds_wasted),
                self.machines.machines(job_id, attempt),
            )
            job.episodes = name_episode_machines(
                diagnosed_episodes(
                    job.changes,
                    prepared,
                    rollup.ideal_cost,
                    decompose_threshold=self.processor.settings.decompose_threshold,
                ),
                self.machines.machines(job_id, attempt),
            )
            last = int(rollup.steps[-1])
            batch = SinkBatch(f"diagnosis/{job_id}/{attempt}/{last}")
            batch.add(
                "diagnoses", diagnosis_rows(job_id, attempt, last, time.time_ns(), job.diagnosis)
            )
            self.sink.write(batch)


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
