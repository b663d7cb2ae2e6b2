"""Trace replay: turn a recorded reference trace into what live ranks would have produced.

A reference trace (producers.reference_format) holds start/duration in float32 seconds
relative to each step's origin. Replay lays the steps back to back on the wall clock from
a start time (now, unless given): step k's origin is the start plus the spans of the steps
before it, and op times become `origin + round(start_ts * 1e9)` ns. pp_rank is the trace's
stage, tp_rank and cp_rank are 0 (the trace holds one TP/CP rank per (dp, stage)).

Output is per-rank local logs (then `lagscope stream` ships them, exactly the production
path) or batches produced straight to Kafka. Pace: `speed=1` replays in real time (a step's
batches are written when the step would have ended), `speed=N` N times faster, `speed=0`
as fast as possible. `repeat=N` replays the trace N times with shifted step numbers (load
tests).

A replay that runs to its end ends the job as a finished job's ranks do: every rank of its
world (the trace's and the TP/CP ranks it does not hold) writes its record once more,
`ended_ns` when the last replayed op ended, so the store reads the job ended, not
silent. Its records name no machine (a trace records none); an interrupted replay ends
nothing, as a killed rank does not.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from lagscope.producers.config import LagscopeConfig
from lagscope.producers.events import (
    BATCH_VERSION,
    JobInfo,
    RankIdentity,
    RankStepBatch,
    SchemaError,
    batch_id_of,
    peek_header,
)
from lagscope.producers.kafka_login import UNREACHABLE_ERRORS, kafka_client, quiet_client_log
from lagscope.producers.log import (
    KIND_BATCH,
    KIND_JOB,
    LogWriter,
    RankLogReader,
    Record,
    list_rank_dirs,
)
from lagscope.producers.redact import redact_url
from lagscope.producers.reference_format import TraceParts
from lagscope.simulator.trace import JobMeta, Trace

log = logging.getLogger("lagscope.replay")
_client_log = quiet_client_log("lagscope.replay.librdkafka")


class UndeliveredError(RuntimeError):
    """Kafka did not confirm every message of a replay (the message says how many)."""


class LogDirInUse(ValueError):
    """The log directory already holds the logs of the job attempt a replay would write:
    a second replay would record each of its steps twice, which no step survives."""


@dataclass
class ReplayStats:
    batches: int = 0
    ops: int = 0
    steps: int = 0
    seconds: float = 0.0


def default_job_id(meta: JobMeta) -> str:
    return f"{meta.trial_name}-{meta.run_id}"


def step_spans_ns(trace: Trace) -> tuple[list[int], list[int]]:
    """The trace's steps, ascending, and how long each lasts: its ops' latest end (op
    times are seconds from their step's origin), rounded to ns."""
    order = np.argsort(trace.step, kind="stable")
    steps, firsts = np.unique(trace.step[order], return_index=True)
    if steps.size == 0:
        return [], []
    end = trace.start_ts.astype(np.float64) + trace.duration.astype(np.float64)
    latest = np.maximum.reduceat(end[order], firsts)
    return steps.tolist(), [round(float(seconds) * 1e9) for seconds in latest]


def back_to_back_ns(spans_ns: Sequence[int], start_wall_ns: int) -> list[int]:
    """Steps of these spans laid back to back on the wall clock from `start_wall_ns`:
    where each begins (the start plus the spans before it), then where the last ends."""
    return list(itertools.accumulate(spans_ns, initial=start_wall_ns))


def step_origins_ns(trace: Trace, start_wall_ns: int) -> dict[int, int]:
    """Each step's origin on the wall clock (ns), the trace's steps laid back to back from
    `start_wall_ns`, as a replay lays them."""
    steps, spans = step_spans_ns(trace)
    return dict(zip(steps, back_to_back_ns(spans, start_wall_ns)[:-1], strict=True))


def iter_step_batches(
    trace: Trace | TraceParts,
    meta: JobMeta,
    *,
    job_id: str,
    attempt: int = 0,
    start_wall_ns: int,
    repeat: int = 1,
) -> Iterator[tuple[int, int, list[RankStepBatch]]]:
    """Yield (step end offset ns from start, step, batches of all ranks) in step order.
    `trace` may come in parts (`reference_format.TraceParts`): whole steps, in order,
    read again for each repeat."""
    parts = [trace] if isinstance(trace, Trace) else trace
    step_stride = _last_step(trace) + 1
    origin_ns = start_wall_ns
    for cycle in range(repeat):
        for part in parts:
            steps, spans = step_spans_ns(part)
            rank = np.where(
                part.rank >= 0, part.rank, part.stage.astype(np.int64) * meta.dp_size + part.dp_rank
            )
            order = np.lexsort((part.start_ts, rank, part.step))
            cuts = np.append(np.searchsorted(part.step[order], steps), order.size)
            for i, step in enumerate(steps):
                rows = order[cuts[i] : cuts[i + 1]]
                replayed_step = step + cycle * step_stride
                batches = _rank_batches(
                    part, rank, rows, job_id=job_id, attempt=attempt, step=replayed_step,
                    origin_ns=origin_ns,
                )  # fmt: skip
                origin_ns += spans[i]
                yield origin_ns - start_wall_ns, replayed_step, batches


def _last_step(trace: Trace | TraceParts) -> int:
    """The trace's highest step (-1 without one); a trace in parts says it."""
    if isinstance(trace, TraceParts):
        return trace.max_step
    return int(trace.step.max()) if trace.step.size else -1


def _distinct_steps(trace: Trace | TraceParts) -> int:
    return trace.steps if isinstance(trace, TraceParts) else int(np.unique(trace.step).size)


def _rank_batches(
    trace: Trace,
    rank: np.ndarray,
    rows: np.ndarray,
    *,
    job_id: str,
    attempt: int,
    step: int,
    origin_ns: int,
) -> list[RankStepBatch]:
    """One step's batches, one per rank: `rows` of the trace, in (rank, start) order, with
    op times from the step's wall-clock origin."""
    batches = []
    for part in np.split(rows, np.flatnonzero(np.diff(rank[rows])) + 1):
        first = part[0]
        batches.append(
            RankStepBatch.build(
                job_id=job_id,
                attempt=attempt,
                rank=int(rank[first]),
                dp_rank=int(trace.dp_rank[first]),
                pp_rank=int(trace.stage[first]),
                tp_rank=0,
                cp_rank=0,
                step=step,
                optype=trace.optype[part],
                optype_names=trace.optype_names,
                microbatch=trace.mb_id[part],
                chunk=trace.mc[part],
                seq=trace.seq_id[part],
                start_ns=origin_ns
                + np.round(trace.start_ts[part].astype(np.float64) * 1e9).astype(np.int64),
                duration_ns=np.round(trace.duration[part].astype(np.float64) * 1e9).astype(
                    np.int64
                ),
            )
        )
    return batches


class ProgressSink(Protocol):
    """Where replay reports progress (`lagscope.cli.progress.Progress` fits)."""

    def update(self, done: int, *, total: int | None = None, note: str = "") -> None: ...


def replay(
    trace: Trace | TraceParts,
    meta: JobMeta,
    *,
    log_dir: str | Path | None = None,
    kafka: LagscopeConfig | None = None,
    job_id: str | None = None,
    attempt: int = 0,
    speed: float = 0.0,
    repeat: int = 1,
    start_wall_ns: int | None = None,
    progress: ProgressSink | None = None,
    max_file_bytes: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> ReplayStats:
    """Replay `trace` into per-rank logs under `log_dir`, or straight to Kafka; a trace
    in parts (`reference_format.TraceParts`) is held a part at a time."""
    if (log_dir is None) == (kafka is None):
        raise ValueError("replay needs exactly one destination: log_dir or kafka")
    if speed < 0:
        raise ValueError(f"speed must be >= 0 (0 = as fast as possible), got {speed}")
    job_id = job_id or default_job_id(meta)
    info = JobInfo.from_meta(meta, job_id=job_id, attempt=attempt)
    stats = ReplayStats()
    begin_wall = time.time_ns() if start_wall_ns is None else start_wall_ns
    begin = time.monotonic()
    destination: _LogDestination | _KafkaDestination
    if log_dir is not None:
        destination = _LogDestination(log_dir, info, max_file_bytes)
    else:
        assert kafka is not None
        destination = _KafkaDestination(kafka, info)
    total_steps = _distinct_steps(trace) * repeat
    begin_progress = time.monotonic()

    def report_progress() -> None:
        if progress is not None:
            rate = stats.ops / max(time.monotonic() - begin_progress, 1e-9)
            progress.update(
                stats.steps, total=total_steps, note=f"{stats.ops:,} ops, {rate:,.0f} ops/s"
            )

    last_batches: list[RankStepBatch] = []
    try:
        for end_offset_ns, _step, batches in iter_step_batches(
            trace, meta, job_id=job_id, attempt=attempt, start_wall_ns=begin_wall, repeat=repeat
        ):
            if speed > 0:
                _wait_until(begin + end_offset_ns / 1e9 / speed, sleep)
            for batch in batches:
                destination.send(batch, batch.encode())
                stats.batches += 1
                stats.ops += batch.n_ops
            stats.steps += 1
            last_batches = batches
            report_progress()
        if last_batches:
            # The monitors close once the last op has ended (the step's span is rounded
            # from the trace's seconds: it may end a nanosecond before that op).
            ended_ns = max(int((b.start_ns + b.duration_ns).max()) for b in last_batches)
            destination.end(ended_records(info, ended_ns))
    finally:
        destination.close()
    stats.seconds = time.monotonic() - begin
    report_progress()
    return stats


def ended_records(info: JobInfo, ended_ns: int) -> list[JobInfo]:
    """The records every rank of `info`'s world writes when its monitor closes at
    `ended_ns`: the job's record, the rank and `ended_ns` set (no machine: a recorded trace
    names none).

    >>> from lagscope.simulator.trace import JobMeta
    >>> meta = JobMeta(trial_name="t", dp_size=2, pp_size=1, tp_size=2, world_size=4)
    >>> ended = ended_records(JobInfo.from_meta(meta, job_id="t-0"), 10**18)
    >>> [(r.record_key, r.ended_ns) for r in ended][-1]
    ('t-0/0/3', 1000000000000000000)
    """
    return [
        info.model_copy(update={"rank_identity": RankIdentity(rank=rank), "ended_ns": ended_ns})
        for rank in range(info.world_size)
    ]


def _wait_until(due: float, sleep: Callable[[float], None]) -> None:
    """Sleep until `due` (monotonic seconds): a step's batches exist once the step has
    ended (that is when a live rank's timer seals them)."""
    delay = due - time.monotonic()
    if delay > 0:
        sleep(delay)


class _LogDestination:
    """Per-rank local logs, as the ranks' timers write them; the job record goes into the
    first log written.

    One process writes every rank's log, on its own thread: a thread per log stalled a
    12,544-rank replay at ~1.5 logs a second once thousands were alive. Each batch is
    written as it comes (a step's batches exist once the step ended, as a live rank's
    timer seals them), and at most `MAX_OPEN_FILES` logs hold an open file: the least
    recently written lets go of its own, and appends to it again on its next batch.
    """

    #: Logs holding an open file at once.
    MAX_OPEN_FILES = 256

    def __init__(self, log_dir: str | Path, info: JobInfo, max_file_bytes: int | None) -> None:
        holder = _holder_of(Path(log_dir), info)
        if holder is not None:
            raise LogDirInUse(
                f"{log_dir}: {holder.name} already holds job {info.job_id} attempt "
                f"{info.attempt}; a second replay would record each of its steps twice: "
                f"replay into an empty directory, or as another attempt (--attempt "
                f"{info.attempt + 1})"
            )
        self.log_dir = log_dir
        self.info = info
        self.options = {} if max_file_bytes is None else {"max_file_bytes": max_file_bytes}
        self.writers: dict[int, LogWriter] = {}
        #: Ranks whose writer holds an open file, least recently written first.
        self._open: OrderedDict[int, None] = OrderedDict()
        self.sent = 0

    def send(self, batch: RankStepBatch, payload: bytes) -> None:
        writer = self._writer(batch.rank)
        if not self.sent:
            writer.append(KIND_JOB, self.info.model_dump_json().encode())
        writer.append(KIND_BATCH, payload)
        self._write(batch.rank, writer)
        self.sent += 1

    def _writer(self, rank: int) -> LogWriter:
        writer = self.writers.get(rank)
        if writer is None:
            writer = self.writers[rank] = LogWriter(
                self.log_dir, rank, background=False, **self.options
            )
        return writer

    def _write(self, rank: int, writer: LogWriter) -> None:
        """Write what `rank`'s writer holds, and keep the open files within the bound."""
        writer.flush()
        self._open[rank] = None
        self._open.move_to_end(rank)
        while len(self._open) > self.MAX_OPEN_FILES:
            oldest, _ = self._open.popitem(last=False)
            self.writers[oldest].release()

    def end(self, records: list[JobInfo]) -> None:
        """Each rank's record of its end after its last batch, in its own log; those of the
        ranks the trace does not hold, in the log that holds the job's record."""
        if not self.writers:
            return  # nothing replayed: no job to end
        first_rank = next(iter(self.writers))
        written = set()
        for record in records:
            assert record.rank_identity is not None
            rank = record.rank_identity.rank
            rank = rank if rank in self.writers else first_rank
            self.writers[rank].append(KIND_JOB, record.model_dump_json().encode())
            written.add(rank)
        for rank in sorted(written):
            self._write(rank, self.writers[rank])

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()


def _holder_of(log_dir: Path, info: JobInfo) -> Path | None:
    """The first rank log under `log_dir` that begins with a record of `info`'s job
    attempt: its job record (a timer writes it first, a replay into its first log) or a
    batch of it (the other logs of a replay). Only each log's first record is read: a
    directory of 12,544 logs is checked in a moment."""
    for directory in list_rank_dirs(log_dir):
        for item in RankLogReader(directory, torn_grace_s=0.0).read(max_bytes=1):
            if isinstance(item, Record):
                if _record_job(item) == (info.job_id, info.attempt):
                    return directory
                break
    return None


def _record_job(record: Record) -> tuple[str, int] | None:
    """The (job, attempt) a log record belongs to (None: it does not say)."""
    try:
        if record.kind == KIND_JOB:
            other = JobInfo.model_validate_json(record.payload)
            return other.job_id, other.attempt
        if record.kind == KIND_BATCH:
            header = peek_header(record.payload)
            return header["job_id"], header["attempt"]
    except (ValueError, SchemaError):
        pass  # the analysis sets it aside; not this replay's concern
    return None


class _KafkaDestination:
    """Kafka, as the streamer ships: the job record on the jobs topic first, each batch on
    the ops topic keyed by its job, with the streamer's headers; idempotent, every
    message confirmed (`close` raises UndeliveredError for those that were not, and
    `send` once Kafka has confirmed nothing for `WAIT_S` while the producer's queue is
    full: a broker that is down would otherwise hold a large replay for ever)."""

    #: How long a replay waits for Kafka to confirm anything, at a full queue or the end.
    WAIT_S = 60.0

    def __init__(self, kafka: LagscopeConfig, info: JobInfo) -> None:
        from confluent_kafka import Producer

        self.kafka = kafka
        self.producer = kafka_client(
            Producer,
            {
                **kafka.kafka.client_config(),
                "enable.idempotence": True,
                "acks": "all",
                "compression.type": kafka.streamer.compression,
                "linger.ms": kafka.streamer.linger_ms,
                "error_cb": self._on_client_error,
                "logger": _client_log,
            },
        )
        self.failed = 0
        self.said_unreachable = False
        self.confirmed_at = time.monotonic()
        self.gave_up = False
        self.producer.produce(kafka.kafka.topic_jobs, key=info.key.encode(),
                              value=info.model_dump_json().encode(),
                              on_delivery=self._delivered)  # fmt: skip

    def _on_client_error(self, error: Any) -> None:
        if error.name() not in UNREACHABLE_ERRORS:
            log.warning("Kafka: %s", redact_url(str(error)))
        elif not self.said_unreachable:
            self.said_unreachable = True
            log.warning("Kafka at %s does not answer (%s); the replay waits up to %g s for it",
                        self._where(), redact_url(error.str()), self.WAIT_S)  # fmt: skip

    def _delivered(self, error: object, _message: object) -> None:
        if error is None:
            self.confirmed_at = time.monotonic()
        else:
            self.failed += 1

    def send(self, batch: RankStepBatch, payload: bytes) -> None:
        while True:
            try:
                self.producer.produce(
                    self.kafka.kafka.topic_ops,
                    key=batch.job_id.encode(),
                    value=payload,
                    headers=[
                        ("lagscope-schema", str(BATCH_VERSION).encode()),
                        ("lagscope-batch-id", batch_id_of(payload).encode()),
                        ("lagscope-rank", str(batch.rank).encode()),
                    ],
                    on_delivery=self._delivered,
                )
                self.producer.poll(0)
                return
            except BufferError:
                self.producer.poll(0.1)
                if time.monotonic() - self.confirmed_at > self.WAIT_S:
                    waiting = len(self.producer)
                    # Given up: `close` waits for nothing more.
                    self.producer.purge()
                    self.producer.poll(0)
                    self.gave_up = True
                    raise UndeliveredError(
                        f"Kafka at {self._where()} confirmed nothing for {self.WAIT_S:g} s "
                        f"with {waiting:,} message(s) waiting: is it up?"
                    ) from None

    def end(self, records: list[JobInfo]) -> None:
        """The ranks' records of their end on the jobs topic (keyed per rank, as a
        streamer ships them), once every batch is confirmed."""
        self._flush()
        for record in records:
            self.producer.produce(self.kafka.kafka.topic_jobs, key=record.record_key.encode(),
                                  value=record.model_dump_json().encode())  # fmt: skip
            self.producer.poll(0)

    def close(self) -> None:
        if not self.gave_up:
            self._flush()

    def _flush(self) -> None:
        remaining = self.producer.flush(self.WAIT_S)
        if remaining:
            # Given up: `close` after a failed `end` waits for nothing more.
            self.producer.purge()
            self.producer.poll(0)
            self.gave_up = True
        if remaining or self.failed:
            raise UndeliveredError(
                f"{remaining + self.failed:,} message(s) were not delivered to Kafka at "
                f"{self._where()} within {self.WAIT_S:g} s"
            )

    def _where(self) -> str:
        return redact_url(self.kafka.kafka.bootstrap_servers)
