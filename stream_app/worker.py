"""The distributed host: a faust-streaming worker, `lagscope ops` -> step processor -> store.

Topology. One agent consumes `lagscope.ops` (key = job id, so every batch of a job lands in
one partition and more workers analyse more jobs in parallel). Each assigned partition has
its own `StepProcessor` (the windows are the processor's own; faust's windowed tables are
not used). Job metadata comes from the compacted `lagscope.jobs` topic, which every worker
reads whole (outside the consumer group: every worker needs every job). Closed steps go to
the store (`steps`, `attribution`, `worker_slowdown`, `changepoints`, `jobs`) and, as JSON,
to `lagscope.results` for other consumers. A message that does not decode goes to the
store's `dead_letters` table and is counted; the worker carries on.

Crash safety (kill -9 mid-window, restart or rebalance: no step lost, none duplicated, the
same numbers as an uninterrupted run):

1. *Snapshots aligned with offsets.* Per partition, the worker periodically writes a
   snapshot of the processor (`StepProcessor.state_dict`: open windows, running ideals,
   detectors, the ids of the retained steps) together with `next_offset`, the first offset
   the snapshot has not consumed, to the store's `worker_state` table. The retained steps'
   inputs (the roll-up window, megabytes for a large job) go to `worker_retained`, each
   step once, when the first snapshot that retains it is written: a snapshot costs what
   changed since the last one, not the whole window. Before a snapshot is written, every
   step the processor closed so far is durably in the store and its results are flushed
   to `lagscope.results`.
2. *Offsets follow snapshots.* The agent gets the ops topic one fetched run at a time
   (`stream_app.fetch_runs`: faust's per-record events cost a quarter of a core at a
   million ops/s) with faust's acks off; the worker commits a partition's offset itself,
   once a durable snapshot covers it. The snapshot's `next_offset` is the authority: after
   a restart or a rebalance the new owner loads the snapshot and skips re-delivered
   messages below it (Kafka's committed offset may lag the snapshot when the worker died
   between the two writes, or when a rebalance came between a snapshot and its commit).
3. *Deterministic re-processing.* Everything after the snapshot is replayed from Kafka into
   the restored processor: the same batches in the same partition order on the same state
   give the same closed steps with the same numbers (the running ideal, the change-point
   detectors and the roll-up depend only on the steps seen before, which the snapshot
   holds), so a re-processed step equals the stored one bit for bit.
4. *Exactly once in `steps`.* Before a write, steps already stored for (job, attempt,
   step) are dropped from the batch with all their rows, so a step re-closed after a
   crash is never written twice (not even transiently, i.e. also without `FINAL`); the
   sink's own version check is the second line. Results on `lagscope.results` are
   at-least-once (key = job id; consumers dedup on (job, attempt, step)).
5. *Store faults.* The sink retries a failed write with bounded exponential back-off
   (`store.write_attempts`); when the store still refuses, the closed steps stay pending,
   no snapshot is written (so no offset is committed past a step the store does not
   have), and the host takes no more messages until a retried write succeeds.

Windows follow event time (`EventClock`): while Kafka holds more of a partition, its
lateness clock is the newest record timestamp delivered, so a backlog of any size (or a
worker held back by a store outage) closes complete steps complete; once caught up it is
wall-clock time, so a silent rank still times out.

Limits: snapshots hand a partition over only between workers that share one store (one
ClickHouse server). Workers with stores of their own (a chDB directory each) cannot read
each other's snapshots: a partition that moves starts fresh at the committed offset, so
the batches its open windows held before it are not re-read (seen: one step of 352 lost,
one stored incomplete, 13 stored twice across the stores, three workers, kill -9 of one).
A step closed by the lateness timeout depends on wall-clock time, so a step that
was closed incomplete before a crash may re-close complete after it; the first stored
version stands. Retained inputs are kept 30 days (table TTL): a job restored after a
longer silence rolls up without the expired steps. Snapshots and retained inputs are in
the safe state format (`stream_app.snapshot_format`: JSON and numpy arrays, never pickle),
so whoever can write the store cannot run code in the worker; a snapshot that does not
decode is skipped for the newest older one that does (or a fresh start), and the
partition is re-read from that snapshot's offset.

The job-level roll-up (`StepProcessor.rollup`: `lagscope analyze` of the retained steps)
is diagnosed and written to `diagnoses` (its evidence holds the job's slowdown) and
published to `lagscope.results` when a job has been idle for `worker.rollup_idle_s`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from lagscope.producers.config import ConfigError, KafkaSettings, LagscopeConfig
from lagscope.producers.events import (
    JobInfo,
    RankStepBatch,
    SchemaError,
    decode_batch,
    peek_header,
)
from lagscope.producers.kafka_login import check_kafka_login
from lagscope.producers.metrics import MetricsServer, SecondsHistogram
from lagscope.simulator.diagnose import diagnose
from lagscope.simulator.prepare import concat_steps
from lagscope.stream_app.admission import job_conflict, job_problem
from lagscope.stream_app.identity import MachineBook, name_machines, rank_identity_batch
from lagscope.stream_app.processor import (
    ProcessorSettings,
    StepOutput,
    StepProcessor,
    encode_step_inputs,
)
from lagscope.stream_app.rows import diagnosis_rows, job_rows, rows_from_outputs
from lagscope.stream_app.schema import WORKER_RETAINED_TABLE, WORKER_STATE_TABLE
from lagscope.stream_app.sink import ClickHouseSink, RetryPolicy, SinkBatch, StoreError
from lagscope.stream_app.snapshot_format import SnapshotError, decode_state, encode_state
from lagscope.stream_app.store_location import DEFAULT_DSN, DSN_ENV

log = logging.getLogger("lagscope.worker")

#: Kinds of dead letters (the `reason` label of `lagscope_worker_dead_letters_total`):
#: a message that is no batch, a batch the admission or the windows set aside, a batch a
#: windowing bug dropped, a job record that is invalid or conflicts with a known one.
_DEAD_LETTER_KINDS = ("undecodable", "rejected", "windowing", "job_metadata")
_WINDOWING_FAILED = "windowing failed"

#: 3: the safe state format (no pickle), retained steps as ids (inputs in worker_retained).
SNAPSHOT_VERSION = 3
#: Snapshots of a partition tried, newest first, when the newest does not decode.
SNAPSHOTS_TRIED = 5


# -- configuration ------------------------------------------------------------------------
class WorkerKafkaSettings(KafkaSettings):
    topic_results: str = "lagscope.results"


class StoreSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: ClickHouse DSN (chdb:///dir or http(s)://...); default $LAGSCOPE_CLICKHOUSE_DSN or
    #: the embedded store under the working directory.
    dsn: str | None = None
    ops_ttl_days: int = Field(default=7, ge=1)
    #: A failed write is tried this many times in all, with exponential back-off of at most
    #: `write_retry_max_wait_s` between tries; after that the closed steps stay pending
    #: (and the offsets uncommitted) until a later write succeeds.
    write_attempts: int = Field(default=5, ge=1)
    write_retry_max_wait_s: float = Field(default=2.0, gt=0)

    def resolved_dsn(self) -> str:
        return self.dsn or os.environ.get(DSN_ENV) or DEFAULT_DSN

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(
            attempts=self.write_attempts,
            first_wait_s=min(0.1, self.write_retry_max_wait_s),
            max_wait_s=self.write_retry_max_wait_s,
        )


class WorkerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: Consumer group (and faust app id): workers of one group share the partitions.
    group_id: str = "lagscope-worker"
    #: Write closed steps at least this often (seconds) ...
    write_interval_s: float = Field(default=0.5, gt=0)
    #: ... or as soon as this many are waiting.
    write_every_steps: int = Field(default=64, ge=1)
    #: Snapshot the processors (and commit offsets) this often.
    checkpoint_interval_s: float = Field(default=5.0, gt=0)
    #: Fetched runs (one partition's records from one fetch) handed to the processor at once.
    take_max_runs: int = Field(default=4, ge=1)
    #: Most bytes fetched per partition at once (the size of a run): larger runs amortise the
    #: per-run cost; a run is at most this much memory per partition.
    fetch_max_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    #: How long a batch of a job without metadata waits for `lagscope.jobs`.
    job_wait_s: float = Field(default=5.0, ge=0)
    #: How often lateness timeouts, writes and snapshots are checked.
    tick_interval_s: float = Field(default=0.5, gt=0)
    #: Roll up and diagnose a job once it has closed no step for this long.
    rollup_idle_s: float = Field(default=10.0, gt=0)
    #: Exit after this long with no message and everything written (tests, backfills).
    exit_when_idle_s: float | None = Field(default=None, gt=0)
    #: Kafka group session timeout; a killed worker's partitions move after this long.
    session_timeout_s: float = Field(default=30.0, ge=6)
    #: faust's data directory (it keeps little: no tables are used).
    data_dir: Path = Path("lagscope-data/worker")
    #: Serve Prometheus metrics on this port (0 = any free port, logged); None = off.
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    #: Address the metrics endpoint listens on.
    metrics_addr: str = "0.0.0.0"


class WorkerConfig(LagscopeConfig):
    kafka: WorkerKafkaSettings = Field(default_factory=WorkerKafkaSettings)
    processor: ProcessorSettings = Field(default_factory=ProcessorSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)


# -- the engine-agnostic core ---------------------------------------------------------------
@dataclass
class _JobTotals:
    gpu_seconds_wasted: float = 0.0
    last_step: int = -1
    rolled_up_step: int = -1


class EventClock:
    """A partition's lateness clock in event time: while the partition is behind (Kafka
    holds more of it), the newest record timestamp it delivered, so a backlog of any size
    is windowed as it was produced and a step times out only when later records show its
    missing ranks were late; once caught up, wall-clock time, so a rank that went silent
    still times out. Never goes backwards."""

    def __init__(self, newest_record_s: float | None = None, wall: Callable[[], float] = time.time):
        self._wall = wall
        self.newest_record_s = newest_record_s
        self._now = float("-inf")
        self.behind = True

    def __call__(self) -> float:
        if self.newest_record_s is None:
            now = self._wall()  # nothing delivered yet
        elif self.behind:
            now = self.newest_record_s
        else:
            now = max(self.newest_record_s, self._wall())
        self._now = max(self._now, now)
        return self._now

    def observe(self, record_timestamp_s: float) -> None:
        if self.newest_record_s is None or record_timestamp_s > self.newest_record_s:
            self.newest_record_s = record_timestamp_s


@dataclass
class _Partition:
    number: int
    processor: StepProcessor
    #: First offset the processor has not consumed.
    next_offset: int = 0
    #: next_offset of the last durable snapshot.
    snapshot_offset: int = 0
    totals: dict[tuple[str, int], _JobTotals] = field(default_factory=dict)
    jobs_written: set[tuple[str, int]] = field(default_factory=set)
    pending: list[StepOutput] = field(default_factory=list)
    dead: list[tuple[str, str, str, bytes, float]] = field(default_factory=list)
    last_write: float = 0.0
    last_snapshot: float = 0.0
    last_step_at: dict[tuple[str, int], float] = field(default_factory=dict)
    #: Retained steps whose inputs are in the store (written by a snapshot).
    persisted: set[tuple[str, int, int]] = field(default_factory=set)
    #: Set when the partition was restored from an older snapshot than the newest (which
    #: did not decode): the consumer must re-read from here.
    seek_to: int | None = None
    #: The processor's lateness clock (event time, see EventClock).
    event_clock: EventClock = field(default_factory=EventClock)


@dataclass(frozen=True)
class OpsMessage:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_s: float


class WorkerCore:
    """Per-partition processors, writes, snapshots: everything but the Kafka client.

    Not thread-safe: the faust host calls it from one executor thread only.
    """

    def __init__(
        self,
        config: WorkerConfig,
        sink: ClickHouseSink,
        publish: Callable[[bytes, bytes], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.sink = sink
        self.publish = publish
        self.clock = clock
        self.topic = config.kafka.topic_ops
        self.group = config.worker.group_id
        self.partitions: dict[int, _Partition] = {}
        #: (job, attempt) -> (metadata, record timestamp s); filled by the jobs reader.
        self.job_infos: dict[tuple[str, int], tuple[JobInfo, float]] = {}
        #: The machine of every worker, from every rank's job record (one per rank).
        self.machines = MachineBook()
        self.counters: dict[str, int] = {
            "messages": 0,
            "replayed_skipped": 0,
            "ops": 0,
            "steps_written": 0,
            "steps_already_stored": 0,
            "dead_letters": 0,
            "snapshots": 0,
            "rollups": 0,
            "failed_writes": 0,
        }
        #: True from a write that failed (after its retries) until one succeeds: the host
        #: stops taking messages meanwhile (backpressure instead of buffering).
        self.store_failing = False
        #: Dead letters of the jobs topic (no partition owns them) not stored yet.
        self._unowned_dead: list[tuple[str, str, str, bytes, float]] = []
        #: Wall-clock time of the first message consumed and of the last steps write.
        self.first_message_at: float | None = None
        self.last_write_at: float | None = None
        # For the metrics endpoint (read by its thread at scrape time):
        #: Dead letters by kind (a bounded label set: see `_DEAD_LETTER_KINDS`).
        self.dead_letters_by_kind: dict[str, int] = dict.fromkeys(_DEAD_LETTER_KINDS, 0)
        #: Steps stored (written once each), by completeness.
        self.steps_stored: dict[bool, int] = {True: 0, False: 0}
        #: Analysis time per closed step: each processor pass's seconds over the steps it
        #: closed (a step re-closed after a crash is observed again).
        self.step_seconds = SecondsHistogram()

    # -- input ------------------------------------------------------------------------
    def on_job_record(self, value: bytes | None, timestamp_s: float, where: str) -> None:
        try:
            info = JobInfo.model_validate_json(value or b"")
        except ValueError as exc:
            log.warning("dead letter %s: invalid job metadata: %s", where, exc)
            self._count_dead("job_metadata")
            # No partition owns a jobs record: stored with the next write.
            self._unowned_dead.append(
                ("", where, f"invalid job metadata: {exc}", value or b"", timestamp_s)
            )
            return
        key = (info.job_id, info.attempt)
        known = self.job_infos.get(key)
        if known is not None:
            problem = job_conflict(known[0], info)
        else:
            # A job beyond the limit is still remembered: each partition's processor
            # rejects it (and its batches) before allocating anything for it.
            problem = job_problem(info, self.config.processor.max_world_size)
            self.job_infos[key] = (info, timestamp_s)
        if problem:
            log.warning("dead letter %s: %s", where, problem)
            self._count_dead("job_metadata")
            self._unowned_dead.append((info.job_id, where, problem, value or b"", timestamp_s))
        elif self.machines.add(info):
            self.sink.write(rank_identity_batch(info))

    def partition(self, number: int) -> _Partition:
        """The state of a partition, restored from its last snapshot on first use."""
        state = self.partitions.get(number)
        if state is None:
            state = self.partitions[number] = self._restore(number)
        return state

    def drop_partition(self, number: int) -> None:
        self.partitions.pop(number, None)

    def on_messages(self, messages: list[OpsMessage]) -> None:
        """Decode, window and analyse a run of messages (steps they close, in one pass)."""
        batches: dict[int, list[RankStepBatch]] = {}
        for message in messages:
            batch = self._decode(message)
            if batch is not None:
                batches.setdefault(message.partition, []).append(batch)
        span: dict[int, tuple[float, float]] = {}
        for message in messages:
            first, last = span.get(message.partition, (message.timestamp_s, message.timestamp_s))
            span[message.partition] = (
                min(first, message.timestamp_s),
                max(last, message.timestamp_s),
            )
        for number, part_batches in batches.items():
            part = self.partition(number)
            # The windows these batches open start no later than the run's first record.
            part.event_clock.observe(span[number][0])
            started = time.perf_counter()
            try:
                outputs = part.processor.on_batches(part_batches)
            except Exception as exc:
                # The processor stores analysis failures as unanalysed steps; this is a
                # windowing bug. Keep the partition going, and the batches as dead letters.
                log.exception("windowing %d batch(es) of %s[%d] failed", len(part_batches),
                              self.topic, number)  # fmt: skip
                for batch in part_batches:
                    part.processor.rejected.append((batch, f"{_WINDOWING_FAILED}: {exc!r}"))
                outputs = []
            self._closed(part, outputs, time.perf_counter() - started)
        for number, (_, last) in span.items():
            self.partition(number).event_clock.observe(last)
        self.write_due()

    def set_behind(self, number: int, behind: bool) -> None:
        """The host says whether the partition has records past what it delivered."""
        part = self.partitions.get(number)
        if part is not None:
            part.event_clock.behind = behind

    def _decode(self, message: OpsMessage) -> RankStepBatch | None:
        """The message's batch, or None when it was re-delivered or is a dead letter."""
        part = self.partition(message.partition)
        if message.offset < part.next_offset:
            # Already inside the snapshot (Kafka's committed offset lagged it).
            self.counters["replayed_skipped"] += 1
            return None
        part.next_offset = message.offset + 1
        self.counters["messages"] += 1
        if self.first_message_at is None:
            self.first_message_at = time.time()
        where = f"{self.topic}[{message.partition}]@{message.offset}"
        try:
            batch = decode_batch(message.value or b"", where=where)
        except SchemaError as exc:
            self._dead_letter(part, message, where, str(exc), "undecodable")
            return None
        except Exception as exc:  # a decoder bug must not stop the partition either
            self._dead_letter(part, message, where, f"undecodable: {exc!r}", "undecodable")
            return None
        self._ensure_job(part, batch)
        self.counters["ops"] += batch.n_ops
        kept, problem = part.processor.admit(batch)
        if problem:
            self._dead_letter(part, message, where, problem, "rejected")
        return kept

    def _ensure_job(self, part: _Partition, batch: RankStepBatch) -> None:
        key = (batch.job_id, batch.attempt)
        if key in part.processor.jobs:
            return
        known = self.job_infos.get(key)
        if known is not None:
            part.processor.on_job(known[0])

    def _count_dead(self, kind: str) -> None:
        self.counters["dead_letters"] += 1
        self.dead_letters_by_kind[kind] += 1

    def _dead_letter(
        self, part: _Partition, message: OpsMessage, where: str, reason: str, kind: str
    ) -> None:
        log.warning("dead letter %s: %s", where, reason)
        self._count_dead(kind)
        job = (message.key or b"").decode("utf-8", "replace")
        part.dead.append((job, where, reason, message.value or b"", message.timestamp_s))

    def _closed(self, part: _Partition, outputs: list[StepOutput], seconds: float) -> None:
        """Take the steps a processor pass of `seconds` closed, and what it set aside."""
        for batch, reason in part.processor.take_rejected():
            where = f"{batch.job_id}/{batch.attempt} step {batch.step} rank {batch.rank}"
            log.warning("dead letter %s: %s", where, reason)
            self._count_dead("windowing" if reason.startswith(_WINDOWING_FAILED) else "rejected")
            # The batch's own time, so a replay writes the same row (ReplacingMergeTree key).
            at = float(batch.start_ns.min()) / 1e9 if batch.n_ops else 0.0
            part.dead.append((batch.job_id, where, reason, batch.encode(), at))
        now = self.clock()
        per_step = seconds / len(outputs) if outputs else 0.0
        for out in outputs:
            self.step_seconds.observe(per_step)
            key = (out.job_id, out.attempt)
            totals = part.totals.setdefault(key, _JobTotals())
            totals.last_step = max(totals.last_step, out.step)
            if out.result is not None:
                slowdown = float(out.result.step_slowdown[0])
                gpu_seconds = float(out.result.t_actual[0]) * out.info.world_size
                totals.gpu_seconds_wasted += gpu_seconds * (1 - 1 / slowdown)
            part.last_step_at[key] = now
            part.pending.append(out)

    # -- periodic work ------------------------------------------------------------------
    def tick(self) -> None:
        """Close late windows; write and roll up what is due."""
        for part in list(self.partitions.values()):
            started = time.perf_counter()
            outputs = part.processor.tick()
            self._closed(part, outputs, time.perf_counter() - started)
            self._rollups(part, force=False)
        self.write_due()

    def write_due(self) -> None:
        """Write the partitions whose closed steps waited long enough, or are many."""
        now = self.clock()
        settings = self.config.worker
        if self._unowned_dead:
            self._store_or_keep(self._write_unowned_dead)
        for part in list(self.partitions.values()):
            if part.pending or part.dead:
                due = len(part.pending) >= settings.write_every_steps
                if due or now - part.last_write >= settings.write_interval_s:
                    self.write(part)

    def checkpoint_due(self, number: int) -> bool:
        part = self.partitions.get(number)
        if part is None or part.next_offset == part.snapshot_offset:
            return False
        return self.clock() - part.last_snapshot >= self.config.worker.checkpoint_interval_s

    def checkpoint(self, number: int) -> int:
        """Write everything closed, snapshot; returns the offset safe to commit: past the
        new snapshot only when every step it has closed is stored, else the last one's."""
        part = self.partitions[number]
        if (
            self.write(part)
            and part.next_offset != part.snapshot_offset
            and self._store_or_keep(self._snapshot, part)
        ):
            self.counters["snapshots"] += 1
        part.last_snapshot = self.clock()
        return part.snapshot_offset

    def finish(self) -> dict[int, int]:
        """Roll up every job and snapshot every partition (idle exit)."""
        committed = {}
        for number, part in list(self.partitions.items()):
            started = time.perf_counter()
            outputs = part.processor.tick()
            self._closed(part, outputs, time.perf_counter() - started)
            self._rollups(part, force=True)
            committed[number] = self.checkpoint(number)
        return committed

    def open_windows(self) -> int:
        return sum(len(p.processor.windows) for p in self.partitions.values())

    def busy(self) -> bool:
        """True while a partition holds something not yet durable."""
        return bool(self._unowned_dead) or any(
            p.pending or p.dead or p.next_offset != p.snapshot_offset or p.processor.windows
            for p in self.partitions.values()
        )

    def retry_writes(self) -> bool:
        """Try again to store what a failed write left pending; True once all is stored."""
        if self._unowned_dead and not self._store_or_keep(self._write_unowned_dead):
            return False
        return all(self.write(part) for part in list(self.partitions.values()))

    # -- writes -------------------------------------------------------------------------
    def write(self, part: _Partition) -> bool:
        """Durably store closed steps (each exactly once) and dead letters, then publish
        the results. False when the store failed even after the sink's retries: what was
        not stored stays pending for the next write (nothing closed is dropped)."""
        part.last_write = self.clock()
        if not part.pending and not part.dead:
            return True
        return self._store_or_keep(self._store_closed, part)

    def _store_or_keep(self, store: Callable[..., None], *args: Any) -> bool:
        """Run a store step that keeps its input on failure; a failure is logged in one
        line and marks the store failing until a later step succeeds."""
        try:
            store(*args)
        except StoreError as exc:
            self.counters["failed_writes"] += 1
            self.store_failing = True
            log.error("store unavailable, closed steps kept and retried: %s", exc)
            return False
        self.store_failing = False
        return True

    def _write_unowned_dead(self) -> None:
        self._write_dead(self._unowned_dead)
        self._unowned_dead = []

    def _store_closed(self, part: _Partition) -> None:
        if part.dead:
            self._write_dead(part.dead)
            part.dead = []
        if not part.pending:
            return
        outputs = part.pending
        for key in {(o.job_id, o.attempt) for o in outputs} - part.jobs_written:
            known = self.job_infos.get(key)
            info = (
                known[0]
                if known
                else part.processor.jobs[key].info
                if key in part.processor.jobs
                else None
            )
            if info is None:
                continue
            batch = SinkBatch(f"jobs/{key[0]}/{key[1]}")
            batch.add("jobs", job_rows(key[0], key[1], info.to_meta(), known[1] if known else 0.0))
            self.sink.write(batch)
            part.jobs_written.add(key)
        stored = self.sink.retry.call(self._stored_steps, outputs, what="steps lookup")
        fresh = [o for o in outputs if (o.job_id, o.attempt, o.step) not in stored]
        self.counters["steps_already_stored"] += len(outputs) - len(fresh)
        by_job: dict[tuple[str, int], list[StepOutput]] = {}
        for out in fresh:
            by_job.setdefault((out.job_id, out.attempt), []).append(out)
        for job_outputs in by_job.values():
            self.sink.write(rows_from_outputs(job_outputs))
            self.counters["steps_written"] += len(job_outputs)
            for out in job_outputs:
                self.steps_stored[out.complete] += 1
            self.last_write_at = time.time()
        if len(fresh) < len(outputs):
            log.info(
                "stored %d step(s); %d re-processed step(s) were already stored",
                len(fresh),
                len(outputs) - len(fresh),
            )
        part.pending = []  # only now: a failure above kept them for the next write
        for out in outputs:
            self.publish(out.job_id.encode(), json.dumps(step_result(out), default=float).encode())

    def _stored_steps(self, outputs: list[StepOutput]) -> set[tuple[str, int, int]]:
        keys = sorted({(o.job_id, o.attempt, o.step) for o in outputs})
        _, rows = self.sink.query(
            "SELECT DISTINCT job_id, attempt, step FROM steps "
            "WHERE (job_id, attempt, step) IN {keys:Array(Tuple(String, UInt32, UInt64))}",
            {"keys": keys},
        )
        return {(j, int(a), int(s)) for j, a, s in rows}

    def _write_dead(self, letters: list[tuple[str, str, str, bytes, float]]) -> None:
        batch = SinkBatch(f"dead/{letters[0][1]}/{letters[-1][1]}/{len(letters)}")
        batch.add(
            "dead_letters",
            {
                "ts": [d[4] for d in letters],
                "job_id": [d[0] for d in letters],
                "source": [d[1] for d in letters],
                "reason": [d[2] for d in letters],
                "payload": [d[3].hex() for d in letters],
            },
        )
        self.sink.write(batch)

    def _rollups(self, part: _Partition, *, force: bool) -> None:
        now = self.clock()
        for key, totals in part.totals.items():
            if totals.rolled_up_step >= totals.last_step:
                continue
            idle = now - part.last_step_at.get(key, now)
            if not force and idle < self.config.worker.rollup_idle_s:
                continue
            if not self.write(part):  # the roll-up follows its steps into the store
                return
            rollup = part.processor.rollup(*key)
            if rollup is None:
                totals.rolled_up_step = totals.last_step
                continue
            state = part.processor.jobs[key]
            prepared = concat_steps(sorted(state.retained, key=lambda p: int(p.steps[0])))
            diagnosis = name_machines(
                diagnose(rollup, prepared, wasted_gpu_s=totals.gpu_seconds_wasted),
                self.machines.machines(*key),
            )
            last = int(rollup.steps[-1])
            batch = SinkBatch(f"diagnosis/{key[0]}/{key[1]}/{last}")
            batch.add("diagnoses", diagnosis_rows(key[0], key[1], last, 0, diagnosis))
            if not self._store_or_keep(self.sink.write, batch):
                return  # rolled up again on a later tick
            totals.rolled_up_step = totals.last_step
            self.counters["rollups"] += 1
            message = {
                "kind": "rollup",
                "job_id": key[0],
                "attempt": key[1],
                "steps": [int(rollup.steps[0]), last],
                "n_steps": len(rollup.steps),
                # At most this many complete steps are covered (the memory budget's cap).
                "window_steps": state.retained_capacity,
                "slowdown": rollup.slowdown,
                "waste": rollup.waste,
                "gpu_seconds_wasted": totals.gpu_seconds_wasted,
                "cause": diagnosis.cause,
                "summary": diagnosis.summary,
            }
            self.publish(key[0].encode(), json.dumps(message, default=float).encode())

    # -- snapshots ----------------------------------------------------------------------
    def _snapshot(self, part: _Partition) -> None:
        self.flush_results()
        self._persist_retained(part)
        payload = {
            "version": SNAPSHOT_VERSION,
            "next_offset": part.next_offset,
            "processor": part.processor.state_dict(with_retained_inputs=False),
            "totals": {k: vars(t) for k, t in part.totals.items()},
            "jobs_written": sorted(part.jobs_written),
            "event_time_s": part.event_clock.newest_record_s,
        }
        blob = encode_state(payload)
        written_at = dt.datetime.now(dt.UTC)
        self.sink.retry.call(
            self._insert_rows,
            WORKER_STATE_TABLE,
            ["group_id", "topic", "partition", "next_offset", "written_at", "state"],
            [[self.group, self.topic, part.number, part.next_offset, written_at, blob]],
            f"state/{self.group}/{self.topic}/{part.number}/{part.next_offset}",
            what="snapshot write",
        )
        part.snapshot_offset = part.next_offset
        log.info(
            "checkpoint %s[%d] next offset %d (%d KiB)",
            self.topic,
            part.number,
            part.next_offset,
            len(blob) // 1024,
        )

    def _persist_retained(self, part: _Partition) -> None:
        """Write the retained steps no snapshot has written yet (each step once)."""
        rows = []
        now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
        current: set[tuple[str, int, int]] = set()
        for (job_id, attempt), job in part.processor.jobs.items():
            for prepared in job.retained:
                key = (job_id, attempt, int(prepared.steps[0]))
                current.add(key)
                if key not in part.persisted:
                    rows.append([self.group, *key, now, encode_step_inputs(prepared)])
        if rows:
            first, last = rows[0], rows[-1]
            self.sink.retry.call(
                self._insert_rows,
                WORKER_RETAINED_TABLE,
                ["group_id", "job_id", "attempt", "step", "written_at", "inputs"],
                rows,
                f"retained/{self.group}/{first[1]}/{first[2]}/{first[3]}-"
                f"{last[1]}/{last[2]}/{last[3]}/{len(rows)}",
                what="retained steps write",
            )
        part.persisted = current

    def _insert_rows(self, table: str, columns: list[str], rows: list[list], token: str) -> None:
        """Checkpoint rows, deduplicated by `token` (a retried checkpoint writes nothing)."""
        from clickhouse_connect.driver.exceptions import ClickHouseError

        try:
            self.sink.client.insert(
                table,
                rows,
                column_names=columns,
                settings={"insert_deduplicate": 1, "insert_deduplication_token": token},
            )
        except (ClickHouseError, OSError) as exc:
            raise StoreError(f"{self.sink.dsn.shown}: insert into {table} failed: {exc}") from None

    def _retained_inputs(self, job: tuple[str, int], steps: list[int]) -> dict[int, bytes]:
        result = self.sink.client.query(
            f"SELECT step, any(inputs) FROM {WORKER_RETAINED_TABLE} "
            "WHERE group_id = {group:String} AND job_id = {job:String} "
            "AND attempt = {attempt:UInt32} AND step IN {steps:Array(UInt64)} GROUP BY step",
            parameters={"group": self.group, "job": job[0], "attempt": job[1], "steps": steps},
            column_formats={"any(inputs)": "bytes"},
        )
        return {int(step): inputs for step, inputs in result.result_rows}

    def _restore(self, number: int) -> _Partition:
        rows = self.sink.client.query(
            f"SELECT next_offset, state FROM {WORKER_STATE_TABLE} "
            "WHERE group_id = {group:String} AND topic = {topic:String} "
            "AND partition = {partition:UInt32} ORDER BY next_offset DESC LIMIT {n:UInt32}",
            parameters={
                "group": self.group,
                "topic": self.topic,
                "partition": number,
                "n": SNAPSHOTS_TRIED,
            },
            column_formats={"state": "bytes"},
        ).result_rows
        now = self.clock()
        for index, (offset, blob) in enumerate(rows):
            where = f"{WORKER_STATE_TABLE}: snapshot of {self.topic}[{number}] at offset {offset}"
            try:
                part = self._from_snapshot(number, blob, where)
            except SnapshotError as exc:
                log.error("%s; trying an older one", exc)
                continue
            if index:
                # Kafka's committed offset may be past this older snapshot: read from it.
                part.seek_to = part.next_offset
            part.last_write = part.last_snapshot = now
            for key in part.totals:
                part.last_step_at[key] = now
            log.info(
                "partition %s[%d]: restored snapshot at offset %d",
                self.topic,
                number,
                part.next_offset,
            )
            return part
        clock = EventClock()
        part = _Partition(number, StepProcessor(self.config.processor, clock), event_clock=clock)
        part.last_write = part.last_snapshot = now
        if rows:
            log.error(
                "partition %s[%d]: no readable snapshot; re-reading it from its start "
                "(steps already stored are not stored again)",
                self.topic,
                number,
            )
            part.seek_to = 0
        else:
            log.info("partition %s[%d]: no snapshot, starting fresh", self.topic, number)
        return part

    def _from_snapshot(self, number: int, blob: bytes, where: str) -> _Partition:
        """A partition resumed from a snapshot payload; SnapshotError when it is not one."""
        payload = decode_state(blob, where)
        version = payload.get("version") if isinstance(payload, dict) else None
        if version != SNAPSHOT_VERSION:
            raise SnapshotError(
                f"{where}: version {version!r}, this worker reads {SNAPSHOT_VERSION}"
            )
        try:
            clock = EventClock(payload["event_time_s"])
            processor = StepProcessor.from_state(
                payload["processor"], clock, retained_inputs=self._retained_inputs
            )
            part = _Partition(
                number,
                processor,
                payload["next_offset"],
                payload["next_offset"],
                event_clock=clock,
            )
            part.totals = {tuple(k): _JobTotals(**v) for k, v in payload["totals"].items()}
            part.jobs_written = {tuple(k) for k in payload["jobs_written"]}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SnapshotError(f"{where}: malformed snapshot ({exc!r})") from None
        # The analysis settings are the snapshot's (changing them mid-job would change the
        # numbers of re-processed steps); only the lateness follows the configuration.
        processor.settings = processor.settings.model_copy(
            update={"lateness_s": self.config.processor.lateness_s}
        )
        part.persisted = {
            (job_id, attempt, int(p.steps[0]))
            for (job_id, attempt), job in processor.jobs.items()
            for p in job.retained
        }
        return part

    def take_seek(self, number: int) -> int | None:
        """The offset the host must move the consumer of a restored partition back to."""
        part = self.partitions.get(number)
        if part is None:
            return None
        seek, part.seek_to = part.seek_to, None
        return seek

    def flush_results(self) -> None:
        """Overridden by the host: make published results durable."""


