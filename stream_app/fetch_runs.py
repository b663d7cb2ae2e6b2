"""A faust app whose agent receives the ops topic one fetched run at a time.

Why: faust turns every Kafka record into a message, an event and two asyncio tasks on the
event loop (decode, flow-control wait, stream hand-off, ack bookkeeping), about 160 us of
Python per record. At a million op events per second (5,500 rank-step batches per second)
that alone took a quarter of each worker's core, on the same GIL as the analysis. The
worker needs none of it per record: it windows batches itself and commits offsets only
after a snapshot covers them.

So, for the topics named in `RunsApp.run_topics`, the consumer hands the agent one message
per partition per fetch (a *run*): its value is the tuple of the fetched records, in
offset order, and its offset is the last record's. Everything else stays faust's: the
consumer group and its rebalances, flow control (a run fetched before a rebalance is
dropped like a record would be), the agent, its stream and timers, the other topics.

Offsets of run topics are not tracked by faust's acks (the topic is declared with
`acks=False`); the host commits them itself with `commit_offsets` once its snapshot covers
them (see `stream_app.worker`, crash safety).

The host also moves a run topic's partitions back itself (`rewind`): a partition's records
reach it in offset order, and where the consumer is past what its analysis took, it must
read them again. faust's own filter of records below the last one it delivered (its read
offsets) is left out for run topics: after such a seek, the rest of a run fetched before it
would raise that mark past the records fetched again, and faust would drop them. The host
skips what it already took by offset.

This relies on faust internals, pinned by the version range in pyproject and covered by
the worker tests against the real broker: `Consumer.getmany` (overridden here),
`Consumer._commit` (the commit of explicit offsets), `Consumer._read_offset` and the
consumer thread's `call_thread`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import faust
from faust.serializers.codecs import Codec
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP


class PassThroughCodec(Codec):
    """A run's value is already Python objects (the records): decode nothing."""

    def _loads(self, s: Any) -> Any:
        return s

    def _dumps(self, s: Any) -> Any:
        return s


class _ReadOffsets(defaultdict):
    """faust's read offsets (the last offset delivered of each partition, below which it
    drops records), kept for every topic but the run topics."""

    def __init__(self, run_topics: frozenset[str]):
        super().__init__(lambda: None)
        self.run_topics = run_topics

    def __getitem__(self, tp: TP) -> int | None:
        return None if tp.topic in self.run_topics else super().__getitem__(tp)

    def __setitem__(self, tp: TP, offset: int | None) -> None:
        if tp.topic not in self.run_topics:
            super().__setitem__(tp, offset)


class RunConsumer(faust_aiokafka.Consumer):
    """faust's aiokafka consumer, yielding one message per fetched run on run topics."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._read_offset = _ReadOffsets(getattr(self.app, "run_topics", frozenset()))

    async def first_offsets(self, partitions: Iterable[TP]) -> dict[TP, int]:
        """The first offset Kafka still holds of each partition (retention deleted the
        records before it)."""
        thread = self._thread
        found = await thread.call_thread(thread._ensure_consumer().beginning_offsets,
                                         list(partitions))  # fmt: skip
        return dict(found)

    async def rewind(self, offsets: Mapping[TP, int]) -> None:
        """Move the consumer of these partitions (those still assigned) to these offsets.

        In the consumer's own thread: aiokafka's seek is not thread-safe, and faust's
        `seek` calls it from the event loop's thread, where it raced the fetcher
        (KeyError in `fetched_records`)."""
        thread = self._thread
        consumer = thread._ensure_consumer()

        def seek() -> None:
            assigned = consumer.assignment()
            for tp, offset in offsets.items():
                if tp in assigned:
                    consumer.seek(tp, offset)

        await thread.call_thread(seek)

    async def getmany(self, timeout: float) -> AsyncIterator[tuple[TP, Any]]:
        records, active_partitions = await self._wait_next_records(timeout)
        if records is None or self.should_stop:
            return
        if not self.flow_active:
            # As faust does: records fetched while the flow is stopped (a rebalance) are
            # dropped and the partitions sought back to their committed offsets.
            try:
                await self.perform_seek()
            except Exception as exc:  # as faust does: log and go on
                self.log.warning("seek while flow not active failed: %r", exc)
            return
        generation_id = self.app.consumer_generation_id
        run_topics = getattr(self.app, "run_topics", frozenset())
        for tp, tp_records in records.items():
            if not self.flow_active or self.app.consumer_generation_id != generation_id:
                break
            if not (
                active_partitions is None
                or tp in active_partitions
                or tp in self._buffered_partitions
            ):
                continue
            self.app.monitor.track_tp_end_offset(tp, self.highwater(tp))
            if tp.topic in run_topics:
                if tp_records:
                    yield tp, self._to_run(tp, tp_records)
            else:
                for record in tp_records:
                    yield tp, self._to_message(tp, record)

    def _to_run(self, tp: TP, records: list[Any]) -> Any:
        last = records[-1]
        timestamp = last.timestamp / 1000.0 if last.timestamp is not None else None
        return faust_aiokafka.ConsumerMessage(
            last.topic,
            last.partition,
            last.offset,
            timestamp,
            last.timestamp_type,
            None,
            None,
            tuple(records),
            None,
            0,
            sum(record.serialized_value_size for record in records),
            tp,
            generation_id=self.app.consumer_generation_id,
        )


class RunTransport(faust_aiokafka.Transport):
    Consumer = RunConsumer


class RunsApp(faust.App):
    """A faust app whose consumer delivers `run_topics` as fetched runs."""

    def __init__(self, *args: Any, run_topics: frozenset[str] = frozenset(), **kwargs: Any):
        self.run_topics = frozenset(run_topics)
        super().__init__(*args, **kwargs)

    def _new_transport(self) -> Any:
        return RunTransport(self.conf.broker_consumer, self)

    async def commit_offsets(self, offsets: Mapping[TP, int]) -> bool:
        """Commit these next-offsets now (partitions no longer assigned are skipped)."""
        consumer = self.consumer
        assigned = consumer.assignment()
        owned = {tp: offset for tp, offset in offsets.items() if tp in assigned}
        if not owned:
            return False
        done = await consumer._commit(owned)
        if done:
            consumer._committed_offset.update(owned)
        return bool(done)


def run_records(message: Any) -> tuple[Any, ...]:
    """The records of a run message (aiokafka ConsumerRecords, offset order)."""
    return message.value
