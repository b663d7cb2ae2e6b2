"""The distributed host: a faust-streaming worker, `lagscope.ops` -> host pipeline -> store.

Topology. One agent consumes `lagscope.ops` (key = job id, so every batch of a job lands in
one partition and more workers analyse more jobs in parallel). Each assigned partition has
its own host pipeline (`stream_app/worker_core.py`: the same `HostCore` `lagscope run`
drives, so both hosts store the same rows; faust's windowed tables are not used). Job
records come from the compacted `lagscope.jobs` topic, which every worker reads whole
(outside the consumer group: every worker needs every job). What the streamers set aside
(`lagscope.deadletter`) is stored in `dead_letters` by a consumer group of its own.
Closed steps, episodes and diagnoses go to the store and, as JSON, to `lagscope.results`
for other consumers.

The agent takes each partition's records one fetched run at a time
(`stream_app/fetch_runs.py`: faust's per-record events cost a quarter of a core at a
million ops/s) with faust's acks off; the worker commits a partition's offset itself, once
a durable snapshot covers it (crash safety: `stream_app/worker_core.py`).

Starting anywhere. The state directory (`--data-dir`, default a fresh temporary directory
removed at exit) is made when missing; a broker that does not answer yet is waited for,
one line per attempt, as `lagscope stream` does; a setting the broker or the client
refuses is one line. Neither is a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from lagscope.producers.config import ConfigError, KafkaSettings
from lagscope.producers.dead_letters import from_streamer
from lagscope.producers.events import SchemaError, peek_header
from lagscope.producers.kafka_login import check_kafka_login, kafka_client
from lagscope.producers.metrics import MetricsServer, Probes, Verdict
from lagscope.producers.topics import topic_ready
from lagscope.store.dsn import directory_to_make
from lagscope.store.sink import ClickHouseSink
from lagscope.stream_app.analysis_process import analysis_peak_rss_mb, peak_rss_mb
from lagscope.stream_app.repeated_lines import (
    KAFKA_COMPLAINTS,
    librdkafka_logger,
    quiet_repeats,
)
from lagscope.stream_app.worker_config import WorkerConfig
from lagscope.stream_app.worker_core import OpsMessage, WorkerCore
from lagscope.stream_app.worker_health import WorkerHealth
from lagscope.stream_app.worker_metrics import worker_metric_families
from lagscope.stream_app.worker_start import wait_for_broker, wait_for_topics

log = logging.getLogger("lagscope.worker")
#: librdkafka's lines of the worker's confluent-kafka clients, retries collapsed.
_CLIENT_LOG = "lagscope.worker.librdkafka"
#: Seconds without a complaint of the Kafka clients after which Kafka answering says it
#: is back (while the broker is away they complain every ~100 ms).
_KAFKA_QUIET_S = 3.0
#: Job records the jobs reader hands the core in one call, at most.
_JOB_RECORDS_PER_CALL = 1000
#: A partition is caught up when the worker has taken every record up to a high watermark
#: Kafka told it at most this long ago (it answers a waiting fetch every ~0.5 s).
_FRESH_ANSWER_S = 1.5


# -- the faust host -------------------------------------------------------------------------
class FaustWorker:
    """Runs a `WorkerCore` inside a faust-streaming app (`run()` blocks until stopped)."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        # A rejected login or a setting librdkafka refuses: one line, not a retry loop. A
        # broker that does not answer yet is waited for (`wait_for_broker`).
        check_kafka_login(config.kafka, broker_required=False)
        #: The state directory, and whether this worker made it (and so removes it).
        self.data_dir, self._own_data_dir = state_directory(config.worker.data_dir)
        #: The directory of the embedded store this worker makes, removed again if it
        #: never reaches Kafka: a mistyped broker must not leave an empty store behind.
        self._made_store = directory_to_make(config.store.resolved_dsn())
        self.sink = ClickHouseSink(config.store.resolved_dsn(), retry=config.store.retry_policy())
        self.sink.ensure_schema(ops_ttl_days=config.store.ops_ttl_days)
        #: The producer of `lagscope.results`: made once a broker answers (`run`), so a
        #: worker waiting for Kafka does not have librdkafka log every failed connect.
        self._producer: Any = None
        self.core = WorkerCore(config, self.sink, self._publish, flush_results=self._flush_results)
        # One thread does all processing: keeps the event loop (heartbeats) responsive and
        # the core single-threaded.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="lagscope-core")
        self._jobs_ready = threading.Event()
        #: Set while the dead-letter reader has stored everything it was given to read.
        self._dead_letters_idle = threading.Event()
        self._known_jobs: set[bytes] = set()
        #: Jobs whose metadata a pass already waited for.
        self._waited_for: set[bytes] = set()
        self._stop = threading.Event()
        #: When the last pass over messages ended (or the last assignment came).
        self._last_message = time.monotonic()
        #: When Kafka last answered: a pass took records, or the group assigned partitions.
        self._kafka_answered_at = 0.0
        self._passes_in_flight = 0
        self._assigned = False
        #: The ops partitions this worker owns now, each with the consumer generation that
        #: assigned it: taken away the moment a rebalance revokes them, so a pass that was
        #: waiting then cannot bring one back to life; and a run fetched in an earlier
        #: generation is not this ownership's (see `_current_runs`).
        self._owned: dict[int, int] = {}
        #: True from a rebalance's revocation to its assignment: owning nothing then is
        #: no reason to think the work is done.
        self._rebalancing = False
        #: Assignments whose partitions are still being restored (`_restore_assigned`),
        #: and their tasks (held: the event loop keeps only weak references).
        self._restores_in_flight = 0
        self._restore_tasks: set[asyncio.Future[None]] = set()
        #: Consumer lag of each assigned ops partition: records in Kafka past the last one
        #: the worker processed (Kafka's high watermark minus the core's next offset).
        self._lag: dict[int, int] = {}
        #: The Prometheus endpoint (`serve_metrics`), when `worker.metrics_port` is set.
        self.metrics: MetricsServer | None = None
        #: The heartbeats the loop beats, and what the endpoint's probes answer.
        self.health = WorkerHealth(config.worker.stall_s, config.kafka, config.store.resolved_dsn())
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
                what="worker", probes=Probes(live=self._live, ready=self._ready),
            )  # fmt: skip
        return self.metrics

    def _live(self) -> Verdict:
        """/healthz (the endpoint's thread): records wait unless none is lagging, no pass
        runs, or the store or a rebalance is what holds the worker back."""
        waiting = self._passes_in_flight > 0 or any(dict(self._lag).values())
        held = self.core.store_failing or self._rebalancing or self._restores_in_flight > 0
        return self.health.live(has_work=waiting and not held)

    def _ready(self) -> Verdict:
        return self.health.ready(store_failing=self.core.store_failing)

    def _metric_families(self) -> list[Any]:
        """The metric families of a scrape (the endpoint's thread)."""
        return worker_metric_families(self.core, self.config.kafka.topic_ops, dict(self._lag))

    def _update_lag(self) -> list[int]:
        """Consumer lag of every assigned ops partition the core has state for; returns
        those whose lateness clock still runs on record time with nothing left to read."""
        consumer = self.app.consumer
        caught_up = []
        for tp in consumer.assignment():
            if tp.topic != self.core.topic:
                continue
            highwater = consumer.highwater(tp)
            part = self.core.partitions.get(tp.partition)
            if highwater is None or part is None:
                continue
            self._lag[tp.partition] = max(0, highwater - part.next_offset)
            if part.next_offset >= highwater and part.clock.behind and self._answered_lately(tp):
                caught_up.append(tp.partition)
        return caught_up

    def _answered_lately(self, tp: Any) -> bool:
        """Whether Kafka answered a fetch of `tp` within `_FRESH_ANSWER_S`: only then does
        its high watermark say there is nothing more. Between the last buffered record's
        hand-over and the next fetch, a stale one read "caught up" mid-backlog, and the
        clock jumped from the records' times to now: every step still waiting for a
        coordinate whose batches were next in Kafka closed without it."""
        try:
            consumer = self.app.consumer._thread._ensure_consumer()  # faust's aiokafka client
            stamp = consumer.last_poll_timestamp(tp)
        except Exception:  # not started, or a rebalance under way
            return False
        return stamp is not None and time.time() - stamp / 1000 <= _FRESH_ANSWER_S

    # -- kafka clients --------------------------------------------------------------------
    def _make_producer(self) -> Any:
        from confluent_kafka import Producer

        return Producer(
            {
                **self.config.kafka.client_config(),
                "logger": librdkafka_logger(_CLIENT_LOG),
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
                "logger": librdkafka_logger(_CLIENT_LOG),
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
                    _serve_client_log(consumer)
                    time.sleep(1.0)
            tps = [TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions]
            ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                    for p in partitions}  # fmt: skip
            consumer.assign(tps)
            position = dict.fromkeys(partitions, 0)
            while not self._stop.is_set():
                if all(position[p] >= ends[p] for p in partitions):
                    self._jobs_ready.set()
                # Many at a time: a 100,000-GPU job's ranks each write two records, which
                # one at a time cost the core a hand-over each.
                records = []
                for msg in consumer.consume(_JOB_RECORDS_PER_CALL, 0.2):
                    if msg.error() is not None:
                        continue
                    position[msg.partition()] = msg.offset() + 1
                    where = f"{topic}[{msg.partition()}]@{msg.offset()}"
                    records.append((msg.value(), msg.timestamp()[1] / 1000, where))
                if not records:
                    continue
                # Their jobs are known once the core took them, before any later batch:
                # the core reads each record once (a 100,000-GPU job's ranks send 200,000).
                self._executor.submit(self._take_job_records, records)
        finally:
            consumer.close()

    def _take_job_records(self, records: list[tuple[bytes | None, float, str]]) -> None:
        self._known_jobs.update(self.core.on_job_records(records))

    # -- faust ------------------------------------------------------------------------------
    def _read_dead_letters(self) -> None:
        """Store what the streamers set aside (the dead-letter topic), so the store holds
        every stage's dead letters, as `lagscope run` does. Its partitions are shared by
        the workers (a consumer group of its own); an offset is committed once its dead
        letters are stored. Read again after a crash, a dead letter is the same row (the
        table's key: job, source, time, payload), which the store's FINAL reads once."""
        from confluent_kafka import Consumer, KafkaException

        topic = self.config.kafka.topic_deadletter
        consumer = kafka_client(
            Consumer,
            {
                **self.config.kafka.client_config(),
                "logger": librdkafka_logger(_CLIENT_LOG),
                "group.id": f"{self.config.worker.group_id}-deadletters",
                "enable.auto.commit": False,
                "auto.offset.reset": "earliest",
            },
        )
        assigned = threading.Event()
        try:
            while not topic_ready(consumer, topic):
                self._dead_letters_idle.set()  # nothing to read (yet)
                _serve_client_log(consumer)
                if self._stop.wait(2.0):
                    return
            self._dead_letters_idle.clear()
            consumer.subscribe([topic], on_assign=lambda *_: assigned.set())
            while not self._stop.is_set():
                messages = [m for m in consumer.consume(500, timeout=0.5) if m.error() is None]
                if not messages:
                    if assigned.is_set() and _caught_up(consumer):
                        self._dead_letters_idle.set()
                    continue
                self._dead_letters_idle.clear()
                letters = [
                    from_streamer(m.value(), f"{topic}[{m.partition()}]@{m.offset()}",
                                  m.timestamp()[1] / 1000)
                    for m in messages
                ]  # fmt: skip
                # Kept pending while the store fails, as every dead letter is.
                store = self.core.on_streamer_dead_letters
                while not self._executor.submit(store, letters).result():
                    letters = []
                    if self._stop.wait(self.config.worker.write_interval_s):
                        return
                try:
                    consumer.commit(asynchronous=False)
                except KafkaException as exc:
                    log.warning("committing %s offsets failed (read again later): %s", topic, exc)
        except RuntimeError:
            return  # the executor shut down: the worker is stopping
        finally:
            consumer.close()

    def _build_app(self) -> Any:
        from lagscope.stream_app.fetch_runs import PassThroughCodec, RunsApp

        kafka = self.config.kafka
        settings = self.config.worker
        app = RunsApp(
            settings.group_id,
            run_topics=frozenset({kafka.topic_ops}),
            broker=[f"kafka://{server.strip()}" for server in kafka.bootstrap_servers.split(",")],
            broker_credentials=_faust_credentials(kafka),
            datadir=str(self.data_dir),
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
            async for runs in stream.noack_take(
                settings.take_max_runs, within=settings.take_within_s
            ):
                await self._on_runs(runs)

        @app.timer(interval=settings.tick_interval_s)
        async def periodic() -> None:
            await self._periodic()

        @app.on_partitions_revoked.connect
        async def on_revoked(app: Any, revoked: Any, **_: Any) -> None:
            partitions = {tp.partition for tp in revoked if tp.topic == kafka.topic_ops}
            self._rebalancing = True
            for number in partitions:
                self._owned.pop(number, None)
            await self._release(partitions)

        @app.on_partitions_assigned.connect
        async def on_assigned(app: Any, assigned: Any, **_: Any) -> None:
            self._last_message = self._kafka_answered_at = time.monotonic()
            self._assigned = True
            # Owned from now on, before the first await: faust resumes fetching before this
            # handler ends, and a run of a partition not yet owned would be dropped after
            # the consumer moved past it (lost). One restored by a pass first is fine.
            generation = app.consumer_generation_id
            numbers = [tp.partition for tp in assigned if tp.topic == kafka.topic_ops]
            self._owned.update({number: generation for number in numbers})
            # Restored outside this handler: aiokafka sends no heartbeat until it returns,
            # and restoring every snapshot of a big assignment (or waiting behind a long
            # pass for the core's thread) can outlast the session timeout; the group then
            # drops this member and rebalances again, and again (a rebalance storm).
            self._restores_in_flight += 1
            task = asyncio.ensure_future(self._restore_assigned(numbers, generation))
            self._restore_tasks.add(task)
            task.add_done_callback(self._restore_tasks.discard)
            self._rebalancing = False

        @app.task
        async def side_topic_readers() -> None:
            # The jobs topic (read whole by every worker) and the dead-letter topic (its
            # partitions shared in a group of their own) each have a thread of their own.
            for target, name in (
                (self._read_jobs, "lagscope-jobs"),
                (self._read_dead_letters, "lagscope-dead-letters"),
            ):
                threading.Thread(target=target, name=name, daemon=True).start()

        return app

    async def _restore_assigned(self, numbers: list[int], generation: int) -> None:
        """Restore the partitions an assignment gave this worker (eagerly: a partition
        whose snapshot already covers its end gets no message, yet its jobs may still
        await their roll-up), and move the consumer back where an older snapshot ends.
        A partition revoked meanwhile is skipped; one a pass restored first is kept."""
        try:
            for number in numbers:
                # The ownership check and the core call's submission have no await between
                # them: a revocation's drop, submitted later, runs after this restore.
                if self._owned.get(number) != generation:
                    continue
                await self._core(self.core.partition, number)
            await self._rewind()
        except Exception:
            log.exception("restoring partitions %s failed; a pass restores them", numbers)
        finally:
            self._restores_in_flight -= 1
            self._last_message = time.monotonic()

    async def _rewind(self) -> None:
        """Move the consumer back where the core asks (`WorkerCore.take_seeks`), or to the
        first record Kafka still holds where retention deleted those the core needs (the
        core counts them as never read)."""
        from faust.types import TP

        seeks = await self._core(self.core.take_seeks)
        seeks = {TP(self.core.topic, n): offset for n, offset in seeks.items() if n in self._owned}
        if not seeks:
            return
        consumer = self.app.consumer
        try:
            first = await consumer.first_offsets(seeks)
            for tp, offset in seeks.items():
                kept = first.get(tp)
                if kept is not None and kept > offset:
                    await self._core(self.core.records_gone, tp.partition, kept)
                    seeks[tp] = kept
            await consumer.rewind(seeks)
        except Exception:
            # The core asks again (REWIND_RETRY_S) while the records it needs do not come.
            log.exception("moving the consumer back to %s failed; retrying", seeks)

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
        runs = self._current_runs(runs)
        messages = _ops_messages(runs)
        await self._wait_for_store()
        await self._wait_for_jobs(messages)
        # Whether Kafka holds more past this pass, told before the core takes it: a step
        # that opens an episode is written at once only when nothing more waits. A
        # partition this pass creates is told at the next tick (`_periodic`).
        await self._track_backlog(runs)
        # A rebalance may have come while this pass waited. No await between this filter
        # and the hand-over to the core.
        current = self._current_runs(runs)
        if len(current) < len(runs):
            runs, messages = current, _ops_messages(current)
        await self._core(self.core.on_messages, messages)
        self.health.progress.beat()
        if messages:
            self._kafka_answered_at = time.monotonic()
        await self._rewind()
        await self._checkpoint_due()

    def _current_runs(self, runs: list[Any]) -> list[Any]:
        """The runs of partitions this worker owns, fetched since the assignment that gave
        it each one. Another worker may own the others now: kept, a run would bring its
        partition back to life here, beside its owner (two writers of its steps, snapshots
        and offsets). And a partition revoked and assigned back to this worker starts
        again from its snapshot (or from Kafka's start): a run fetched before, still in
        faust's take buffer, would be the first records that state sees, and the records
        before it, fetched again, would be skipped as already processed (lost steps)."""
        owned = self._owned
        return [run for run in runs
                if owned.get(run.message.partition, -1) == run.message.generation_id]  # fmt: skip

    async def _track_backlog(self, runs: list[Any]) -> None:
        """Tell each partition of the pass whether Kafka holds more of it (its lateness
        then follows the records' own timestamps, see EventClock)."""
        consumer = self.app.consumer
        for run in runs:
            message = run.message
            if message.partition not in self._owned:
                continue  # revoked while the pass waited: aiokafka asserts on its highwater
            highwater = consumer.highwater(message.tp)
            behind = highwater is None or message.offset + 1 < highwater
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
        for number in self._update_lag():
            # No pass says so of a partition restored from a snapshot at its end (a
            # restart or a rebalance after its job's last records): on record time its
            # clock would never move, and a step some rank never finished would stay
            # open for good, unanalysed, the job never concluded, the worker never idle.
            await self._core(self.core.set_behind, number, False)
        await self._core(self.core.tick)
        self.health.tick()
        self._note_fetch_answers()
        self._say_when_kafka_is_back()
        await self._rewind()
        await self._checkpoint_due()
        idle_exit = self.config.worker.exit_when_idle_s
        if (
            idle_exit is not None
            and self._assigned
            and not self._stop.is_set()
            and not self._rebalancing
            and not self._restores_in_flight
            and self._idle_for(idle_exit)
            and self._dead_letters_idle.is_set()
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
                "peak_rss_mb": _peak_rss_mb(),
                "analysis_processes_peak_rss_mb": analysis_peak_rss_mb(),
            }
            print(json.dumps(summary), flush=True)
            self._stop.set()
            os.kill(os.getpid(), signal.SIGTERM)

    def _note_fetch_answers(self) -> None:
        """Kafka answers a fetch of an assigned partition about twice a second, records or
        none: the last answer counts, so that the outage's end is told even when the
        job's last records came before a client's last complaint (a producer retrying
        for its id while the restarted broker loads its state)."""
        try:
            consumer = self.app.consumer._thread._ensure_consumer()  # faust's aiokafka client
            assigned = consumer.assignment()
            stamps = [consumer.last_poll_timestamp(tp) for tp in assigned]
        except Exception:  # not started, or a rebalance under way: the next tick reads
            return
        stamps_ms = [stamp for stamp in stamps if stamp is not None]
        if stamps_ms:
            answered_at = time.monotonic() - (time.time() - max(stamps_ms) / 1000)
            self._kafka_answered_at = max(self._kafka_answered_at, answered_at)

    def _say_when_kafka_is_back(self) -> None:
        """One line once Kafka answered (records, a fetch, an assignment) after its clients'
        complaints stopped: the news an operator waits for after an outage (the errors
        are held back to a few lines, `repeated_lines.py`, and would otherwise just
        stop)."""
        outage = KAFKA_COMPLAINTS.take_outage(
            time.monotonic(), _KAFKA_QUIET_S, self._kafka_answered_at
        )
        # Only after complaints that repeated (some were held back): a rebalance's one or
        # two warnings are no outage.
        if outage is not None and outage.lines > outage.shown:
            log.info(
                "Kafka answers again: its clients' warnings and errors stopped after %.0f s "
                "(%d lines, %d of them logged)", outage.seconds, outage.lines, outage.shown,
            )  # fmt: skip

    def _idle_for(self, seconds: float) -> bool:
        return not self._passes_in_flight and time.monotonic() - self._last_message >= seconds

    async def _checkpoint_due(self) -> None:
        owned = [number for number in await self._core(lambda: list(self.core.partitions))
                 if number in self._owned]  # fmt: skip
        committed = await self._core(self.core.checkpoint_all_due, owned)
        if committed:
            await self._commit(committed)

    async def _commit(self, committed: dict[int, int]) -> None:
        """Commit offsets a durable snapshot covers (a failure only delays the commit)."""
        from faust.types import TP

        topic = self.core.topic
        # Kafka takes a group member's commit for any partition: only an owner's counts.
        committed = {n: o for n, o in committed.items() if n in self._owned}
        if not committed:
            return
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

        def checkpoint_held() -> None:
            # Together: one write and one snapshot insert, however many partitions go (a
            # worker leaving the group hands all of its jobs over, each a round trip).
            core = self.core
            core.checkpoints_of(sorted(n for n in partitions if n in core.partitions))

        try:
            await self._core(checkpoint_held)
        except Exception:
            log.exception("checkpoint of revoked partitions %s failed", sorted(partitions))
        for number in partitions:
            await self._core(self.core.drop_partition, number)
            self._lag.pop(number, None)

    def wait_for_broker(self) -> None:
        """Return once a Kafka broker answers (`worker_start.wait_for_broker`), the
        worker's loop beating meanwhile."""
        wait_for_broker(self.config, self.health.loop.beat)

    def wait_for_topics(self) -> None:
        """Return once the ops topic exists (`worker_start.wait_for_topics`)."""
        wait_for_topics(self.config)

    def run(self) -> None:
        from faust.worker import Worker

        self.serve_metrics()
        self.wait_for_broker()
        self.wait_for_topics()
        self._producer = self._make_producer()
        quiet_repeats("aiokafka")  # its loggers exist: faust's driver imported them
        logging.getLogger("mode.timers").addFilter(_overlap_as_debug)
        # Left out: faust logs what is printed as WARNING lines, and the idle exit's
        # summary (one JSON line on stdout, for scripts) is no warning.
        Worker(
            self.app, loglevel=logging.getLogger().level or logging.INFO, redirect_stdouts=False
        ).execute_from_commandline()

    def close(self) -> None:
        """Remove the state directory this worker made for itself (none it was given), and
        the store it made if it never reached Kafka (so stored nothing)."""
        if self._own_data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
        if self._producer is None and self._made_store is not None:
            self.sink.close()
            shutil.rmtree(self._made_store, ignore_errors=True)


def _overlap_as_debug(record: logging.LogRecord) -> bool:
    """faust's timers warn when a tick ran longer than its interval; the worker's tick
    waits for the core's one thread while a pass runs there (the first pass infers the
    job's model, a catch-up's passes hold many steps: a second or more), so for it that
    is the design, not news: a DEBUG line, shown only when the worker logs at DEBUG.

    >>> record = logging.LogRecord("mode.timers", logging.WARNING, "", 0,
    ...     "Timer %s is overlapping (interval=%r runtime=%r)", ("periodic", 0.5, 1.8), None)
    >>> _overlap_as_debug(record) == logging.getLogger("mode.timers").isEnabledFor(10)
    True
    >>> record.levelname
    'DEBUG'
    """
    if record.levelno == logging.WARNING and str(record.msg).startswith("Timer %s is overlapping"):
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
    return True


def state_directory(configured: Path | None) -> tuple[Path, bool]:
    """The worker's state directory, made when missing, and whether it was made for this
    run (a temporary one when none is configured: faust keeps nothing this worker needs
    after it exits). ConfigError, one line, when it cannot be made or written."""
    if configured is None:
        return Path(tempfile.mkdtemp(prefix="lagscope-worker-")), True
    try:
        configured.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"worker.data_dir (--data-dir) {configured}: cannot create it ({exc.strerror or exc})"
        ) from None
    if not os.access(configured, os.W_OK | os.X_OK):
        raise ConfigError(
            f"worker.data_dir (--data-dir) {configured}: not writable by this user "
            f"(uid {os.getuid()})"
        )
    return configured, False


def _serve_client_log(consumer: Any) -> None:
    """Hand the client's queued log lines to its logger now. librdkafka's lines reach the
    logger only from a poll: a reader waiting for its topic to exist (list_topics does not
    poll) kept an outage's connection errors queued until its close(), which logged them
    as fresh ERRORs while the worker exited, long after Kafka had come back."""
    consumer.poll(0)


def _caught_up(consumer: Any) -> bool:
    """Whether the consumer has read every record of its assigned partitions."""
    from confluent_kafka import KafkaException

    try:
        assignment = consumer.assignment()
        # Before its first fetch a partition has no position: its committed offset says
        # where the group is (negative: none).
        read_to = {
            (tp.topic, tp.partition): tp.offset for tp in consumer.committed(assignment, timeout=5)
        }
        for tp in consumer.position(assignment):
            low, high = consumer.get_watermark_offsets(tp, timeout=5)
            if high > max(tp.offset, read_to.get((tp.topic, tp.partition), -1), low):
                return False
    except KafkaException:
        return False
    return True


def _batch_job_id(message: OpsMessage) -> bytes | None:
    """The job id in a message's batch header; None for a message that is no batch (a
    garbage key or value must not make the worker wait for job metadata)."""
    try:
        return peek_header(message.value or b"")["job_id"].encode()
    except SchemaError:
        return None


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


def _ops_messages(runs: list[Any]) -> list[OpsMessage]:
    from lagscope.stream_app.fetch_runs import run_records

    return [
        OpsMessage(record.partition, record.offset, record.key, record.value,
                   record.timestamp / 1000 if record.timestamp is not None else 0.0)
        for run in runs
        for record in run_records(run.message)
    ]  # fmt: skip


def _peak_rss_mb() -> float:
    """The most memory this process held (MB), for sizing a worker. Linux's VmHWM: its
    getrusage maximum survives exec, so a worker started by a large process would
    report its parent's peak."""
    return peak_rss_mb("self") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