def step_result(out: StepOutput, top: int = 3) -> dict[str, Any]:
    """The `lagscope.results` message of a closed step."""
    message: dict[str, Any] = {
        "kind": "step",
        "job_id": out.job_id,
        "attempt": out.attempt,
        "step": out.step,
        "start_ns": out.start_ns,
        "complete": out.complete,
        "missing": [{"dp": dp, "pp": pp} for dp, pp in out.missing],
        "reason": out.reason,
        "changepoints": [
            {
                "series": c.series,
                "step": c.step,
                "kind": c.kind,
                "before_mean": c.before_mean,
                "after_mean": c.after_mean,
                "probability": c.probability,
            }
            for c in out.changes
        ],
    }
    r = out.result
    if r is None:
        message.update(slowdown=None, waste=None, actual_s=None, simulated_s=None, ideal_s=None)
        return message
    slowdown = float(r.step_slowdown[0])
    message.update(
        slowdown=slowdown,
        waste=1 - 1 / slowdown,
        actual_s=float(r.t_actual[0]),
        simulated_s=float(r.t_nodelay[0]),
        ideal_s=float(r.t_ideal[0]),
        analysed_dp_ranks=list(out.analysed_dp_ranks),
    )
    attributions: dict[str, list[dict[str, Any]]] = {}
    for kind, attribution in (
        ("optype", r.by_optype),
        ("dp_rank", r.by_dp_rank),
        ("stage", r.by_stage),
    ):
        ranked = sorted(
            ((name, float(np.asarray(series)[0])) for name, series in attribution.per_step.items()),
            key=lambda item: -item[1],
        )
        attributions[kind] = [{"name": n, "slowdown": s} for n, s in ranked[:top]]
    message["top_attributions"] = attributions
    return message


