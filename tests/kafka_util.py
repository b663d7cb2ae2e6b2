"""Reading topics back in tests (a real consumer against the real broker)."""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition


@dataclass(frozen=True)
class Message:
    key: bytes | None
    value: bytes
    headers: dict[str, bytes]
    #: When its producer made it (epoch seconds: the record's CreateTime).
    timestamp_s: float = 0.0


def consume_all(bootstrap: str, topic: str, *, timeout_s: float = 60.0) -> list[Message]:
    """Every message of `topic` from the beginning to the current end of each partition."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"test-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
        }
    )
    try:
        deadline = time.monotonic() + timeout_s
        metadata = consumer.list_topics(topic, timeout=10)
        partitions = metadata.topics[topic].partitions
        if metadata.topics[topic].error is not None or not partitions:
            return []  # the topic was never written to
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        at_end: set[int] = set()
        out: list[Message] = []
        while len(at_end) < len(partitions):
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic} did not reach its end in {timeout_s}s")
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error() is not None:
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    at_end.add(msg.partition())
                    continue
                raise RuntimeError(f"consuming {topic}: {msg.error()}")
            at_end.discard(msg.partition())
            out.append(Message(msg.key(), msg.value(), dict(msg.headers() or []),
                               msg.timestamp()[1] / 1000))  # fmt: skip
        return out
    finally:
        consumer.close()


def measure_with_broker(prefix: str, measure: Callable[[str, Path, int], list[dict]]) -> list[dict]:
    """A live benchmark's `measure(bootstrap, work folder, repeat)` against the broker of
    `LAGSCOPE_KAFKA_BOOTSTRAP`, else a local one started for it
    (`LAGSCOPE_BENCH_LIVE_REPEAT`: how many times it runs its live jobs, 1 by default)."""
    from lagscope.deploy.kafka_local import KafkaBroker

    repeat = int(os.environ.get("LAGSCOPE_BENCH_LIVE_REPEAT", "1"))
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        work = Path(tmp)
        bootstrap = os.environ.get("LAGSCOPE_KAFKA_BOOTSTRAP")
        if bootstrap:
            return measure(bootstrap, work, repeat)
        with KafkaBroker(work / "kafka", initial_rebalance_delay_ms=3000) as broker:
            return measure(broker.bootstrap, work, repeat)
