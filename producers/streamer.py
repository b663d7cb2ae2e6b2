"""The streamer sidecar: tails every rank's local log and ships its batches to Kafka.

One streamer runs per host next to the training ranks (`lagscope stream --log-dir ...`).
It follows each `rank-NNNNNN/` directory (new files, rotation, truncation, deleted files;
see producers.log) and produces:

- every rank-step batch record to `lagscope.ops`: value = the batch's encoding exactly as
  the rank wrote it (no re-encoding), key = job id, headers `lagscope-schema` (encoding
  version), `lagscope-batch-id` (deterministic, for deduplication) and `lagscope-rank`;
- job metadata records (JobInfo) once per (job, attempt) to the compacted `lagscope.jobs`,
  keyed `job/attempt`;
- everything that is not valid (torn records, garbage, batches that fail to decode) to
  `lagscope.deadletter` as JSON with the file, offset, length and reason.

Delivery guarantees: the producer is idempotent with acks=all. Positions are checkpointed
(temp file + fsync + os.replace) only up to the last record whose delivery - and that of
every record before it in the same rank directory - Kafka confirmed. After kill -9 the
streamer resumes from the checkpoint and re-sends what was unconfirmed; a re-sent batch
carries the same batch id, so sinks drop it. When Kafka is down, librdkafka retries; a
message that still fails makes the streamer rewind that rank to its confirmed position and
retry after a back-off. The log on disk is the buffer: reading pauses while
`max_in_flight_bytes` are unconfirmed, so memory stays bounded however long Kafka is away.
Grouping into rank-step batches happens in the rank's timer (which knows where a step
ends), so a batch's content - and id - does not depend on when the streamer read it.

With `streamer.metrics_port` (`--metrics-port`) it serves its counts as Prometheus
metrics (producers.metrics; names in deploy/README.md).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lagscope.producers.config import ConfigError, LagscopeConfig
from lagscope.producers.dead_letters import STREAMER_DEAD_LETTER_SCHEMA, streamer_dead_letter
from lagscope.producers.events import BATCH_VERSION, JobInfo, SchemaError, batch_id_of, peek_header
from lagscope.producers.kafka_login import (
    UNREACHABLE_ERRORS,
    check_kafka_login,
    kafka_client,
    quiet_client_log,
)
from lagscope.producers.log import (
    KIND_BATCH,
    KIND_JOB,
    Position,
    RankLogReader,
    Record,
    SkippedSpan,
    list_log_files,
    list_rank_dirs,
)
from lagscope.producers.metrics import Heartbeat, MetricsServer, Probes, Verdict
from lagscope.producers.redact import redact_url
from lagscope.producers.topics import make_topics

log = logging.getLogger("lagscope.streamer")
_client_log = quiet_client_log("lagscope.streamer.librdkafka")
#: Delivery reports of messages `close()` purged from the queue.
_OWN_PURGE = frozenset({"_PURGE_QUEUE", "_PURGE_INFLIGHT"})


def _means_unreachable(exc: BaseException) -> bool:
    """An admin request that failed because no broker answered in time."""
    if isinstance(exc, TimeoutError):
        return True
    error = exc.args[0] if exc.args else None
    name = error.name() if hasattr(error, "name") else ""
    return name in UNREACHABLE_ERRORS or name == "_TIMED_OUT"


CHECKPOINT_VERSION = 1
SCHEMA_HEADER = "lagscope-schema"
BATCH_ID_HEADER = "lagscope-batch-id"
RANK_HEADER = "lagscope-rank"
_READ_BUDGET = 2 << 20


@dataclass
class StreamerStats:
    batches: int = 0
    ops: int = 0
    jobs: int = 0
    dead_letters: int = 0
    delivery_failures: int = 0
    rewinds: int = 0
    bytes: int = 0
    #: Seconds no Kafka broker answered, and the failed connection attempts meanwhile.
    kafka_unreachable_s: float = 0.0
    kafka_connect_failures: int = 0

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class _Outage:
    """No broker answers since `since` (monotonic); librdkafka keeps retrying with back-off."""

    since: float
    first_error: str


@dataclass
class _Pending:
    """One log item on its way to Kafka; positions advance over delivered prefixes only."""

    end: Position
    size: int
    delivered: bool = False
    failed: bool = False


@dataclass
class _RankState:
    reader: RankLogReader
    confirmed: Position | None
    pending: deque[_Pending] = field(default_factory=deque)
    rewind: bool = False


class Streamer:
    """Ship local logs to Kafka; `run()` until stopped (or idle, with `idle_exit_s`)."""

    def __init__(self, config: LagscopeConfig, producer: Any = None) -> None:
        if config.streamer.log_dir is None:
            raise ValueError("streamer.log_dir is not set (flag --log-dir)")
        self.config = config
        self.settings = config.streamer
        self.log_dir = Path(config.streamer.log_dir)
        self.checkpoint_path = config.streamer.resolved_checkpoint_path()
        self.stats = StreamerStats()
        self._stop = threading.Event()
        self._ranks: dict[str, _RankState] = {}
        #: This node, named in its dead letters (a path alone does not say which node). In
        #: a pod the host name is the pod's: Kubernetes gives the node as NODE_NAME.
        self._host = os.environ.get("NODE_NAME") or socket.gethostname()
        self._jobs_sent: set[str] = set()
        #: Rank log directories whose last record shipped is their rank's end (its monitor
        #: closed): what `exit_after_job_end_s` waits for. Kept in the checkpoint, so a
        #: restarted sidecar knows it too.
        self._ended_ranks: set[str] = set()
        #: Rank directories whose shipped files this user may not delete (said once each).
        self._undeletable: set[str] = set()
        #: When SIGTERM asked for a drain (`drain_s`), monotonic; None: not draining.
        self._draining_since: float | None = None
        #: Jobs whose records carry fields this build does not know, said once each.
        self._told_unknown: set[str] = set()
        self._in_flight_bytes = 0
        self._checkpoint_dirty = False
        self._last_checkpoint = 0.0
        self._backoff_s = 0.0
        #: Rewinds since the last confirmed delivery: the back-off grows with this, not
        #: with the lifetime count, so one outage long ago does not slow every later rewind.
        self._rewinds_in_a_row = 0
        self._fatal = False
        self._outage: _Outage | None = None
        #: Set once close() has said how the run ended: the client's last errors (its final
        #: poll, its teardown) must not open an outage that no line will ever close.
        self._exit_reported = False
        self._waiting_for_log_dir = False
        #: Whether a broker answered in this run (created topics or confirmed a delivery).
        self._kafka_answered = False
        #: Wall-clock time of the last confirmed delivery and of the last checkpoint
        #: written (the metrics endpoint's).
        self._last_delivery_s: float | None = None
        self._last_checkpoint_s: float | None = None
        #: The Prometheus endpoint (`serve_metrics`), when `streamer.metrics_port` is set.
        self.metrics: MetricsServer | None = None
        #: Beaten by the shipping loop (and its waits for Kafka): /healthz reads it.
        self.heartbeat = Heartbeat(config.streamer.stall_s)
        self._owns_producer = producer is None
        if producer is None:
            # A rejected login is one line, not a retry loop; no broker yet is waited for.
            check_kafka_login(config.kafka, broker_required=False)
        self._producer = producer or self._make_producer()
        self._load_checkpoint()

    # -- setup ----------------------------------------------------------------------------

    def _make_producer(self) -> Any:
        from confluent_kafka import Producer

        settings = self.settings
        config = self.config.kafka.client_config()
        config.update(
            {
                "enable.idempotence": True,
                "acks": "all",
                "compression.type": settings.compression,
                "linger.ms": settings.linger_ms,
                "message.timeout.ms": settings.delivery_timeout_ms,
                "queue.buffering.max.kbytes": max(1024, 2 * settings.max_in_flight_bytes // 1024),
                "batch.size": 1 << 20,
                "reconnect.backoff.max.ms": 2000,
                "error_cb": self._on_client_error,
                "logger": _client_log,
            }
        )
        config.update(self.config.kafka.client_options)
        return kafka_client(Producer, config)

    def _on_client_error(self, err: Any) -> None:
        if err.name() in UNREACHABLE_ERRORS:
            self.stats.kafka_connect_failures += 1
            self._begin_outage(err.str())
            return
        if err.fatal():
            # The idempotent producer cannot continue (e.g. fenced): rewind every rank and
            # start a new producer; already-sent batches are re-sent with their ids.
            log.error("fatal Kafka producer error: %s; restarting the producer",
                      redact_url(str(err)))  # fmt: skip
            self._fatal = True
            for state in self._ranks.values():
                state.rewind = True
        else:
            log.warning("Kafka: %s", redact_url(str(err)))

    def ensure_topics(self, timeout_s: float = 10.0) -> None:
        """Create the topics if missing (`producers/topics.py`); best effort, the broker
        may be down."""
        from confluent_kafka.admin import AdminClient

        kafka = self.config.kafka
        admin = kafka_client(
            AdminClient,
            {**kafka.client_config(), "error_cb": self._on_client_error, "logger": _client_log},
        )
        asked = time.monotonic()
        made = make_topics(admin, kafka, timeout_s)
        if made.created or made.existed:
            self._kafka_answered = True
        if not made.failed:
            return
        first = next(iter(made.failed.values()))
        if all(_means_unreachable(exc) for exc in made.failed.values()):
            reason = str(first) or f"no answer in {timeout_s:g} s"
            self._begin_outage(f"could not create topics: {reason}", since=asked)
        else:
            log.warning("could not create topic(s) %s: %s", ", ".join(made.failed),
                        redact_url(str(first)))  # fmt: skip

    def _load_checkpoint(self) -> None:
        try:
            raw = json.loads(self.checkpoint_path.read_text())
        except FileNotFoundError:
            return
        except OSError as exc:  # a directory, a file it may not read
            raise ConfigError(
                f"checkpoint {self.checkpoint_path}: cannot be read ({exc.strerror or exc})"
            ) from None
        except (ValueError, UnicodeDecodeError) as exc:
            # os.replace makes a torn checkpoint impossible; a corrupt one is someone else's
            # write. Starting over re-sends (deduplicated by batch id) rather than losing data.
            kept = self._set_aside_checkpoint()
            log.error("checkpoint %s is unreadable (%s); moved to %s, re-reading all logs",
                      self.checkpoint_path, exc, kept)  # fmt: skip
            return
        if not isinstance(raw, dict) or raw.get("version") != CHECKPOINT_VERSION:
            version = raw.get("version") if isinstance(raw, dict) else None
            kept = self._set_aside_checkpoint()
            log.error("checkpoint %s has unknown version %r; moved to %s, re-reading all logs",
                      self.checkpoint_path, version, kept)  # fmt: skip
            return
        for name, pos in raw.get("positions", {}).items():
            position = Position(pos["file"], int(pos["offset"]))
            self._ranks[name] = _RankState(self._reader(self.log_dir / name, position), position)
        self._jobs_sent = set(raw.get("jobs_sent", []))
        self._ended_ranks = set(raw.get("ended_ranks", []))

    def _set_aside_checkpoint(self) -> Path:
        """Move a checkpoint this build cannot read out of the way (it may be a newer
        streamer's, or a file that is not ours): the next checkpoint must not overwrite
        what the streamer did not write."""
        kept = self.checkpoint_path.with_name(
            f"{self.checkpoint_path.name}.unreadable-{time.strftime('%Y%m%dT%H%M%S')}"
        )
        os.replace(self.checkpoint_path, kept)
        return kept

    def _reader(self, directory: Path, position: Position | None) -> RankLogReader:
        return RankLogReader(directory, position, torn_grace_s=self.settings.torn_grace_s)

    def write_checkpoint(self) -> None:
        data = {
            "version": CHECKPOINT_VERSION,
            "positions": {
                name: {"file": state.confirmed.file, "offset": state.confirmed.offset}
                for name, state in sorted(self._ranks.items())
                if state.confirmed is not None
            },
            "jobs_sent": sorted(self._jobs_sent),
            # A key older streamers ignore (the checkpoint's version stays 1).
            "ended_ranks": sorted(self._ended_ranks),
        }
        self.checkpoint_path.parent.mkdir(parents=True, exist_ok=True)
        temp = self.checkpoint_path.with_name(self.checkpoint_path.name + ".tmp")
        with open(temp, "w") as handle:
            json.dump(data, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, self.checkpoint_path)
        dir_fd = os.open(self.checkpoint_path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        self._checkpoint_dirty = False
        self._last_checkpoint = time.monotonic()
        self._last_checkpoint_s = time.time()
        if self.settings.delete_shipped:
            self._delete_shipped()

    def _delete_shipped(self) -> None:
        """Remove files wholly before each rank's checkpointed position (already durable).
        A file this user may not delete (a rank directory of another owner) is said once
        per directory and kept: shipping goes on, the disk fills."""
        for name, state in self._ranks.items():
            if state.confirmed is None:
                continue
            directory = self.log_dir / name
            for file in list_log_files(directory):
                if file >= state.confirmed.file:
                    break
                try:
                    (directory / file).unlink(missing_ok=True)
                except OSError as exc:
                    if name not in self._undeletable:
                        self._undeletable.add(name)
                        log.warning(
                            "cannot delete shipped log files in %s (%s): they stay on the "
                            "disk; make the directory writable by uid %d",
                            directory, exc.strerror or exc, os.getuid(),
                        )  # fmt: skip
                    break

    # -- main loop ------------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()

    def terminate(self) -> None:
        """What SIGTERM does: with `drain_s`, ship what the logs hold to its end first (a
        job's sidecar, stopped once the trainer exited), else stop as `stop()` does. A
        second SIGTERM while draining stops at once."""
        if self.settings.drain_s > 0 and self._draining_since is None:
            self._draining_since = time.monotonic()
        else:
            self.stop()

    @property
    def draining(self) -> bool:
        return self._draining_since is not None

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.terminate())
        signal.signal(signal.SIGINT, lambda *_: self.stop())

    def serve_metrics(self) -> MetricsServer | None:
        """Start the Prometheus endpoint when `streamer.metrics_port` is set (once; `run()`
        calls it too). It stays up after `run()` returns, so a last scrape sees the final
        counts, until `close_metrics()` or the end of the process. OSError: port taken."""
        if self.metrics is None and self.settings.metrics_port is not None:
            from lagscope.producers import metrics

            self.metrics = metrics.serve(
                self._metric_families,
                self.settings.metrics_port,
                self.settings.metrics_addr,
                what="streamer",
                probes=Probes(live=self._live, ready=self._ready),
            )
        return self.metrics

    def _live(self) -> Verdict:
        """Liveness: the shipping loop goes round (an outage is ridden out in the loop)."""
        age = self.heartbeat.age()
        if self.heartbeat.stale():
            return False, f"the shipping loop has not gone round for {age:.0f} s"
        return True, f"the shipping loop went round {age:.1f} s ago"

    def _ready(self) -> Verdict:
        """Readiness: Kafka answers (the logs keep everything while it does not)."""
        outage = self._outage
        where = redact_url(self.config.kafka.bootstrap_servers)
        if outage is not None:
            return False, (
                f"Kafka at {where} has not answered for {time.monotonic() - outage.since:.0f} s"
            )
        return True, f"Kafka at {where} answers"

    def close_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None

    def _metric_families(self) -> list[Any]:
        """The metric families of a scrape (called from the endpoint's thread: it only
        reads counters, which the streaming thread keeps in plain Python)."""
        from lagscope.producers.metrics import counter, gauge

        stats = self.stats
        outage = self._outage
        unreachable_s = stats.kafka_unreachable_s
        if outage is not None:
            unreachable_s += time.monotonic() - outage.since
        return [
            counter("lagscope_streamer_ops_total",
                    "Ops produced to Kafka, in rank-step batches (re-sends after a rewind "
                    "count again).", stats.ops),
            counter("lagscope_streamer_batches_total",
                    "Rank-step batch records produced to the ops topic.", stats.batches),
            counter("lagscope_streamer_jobs_total",
                    "Job metadata records produced to the jobs topic.", stats.jobs),
            counter("lagscope_streamer_bytes_total",
                    "Bytes of record values produced to Kafka.", stats.bytes),
            counter("lagscope_streamer_dead_letters_total",
                    "Log records sent to the dead-letter topic (torn, garbage, undecodable).",
                    stats.dead_letters),
            counter("lagscope_streamer_delivery_failures_total",
                    "Messages Kafka did not confirm (re-sent from the log).",
                    stats.delivery_failures),
            counter("lagscope_streamer_rewinds_total",
                    "Rewinds of ranks to their confirmed position after failed deliveries.",
                    stats.rewinds),
            counter("lagscope_streamer_kafka_connect_failures_total",
                    "Failed connection attempts to Kafka brokers.",
                    stats.kafka_connect_failures),
            counter("lagscope_streamer_kafka_unreachable_seconds_total",
                    "Seconds no Kafka broker answered.", unreachable_s),
            gauge("lagscope_streamer_kafka_up",
                  "1 while Kafka answers, 0 during an outage.", 0 if outage else 1),
            gauge("lagscope_streamer_in_flight_bytes",
                  "Bytes produced and not yet confirmed by Kafka.", self._in_flight_bytes),
            gauge("lagscope_streamer_ranks",
                  "Rank log directories followed.", len(self._ranks)),
            gauge("lagscope_streamer_last_delivery_timestamp_seconds",
                  "Unix time of the last delivery Kafka confirmed (0: none yet).",
                  self._last_delivery_s or 0.0),
            gauge("lagscope_streamer_last_checkpoint_timestamp_seconds",
                  "Unix time the checkpoint (what Kafka confirmed) was last written (0: "
                  "not yet).", self._last_checkpoint_s or 0.0),
        ]  # fmt: skip

    def run(self) -> StreamerStats:
        self.serve_metrics()
        idle_since = time.monotonic()
        settings = self.settings
        while not self._stop.is_set():
            self.heartbeat.beat()
            did_work = self.step()
            now = time.monotonic()
            # A Kafka that has never answered this run (a wrong address, a backfill with no
            # cluster) would keep an idle streamer forever: queueing what cannot drain is no
            # progress, and the logs keep it. An outage after Kafka answered is ridden out.
            never_answered = self._outage is not None and not self._kafka_answered
            if (did_work or self._in_flight_bytes) and not never_answered:
                idle_since = now
            if settings.idle_exit_s is not None and now - idle_since >= settings.idle_exit_s:
                break
            if (
                settings.exit_after_job_end_s is not None
                and now - idle_since >= settings.exit_after_job_end_s
                and self.job_ended()
            ):
                log.info("every rank's end is shipped and nothing new came for %g s: exiting",
                         settings.exit_after_job_end_s)  # fmt: skip
                break
            if self._draining_since is not None and self._drained(did_work, now):
                break
            if not did_work:
                self._producer.poll(settings.poll_interval_s)
        self.close()
        return self.stats

    def job_ended(self) -> bool:
        """Whether every rank log under the log directory has shipped its rank's end record
        and Kafka confirmed everything read (False while there is no rank log at all)."""
        names = [directory.name for directory in list_rank_dirs(self.log_dir)]
        return (
            bool(names)
            and not self._in_flight_bytes
            and all(name in self._ended_ranks for name in names)
        )

    def _drained(self, did_work: bool, now: float) -> bool:
        """While draining: True once every rank log was read to its end and Kafka confirmed
        it all (a torn record at a log's end becomes a dead letter after `torn_grace_s`,
        and is shipped as one), or once `drain_s` has passed."""
        assert self._draining_since is not None
        if now - self._draining_since >= self.settings.drain_s:
            log.warning("SIGTERM: stopping after draining for %g s (streamer.drain_s)",
                        self.settings.drain_s)  # fmt: skip
            return True
        if did_work or self._in_flight_bytes:
            return False
        for directory in list_rank_dirs(self.log_dir):
            state = self._ranks.get(directory.name)
            if state is None or not state.reader.at_end():
                return False
        log.info("SIGTERM: the logs are shipped to their end after %.1f s of draining",
                 now - self._draining_since)  # fmt: skip
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        # No broker answers: waiting for confirmations that cannot come only delays the exit.
        deadline = time.monotonic() + (0.0 if self._outage is not None else timeout_s)
        while self._in_flight_bytes and time.monotonic() < deadline:
            self._producer.poll(0.1)
            self._advance()
        self._advance()
        # A log directory that never appeared has nothing to remember, and a checkpoint in
        # it (the default place) would create it.
        if self._ranks or self.log_dir.is_dir():
            self.write_checkpoint()
        outage_at_exit = self._outage is not None
        if outage_at_exit:
            self._end_outage(at_exit=True)
        self._exit_reported = True
        if self._in_flight_bytes and self._owns_producer:
            # Unconfirmed messages are dropped from memory, not from the log: the checkpoint
            # stays before them and the next run re-sends them.
            if not outage_at_exit:  # the outage's summary line said so already
                log.warning(
                    "%d bytes unconfirmed at shutdown; they are re-sent on the next run",
                    self._in_flight_bytes,
                )
            self._producer.purge()
            self._producer.poll(0)

    @property
    def kafka_answered(self) -> bool:
        """Whether Kafka answered at least once this run (a delivery or a topic call)."""
        return self._kafka_answered

    def unshipped_bytes(self) -> int:
        """Bytes of the rank logs past what Kafka confirmed: read and unconfirmed, and not
        read yet. What `lagscope stream` reports when it exits with data left behind (the
        logs keep it; the next run sends it)."""
        total = 0
        for directory in list_rank_dirs(self.log_dir):
            state = self._ranks.get(directory.name)
            confirmed = state.confirmed if state is not None else None
            for name in list_log_files(directory):
                if confirmed is not None and name < confirmed.file:
                    continue
                try:
                    size = (directory / name).stat().st_size
                except FileNotFoundError:  # rotated away meanwhile
                    continue
                if confirmed is not None and name == confirmed.file:
                    size -= min(size, confirmed.offset)
                total += size
        return total

    def _begin_outage(self, reason: str, since: float | None = None) -> None:
        """The one line that says no broker answers (librdkafka retries with back-off)."""
        if self._outage is not None or self._exit_reported:
            return
        # librdkafka's reasons quote the broker as given (sasl_ssl://user:pw@host/bootstrap)
        reason = redact_url(reason)
        self._outage = _Outage(time.monotonic() if since is None else since, reason)
        log.warning(
            "Kafka at %s does not answer (%s); retrying with back-off, the logs keep "
            "everything until it does",
            redact_url(self.config.kafka.bootstrap_servers),
            reason,
        )

    def _end_outage(self, *, at_exit: bool) -> None:
        """The one summary line of an outage: when a broker answers again, or at exit."""
        assert self._outage is not None
        seconds = time.monotonic() - self._outage.since
        self.stats.kafka_unreachable_s += seconds
        if at_exit:
            log.warning(
                "Kafka at %s did not answer for %.0f s (%d failed connection attempts, "
                "first: %s); %d unconfirmed bytes stay in the logs and are sent on the next run",
                redact_url(self.config.kafka.bootstrap_servers),
                seconds,
                self.stats.kafka_connect_failures,
                self._outage.first_error,
                self._in_flight_bytes,
            )
        else:
            log.warning(
                "Kafka at %s answers again after %.0f s (%d failed connection attempts)",
                redact_url(self.config.kafka.bootstrap_servers),
                seconds,
                self.stats.kafka_connect_failures,
            )
        self._outage = None

    def _note_log_dir(self) -> None:
        """Say once that the log directory is not there yet, and once that it appeared: a
        sidecar often starts before the training job creates it, and waits (a typo in the
        path shows in that one line; `idle_exit_s` ends the wait)."""
        exists = os.path.isdir(self.log_dir)
        if not exists and not self._waiting_for_log_dir:
            self._waiting_for_log_dir = True
            log.warning("%s does not exist yet; waiting for the training job to create it",
                        self.log_dir)  # fmt: skip
        elif exists and self._waiting_for_log_dir:
            self._waiting_for_log_dir = False
            log.warning("%s appeared; shipping its logs", self.log_dir)

    def step(self) -> bool:
        """Read what is readable, produce it, serve delivery reports; True if it did work."""
        self._producer.poll(0)
        self._advance()
        if any(state.rewind for state in self._ranks.values()):
            self._rewind_failed()
            return True
        if self._backoff_s and time.monotonic() < self._backoff_s:
            return False
        did_work = False
        self._note_log_dir()
        for directory in list_rank_dirs(self.log_dir):
            name = directory.name
            state = self._ranks.get(name)
            if state is None:
                state = self._ranks[name] = _RankState(self._reader(directory, None), None)
            room = self.settings.max_in_flight_bytes - self._in_flight_bytes
            if room <= 0:
                break
            # Never read more than fits: unconfirmed bytes stay bounded by about one record
            # over the limit, however long Kafka is away.
            items = state.reader.read(min(_READ_BUDGET, room))
            for item in items:
                self._ship(name, state, item)
                did_work = True
        self._producer.poll(0)
        self._advance()
        if self._checkpoint_dirty and (
            time.monotonic() - self._last_checkpoint >= self.settings.checkpoint_interval_s
        ):
            self.write_checkpoint()
        return did_work

    # -- producing ------------------------------------------------------------------------

    def _ship(self, rank_name: str, state: _RankState, item: Record | SkippedSpan) -> None:
        if isinstance(item, SkippedSpan):
            end = item.end or Position(Path(item.source).name, item.offset + item.length)
            self._send_dead_letter(
                state, end, item.source, item.offset, item.length, item.reason, item.sample
            )
        elif item.kind == KIND_BATCH:
            self._ship_batch(rank_name, state, item)
        elif item.kind == KIND_JOB:
            self._ship_job(rank_name, state, item)

    def _ship_batch(self, rank_name: str, state: _RankState, item: Record) -> None:
        """A rank-step batch to the ops topic, keyed by its job; one that cannot be read is
        a dead letter."""
        try:
            head = peek_header(item.payload)
            _check_batch(item.payload)
        except SchemaError as exc:
            # The file path is built only here: pathlib per record costs more than the rest.
            source = str(self.log_dir / rank_name / item.file)
            self._send_dead_letter(
                state, item.position_after, source, item.offset, len(item.payload),
                f"{source}@{item.offset}: {exc}", item.payload[:64],
            )  # fmt: skip
            return
        self._produce(
            state,
            item.position_after,
            self.config.kafka.topic_ops,
            key=head["job_id"].encode(),
            value=item.payload,
            headers=[
                (SCHEMA_HEADER, str(BATCH_VERSION).encode()),
                (BATCH_ID_HEADER, batch_id_of(item.payload).encode()),
                (RANK_HEADER, str(head["rank"]).encode()),
            ],
        )
        self.stats.batches += 1
        self.stats.ops += head["n_ops"]

    def _ship_job(self, rank_name: str, state: _RankState, item: Record) -> None:
        """A job record to the compacted jobs topic, once per record key and once more for
        the rank's end (its record again, `ended_ns` set, which compaction keeps); one
        that cannot be read is a dead letter."""
        source = str(self.log_dir / rank_name / item.file)
        try:
            info = JobInfo.model_validate_json(item.payload)
        except ValueError as exc:
            self._send_dead_letter(
                state,
                item.position_after,
                source,
                item.offset,
                len(item.payload),
                f"invalid job metadata: {exc}",
                item.payload[:64],
            )
            return
        if info.ended_ns is None:
            self._ended_ranks.discard(rank_name)  # a new attempt in the same log
        else:
            self._ended_ranks.add(rank_name)
        sent_key = info.record_key if info.ended_ns is None else f"{info.record_key}/ended"
        if sent_key in self._jobs_sent:
            self._track(state, _Pending(item.position_after, 0, delivered=True))
            return
        if info.unknown_fields and info.key not in self._told_unknown:
            # A newer writer's record: shipped as it is (the bytes are the rank's), and
            # said once per job, so a reader's upgrade is a choice, not a surprise.
            self._told_unknown.add(info.key)
            log.info(
                "job %s writes job records of schema version %d with fields this build "
                "does not know (%s); shipped unchanged",
                info.key, info.schema_version, ", ".join(info.unknown_fields),
            )  # fmt: skip
        self._produce(state, item.position_after, self.config.kafka.topic_jobs,
                      key=info.record_key.encode(), value=item.payload,
                      headers=[(SCHEMA_HEADER, f"job-{info.schema_version}".encode())],
                      job_key=sent_key)  # fmt: skip
        self.stats.jobs += 1

    def _send_dead_letter(
        self, state: _RankState, end: Position, source: str, offset: int, length: int,
        reason: str, sample: bytes,
    ) -> None:  # fmt: skip
        value = streamer_dead_letter(host=self._host, source=source, offset=offset,
                                     length=length, reason=reason, sample=sample)  # fmt: skip
        log.warning("dead letter %s@%d (%d bytes): %s", source, offset, length, reason)
        self._produce(
            state,
            end,
            self.config.kafka.topic_deadletter,
            key=source.encode(),
            value=value,
            headers=[(SCHEMA_HEADER, STREAMER_DEAD_LETTER_SCHEMA)],
        )
        self.stats.dead_letters += 1

    def _track(self, state: _RankState, pending: _Pending) -> None:
        state.pending.append(pending)
        self._in_flight_bytes += pending.size

    def _produce(
        self,
        state: _RankState,
        end: Position,
        topic: str,
        *,
        key: bytes,
        value: bytes,
        headers: list[tuple[str, bytes]],
        job_key: str | None = None,
    ) -> None:
        pending = _Pending(end, len(value))
        self._track(state, pending)
        self.stats.bytes += len(value)

        def on_delivery(err: Any, _msg: Any) -> None:
            if err is None:
                pending.delivered = True
                self._kafka_answered = True
                self._last_delivery_s = time.time()
                if self._outage is not None:
                    self._end_outage(at_exit=False)
                if job_key is not None:
                    self._jobs_sent.add(job_key)
            elif err.name() in _OWN_PURGE:
                # Our own purge at shutdown: the checkpoint stays before it, nothing is lost.
                pending.failed = True
            else:
                pending.failed = True
                state.rewind = True
                if err.fatal():
                    self._fatal = True
                self.stats.delivery_failures += 1
                if self._outage is None:  # during an outage, its summary line counts for all
                    log.warning("delivery to %s failed (%s); will re-send from the log", topic,
                                redact_url(str(err)))  # fmt: skip

        while True:
            try:
                self._producer.produce(topic, value=value, key=key, headers=headers,
                                       on_delivery=on_delivery)  # fmt: skip
                return
            except BufferError:
                # librdkafka's queue is full: serve delivery reports until there is room.
                self._producer.poll(0.1)

    def _advance(self) -> None:
        """Move each rank's confirmed position over its delivered prefix."""
        for state in self._ranks.values():
            pending = state.pending
            while pending and pending[0].delivered:
                done = pending.popleft()
                self._in_flight_bytes -= done.size
                if done.size:  # a real delivery (not a job record already sent)
                    self._rewinds_in_a_row = 0
                state.confirmed = done.end
                self._checkpoint_dirty = True

    def _rewind_failed(self) -> None:
        """After a failed delivery: wait for the rest in flight, then re-read from the last
        confirmed position of each affected rank (re-sent batches keep their ids)."""
        self.stats.rewinds += 1
        deadline = time.monotonic() + self.settings.delivery_timeout_ms / 1000 + 30
        while any(not (p.delivered or p.failed) for s in self._ranks.values()
                  for p in s.pending) and time.monotonic() < deadline:  # fmt: skip
            self.heartbeat.beat()  # waiting for Kafka's answers is the loop's work
            self._producer.poll(0.1)
        self._advance()  # deliveries confirmed before the failure reset the count first
        self._rewinds_in_a_row += 1
        if self._fatal and self._owns_producer:
            self._producer.purge()
            self._producer = self._make_producer()
            self._fatal = False
        for name, state in self._ranks.items():
            if not state.rewind and not state.pending:
                continue
            self._in_flight_bytes -= sum(p.size for p in state.pending)
            state.pending.clear()
            state.rewind = False
            state.reader = self._reader(self.log_dir / name, state.confirmed)
        self._backoff_s = time.monotonic() + min(5.0, 0.5 * self._rewinds_in_a_row)


def _check_batch(payload: bytes, where: str = "batch") -> None:
    """Cheap validation on the hot path: the batch's own checksum and declared size.

    The full decode (dictionary, column invariants) runs in the stream app; what the
    streamer must not forward is bytes that are not a batch at all.
    """
    body = memoryview(payload)[:-4]
    if zlib.crc32(body) != int.from_bytes(payload[-4:], "little"):
        raise SchemaError(f"{where}: batch checksum mismatch (corrupted batch)")
