"""One question before a Kafka client starts its loop: does the broker accept our login?

librdkafka retries a rejected SASL login for ever, logging each try, so a wrong password
would look like a broker that is slow to answer. The streamer and the worker ask once,
up front, and a rejection becomes one `ConfigError` line naming the broker, the user and
the mechanism (never the password). Any other failure (the broker is down, the network is
slow) is left to the clients' own reconnect logic.
"""

from __future__ import annotations

import time
from typing import Any

from lagscope.producers.config import ConfigError, KafkaSettings


def check_kafka_login(kafka: KafkaSettings, timeout_s: float = 15.0) -> None:
    """Raise ConfigError when the broker rejects the SASL login of `kafka` (its
    `client_options`, e.g. `--kafka-option`, included). No-op without SASL."""
    config = kafka.client_config()
    if not str(config.get("security.protocol", "")).upper().startswith("SASL"):
        return
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient

    rejected: list[str] = []

    def on_error(err: Any) -> None:
        if err.code() in (KafkaError._AUTHENTICATION, KafkaError.SASL_AUTHENTICATION_FAILED):
            rejected.append(err.str())

    # log_level 0: the rejection is reported once, by us, not by librdkafka at every retry.
    admin = AdminClient({**config, "error_cb": on_error, "log_level": 0})
    deadline = time.monotonic() + timeout_s
    while not rejected and time.monotonic() < deadline:
        try:
            admin.list_topics(timeout=1.0)
            return
        except KafkaException:
            admin.poll(0.1)  # deliver error callbacks
    if rejected:
        reason = rejected[0].split(": ", 1)[-1]
        raise ConfigError(
            f"Kafka at {config.get('bootstrap.servers')} rejected the login of user "
            f"{config.get('sasl.username')!r} ({config.get('sasl.mechanism')} over "
            f"{config.get('security.protocol')}): {reason}"
        )
