"""Questions before a Kafka client starts its loop: are its settings ones librdkafka knows,
does a broker answer (for a client that cannot wait for one), and does it accept our login?

librdkafka refuses a misspelt property (`sasl.pasword`) or a bad value by raising from
the client's constructor, deep in a command's start-up; and it retries a rejected SASL
login for ever, logging each try, so a wrong password would look like a broker that is
slow to answer. The streamer and the worker ask both once, up front, and each problem
becomes one `ConfigError` line naming the setting, or the broker, the user and the
mechanism, never a password (`producers.redact`). Any other failure (the broker is down,
the network is slow) is left to the clients' own reconnect logic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from lagscope.producers.config import ConfigError, KafkaSettings
from lagscope.producers.redact import scrub, secret_values

_Client = TypeVar("_Client")

#: Client errors that mean "no broker answers": an outage, reported once, not per attempt.
UNREACHABLE_ERRORS = frozenset({"_TRANSPORT", "_ALL_BROKERS_DOWN", "_RESOLVE"})


def quiet_client_log(name: str) -> logging.Logger:
    """The logger for a client's own librdkafka lines (its `logger` setting): one per
    failed connection attempt, several a second while a broker is down, written straight
    to stderr without it. Every error among them also reaches the client's `error_cb`,
    which says an outage once; they are kept below the level a command shows."""
    client_log = logging.getLogger(name)
    client_log.setLevel(logging.CRITICAL)
    return client_log


def kafka_client(factory: Callable[[dict[str, Any]], _Client], config: dict[str, Any]) -> _Client:
    """`factory(config)` (a confluent-kafka Producer, Consumer or AdminClient); settings
    librdkafka refuses are one ConfigError line without the values of secret settings."""
    from confluent_kafka import KafkaException

    try:
        return factory(config)
    except (KafkaException, ValueError, TypeError) as exc:
        error = exc.args[0] if exc.args else exc
        reason = error.str() if hasattr(error, "str") else str(error)
        raise ConfigError(
            f"Kafka client settings (kafka.* settings, kafka.client_options, --kafka-option): "
            f"{scrub(reason, secret_values(config))}"
        ) from None


def check_kafka_settings(kafka: KafkaSettings) -> None:
    """Raise ConfigError when librdkafka refuses a setting of `kafka` (a misspelt
    property, a bad value, an unreadable certificate file). Connects to nothing: the
    client it builds is dropped before its first connection matters."""
    from confluent_kafka import Producer

    producer = kafka_client(Producer, {**kafka.client_config(), "log_level": 0})
    producer.purge()
    del producer


def check_kafka_login(
    kafka: KafkaSettings, timeout_s: float = 15.0, *, broker_required: bool = True
) -> None:
    """Raise ConfigError when a setting of `kafka` is refused (`check_kafka_settings`),
    when the broker rejects its SASL login (its `client_options`, e.g. `--kafka-option`,
    included; not tried without SASL), or, with `broker_required`, when no broker answers
    within `timeout_s` (`check_kafka_reachable`): the worker's faust app cannot start
    without one and would stop with a traceback. The streamer passes False: it waits for
    Kafka, and the logs keep everything meanwhile."""
    check_kafka_settings(kafka)
    config = kafka.client_config()
    if not str(config.get("security.protocol", "")).upper().startswith("SASL"):
        if broker_required:
            check_kafka_reachable(kafka, timeout_s)
        return
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient

    rejected: list[str] = []

    def on_error(err: Any) -> None:
        if err.code() in (KafkaError._AUTHENTICATION, KafkaError.SASL_AUTHENTICATION_FAILED):
            rejected.append(err.str())

    # log_level 0: the rejection is reported once, by us, not by librdkafka at every retry.
    admin = kafka_client(AdminClient, {**config, "error_cb": on_error, "log_level": 0})
    deadline = time.monotonic() + timeout_s
    while not rejected and time.monotonic() < deadline:
        try:
            admin.list_topics(timeout=1.0)
            return
        except KafkaException:
            admin.poll(0.1)  # deliver error callbacks
    if rejected:
        reason = rejected[0].split(": ", 1)[-1]
        message = (
            f"Kafka at {config.get('bootstrap.servers')} rejected the login of user "
            f"{config.get('sasl.username')!r} ({config.get('sasl.mechanism')} over "
            f"{config.get('security.protocol')}): {reason}"
        )
        raise ConfigError(scrub(message, secret_values(config)))
    if broker_required:
        raise ConfigError(_unreachable(config, timeout_s, "no answer"))


def check_kafka_reachable(kafka: KafkaSettings, timeout_s: float = 15.0) -> None:
    """Raise ConfigError when no broker of `kafka` answers within `timeout_s`: for a client
    that cannot start without one (the worker's faust app stops at once with a traceback),
    unlike the streamer, which waits for Kafka and keeps the logs meanwhile."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    config = kafka.client_config()
    admin = kafka_client(AdminClient, {**config, "log_level": 0})
    deadline = time.monotonic() + timeout_s
    reason = f"no answer in {timeout_s:g} s"
    while time.monotonic() < deadline:
        try:
            admin.list_topics(timeout=min(2.0, max(0.1, deadline - time.monotonic())))
            return
        except KafkaException as exc:
            error = exc.args[0] if exc.args else exc
            reason = error.str() if hasattr(error, "str") else str(error)
    raise ConfigError(_unreachable(config, timeout_s, reason))


def _unreachable(config: dict[str, Any], timeout_s: float, reason: str) -> str:
    return scrub(
        f"no Kafka broker answers at {config.get('bootstrap.servers')} "
        f"({config.get('security.protocol')}) after {timeout_s:g} s: {reason}",
        secret_values(config),
    )
