"""One host pipeline, two drivers: what `lagscope run` (logs, embedded) and `lagscope worker`
(Kafka, faust) share, so that the same input gives the same rows in every table.

`HostCore` takes job records and rank-step batches as bytes with their origin, admits
them or sets them aside as dead letters (`producers/dead_letters.py`, with the reason and
the origin), windows and analyses the steps (`StepProcessor`: what-if, change points,
episodes, the job's diagnosis every few steps), and writes every table's rows to the
store exactly once: `steps`, `attribution`, `worker_slowdown`, `changepoints`,
`episodes`, `diagnoses`, `dead_letters`, `jobs`, `rank_identity` (and `ops` where raw ops
are kept). `conclude` ends a job (its ranks said they ended, its input ended, or it
fell idle): every episode's bounds refined, the final diagnosis.

The drivers differ only in how records arrive (rank logs, Kafka partitions), how time
passes for the lateness timeout (`LatenessClock`, fed with the records' own times), and
how progress is checkpointed (the worker snapshots the core's state with the offset it
covers, `store/checkpoints.py`; the embedded host re-reads its logs).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lagscope.producers.dead_letters import DeadLetter
from lagscope.producers.events import (
    PER_RANK_FIELDS,
    JobInfo,
    RankStepBatch,
    SchemaError,
    another_rank,
    batch_id_of,
    decode_batch,
)
from lagscope.simulator.episodes import Episode
from lagscope.simulator.job_story import EpisodeState, JobDiagnosis
from lagscope.simulator.job_totals import JobTotals
from lagscope.simulator.trace import JobMeta
from lagscope.simulator.whatif import WhatIfResult
from lagscope.store.rows import (
    concat_columns,
    dead_letter_batch,
    diagnosis_rows,
    digest_of,
    episode_rows,
    episode_version,
    job_rows,
    joined_rows,
    rank_identity_batch,
    raw_op_rows,
    raw_ops_token,
    rows_from_outputs,
)
from lagscope.store.sink import ClickHouseSink, SinkBatch
from lagscope.stream_app.admission import job_conflict, job_problem
from lagscope.stream_app.analysis_process import AnalysisProcessError
from lagscope.stream_app.host_job import HostJob
from lagscope.stream_app.identity import MachineBook, name_machines
from lagscope.stream_app.processor import (
    LATE_REASON,
    DetectedChange,
    JobConclusion,
    ProcessorSettings,
    StepOutput,
    StepProcessor,
)
from lagscope.stream_app.set_aside import DeadLetters

log = logging.getLogger("lagscope.host")

#: A host writes its closed steps at least this often (s) ...
WRITE_INTERVAL_S = 0.5
#: ... or as soon as this many wait: the defaults of both hosts (`lagscope worker`'s
#: settings, `lagscope run`'s runner). 256 steps bound what waits in a backlog (one worker
#: drained the AR backlog 6-11 % faster than with 64).
WRITE_EVERY_STEPS = 256
#: ... and no more often than keeps writes to this share of the host's time: a write's
#: cost is mostly fixed per table (in chDB ~100 ms for ~100 AR steps on a shared core), so
#: a backlog drained at the interval spent a sixth of its time writing; a job followed live
#: writes a few steps in tens of ms and keeps the interval.
WRITE_MAX_SHARE = 0.1
#: A host that has read all there is writes what it closed at once, as long as writing
#: takes at most this share of its time: it has nothing else to do, and every step is
#: news to the on-call (a step's end to its rows in the store has a 1 s budget; waiting
#: for the interval took 0.25 s of it on average, up to 2 s behind a slow write).
WRITE_MAX_SHARE_CAUGHT_UP = 0.5

#: ... or as soon as the raw ops waiting (`store_raw_ops`) came in this many bytes: a
#: 12,288-GPU job's 256 steps of them held ~3 GB as rows (`lagscope run` of a backlog).
RAW_OPS_PENDING_BYTES = 16 << 20
#: Raw ops are written in parts of this many batches (~190,000 ops of a 12,288-GPU job;
#: a 100,000-GPU job's step has 12,544): the store's insert of a part holds several
#: times its rows (40 steps of that job through `lagscope run`, peak RSS: 8,192 batches
#: a part and 32 MB waiting 1.46 GB, 2,048 and 16 MB 1.13 GB, as fast).
RAW_OPS_WRITE_BATCHES = 2048

_WINDOWING_FAILED = "windowing failed"


class LatenessClock:
    """A host's lateness clock: while the host is behind its input (more of it is waiting
    to be read), the time of the newest record it delivered, so a backlog of any size is
    windowed as it was produced and a step times out only when later records show its
    missing ranks were late; once caught up, wall-clock time, so a rank that went silent
    still times out. Never goes backwards."""

    def __init__(
        self,
        newest_record_s: float | None = None,
        wall: Callable[[], float] = time.time,
        *,
        reading_s: float | None = None,
    ) -> None:
        """`reading_s`: the reading of the clock this one goes on from (a snapshot's)."""
        self._wall = wall
        self.newest_record_s = newest_record_s
        self._now = float("-inf") if reading_s is None else reading_s
        self.behind = True

    @property
    def reading_s(self) -> float | None:
        """Its last reading (None before the first): a resumed host's clock goes on from
        it, so the windows and arrivals it restores keep their ages."""
        return None if self._now == float("-inf") else self._now

    def __call__(self) -> float:
        if self.newest_record_s is None:
            now = self._wall()  # nothing delivered yet
        elif self.behind:
            now = self.newest_record_s
        else:
            now = max(self.newest_record_s, self._wall())
        self._now = max(self._now, now)
        return self._now

    def observe(self, record_time_s: float) -> None:
        if self.newest_record_s is None or record_time_s > self.newest_record_s:
            self.newest_record_s = record_time_s

    def arrival(self, batch: RankStepBatch, sent_s: float) -> tuple[float, float]:
        """When `batch`, sent at `sent_s` (its record's time), arrives here on this clock,
        and how long after it was sent: now (a driver moves the clock to each record's
        own time while behind, so a backlog's delays read as they were)."""
        now = self()
        return now, now - sent_s


@dataclass(frozen=True)
class _Standing:
    """What a job attempt's standing record gives every later record of it."""

    #: Its job fields as read (its rank's removed). Another record whose fields compare
    #: equal describes the same job: where Python's equality mixes JSON's types (true, 1
    #: and 1.0), the validation reads them as the same value too.
    job_fields: dict[str, Any]
    #: Its `jobs` row's parts: the job's layout and the record without its rank's fields.
    meta: JobMeta
    record: str

    @classmethod
    def of(cls, info: JobInfo, payload: bytes) -> _Standing:
        fields = json.loads(payload)
        for name in PER_RANK_FIELDS:
            fields.pop(name, None)
        return cls(fields, info.to_meta(), info.model_dump_json(exclude=PER_RANK_FIELDS))


class JobRecords:
    """Every job record a host has seen: the one that stands per job attempt, those
    rejected and why, and the machine of every worker. The rows they make (`jobs`,
    `rank_identity`) and their dead letters wait in `pending` until written."""

    def __init__(self, max_world_size: int) -> None:
        self.max_world_size = max_world_size
        #: (job, attempt) -> (the record that stands, its time).
        self.infos: dict[tuple[str, int], tuple[JobInfo, float]] = {}
        #: (job, attempt) -> rank -> when its monitor closed (ns), as its record said.
        self.ended: dict[tuple[str, int], dict[int, int]] = {}
        self.machines = MachineBook()
        self.pending: list[SinkBatch] = []
        #: (job, attempt) -> its pending row of ranks ended, while unwritten: a rank's end
        #: updates it rather than adding a row (100,000 ranks end a 100,000-GPU job).
        self._pending_end: dict[tuple[str, int], SinkBatch] = {}
        #: What the hosts that share these records set aside.
        self.dead_letters = DeadLetters()
        self._standing: dict[tuple[str, int], _Standing] = {}

    def take(self, payload: bytes, source: str, at_s: float) -> JobInfo | None:
        """Take a job record; None when it was set aside (a dead letter says why)."""
        same_job = self._of_a_standing_job(payload)
        try:
            info = same_job or JobInfo.model_validate_json(payload or b"")
        except ValueError as exc:
            self._dead(DeadLetter(source, f"invalid job metadata: {exc}", payload, "", at_s))
            return None
        key = (info.job_id, info.attempt)
        known = self.infos.get(key)
        if same_job is not None:
            problem = ""
        elif known is not None:
            problem = job_conflict(known[0], info)
        else:
            problem = job_problem(info, self.max_world_size)
        if known is None:
            # A job beyond the limit is remembered too: the processors reject it (and its
            # batches) before allocating anything for it.
            self.infos[key] = (info, at_s)
            self._standing[key] = _Standing.of(info, payload)
            if not problem:
                batch = SinkBatch(f"jobs/{info.job_id}/{info.attempt}")
                batch.add("jobs", self._job_row(info))
                self.pending.append(batch)
        if problem:
            self._dead(DeadLetter(source, problem, payload, info.job_id, at_s))
            return None
        if self.machines.add(info):
            self.pending.append(rank_identity_batch(info))
        self._take_end(info)
        return info

    def _of_a_standing_job(self, payload: bytes) -> JobInfo | None:
        """The record, when its job attempt's record stands and its job fields read as
        that one's did: the standing record with this rank's own fields, which are all
        that is validated (a 100,000-GPU job's ranks send 200,000 records of one job, each
        ~70 us validated in full). None for any other: it is validated in full, and its
        errors and conflicts named there."""
        try:
            fields = json.loads(payload)
            own = {name: fields.pop(name) for name in PER_RANK_FIELDS if name in fields}
            key = (fields.get("job_id"), fields.get("attempt", 0))
            standing = self._standing.get(key)
        except (ValueError, TypeError, AttributeError):  # not a record, or a key of none
            return None
        if standing is None or fields != standing.job_fields:
            return None
        try:
            return another_rank(self.infos[key][0], own)
        except ValueError:
            return None

    def _job_row(self, info: JobInfo) -> dict[str, list]:
        """The job attempt's `jobs` row as its records stand: version = its ranks ended."""
        key = (info.job_id, info.attempt)
        standing, started = self.infos[key]
        parts = self._standing[key]
        ended = self.ended.get(key, {})
        done = len(ended) >= standing.world_size
        return job_rows(info.job_id, info.attempt, parts.meta, started,
                        version=len(ended), record=parts.record, ranks_ended=len(ended),
                        ended_at=max(ended.values()) / 1e9 if done else None)  # fmt: skip

    def _take_end(self, info: JobInfo) -> None:
        """A rank's record that says it ended: the job's row again, one more rank ended (a
        record read again changes nothing)."""
        key = (info.job_id, info.attempt)
        if info.ended_ns is None or info.rank_identity is None:
            return
        if job_problem(self.infos[key][0], self.max_world_size):
            return  # a job set aside has no row
        ended = self.ended.setdefault(key, {})
        if info.rank_identity.rank in ended:
            return
        ended[info.rank_identity.rank] = info.ended_ns
        token = f"jobs/{info.job_id}/{info.attempt}/ended/{len(ended)}"
        batch = self._pending_end.get(key)
        if batch is None:
            batch = self._pending_end[key] = SinkBatch(token)
            self.pending.append(batch)
        batch.dedup_token, batch.tables = token, {"jobs": self._job_row(info)}

    def all_ended(self) -> bool:
        """Whether there are jobs and every rank of each said it ended."""
        return bool(self.infos) and all(self.has_ended(key) for key in self.infos)

    def has_ended(self, key: tuple[str, int], *, after_ns: int | None = None) -> bool:
        """Whether every rank of the job attempt said it ended (with `after_ns`: the last
        of them after it; a step that began later came from monitors opened again)."""
        known = self.infos.get(key)
        ended = self.ended.get(key, {})
        if known is None or len(ended) < known[0].world_size:
            return False
        return after_ns is None or max(ended.values()) >= after_ns

    def _dead(self, letter: DeadLetter) -> None:
        self.dead_letters.add(letter, "job_metadata")

    def write(self, sink: ClickHouseSink) -> None:
        """Store the pending rows in one write (a large job's ranks each send a record as
        they start: one write each was 100,000 inserts at 100,000 GPUs); what a failed
        write leaves stays pending."""
        if len(self.pending) > 1:
            self.pending = [SinkBatch.merged(self.pending)]
        self._pending_end.clear()  # merged or about to be written: a new end is a new row
        while self.pending:
            sink.write(self.pending[0])
            self.pending.pop(0)
        if self.dead_letters:
            waiting = self.dead_letters.waiting
            sink.write(dead_letter_batch(waiting))
            self.dead_letters.take(len(waiting))


@dataclass
class Written:
    """What one `HostCore.write` stored (the worker publishes it)."""

    outputs: list[StepOutput] = field(default_factory=list)
    conclusions: list[JobConclusion] = field(default_factory=list)


@dataclass
class JobReport:
    """What a host knows of one job attempt, for a summary or a report."""

    info: JobInfo
    totals: JobTotals
    #: The latest diagnosis (with its roll-up); None before the first one.
    latest: JobDiagnosis | None
    #: Every episode's latest state, machines named, in onset order.
    episodes: list[Episode]
    episode_states: list[EpisodeState]
    changes: list[DetectedChange]
    #: Its latest steps closed incomplete (`host_job.INCOMPLETE_KEPT`; `totals` counts
    #: them all)
    #: and the coordinates each lacked.
    incomplete_steps: list[tuple[int, tuple[tuple[int, int], ...]]]
    #: The machine of each (dp, pp) worker, where its rank's record said.
    machines: dict[tuple[int, int], str] = field(default_factory=dict)
    #: When this host closed the job's last step (epoch seconds).
    last_step_closed_at: float | None = None
    #: The first step that closed unanalysed and why (the steps table has every one).
    first_failure: tuple[int, str] | None = None
    #: Bytes each structure the job keeps between steps holds (`StepProcessor.held_bytes`).
    held_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return self.totals.steps

    @property
    def rollup(self) -> WhatIfResult | None:
        return self.latest.rollup if self.latest is not None else None

    @property
    def diagnosis(self) -> Any:
        """The run's verdict (its diagnosis and its episodes' one story)."""
        return self.latest.verdict if self.latest is not None else None

    @property
    def run_diagnosis(self) -> Any:
        return self.latest.run if self.latest is not None else None

    @property
    def gpu_seconds(self) -> float:
        return self.totals.gpu_seconds

    @property
    def gpu_seconds_wasted(self) -> float:
        """GPU-seconds above the straggler-free steps: stragglers and jitter together."""
        return self.totals.gpu_seconds_above_ideal

    @property
    def straggler_gpu_seconds(self) -> float:
        return sum(s.gpu_seconds_lost for s in self.episode_states)

    @property
    def last_step(self) -> int | None:
        return self.totals.last_step if self.totals.steps else None


class HostCore:
    """Records in, rows out: one step processor and what a host keeps around it.

    Not thread-safe: a host calls it from one thread.
    """

    def __init__(
        self,
        settings: ProcessorSettings,
        records: JobRecords,
        *,
        clock: LatenessClock | None = None,
        store_raw_ops: bool = False,
        processor: StepProcessor | None = None,
    ) -> None:
        self.settings = settings
        self.records = records
        self.clock = clock or LatenessClock()
        self.processor = processor or StepProcessor(settings, self.clock)
        self.store_raw_ops = store_raw_ops
        self.pending: list[StepOutput] = []
        self.conclusions: list[JobConclusion] = []
        #: What this host set aside of its input, stored with its steps (a worker commits
        #: its partition's offsets after them); counted with its records' letters.
        self.dead_letters = DeadLetters(counted_with=records.dead_letters)
        #: Raw ops waiting for the next write: their batches (with their ids), and the
        #: bytes they came in (`RAW_OPS_PENDING_BYTES` makes a write due).
        self._raw_ops: list[tuple[RankStepBatch, str]] = []
        self._raw_ops_bytes = 0
        #: Job attempts whose raw ops are not stored (too large for its host to write).
        self.raw_ops_left_out: set[tuple[str, int]] = set()
        #: Seconds the last write that stored steps took (`write_due` spaces writes by it).
        self.write_seconds = 0.0
        #: Whether the store may hold rows of steps whose write was cut short: at the start
        #: (by an earlier run of this host, or a crashed owner of its partition) and after
        #: a failed write, until a write stores steps no earlier one touched.
        self.cut_short_possible = True
        #: Per job attempt, what the host keeps beside its processor's state.
        self.jobs: dict[tuple[str, int], HostJob] = {}
        self.has_news = False
        self.counters: dict[str, int] = {"ops": 0, "steps_written": 0, "steps_already_stored": 0}

    def job(self, job_id: str, attempt: int) -> HostJob:
        """What the host keeps of a job attempt (made at its first mention)."""
        found = self.jobs.get((job_id, attempt))
        if found is None:
            found = self.jobs[job_id, attempt] = HostJob()
        return found

    # -- input ------------------------------------------------------------------------
    def on_job_record(self, payload: bytes, source: str, at_s: float) -> JobInfo | None:
        """A job record (from a rank's log, or the jobs topic)."""
        info = self.records.take(payload, source, at_s)
        if info is not None and info.key not in self.processor.jobs:
            self._take_job(info)
        return info

    def _take_job(self, info: JobInfo) -> None:
        problem = self.processor.on_job(info)
        if problem:
            log.warning("job %s: %s", info.key, problem)
        self._take_rejected()

    def on_batches(self, records: Iterable[tuple[bytes, str, float]]) -> list[RankStepBatch | None]:
        """Decode, admit and window rank-step batches (payload, origin, time of each);
        analyse the steps they close. Returns each record's windowed batch (None: set
        aside, or of a TP/CP rank other than 0). Each batch arrives when the lateness
        clock says (`LatenessClock.arrival`, as it is read from `records`: a driver may
        move the clock to each record's own time as it hands it over), `time of each`
        after it was sent."""
        kept: list[RankStepBatch | None] = []
        windowed: list[RankStepBatch] = []
        arrivals: list[tuple[float, float]] = []
        for payload, source, at_s in records:
            batch = self._admit(payload, source, at_s)
            kept.append(batch)
            if batch is not None:
                windowed.append(batch)
                arrivals.append(self.clock.arrival(batch, at_s))
                if (
                    self.store_raw_ops
                    and batch.tp_rank == 0
                    and batch.cp_rank == 0
                    and (batch.job_id, batch.attempt) not in self.raw_ops_left_out
                ):
                    self._raw_ops.append((batch, batch_id_of(payload)))
                    self._raw_ops_bytes += len(payload)
        if windowed:
            try:
                outputs = self.processor.on_batches(windowed, admitted=True, arrivals=arrivals)
            except AnalysisProcessError:
                raise  # not the batches' fault: the host stops and resumes from a snapshot
            except Exception as exc:
                # The processor stores analysis failures as unanalysed steps; this is a
                # windowing bug. Keep the host going, and the batches as dead letters.
                log.exception("windowing %d batch(es) failed", len(windowed))
                for batch in windowed:
                    self.processor.rejected.append((batch, f"{_WINDOWING_FAILED}: {exc!r}"))
                outputs = []
            self._closed(outputs)
            # A job whose batches still arrive is not idle, however long its steps take
            # to close (a step of 15 s), or to analyse (a large job's step can take this
            # host longer than the idle time): its clock starts once they are handled.
            now = self.clock()
            for batch in windowed:
                self.job(batch.job_id, batch.attempt).last_input_at = now
        return kept

    def _admit(self, payload: bytes, source: str, at_s: float) -> RankStepBatch | None:
        try:
            batch = decode_batch(payload or b"", where=source)
        except SchemaError as exc:
            self.dead_letter(DeadLetter(source, str(exc), payload, "", at_s), "undecodable")
            return None
        except Exception as exc:  # a decoder bug must not stop the host either
            reason = f"undecodable: {exc!r}"
            self.dead_letter(DeadLetter(source, reason, payload, "", at_s), "undecodable")
            return None
        key = (batch.job_id, batch.attempt)
        if key not in self.processor.jobs and key in self.records.infos:
            self._take_job(self.records.infos[key][0])
        self.counters["ops"] += batch.n_ops
        kept, problem = self.processor.admit(batch)
        if problem:
            self.dead_letter(DeadLetter(source, problem, payload, batch.job_id, at_s), "rejected")
        return kept

    def dead_letter(self, letter: DeadLetter, kind: str) -> None:
        """Set input aside (logged, counted by kind, stored with the next write)."""
        self.dead_letters.add(letter, kind)

    def _take_rejected(self) -> None:
        for batch, reason in self.processor.take_rejected():
            where = f"{batch.job_id}/{batch.attempt} step {batch.step} rank {batch.rank}"
            kind = "windowing" if reason.startswith(_WINDOWING_FAILED) else "rejected"
            if reason.startswith(LATE_REASON):
                kind = "late"
            # The batch's own time, so a replay writes the same row.
            at = float(batch.start_ns.min()) / 1e9 if batch.n_ops else 0.0
            self.dead_letter(DeadLetter(where, reason, batch.encode(), batch.job_id, at), kind)

    # -- time ---------------------------------------------------------------------------
    def tick(self) -> None:
        """Close the windows whose lateness timeout passed; conclude the jobs that ended."""
        self._closed(self.processor.tick())
        self.conclude_ended()

    def close_through(self, job_id: str, attempt: int, step: int) -> None:
        """Close the job's windows up to `step` (its input moved past them)."""
        self._closed(self.processor.close_through(job_id, attempt, step))

    def flush(self) -> None:
        """Close every open window (the end of the input)."""
        self._closed(self.processor.flush())

    def settle(self) -> None:
        """Wait for the analysis of every closed step; its outputs become pending."""
        self._closed(self.processor.drain())

    def _closed(self, outputs: list[StepOutput]) -> None:
        self._take_rejected()
        now = self.clock()
        wall = time.time()
        for out in outputs:
            self.has_news |= self.job(out.job_id, out.attempt).took(out, now, wall)
            self.pending.append(out)

    # -- the end of a job -------------------------------------------------------------
    def conclude(
        self, job_id: str, attempt: int = 0, *, ended: bool = True
    ) -> JobConclusion | None:
        """End a job now (its input `ended`, or it fell idle): final diagnosis, episodes
        refined (at an idle, the closed ones)."""
        self.settle()
        conclusion = self.processor.conclude(job_id, attempt, ended=ended)
        if conclusion is not None:
            live = self.processor.live_job(job_id, attempt)
            self.job(job_id, attempt).concluded_step = live.totals.last_step if live else -1
            self.conclusions.append(conclusion)
        return conclusion

    def conclude_all(self) -> None:
        """Conclude every job not concluded at its last step (the end of the input)."""
        for key in list(self.processor.jobs):
            if not self._concluded_at_last_step(key):
                self.conclude(*key)

    def conclude_ended(self) -> list[tuple[str, int]]:
        """Conclude every job each rank of which said it ended, once the host read all
        there is, no step of it is open and its last steps were handed to the store: its
        final answer is in the store when the job ends, not when its host falls idle
        (`conclude_idle`) or its input ends. Returns them."""
        if self.clock.behind:
            return []  # its last steps may still be on the way
        # Its last steps are stored first: a conclusion (a roll-up, the refit, the final
        # diagnosis) takes a while, and they are what the store is waiting for.
        waiting = {key[:2] for key in self.processor.windows}
        waiting |= {(out.job_id, out.attempt) for out in self.pending}
        done = []
        for key, job in list(self.processor.jobs.items()):
            if key in waiting or self.processor.analysing(*key):
                continue
            if self._concluded_at_last_step(key):
                continue
            # Steps that began after every rank said it ended (a job that opened its
            # monitors again) are no end: it is concluded when it falls idle, not at
            # each of them.
            if self.records.has_ended(key, after_ns=job.live.totals.last_step_start_ns):
                self.conclude(*key)
                done.append(key)
        return done

    def _concluded_at_last_step(self, key: tuple[str, int]) -> bool:
        job = self.processor.jobs.get(key)
        last = job.live.totals.last_step if job is not None else -1
        return self.job(*key).concluded_by(last)

    def conclude_idle(self, idle_s: float, *, ended: bool = False) -> list[tuple[str, int]]:
        """Conclude every job that received no batch and closed no step for `idle_s` since
        its last conclusion (a job that stopped, or paused: a later step resumes it;
        `ended`: the host's input ended); returns them."""
        now = self.clock()
        done = []
        for key, job in list(self.processor.jobs.items()):
            last = job.live.totals.last_step
            host_job = self.job(*key)
            if last < 0 or host_job.concluded_by(last):
                continue
            if host_job.idle_for(now) >= idle_s:
                self.conclude(*key, ended=ended)
                done.append(key)
        return done

    # -- output -------------------------------------------------------------------------
    @property
    def has_pending(self) -> bool:
        return bool(self.pending or self.conclusions or self.dead_letters
                    or self.records.pending or self.records.dead_letters
                    or self._raw_ops)  # fmt: skip

    def write_due(self, now: float, last_write: float, every_steps: int, interval_s: float) -> bool:
        """Whether what is pending is to be written now: at once when a step opened or
        closed an episode (`news_due`) or a job was concluded; when `every_steps` steps wait
        (a backlog is written in batches); once the host has read all there is, at once
        unless writes would take more than `WRITE_MAX_SHARE_CAUGHT_UP` of its time; else
        `interval_s` after the last write, or later when writes are slow, so they take at
        most `WRITE_MAX_SHARE` of the host's time. `now` and `last_write` on one clock."""
        if not self.has_pending:
            return False
        since = now - last_write
        return (
            self.news_due
            or len(self.pending) >= every_steps
            or self._raw_ops_bytes >= RAW_OPS_PENDING_BYTES
            or bool(self.conclusions)
            or (not self.clock.behind and since >= self.write_seconds / WRITE_MAX_SHARE_CAUGHT_UP)
            or since >= max(interval_s, self.write_seconds / WRITE_MAX_SHARE)
        )

    @property
    def news_due(self) -> bool:
        """Whether a pending step opened or closed an episode and the host has read all
        there is: then it is written at once. In a backlog it is nobody's news yet (and a
        flapping worker would make a write of every few steps)."""
        return self.has_news and not self.clock.behind

    def write(self, sink: ClickHouseSink) -> Written:
        """Store every pending row exactly once (`write_hosts` of this host alone)."""
        return write_hosts([self], sink)[0]

    @property
    def raw_ops_waiting(self) -> list[tuple[RankStepBatch, str]]:
        """The raw ops waiting for a write (each batch with its id), oldest first."""
        return self._raw_ops

    def take_raw_ops(self) -> list[tuple[RankStepBatch, str]]:
        """The raw ops waiting for a write (each batch with its id), no longer held here:
        the writer stores them, or the host has lost them with its process."""
        taken, self._raw_ops, self._raw_ops_bytes = self._raw_ops, [], 0
        return taken

    def live_rows(self, outputs: list[StepOutput]) -> tuple[list[dict], list[dict]]:
        """The `episodes` and `diagnoses` rows the steps of `outputs` (of any of this
        host's jobs) made, a column set per job."""
        episodes: list[dict[str, list]] = []
        diagnoses: list[dict[str, list]] = []
        by_job: dict[tuple[str, int], list[StepOutput]] = {}
        for out in outputs:
            by_job.setdefault((out.job_id, out.attempt), []).append(out)
        for (job_id, attempt), job_outputs in by_job.items():
            states = [state for out in job_outputs for state in out.episodes]
            if states:
                episodes.append(episode_rows(job_id, attempt, states, self.records.machines))
            found = [out.diagnosis for out in job_outputs if out.diagnosis is not None]
            if found:
                diagnoses.append(self._diagnosis_rows(job_id, attempt, found))
        return episodes, diagnoses

    def _diagnosis_rows(
        self, job_id: str, attempt: int, diagnoses: Sequence[JobDiagnosis]
    ) -> dict[str, list]:
        machines = self.records.machines.machines(job_id, attempt)
        live = self.processor.live_job(job_id, attempt)
        starts = live.step_start_ns if live is not None else {}
        rows: dict[str, list] = {}
        for found in diagnoses:
            part = diagnosis_rows(
                job_id,
                attempt,
                found.step,
                starts.get(found.step, 0),
                name_machines(found.verdict, machines),
                version=episode_version(found.step, found.final),
            )
            for name, values in part.items():
                rows.setdefault(name, []).extend(values)
        return rows

    def conclusion_rows(self, conclusion: JobConclusion) -> tuple[str, list, list]:
        """A conclusion's dedup token, episodes rows and diagnoses rows (each a list of
        column sets, empty when it has none)."""
        job_id, attempt = conclusion.job_id, conclusion.attempt
        last = conclusion.diagnosis.step if conclusion.diagnosis is not None else -1
        token = f"conclusion/{job_id}/{attempt}/{last}/{len(conclusion.episodes)}"
        episodes = diagnoses = []
        if conclusion.episodes:
            episodes = [episode_rows(job_id, attempt, conclusion.episodes, self.records.machines)]
        if conclusion.diagnosis is not None:
            diagnoses = [self._diagnosis_rows(job_id, attempt, [conclusion.diagnosis])]
        return token, episodes, diagnoses

    # -- views --------------------------------------------------------------------------
    def job_keys(self) -> list[tuple[str, int]]:
        return list(self.processor.jobs)

    def job_report(
        self, job_id: str, attempt: int = 0, *, provisional: JobDiagnosis | None = None
    ) -> JobReport | None:
        """What a summary or a report shows of a job, its machines named; `provisional`
        stands in for its diagnosis before the first one is due."""
        live = self.processor.live_job(job_id, attempt)
        if live is None:
            return None
        host_job = self.jobs.get((job_id, attempt), HostJob())
        machines = self.records.machines.machines(job_id, attempt)
        latest = live.last_diagnosis or provisional
        if latest is not None and machines:
            latest = JobDiagnosis(
                latest.step,
                latest.rollup,
                name_machines(latest.run, machines),
                name_machines(latest.verdict, machines),
                latest.final,
            )
        states = live.episodes()
        episodes = [
            Episode(
                s.episode.onset,
                s.episode.recovery,
                name_machines(s.diagnosis, machines),
                (f"worker/{s.episode.dp}.{s.episode.stage}",),
            )
            for s in states
        ]
        return JobReport(
            live.info,
            live.totals,
            latest,
            episodes,
            states,
            list(host_job.changes),
            list(host_job.incomplete),
            dict(machines),
            host_job.last_closed_wall,
            host_job.first_failure,
            self.processor.held_bytes(job_id, attempt),
        )

    # -- state --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (nothing pending: write first)."""
        return {
            "processor": self.processor.state_dict(with_retained_inputs=False),
            "concluded_step": [
                [*key, job.concluded_step]
                for key, job in self.jobs.items()
                if job.concluded_step is not None
            ],
            "event_time_s": self.clock.newest_record_s,
            "clock_reading_s": self.clock.reading_s,
        }


def write_hosts(hosts: Sequence[HostCore], sink: ClickHouseSink) -> list[Written]:
    """Store every pending row of `hosts` (a worker's partitions; the embedded host alone)
    exactly once, and return what each stored.

    Every job's closed steps go in one batch: a write costs mostly per insert, so a host
    following many jobs live writes them all with one lookup and one insert a table. A
    step already stored (re-processed after a crash or a rebalance) is left out with all
    its rows, even without FINAL; the sink's version check, on the same lookup, is the
    second line. What a failed write (a StoreError after the sink's retries) did not
    store stays pending on its host."""
    for host in hosts:
        host.records.write(sink)  # a worker's hosts share theirs: written once
    waiting = [host.dead_letters.waiting for host in hosts]
    if any(waiting):
        sink.write(dead_letter_batch([letter for letters in waiting for letter in letters]))
        for host, letters in zip(hosts, waiting, strict=True):
            host.dead_letters.take(len(letters))
    written = [Written() for _ in hosts]
    if any(host.pending for host in hosts):
        _write_steps(hosts, sink, written)
    _write_raw_ops(hosts, sink)
    if any(host.conclusions for host in hosts):
        # One batch for every job concluded (a worker's idle exit concludes all it follows).
        sink.write(_conclusions_batch(hosts))
        for host, done in zip(hosts, written, strict=True):
            done.conclusions, host.conclusions = host.conclusions, []
    return written


def _write_steps(hosts: Sequence[HostCore], sink: ClickHouseSink, written: list[Written]) -> None:
    """The closed steps pending on `hosts`, with the episodes and diagnoses they made, in
    one batch; the steps the store already has (at their version) left out."""
    started = time.perf_counter()
    keys = sorted({(o.job_id, o.attempt, o.step) for h in hosts for o in h.pending})
    stored = sink.retry.call(sink.stored_versions, keys, what="steps lookup")
    # A step closed again (late batches came) is a newer version of a stored one.
    fresh = [
        [o for o in host.pending if stored.get((o.job_id, o.attempt, o.step), -1) < o.version]
        for host in hosts
    ]
    checked = [host.cut_short_possible for host in hosts]
    for host in hosts:
        host.cut_short_possible = True  # until the write below says otherwise
    replaced = 0
    if any(fresh):
        batch = rows_from_outputs([out for outputs in fresh for out in outputs])
        live = [host.live_rows(outputs) for host, outputs in zip(hosts, fresh, strict=True)]
        for table, index in (("episodes", 0), ("diagnoses", 1)):
            parts = [part for rows in live for part in rows[index]]
            if parts:
                batch.add(table, concat_columns(parts))
        report = sink.write(batch, replace_cut_short=any(checked), stored_versions=stored)
        replaced = report.steps_replaced
    seconds = time.perf_counter() - started
    for host, outputs, was_checked, done in zip(hosts, fresh, checked, written, strict=True):
        pending = len(host.pending)
        if len(outputs) < pending:
            log.info("stored %d step(s); %d re-processed step(s) were already stored",
                     len(outputs), pending - len(outputs))  # fmt: skip
        host.counters["steps_already_stored"] += pending - len(outputs)
        host.counters["steps_written"] += len(outputs)
        host.pending = []  # only now: a failure above kept them for the next write
        host.has_news = False
        host.write_seconds = seconds
        done.outputs = outputs
        # Re-processed steps (stored ones among them) may still be followed by those of
        # the write that was cut short.
        host.cut_short_possible = was_checked and (replaced > 0 or len(outputs) < pending)


def _write_raw_ops(hosts: Sequence[HostCore], sink: ClickHouseSink) -> None:
    """The raw ops waiting on `hosts`, after their steps, `RAW_OPS_WRITE_BATCHES` batches
    an insert. Each insert is named by its content: a write that failed after storing
    them, retried, stores them once. Their rows are made here, a part at a time (a row of
    raw ops takes ~4x its bytes on the wire). A failed insert leaves them with the host."""
    raw_ops = [part for host in hosts for part in host.raw_ops_waiting]
    for first in range(0, len(raw_ops), RAW_OPS_WRITE_BATCHES):
        rows = [raw_op_rows(batch, batch_id) for batch, batch_id in
                raw_ops[first : first + RAW_OPS_WRITE_BATCHES]]  # fmt: skip
        batch = SinkBatch(raw_ops_token(rows))
        batch.add("ops", joined_rows(rows))
        sink.write(batch)
    if raw_ops:
        for host in hosts:
            host.take_raw_ops()


def _conclusions_batch(hosts: Sequence[HostCore]) -> SinkBatch:
    """The rows of every conclusion pending on `hosts`; its dedup token names the one
    conclusion, or digests the names of several."""
    tokens, tables = [], {"episodes": [], "diagnoses": []}
    for host in hosts:
        for conclusion in host.conclusions:
            token, episodes, diagnoses = host.conclusion_rows(conclusion)
            tokens.append(token)
            tables["episodes"] += episodes
            tables["diagnoses"] += diagnoses
    if len(tokens) == 1:
        batch = SinkBatch(tokens[0])
    else:
        batch = SinkBatch(f"conclusions/{len(tokens)}/{digest_of(sorted(tokens))}")
    for table, parts in tables.items():
        if parts:
            batch.add(table, concat_columns(parts))
    return batch
