"""How a worker starts against Kafka: it waits for a broker to answer, then for its ops
topic, which it makes (with the jobs and dead-letter topics, as the streamer makes them)
where it may. A cluster's workers often start before its broker, and always before any
streamer has written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from lagscope.producers.config import ConfigError
from lagscope.producers.kafka_login import kafka_client
from lagscope.producers.redact import scrub, secret_values
from lagscope.producers.topics import make_topics, topic_ready
from lagscope.stream_app.worker_config import WorkerConfig

log = logging.getLogger("lagscope.worker")


def wait_for_broker(config: WorkerConfig, beat: Callable[[], None]) -> None:
    """Return once a Kafka broker answers; until then, one line per attempt (the
    worker cannot consume without one, and a broker that comes up later is the
    common case of a cluster starting). With `exit_when_idle_s`, a broker that has not
    answered within it is a ConfigError (one line), as `lagscope stream` gives up."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    client = config.kafka.client_config()
    servers = client.get("bootstrap.servers")
    admin = kafka_client(AdminClient, {**client, "log_level": 0})
    retry_s = config.worker.broker_retry_s
    give_up_s = config.worker.exit_when_idle_s
    began = time.monotonic()
    attempt = 0
    while True:
        attempt += 1
        beat()  # waiting for a broker is what the worker does now
        try:
            admin.list_topics(timeout=retry_s)
            if attempt > 1:
                log.info("Kafka at %s answers: starting", servers)
            return
        except KafkaException as exc:
            error = exc.args[0] if exc.args else exc
            reason = scrub(
                error.str() if hasattr(error, "str") else str(error), secret_values(client)
            )
        waited = time.monotonic() - began
        if give_up_s is not None and waited >= give_up_s:
            raise ConfigError(
                f"no Kafka broker answers at {scrub(str(servers), secret_values(client))} "
                f"after {waited:.0f} s ({reason}); nothing was consumed"
            )
        log.warning(
            "Kafka at %s does not answer (%s); attempt %d, retrying every %g s",
            scrub(str(servers), secret_values(client)), reason, attempt, retry_s,
        )  # fmt: skip
        time.sleep(retry_s)


def wait_for_topics(config: WorkerConfig) -> None:
    """Return once the ops topic exists, made here when it was missing (with the jobs
    and dead-letter topics, as the streamer makes them: `producers/topics.py`), or,
    where this worker may not make topics, once someone else did. One line says which.
    A worker subscribed to a topic that does not exist yet is assigned nothing and
    looks for it again only minutes later: on a fresh cluster, whose workers start
    before any streamer, it consumed nothing of the job that ran meanwhile. With
    `exit_when_idle_s`, a topic that has not appeared within it is a ConfigError."""
    from confluent_kafka.admin import AdminClient

    kafka = config.kafka
    client = kafka.client_config()
    admin = kafka_client(AdminClient, {**client, "log_level": 0})
    # Made before anything asks for their metadata: a broker that creates topics on
    # demand would make them at that request, without the jobs topic's compaction.
    made = make_topics(admin, kafka)
    if not made.created and topic_ready(admin, kafka.topic_ops):
        return  # the common case: a cluster that ran before
    began = time.monotonic()
    if not made.created:
        failed = made.failed.get(kafka.topic_ops) or next(iter(made.failed.values()), None)
        reason = scrub(str(failed), secret_values(client)) if failed else "not made yet"
        log.warning("topic %s does not exist and this worker could not create it (%s): "
                    "waiting for it, subscribing once it appears", kafka.topic_ops,
                    reason)  # fmt: skip
    give_up_s = config.worker.exit_when_idle_s
    while not topic_ready(admin, kafka.topic_ops):
        waited = time.monotonic() - began
        if give_up_s is not None and waited >= give_up_s:
            raise ConfigError(
                f"topic {kafka.topic_ops} did not appear in {waited:.0f} s and could not "
                "be created; nothing was consumed"
            )
        time.sleep(1.0)
        if not made.created:  # a refusal may pass (a broker still starting)
            made = make_topics(admin, kafka)
    if made.created:
        log.info("topic(s) %s were missing: created them; subscribing",
                 made.describe_created(kafka))  # fmt: skip
    else:
        log.info("topic %s appeared after %.0f s (made by another client): subscribing",
                 kafka.topic_ops, time.monotonic() - began)  # fmt: skip
