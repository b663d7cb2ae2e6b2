"""The Kafka topics lagscope reads and writes, made where they are missing.

Both ends of the pipeline make them: the streamer before its first batch, and a worker
before it subscribes. On a fresh cluster the operator starts the workers first; a worker
subscribed to a topic that did not exist yet was assigned nothing, and its client looks
for new topics only every few minutes, so it consumed nothing of the job that then ran.

What is made: `lagscope.ops` and `lagscope.deadletter` with `kafka.ops_partitions`
partitions (unset: the broker's `num.partitions`), `lagscope.jobs` with one partition and
compaction (one record per job attempt stays), each with the broker's replication factor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lagscope.producers.config import KafkaSettings


@dataclass
class TopicsMade:
    """What one attempt to make the topics found: the topics it created, those that were
    there already, and those it could not make with the reason."""

    created: list[str] = field(default_factory=list)
    existed: list[str] = field(default_factory=list)
    failed: dict[str, BaseException] = field(default_factory=dict)

    def describe_created(self, kafka: KafkaSettings) -> str:
        """The created topics as a log line names them, with what they were made with.

        >>> made = TopicsMade(created=["lagscope.ops", "lagscope.jobs"])
        >>> made.describe_created(KafkaSettings(ops_partitions=8))
        'lagscope.ops (8 partitions), lagscope.jobs (1 partition, compacted)'
        """
        shown = []
        for name in self.created:
            if name == kafka.topic_jobs:
                shown.append(f"{name} (1 partition, compacted)")
            elif kafka.ops_partitions is not None:
                shown.append(f"{name} ({kafka.ops_partitions} partitions)")
            else:
                shown.append(f"{name} (the broker's default partitions)")
        return ", ".join(shown)


def wanted_topics(kafka: KafkaSettings) -> list[Any]:
    """The topics as confluent-kafka's admin client creates them."""
    from confluent_kafka.admin import NewTopic

    partitions = kafka.ops_partitions if kafka.ops_partitions is not None else -1
    return [
        NewTopic(kafka.topic_ops, num_partitions=partitions, replication_factor=-1),
        NewTopic(kafka.topic_deadletter, num_partitions=partitions, replication_factor=-1),
        NewTopic(
            kafka.topic_jobs,
            num_partitions=1,
            replication_factor=-1,
            config={"cleanup.policy": "compact"},
        ),
    ]


def make_topics(admin: Any, kafka: KafkaSettings, timeout_s: float = 10.0) -> TopicsMade:
    """Create the topics that are missing through `admin` (an AdminClient); a topic that
    exists is left as it is. Never raises for a refusal: it is in `failed`."""
    from confluent_kafka import KafkaException

    topics = wanted_topics(kafka)
    made = TopicsMade()
    try:
        futures = admin.create_topics(topics, request_timeout=timeout_s)
    except KafkaException as exc:
        made.failed = {topic.topic: exc for topic in topics}
        return made
    for name, future in futures.items():
        try:
            future.result(timeout=timeout_s)
            made.created.append(name)
        except Exception as exc:
            if "TOPIC_ALREADY_EXISTS" in str(exc):
                made.existed.append(name)
            else:
                made.failed[name] = exc
    return made


def topic_ready(client: Any, topic: str, timeout_s: float = 5.0) -> bool:
    """Whether the broker's metadata holds `topic` with its partitions (a client that
    subscribes to it then is assigned them)."""
    from confluent_kafka import KafkaException

    try:
        found = client.list_topics(topic, timeout=timeout_s).topics.get(topic)
    except KafkaException:
        return False
    return found is not None and found.error is None and bool(found.partitions)