# -- the faust host -------------------------------------------------------------------------
class FaustWorker:
    """Runs a `WorkerCore` inside a faust-streaming app (`run()` blocks until stopped)."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        check_kafka_login(config.kafka)  # a rejected login: one line, not a retry loop
        self.sink = ClickHouseSink(config.store.resolved_dsn(), retry=config.store.retry_policy())
        self.sink.ensure_schema(ops_ttl_days=config.store.ops_ttl_days)
        self._producer = self._make_producer()
        self.core = WorkerCore(config, self.sink, self._publish)
        self.core.flush_results = self._flush_results  # type: ignore[method-assign]
        # One thread does all processing: keeps the event loop (heartbeats) responsive and
        # the core single-threaded.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="lagscope-core")
        self._jobs_ready = threading.Event()
        self._known_jobs: set[bytes] = set()
        #: Jobs whose metadata a pass already waited for.
        self._waited_for: set[bytes] = set()
        self._stop = threading.Event()
        #: When the last pass over messages ended (or the last assignment came).
        self._last_message = time.monotonic()
        self._passes_in_flight = 0
        self._assigned = False
        #: Consumer lag of each assigned ops partition: records in Kafka past the last one
        #: the worker processed (Kafka's high watermark minus the core's next offset).
        self._lag: dict[int, int] = {}
        #: The Prometheus endpoint (`serve_metrics`), when `worker.metrics_port` is set.
        self.metrics: MetricsServer | None = None
        self.app = self._build_app()

    # -- metrics ----------------------------------------------------------------------------
    def serve_metrics(self) -> MetricsServer | None:
        """Start the Prometheus endpoint when `worker.metrics_port` is set (once; `run()`
        calls it too). OSError: the port is taken."""
        settings = self.config.worker
        if self.metrics is None and settings.metrics_port is not None:
            from lagscope.producers import metrics

            self.metrics = metrics.serve(
                self._metric_families, settings.metrics_port, settings.metrics_addr,
                what="worker",
            )  # fmt: skip
        return self.metrics

    def _metric_families(self) -> list[Any]:
        """The metric families of a scrape (the endpoint's thread): copies of counters the
        core and the event loop keep in plain Python."""
        from lagscope.producers.metrics import (
            counter,
            gauge,
            histogram,
            labelled_counter,
            labelled_gauge,
        )

        core = self.core
        counters = dict(core.counters)
        topic = self.config.kafka.topic_ops
        lag = {(topic, str(number)): value for number, value in dict(self._lag).items()}
        stored = dict(core.steps_stored)
        return [
            counter("lagscope_worker_records_total",
                    "Records of the ops topic processed (re-deliveries below a snapshot not "
                    "counted).", counters["messages"]),
            counter("lagscope_worker_replayed_records_total",
                    "Re-delivered records skipped because a snapshot already covers them.",
                    counters["replayed_skipped"]),
            counter("lagscope_worker_ops_total", "Ops in the processed batches.",
                    counters["ops"]),
            labelled_counter("lagscope_worker_steps_total",
                             "Closed steps stored, each once (complete: every rank reported).",
                             ["complete"],
                             {("true",): stored[True], ("false",): stored[False]}),
            counter("lagscope_worker_steps_already_stored_total",
                    "Re-closed steps (after a crash or rebalance) found already stored.",
                    counters["steps_already_stored"]),
            labelled_counter("lagscope_worker_dead_letters_total",
                             "Records set aside in the store's dead_letters table, by kind.",
                             ["reason"],
                             {(kind,): n for kind, n in dict(core.dead_letters_by_kind).items()}),
            counter("lagscope_worker_snapshots_total", "Processor snapshots written.",
                    counters["snapshots"]),
            counter("lagscope_worker_rollups_total", "Job roll-ups diagnosed.",
                    counters["rollups"]),
            counter("lagscope_worker_failed_writes_total",
                    "Store writes that failed after their retries.", counters["failed_writes"]),
            gauge("lagscope_worker_store_failing",
                  "1 while the store refuses writes (the worker then takes no messages).",
                  1 if core.store_failing else 0),
            labelled_gauge("lagscope_worker_consumer_lag_records",
                           "Records in Kafka past the last one processed, per assigned "
                           "partition.", ["topic", "partition"], lag),
            histogram("lagscope_worker_step_processing_seconds",
                      "Analysis time per closed step (a processor pass over the steps it "
                      "closed).", core.step_seconds),
            gauge("lagscope_worker_last_step_timestamp_seconds",
                  "Unix time of the last write of closed steps to the store (0: none yet).",
                  core.last_write_at or 0.0),
        ]  # fmt: skip

    def _update_lag(self) -> None:
        """Consumer lag of every assigned ops partition the core has state for."""
        consumer = self.app.consumer
        for tp in consumer.assignment():
            if tp.topic != self.core.topic:
                continue
            highwater = consumer.highwater(tp)
            part = self.core.partitions.get(tp.partition)
            if highwater is None or part is None:
                continue
            self._lag[tp.partition] = max(0, highwater - part.next_offset)

    # -- kafka clients --------------------------------------------------------------------
    def _make_producer(self) -> Any:
        from confluent_kafka import Producer

        return Producer(
            {
                **self.config.kafka.client_config(),
                "enable.idempotence": True,
                "acks": "all",
                "compression.type": "zstd",
                "linger.ms": 20,
            }
        )

    def _publish(self, key: bytes, value: bytes) -> None:
        topic = self.config.kafka.topic_results
        while True:
            try:
                self._producer.produce(topic, key=key, value=value)
                self._producer.poll(0)
                return
            except BufferError:
                self._producer.poll(0.1)

    def _flush_results(self) -> None:
        remaining = self._producer.flush(30)
        if remaining:
            raise RuntimeError(f"{remaining} results not delivered to Kafka in 30 s")

    def _read_jobs(self) -> None:
        """Read the compacted jobs topic whole, then follow it (a thread, outside the group)."""
        from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

        topic = self.config.kafka.topic_jobs
        consumer = Consumer(
            {
                **self.config.kafka.client_config(),
                "group.id": f"{self.config.worker.group_id}-jobs-reader",
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
            }
        )
        try:
            partitions: list[int] = []
            while not partitions and not self._stop.is_set():
                try:
                    meta = consumer.list_topics(topic, timeout=5)
                    found = meta.topics.get(topic)
                    if found is not None and found.error is None:
                        partitions = list(found.partitions)
                except KafkaException as exc:
                    log.warning("jobs topic %s: %s", topic, exc)
                if not partitions:
                    self._jobs_ready.set()  # nothing to wait for yet
                    time.sleep(1.0)
            tps = [TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions]
            ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                    for p in partitions}  # fmt: skip
            consumer.assign(tps)
            position = dict.fromkeys(partitions, 0)
            while not self._stop.is_set():
                if all(position[p] >= ends[p] for p in partitions):
                    self._jobs_ready.set()
                msg = consumer.poll(0.2)
                if msg is None or msg.error() is not None:
                    continue
                position[msg.partition()] = msg.offset() + 1
                where = f"{topic}[{msg.partition()}]@{msg.offset()}"
                timestamp = msg.timestamp()[1] / 1000
                self._executor.submit(self.core.on_job_record, msg.value(), timestamp, where)
                job_id = _job_id_of(msg.value())
                if job_id is not None:
                    # After the submit: the executor runs it before any later batch.
                    self._known_jobs.add(job_id)
        finally:
            consumer.close()

    # -- faust ------------------------------------------------------------------------------
    def _build_app(self) -> Any:
        from lagscope.stream_app.fetch_runs import PassThroughCodec, RunsApp

        kafka = self.config.kafka
        settings = self.config.worker
        app = RunsApp(
            settings.group_id,
            run_topics=frozenset({kafka.topic_ops}),
            broker=[f"kafka://{server.strip()}" for server in kafka.bootstrap_servers.split(",")],
            broker_credentials=_faust_credentials(kafka),
            datadir=str(settings.data_dir),
            web_enabled=False,
            topic_disable_leader=True,
            stream_wait_empty=False,
            consumer_auto_offset_reset="earliest",
            broker_session_timeout=settings.session_timeout_s,
            broker_heartbeat_interval=min(3.0, settings.session_timeout_s / 5),
            broker_commit_interval=1.0,
            consumer_max_fetch_size=settings.fetch_max_bytes,
        )
        # Offsets of the ops topic are committed by the worker after its snapshots, not by
        # faust's acks (module docstring, 2).
        topic = app.topic(
            kafka.topic_ops, key_serializer="raw", value_serializer=PassThroughCodec(), acks=False
        )

        @app.agent(topic, name="lagscope-ops")
        async def ops(stream: Any) -> None:
            async for runs in stream.noack_take(settings.take_max_runs, within=0.2):
                await self._on_runs(runs)

        @app.timer(interval=settings.tick_interval_s)
        async def periodic() -> None:
            await self._periodic()

        @app.on_partitions_revoked.connect
        async def on_revoked(app: Any, revoked: Any, **_: Any) -> None:
            await self._release({tp.partition for tp in revoked if tp.topic == kafka.topic_ops})

        @app.on_partitions_assigned.connect
        async def on_assigned(app: Any, assigned: Any, **_: Any) -> None:
            # Restore eagerly: a partition whose snapshot already covers its end gets no
            # message, yet its jobs may still await their roll-up.
            self._last_message = time.monotonic()
            self._assigned = True
            for tp in assigned:
                if tp.topic == kafka.topic_ops:
                    await self._core(self.core.partition, tp.partition)
                    seek = await self._core(self.core.take_seek, tp.partition)
                    if seek is not None:
                        await self.app.consumer.seek(tp, seek)

        @app.task
        async def jobs_reader() -> None:
            thread = threading.Thread(target=self._read_jobs, name="lagscope-jobs", daemon=True)
            thread.start()

        return app

    async def _core(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _on_runs(self, runs: list[Any]) -> None:
        self._passes_in_flight += 1
        try:
            await self._pass(runs)
        finally:
            self._passes_in_flight -= 1
            self._last_message = time.monotonic()

    async def _pass(self, runs: list[Any]) -> None:
        from lagscope.stream_app.fetch_runs import run_records

        owned = {
            tp.partition for tp in self.app.consumer.assignment() if tp.topic == self.core.topic
        }
        messages = [
            OpsMessage(record.partition, record.offset, record.key, record.value,
                       record.timestamp / 1000 if record.timestamp is not None else 0.0)
            for run in runs
            if run.message.partition in owned  # else revoked while buffered: its owner replays it
            for record in run_records(run.message)
        ]  # fmt: skip
        await self._wait_for_store()
        await self._wait_for_jobs(messages)
        await self._core(self.core.on_messages, messages)
        await self._track_backlog(runs)
        await self._checkpoint_due()

    async def _track_backlog(self, runs: list[Any]) -> None:
        """Tell each partition of the pass whether Kafka holds more of it (its lateness
        then follows the records' own timestamps, see EventClock)."""
        consumer = self.app.consumer
        for run in runs:
            message = run.message
            highwater = consumer.highwater(message.tp)
            behind = highwater is not None and message.offset + 1 < highwater
            if highwater is not None:
                self._lag[message.partition] = max(0, highwater - message.offset - 1)
            await self._core(self.core.set_behind, message.partition, behind)

    async def _wait_for_store(self) -> None:
        """While the store refuses writes, take no more messages (backpressure: what is
        closed waits in memory, the rest waits in Kafka) and retry the pending writes."""
        while self.core.store_failing and not self._stop.is_set():
            await asyncio.sleep(self.config.worker.write_interval_s)
            await self._core(self.core.retry_writes)

    async def _wait_for_jobs(self, messages: list[OpsMessage]) -> None:
        """Give `lagscope.jobs` a moment to deliver the metadata of jobs not seen yet."""
        deadline = time.monotonic() + self.config.worker.job_wait_s
        while not self._jobs_ready.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        unknown = {job for job in map(_batch_job_id, messages) if job is not None}
        # Each job is waited for once: a job whose record never comes (or garbage that
        # looks like a batch) must not hold up every later pass.
        unknown -= self._known_jobs | self._waited_for
        self._waited_for |= unknown
        while unknown and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            unknown -= self._known_jobs

    async def _periodic(self) -> None:
        await self._core(self.core.tick)
        self._update_lag()
        await self._checkpoint_due()
        idle_exit = self.config.worker.exit_when_idle_s
        if (
            idle_exit is not None
            and self._assigned
            and not self._stop.is_set()
            and self._idle_for(idle_exit)
            and not await self._core(self.core.open_windows)
            and self._idle_for(idle_exit)  # no pass began while the core was asked
        ):
            last_pass_ended = self._last_message
            committed = await self._core(self.core.finish)
            await self._commit(committed)
            if self._passes_in_flight or self._last_message != last_pass_ended:
                return  # messages came after all: not idle
            if await self._core(self.core.busy):
                return  # the store failed: not everything is stored yet
            log.info("idle for %.1f s: exiting (%s)", idle_exit, json.dumps(self.core.counters))
            summary = {
                "worker_counters": self.core.counters,
                "first_message_at": self.core.first_message_at,
                "last_write_at": self.core.last_write_at,
            }
            print(json.dumps(summary), flush=True)
            self._stop.set()
            os.kill(os.getpid(), signal.SIGTERM)

    def _idle_for(self, seconds: float) -> bool:
        return not self._passes_in_flight and time.monotonic() - self._last_message >= seconds

    async def _checkpoint_due(self) -> None:
        for number in await self._core(lambda: list(self.core.partitions)):
            if await self._core(self.core.checkpoint_due, number):
                offset = await self._core(self.core.checkpoint, number)
                await self._commit({number: offset})

    async def _commit(self, committed: dict[int, int]) -> None:
        """Commit offsets a durable snapshot covers (a failure only delays the commit)."""
        from faust.types import TP

        topic = self.core.topic
        try:
            await self.app.commit_offsets({TP(topic, n): o for n, o in committed.items()})
        except Exception:
            # Kafka's offset then lags the snapshot; the snapshot's next_offset covers the gap.
            log.exception("committing %s offsets %s failed; a later commit catches up", topic,
                          committed)  # fmt: skip

    async def _release(self, partitions: set[int]) -> None:
        """A rebalance takes these partitions away: snapshot what we have, then forget.

        No commit here: committing while the group rebalances can stall the rebalance; the
        snapshot's next_offset lets the new owner skip what Kafka re-delivers.
        """
        for number in partitions:
            try:
                if number in self.core.partitions:
                    await self._core(self.core.checkpoint, number)
            except Exception:
                log.exception("checkpoint of revoked partition %d failed", number)
            await self._core(self.core.drop_partition, number)
            self._lag.pop(number, None)

    def run(self) -> None:
        from faust.worker import Worker

        self.serve_metrics()
        Worker(
            self.app, loglevel=logging.getLogger().level or logging.INFO
        ).execute_from_commandline()


def _batch_job_id(message: OpsMessage) -> bytes | None:
    """The job id in a message's batch header; None for a message that is no batch (a
    garbage key or value must not make the worker wait for job metadata)."""
    try:
        return peek_header(message.value or b"")["job_id"].encode()
    except SchemaError:
        return None


def _job_id_of(value: bytes | None) -> bytes | None:
    try:
        job_id = json.loads(value or b"").get("job_id")
    except (ValueError, AttributeError):
        return None
    return job_id.encode() if isinstance(job_id, str) else None


def _faust_credentials(kafka: KafkaSettings) -> Any:
    import ssl

    import faust

    protocol = kafka.security_protocol
    if protocol == "PLAINTEXT":
        return None
    context = None
    if protocol in ("SSL", "SASL_SSL"):
        context = ssl.create_default_context(cafile=kafka.ssl_ca_location)
        if kafka.ssl_certificate_location:
            context.load_cert_chain(
                kafka.ssl_certificate_location,
                kafka.ssl_key_location,
                kafka.ssl_key_password.get_secret_value() if kafka.ssl_key_password else None,
            )
    if protocol == "SSL":
        return faust.SSLCredentials(context)
    if not kafka.sasl_username or kafka.sasl_password is None:
        raise ConfigError(
            f"kafka.security_protocol {protocol} needs sasl_username and sasl_password"
        )
    return faust.SASLCredentials(
        username=kafka.sasl_username,
        password=kafka.sasl_password.get_secret_value(),
        mechanism=kafka.sasl_mechanism or "PLAIN",
        ssl_context=context,
    )
