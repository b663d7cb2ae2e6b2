"""The distributed host's core: Kafka partitions -> one host pipeline each -> the store.

Everything of `lagscope worker` but the Kafka client (`stream_app/worker.py` drives it from
faust). Each assigned partition of the ops topic has its own `HostCore`
(`stream_app/host_core.py`, the pipeline `lagscope run` drives too); job records (the
compacted jobs topic, read whole by every worker) are shared by all of them.

Crash safety (kill -9 mid-window, restart or rebalance: no step lost, none duplicated, the
same numbers as an uninterrupted run):

1. *Snapshots aligned with offsets.* Per partition, the worker periodically writes a
   snapshot of its core (the processor's windows, running ideals, detectors, episodes and
   totals, the ids of the retained steps) together with `next_offset`, the first offset
   the snapshot has not consumed (`store/checkpoints.py`); the partitions due at once
   share one insert. Before a snapshot is written, every step the core closed so far is
   durably in the store and its results are flushed to `lagscope.results`.
2. *Offsets follow snapshots.* The host gets the ops topic one fetched run at a time and
   commits a partition's offset itself, once a durable snapshot covers it. The snapshot's
   `next_offset` is the authority: after a restart or a rebalance the new owner loads the
   snapshot and skips re-delivered messages below it. Where the consumer is past it (a
   committed offset ahead of the snapshot read, a run fetched before a rebalance that
   never reached the core), the host moves the consumer back (`take_seeks`); only the
   records Kafka no longer holds are skipped, counted and named (`records_gone`).
3. *Deterministic re-processing.* Everything after the snapshot is replayed from Kafka into
   the restored core: the same batches in the same partition order on the same state give
   the same closed steps with the same numbers, episodes and diagnoses, so a re-processed
   step equals the stored one bit for bit.
4. *Exactly once in `steps`.* A step already stored is left out of a write with all its
   rows (`HostCore.write`); episodes and diagnoses are versioned by the job's step, so a
   replayed state replaces itself. Results on `lagscope.results` are at-least-once (key =
   job id; consumers dedup on (job, attempt, step) and (job, attempt, episode, version)).
5. *Store faults.* The sink retries a failed write with bounded exponential back-off;
   when the store still refuses, the closed steps stay pending, no snapshot is written (so
   no offset is committed past a step the store does not have), and the host takes no
   more messages until a retried write succeeds.

Windows follow event time (`LatenessClock`): while Kafka holds more of a partition, its
lateness clock is the newest record timestamp delivered (each batch arrives at its own
record's time), so a backlog of any size (or a worker held back by a store outage) closes
complete steps complete; once caught up it is wall-clock time, so a silent rank still
times out (`stream_app/lateness.py`). The clock's reading is in the snapshot: a successor
goes on from it, and the restored windows keep their ages.

Limits: snapshots hand a partition over only between workers that share one store (one
ClickHouse server). Workers with stores of their own (a chDB directory each) cannot read
each other's snapshots: a partition that moves is read again from Kafka's start.
Retained inputs are kept 30 days (table TTL).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lagscope.producers.dead_letters import DeadLetter
from lagscope.producers.metrics import SecondsHistogram
from lagscope.simulator.job_story import EpisodeState
from lagscope.simulator.prepare import PreparedTrace
from lagscope.store.checkpoints import CheckpointStore
from lagscope.store.errors import StoreError
from lagscope.store.rows import episode_version, json_text
from lagscope.store.sink import ClickHouseSink
from lagscope.store.snapshot_format import SnapshotError, decode_state, encode_state
from lagscope.stream_app.host_core import (
    HostCore,
    JobRecords,
    LatenessClock,
    Written,
    write_hosts,
)
from lagscope.stream_app.processor import (
    JobConclusion,
    StepOutput,
    StepProcessor,
    encode_step_inputs,
)
from lagscope.stream_app.worker_config import WorkerConfig

log = logging.getLogger("lagscope.worker")

#: 4: the host core's state (episodes, totals and diagnosis cadence in the processor's).
SNAPSHOT_VERSION = 4
#: Snapshots of a partition tried, newest first, when the newest does not decode.
SNAPSHOTS_TRIED = 5
#: A snapshot's new retained steps are encoded and inserted in parts of about this many
#: bytes: all at once, a 12,288-GPU job's 34-step window (~70 MB encoded) and the store's
#: copies of it made the worker's peak, 1.45 GB over 300 steps.
RETAINED_WRITE_BYTES = 16 << 20
#: Seconds a seek back may take before the host is asked for it again: the record it
#: went back for comes within a fetch (milliseconds), unless the seek failed or Kafka
#: deleted the record between the host's look at the partition's start and the fetch.
REWIND_RETRY_S = 10.0
#: Seeks back to one offset after which the records Kafka hands over still start past it:
#: that offset is not delivered at all (a transaction marker, if a transactional producer
#: such as a mirroring one wrote the topic), and the analysis goes on from the first
#: record Kafka did hand over.
REWIND_TRIES = 3


@dataclass(frozen=True)
class OpsMessage:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_s: float


@dataclass
class _Partition:
    number: int
    core: HostCore
    #: First offset the core has not consumed.
    next_offset: int = 0
    #: next_offset of the last durable snapshot.
    snapshot_offset: int = 0
    last_write: float = 0.0
    last_snapshot: float = 0.0
    #: Seconds the last snapshot took to encode and write.
    snapshot_cost_s: float = 0.0
    #: Retained steps whose inputs are in the store (written by a snapshot).
    persisted: set[tuple[str, int, int]] = field(default_factory=set)
    #: The offset the host must move the consumer back to (`take_seeks`): the partition
    #: was restored from an older snapshot than Kafka's committed offset, or the consumer
    #: handed over a record past `next_offset`.
    seek_to: int | None = None
    #: When the host took `seek_to`; None once the record at `next_offset` came.
    seeking_since: float | None = None
    #: The lowest offset held since then, and the seeks taken for `next_offset`.
    held_from: int | None = None
    seek_tries: int = 0

    @property
    def clock(self) -> LatenessClock:
        return self.core.clock


class WorkerCore:
    """Per-partition host cores, their writes and snapshots: everything but Kafka.

    Not thread-safe: the faust host calls it from one executor thread only.
    """

    def __init__(
        self,
        config: WorkerConfig,
        sink: ClickHouseSink,
        publish: Callable[[bytes, bytes], None],
        clock: Callable[[], float] = time.monotonic,
        *,
        flush_results: Callable[[], None] = lambda: None,
    ) -> None:
        self.config = config
        self.sink = sink
        self.publish = publish
        self.flush_results = flush_results
        self.clock = clock
        self.topic = config.kafka.topic_ops
        self.group = config.worker.group_id
        self.checkpoints = CheckpointStore(sink, self.group, self.topic)
        self.records = JobRecords(config.processor.max_world_size)
        self.partitions: dict[int, _Partition] = {}
        self.counters: dict[str, int] = {
            "messages": 0,
            "replayed_skipped": 0,
            "records_never_read": 0,
            "held_for_seek": 0,
            "ops": 0,
            "steps_written": 0,
            "steps_already_stored": 0,
            "steps_closed_again": 0,
            "dead_letters": 0,
            "snapshots": 0,
            "rollups": 0,
            "failed_writes": 0,
        }
        #: True from a write that failed (after its retries) until one succeeds: the host
        #: stops taking messages meanwhile (backpressure instead of buffering).
        self.store_failing = False
        #: Wall-clock time of the first message consumed and of the last steps write.
        self.first_message_at: float | None = None
        self.last_write_at: float | None = None
        #: Steps stored (written once each), by completeness.
        self.steps_stored: dict[bool, int] = {True: 0, False: 0}
        #: Analysis time per closed step: each pass's seconds over the steps it closed (a
        #: step re-closed after a crash is observed again).
        self.step_seconds = SecondsHistogram()
        #: Ops counted by the cores of partitions given away since.
        self._ops_dropped = 0

    # -- counters read by the metrics endpoint ------------------------------------------
    @property
    def dead_letters_by_kind(self) -> dict[str, int]:
        return self.records.dead_letters.by_kind

    def _count_totals(self) -> None:
        self.counters["dead_letters"] = self.records.dead_letters.total
        cores = [p.core for p in self.partitions.values()]
        self.counters["ops"] = self._ops_dropped + sum(c.counters["ops"] for c in cores)

    # -- input ------------------------------------------------------------------------
    def on_job_record(self, value: bytes | None, timestamp_s: float, where: str) -> None:
        """A record of the jobs topic (every worker reads them all)."""
        self.on_job_records([(value, timestamp_s, where)])

    def on_job_records(self, records: Sequence[tuple[bytes | None, float, str]]) -> set[bytes]:
        """Records of the jobs topic, each (value, its time in s, where it was read);
        returns the ids of the jobs they name, as a batch's header names them (a record
        set aside counts too: its job's batches must not wait for another)."""
        jobs = set()
        for value, timestamp_s, where in records:
            info = self.records.take(value or b"", where, timestamp_s)
            job_id = info.job_id.encode() if info is not None else _job_id_of(value)
            if job_id is not None:
                jobs.add(job_id)
        self._count_totals()
        return jobs

    def on_streamer_dead_letters(self, letters: list[DeadLetter]) -> bool:
        """Dead letters the streamers sent (the dead-letter topic), stored with what else
        waits; True once everything is stored (the reader then commits their offsets),
        False while the store fails (they stay pending, as every dead letter does)."""
        for letter in letters:
            # Logged by the streamer on its node.
            self.records.dead_letters.add(letter, "streamer", logged=False)
        self._count_totals()
        if not (self.records.pending or self.records.dead_letters):
            return True
        return self._store_or_keep(self.records.write, self.sink)

    def partition(self, number: int) -> _Partition:
        """The state of a partition, restored from its last snapshot on first use."""
        state = self.partitions.get(number)
        if state is None:
            state = self.partitions[number] = self._restore(number)
        return state

    def drop_partition(self, number: int) -> None:
        part = self.partitions.pop(number, None)
        if part is not None:
            self._ops_dropped += part.core.counters["ops"]
            part.core.processor.close()

    def on_messages(self, messages: list[OpsMessage]) -> None:
        """Decode, window and analyse a run of messages (steps they close, in one pass)."""
        by_partition: dict[int, list[OpsMessage]] = {}
        for message in messages:
            by_partition.setdefault(message.partition, []).append(message)
        for number, part_messages in by_partition.items():
            part = self.partition(number)
            fresh = []
            for message in part_messages:
                if message.offset < part.next_offset:
                    # Already inside the snapshot (Kafka's committed offset lagged it).
                    self.counters["replayed_skipped"] += 1
                    continue
                if message.offset > part.next_offset:
                    # The consumer is past what the analysis took (a committed offset
                    # past the snapshot, a run fetched before a rebalance and dropped
                    # with its generation, records before a seek still in the buffers):
                    # the records come again once the host moves the consumer back.
                    # Those Kafka deleted meanwhile are counted then (`records_gone`).
                    self.counters["held_for_seek"] += 1
                    if part.held_from is None or message.offset < part.held_from:
                        part.held_from = message.offset
                    if part.seek_to is None and part.seeking_since is None:
                        part.seek_to = part.next_offset
                        log.warning("partition %s[%d]: handed offset %d, the analysis is at %d: "
                                    "moving the consumer back from offset %d to %d", self.topic,
                                    number, message.offset, part.next_offset, message.offset,
                                    part.next_offset)  # fmt: skip
                    continue
                part.next_offset = message.offset + 1
                part.seeking_since, part.held_from, part.seek_tries = None, None, 0
                fresh.append(message)
            if not fresh:
                continue
            self.counters["messages"] += len(fresh)
            if self.first_message_at is None:
                self.first_message_at = time.time()
            closed_before = len(part.core.pending)
            started = time.perf_counter()
            part.core.on_batches(self._arriving(part, fresh))
            self._observe_steps(part, closed_before, time.perf_counter() - started)
        self._count_totals()
        self.write_due()

    def _arriving(
        self, part: _Partition, messages: list[OpsMessage]
    ) -> Iterable[tuple[bytes, str, float]]:
        """The records for the core, the partition's clock at each one's own time as the
        core takes it: behind its input, a batch arrives when it was produced, so a
        coordinate's silences and a step's wait read as they were, however fast the
        backlog is read."""
        for m in messages:
            part.clock.observe(m.timestamp_s)
            yield m.value or b"", f"{self.topic}[{part.number}]@{m.offset}", m.timestamp_s

    def take_seeks(self) -> dict[int, int]:
        """The offsets the host must move the consumer of these partitions back to: those
        asked for since the last call, and those asked for `REWIND_RETRY_S` ago whose
        record has not come (the seek failed, or Kafka deleted the record meanwhile)."""
        now = time.monotonic()
        seeks = {}
        for number, part in self.partitions.items():
            stalled = part.seeking_since is not None and now - part.seeking_since > REWIND_RETRY_S
            if part.seek_to is None and not stalled:
                continue
            part.seek_tries += 1
            if part.seek_tries > REWIND_TRIES and part.held_from is not None:
                self._skip(number, part.held_from, "were not delivered by Kafka")
            seeks[number] = part.next_offset
            part.seek_to, part.seeking_since, part.held_from = None, now, None
        return seeks

    def records_gone(self, number: int, first_kept: int) -> None:
        """Kafka holds the partition's records from `first_kept` on only: the offsets are
        contiguous (the streamer's producer is idempotent, not transactional), so the
        records between the analysis' next offset and `first_kept` were deleted by the
        topic's retention before this worker read them. Their steps are incomplete or
        missing: say so, once per gap, and go on from `first_kept`."""
        self._skip(number, first_kept, "were never read (deleted by the topic's retention)")

    def _skip(self, number: int, to: int, why: str) -> None:
        part = self.partitions.get(number)
        if part is None or to <= part.next_offset:
            return
        self.counters["records_never_read"] += to - part.next_offset
        log.warning("partition %s[%d]: records at offsets %d..%d %s; their steps are "
                    "incomplete or missing", self.topic, number, part.next_offset, to - 1,
                    why)  # fmt: skip
        part.next_offset = to
        part.seek_tries = 0

    def _observe_steps(self, part: _Partition, closed_before: int, seconds: float) -> None:
        closed = len(part.core.pending) - closed_before
        for _ in range(closed):
            self.step_seconds.observe(seconds / closed)

    def set_behind(self, number: int, behind: bool) -> None:
        """The host says whether the partition has records past what it delivered."""
        part = self.partitions.get(number)
        if part is not None:
            part.clock.behind = behind

    # -- periodic work ------------------------------------------------------------------
    def tick(self) -> None:
        """Close late windows; conclude idle jobs; write what is due."""
        for part in list(self.partitions.values()):
            closed_before = len(part.core.pending)
            started = time.perf_counter()
            part.core.tick()
            self._observe_steps(part, closed_before, time.perf_counter() - started)
            part.core.conclude_idle(self.config.worker.rollup_idle_s)
        self.write_due()

    def write_due(self) -> None:
        """Write the partitions whose closed steps waited long enough, or are many, or
        opened or closed an episode (`HostCore.news_due`)."""
        now = self.clock()
        settings = self.config.worker
        if self.records.pending or self.records.dead_letters:
            self._store_or_keep(self.records.write, self.sink)
        every, interval = settings.write_every_steps, settings.write_interval_s
        parts = list(self.partitions.values())
        if any(part.core.write_due(now, part.last_write, every, interval) for part in parts):
            # One write for every partition with something pending: its cost is mostly
            # per insert, whatever the number of jobs in it.
            self.write(*parts)

    def checkpoint_due(self, number: int, share: float = 1.0) -> bool:
        """Whether the partition has taken records since its last snapshot and `share` of
        the time between two of its snapshots has passed."""
        part = self.partitions.get(number)
        if part is None or part.next_offset == part.snapshot_offset:
            return False
        settings = self.config.worker
        # A large job's snapshot is large (84 MB at 100,000 GPUs, mostly its change-point
        # detectors): space them so they take at most their share of the worker's time.
        interval = max(
            settings.checkpoint_interval_s, part.snapshot_cost_s / settings.checkpoint_max_share
        )
        return self.clock() - part.last_snapshot >= share * interval

    def checkpoint_if_due(self, number: int) -> int | None:
        """`checkpoint` when due (None when not, or the partition was dropped meanwhile):
        one call, so no rebalance comes between the question and the snapshot."""
        return self.checkpoint(number) if self.checkpoint_due(number) else None

    def checkpoint_all_due(self, numbers: Iterable[int]) -> dict[int, int]:
        """Checkpoint those of `numbers` that are due, together (`checkpoints_of`), with
        those half-way to due, so that partitions assigned or woken at different times
        fall into step; returns the offset safe to commit of each. One call, as
        `checkpoint_if_due`."""
        numbers = list(numbers)
        if not any(self.checkpoint_due(n) for n in numbers):
            return {}
        return self.checkpoints_of([n for n in numbers if self.checkpoint_due(n, share=0.5)])

    def checkpoint(self, number: int) -> int:
        """Write everything closed, snapshot; returns the offset safe to commit: past the
        new snapshot only when every step it has closed is stored, else the last one's."""
        return self.checkpoints_of([number])[number]

    def checkpoints_of(self, numbers: Sequence[int]) -> dict[int, int]:
        """`checkpoint` of several partitions in one write and one snapshot insert: a
        worker following many jobs (a partition each) checkpoints them every
        `checkpoint_interval_s`, and each insert is a round trip to the store."""
        parts = [self.partitions[number] for number in numbers]
        for part in parts:
            # Steps still being analysed are closed in the snapshot: stored first, or lost.
            part.core.settle()
        if parts and self.write(*parts):
            changed = [part for part in parts if part.next_offset != part.snapshot_offset]
            if changed and self._store_or_keep(self._snapshot, changed):
                self.counters["snapshots"] += len(changed)
        now = self.clock()
        for part in parts:
            part.last_snapshot = now
        return {part.number: part.snapshot_offset for part in parts}

    def finish(self) -> dict[int, int]:
        """Conclude every job not concluded at its last step and snapshot every partition
        (idle exit)."""
        for part in self.partitions.values():
            part.core.tick()
            # Steps still with the analysis process count: a job all of whose steps were
            # there would look as if it had none, and end without its conclusion.
            part.core.settle()
            part.core.conclude_idle(0.0, ended=True)
        return self.checkpoints_of(list(self.partitions))

    def open_windows(self) -> int:
        return sum(len(p.core.processor.windows) for p in self.partitions.values())

    def busy(self) -> bool:
        """True while a partition holds something not yet durable."""
        return bool(self.records.pending or self.records.dead_letters) or any(
            p.core.has_pending
            or p.next_offset != p.snapshot_offset
            or p.seek_to is not None
            or p.seeking_since is not None
            or p.core.processor.windows
            or p.core.processor.in_flight
            for p in self.partitions.values()
        )

    def retry_writes(self) -> bool:
        """Try again to store what a failed write left pending; True once all is stored."""
        if (self.records.pending or self.records.dead_letters) and not self._store_or_keep(
            self.records.write, self.sink
        ):
            return False
        return self.write(*self.partitions.values())

    # -- writes -------------------------------------------------------------------------
    def write(self, *parts: _Partition) -> bool:
        """Durably store what the partitions' cores closed (each step exactly once, all in
        one write), then publish it. False when the store failed even after the sink's
        retries: what was not stored stays pending for the next write (nothing closed is
        dropped)."""
        now = self.clock()
        for part in parts:
            part.last_write = now
        pending = [part for part in parts if part.core.has_pending]
        if not pending:
            return True
        return self._store_or_keep(self._store, pending)

    def _store_or_keep(self, store: Callable[..., Any], *args: Any) -> bool:
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

    def _store(self, parts: list[_Partition]) -> None:
        stored_before = sum(part.core.counters["steps_already_stored"] for part in parts)
        writes = write_hosts([part.core for part in parts], self.sink)
        self.counters["steps_already_stored"] += (
            sum(part.core.counters["steps_already_stored"] for part in parts) - stored_before
        )
        for written in writes:
            self._publish(written)
        self._count_totals()

    def _publish(self, written: Written) -> None:
        """Count what a write stored and publish it on the results topic."""
        self.counters["steps_written"] += len(written.outputs)
        for out in written.outputs:
            if out.version:  # a step closed again with late batches: stored before
                self.counters["steps_closed_again"] += 1
            else:
                self.steps_stored[out.complete] += 1
        if written.outputs:
            self.last_write_at = time.time()
        for out in written.outputs:
            self.publish(out.job_id.encode(), _json(step_result(out)))
            for state in out.episodes:
                self.publish(out.job_id.encode(), _json(episode_result(out.job_id, state)))
        for conclusion in written.conclusions:
            self.counters["rollups"] += 1
            self.publish(conclusion.job_id.encode(), _json(conclusion_result(conclusion)))
            for state in conclusion.episodes:
                self.publish(
                    conclusion.job_id.encode(), _json(episode_result(conclusion.job_id, state))
                )

    # -- snapshots ----------------------------------------------------------------------
    def _snapshot(self, parts: list[_Partition]) -> None:
        """Snapshot `parts` (the retained steps they added, in parts of
        `RETAINED_WRITE_BYTES`, then one insert of their states). Each one's cost
        (`snapshot_cost_s`, which spaces a large job's snapshots) is its own encoding and
        its share of the inserts."""
        began = time.perf_counter()
        self.flush_results()
        retained = {part.number: self._new_retained(part) for part in parts}
        self._write_retained([step for steps, _ in retained.values() for step in steps])
        for part in parts:
            part.core.processor.forget_diagnosed()  # stored: a resume reads them there
        snapshots, encoding = [], []
        for part in parts:
            started = time.perf_counter()
            payload = {
                "version": SNAPSHOT_VERSION,
                "next_offset": part.next_offset,
                "core": part.core.state_dict(),
            }
            snapshots.append((part.number, part.next_offset, encode_state(payload)))
            encoding.append(time.perf_counter() - started)
        self.checkpoints.write_snapshots(snapshots)
        shared = (time.perf_counter() - began - sum(encoding)) / len(parts)
        for part, (_, _, blob), seconds in zip(parts, snapshots, encoding, strict=True):
            part.persisted = retained[part.number][1]
            part.snapshot_offset = part.next_offset
            part.snapshot_cost_s = seconds + shared
            log.info("checkpoint %s[%d] next offset %d (%d KiB)", self.topic, part.number,
                     part.next_offset, len(blob) // 1024)  # fmt: skip

    def _new_retained(
        self, part: _Partition
    ) -> tuple[list[tuple[str, int, int, PreparedTrace]], set[tuple[str, int, int]]]:
        """The retained steps of the partition no snapshot has written yet (each step is
        written once), and the keys of all it retains."""
        steps = []
        current: set[tuple[str, int, int]] = set()
        for (job_id, attempt), job in part.core.processor.jobs.items():
            # The steps of its last diagnosis too: a resumed job makes it again from them.
            for prepared in (*job.retained, *job.diagnosed_beyond_window()):
                key = (job_id, attempt, int(prepared.steps[0]))
                current.add(key)
                if key not in part.persisted:
                    steps.append((*key, prepared))
        return steps, current

    def _write_retained(self, steps: list[tuple[str, int, int, PreparedTrace]]) -> None:
        """Encode and store retained steps, an insert each `RETAINED_WRITE_BYTES` of them:
        only a part's bytes and the store's copies of them are held at once."""
        encoded: list[tuple[str, int, int, bytes]] = []
        size = 0
        for job_id, attempt, step, prepared in steps:
            inputs = encode_step_inputs(prepared)
            encoded.append((job_id, attempt, step, inputs))
            size += len(inputs)
            if size >= RETAINED_WRITE_BYTES:
                self.checkpoints.write_retained(encoded)
                encoded, size = [], 0
        self.checkpoints.write_retained(encoded)

    def _restore(self, number: int) -> _Partition:
        rows = self.checkpoints.snapshots(number, SNAPSHOTS_TRIED)
        now = self.clock()
        for index, (offset, blob) in enumerate(rows):
            where = f"worker_state: snapshot of {self.topic}[{number}] at offset {offset}"
            try:
                part = self._from_snapshot(number, blob, where)
            except SnapshotError as exc:
                log.error("%s; trying an older one", exc)
                continue
            if index:
                # Kafka's committed offset may be past this older snapshot: read from it.
                # (Not after the newest: only owners commit, never past their snapshot,
                # and a seek while the consumer's fetcher holds records of the partition
                # crashed aiokafka's fetcher, KeyError in fetched_records.)
                part.seek_to = part.next_offset
            part.last_write = part.last_snapshot = now
            log.info("partition %s[%d]: restored snapshot at offset %d", self.topic, number,
                     part.next_offset)  # fmt: skip
            return part
        part = _Partition(number, self._new_core())
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

    def _new_core(self, clock: LatenessClock | None = None,
                  processor: StepProcessor | None = None) -> HostCore:  # fmt: skip
        clock = clock or LatenessClock()
        core = HostCore(
            self.config.processor,
            self.records,
            clock=clock,
            processor=processor,
            store_raw_ops=self.config.store.raw_ops,
        )
        # Snapshots store each job's last diagnosis' steps, so a resume makes it again.
        core.processor.keep_diagnosed = True
        return core

    def _from_snapshot(self, number: int, blob: bytes, where: str) -> _Partition:
        """A partition resumed from a snapshot payload; SnapshotError when it is not one."""
        payload = decode_state(blob, where)
        version = payload.get("version") if isinstance(payload, dict) else None
        if version != SNAPSHOT_VERSION:
            raise SnapshotError(
                f"{where}: version {version!r}, this worker reads {SNAPSHOT_VERSION}"
            )
        try:
            saved = payload["core"]
            clock = LatenessClock(saved["event_time_s"], reading_s=saved.get("clock_reading_s"))
            processor = StepProcessor.from_state(
                saved["processor"],
                clock,
                retained_inputs=self.checkpoints.retained_inputs,
                host=self.config.processor,
            )
            core = self._new_core(clock, processor)
            for job_id, attempt, step in saved["concluded_step"]:
                core.job(job_id, int(attempt)).concluded_step = int(step)
            offset = int(payload["next_offset"])
            part = _Partition(number, core, offset, offset)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise SnapshotError(f"{where}: malformed snapshot ({exc!r})") from None
        now = clock()
        for key in processor.jobs:
            core.job(*key).last_input_at = now
        part.persisted = {
            (job_id, attempt, int(p.steps[0]))
            for (job_id, attempt), job in processor.jobs.items()
            for p in job.retained
        }
        return part


# -- messages of lagscope.results ---------------------------------------------------------
def _json(message: dict[str, Any]) -> bytes:
    return json_text(message).encode()


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
        "missing_reason": out.missing_reason,
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


def episode_result(job_id: str, state: EpisodeState) -> dict[str, Any]:
    """The `lagscope.results` message of an episode's state (consumers keep the highest
    `version` per (job, attempt, episode))."""
    episode = state.episode
    return {
        "kind": "episode",
        "job_id": job_id,
        "episode_id": episode.episode_id,
        "state": "open" if episode.open else "closed",
        "onset_step": episode.onset,
        "recovery_step": episode.recovery,
        "first_seen_step": episode.first_seen,
        "cause": state.diagnosis.cause,
        "optype": episode.kind,
        "dp_rank": episode.dp,
        "pp_rank": episode.stage,
        "share": state.cost.share,
        "gpu_seconds_lost": state.gpu_seconds_lost,
        "summary": state.diagnosis.summary,
        "version": episode_version(state.at_step, state.final),
    }


def conclusion_result(conclusion: JobConclusion) -> dict[str, Any]:
    """The `lagscope.results` message of a job's end: its final verdict."""
    found = conclusion.diagnosis
    message: dict[str, Any] = {
        "kind": "rollup",
        "job_id": conclusion.job_id,
        "attempt": conclusion.attempt,
        "episodes": len(conclusion.episodes),
    }
    if found is None:
        return message
    rollup = found.rollup
    message.update(
        steps=[int(rollup.steps[0]), int(rollup.steps[-1])],
        n_steps=len(rollup.steps),
        slowdown=rollup.slowdown,
        waste=rollup.waste,
        noise_floor=found.run.evidence.noise_floor,
        cause=found.verdict.cause,
        summary=found.verdict.summary,
    )
    return message


def _job_id_of(value: bytes | None) -> bytes | None:
    """The job id a record that was set aside names, if it names one."""
    try:
        job_id = json.loads(value or b"").get("job_id")
    except (ValueError, AttributeError):
        return None
    return job_id.encode() if isinstance(job_id, str) else None
