"""What a worker's probes answer (`/healthz`, `/readyz` on its metrics port).

Liveness is judged from two heartbeats the worker's own loop beats, never from the HTTP
server's thread, which answers as long as the process lives:

- the loop: each tick of the faust event loop beats it once its first call into the core's
  one thread has returned. A core wedged in a call (a store that accepted a write and never
  answers) or an event loop that blocks stops it.
- progress: the core took records (or there was nothing to take). While the consumer has
  records waiting (consumer lag, a pass in flight) and the core takes none, it ages: a
  consumer that fetches nothing any more.

A worker is dead (restart it) when either is older than `worker.stall_s`. Before its loop's
first tick (waiting for Kafka, which beats the loop at each attempt, then joining the
group) it has `STARTUP_STALLS` times as long. A store that refuses writes holds the worker
back on purpose (what is closed waits in memory, the rest in Kafka): that is readiness'
business, not a reason to restart.

Readiness asks the two things the worker cannot work without, now: Kafka (a metadata
request) and the store (ClickHouse's `/ping`, and whether its last write failed).
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from lagscope.producers.config import KafkaSettings
from lagscope.producers.metrics import Heartbeat, Verdict
from lagscope.producers.redact import scrub, secret_values
from lagscope.store.dsn import parse_dsn

#: Seconds a readiness check waits for Kafka or the store.
CHECK_TIMEOUT_S = 3.0
#: Before the loop's first tick, a worker may go this many times `stall_s` without a beat
#: (faust's start and the group's first rebalance, after the wait for a broker).
STARTUP_STALLS = 5


class WorkerHealth:
    """The heartbeats a worker beats, and the verdicts its probes give."""

    def __init__(
        self,
        stall_s: float,
        kafka: KafkaSettings,
        dsn: str,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.loop = Heartbeat(stall_s, clock)
        self.progress = Heartbeat(stall_s, clock)
        #: Whether the loop has ticked once (`tick`): its start is over.
        self.started = False
        self._kafka = kafka
        self._store = parse_dsn(dsn)
        self._admin: Any = None
        self._admin_lock = threading.Lock()

    def tick(self) -> None:
        """The loop went round (its tick's first call into the core returned)."""
        self.started = True
        self.loop.beat()

    def live(self, *, has_work: bool) -> Verdict:
        """Dead once the loop stalled, or records wait and the core took none for
        `stall_s` (`has_work`: records wait, and the store is not what holds them back).

        >>> now = [0.0]
        >>> health = WorkerHealth(60, KafkaSettings(), "chdb://", clock=lambda: now[0])
        >>> now[0] = 250.0; health.live(has_work=True)[0]  # starting: 5 x 60 s allowed
        True
        >>> now[0] = 30.0; health.tick()
        >>> health.live(has_work=True)
        (True, 'the loop went round 0 s ago; records taken 30 s ago')
        >>> now[0] = 90.0; health.tick()
        >>> health.live(has_work=True)
        (False, 'records wait and the core has taken none for 90 s')
        >>> health.live(has_work=False)[0]  # nothing waits: nothing to take
        True
        >>> now[0] = 200.0
        >>> health.live(has_work=False)
        (False, "the worker's loop has not gone round for 110 s (a call into the core that never returned, or a blocked event loop)")
        """  # noqa: E501
        if not self.started:
            limit = STARTUP_STALLS * self.loop.stall_s
            if self.loop.age() > limit:
                return False, f"the worker's loop has not started in {self.loop.age():.0f} s"
            return True, "starting: waiting for Kafka or the group's first assignment"
        if self.loop.stale():
            return False, (
                f"the worker's loop has not gone round for {self.loop.age():.0f} s (a call "
                "into the core that never returned, or a blocked event loop)"
            )
        if not has_work:
            self.progress.beat()  # nothing to take: no stall of the consumer
        elif self.progress.stale():
            age = self.progress.age()
            return False, f"records wait and the core has taken none for {age:.0f} s"
        return True, (
            f"the loop went round {self.loop.age():.0f} s ago; records taken "
            f"{self.progress.age():.0f} s ago"
        )

    def ready(self, *, store_failing: bool) -> Verdict:
        """Ready while Kafka answers a metadata request and the store answers its ping and
        takes writes."""
        problems = [self._kafka_answers(), self._store_answers()]
        if store_failing:
            problems.append(f"the store {self._store.shown} refuses writes")
        found = [problem for problem in problems if problem is not None]
        if found:
            return False, "; ".join(found)
        return True, f"Kafka and the store {self._store.shown} answer"

    def _kafka_answers(self) -> str | None:
        """None when a broker answers; else why not (without a secret)."""
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient

        from lagscope.producers.kafka_login import kafka_client

        config = self._kafka.client_config()
        with self._admin_lock:
            if self._admin is None:
                self._admin = kafka_client(AdminClient, {**config, "log_level": 0})
            admin = self._admin
        try:
            admin.list_topics(timeout=CHECK_TIMEOUT_S)
        except KafkaException as exc:
            error = exc.args[0] if exc.args else exc
            reason = error.str() if hasattr(error, "str") else str(error)
            shown = scrub(f"Kafka at {config.get('bootstrap.servers')} does not answer "
                          f"({reason})", secret_values(config))  # fmt: skip
            return shown
        return None

    def _store_answers(self) -> str | None:
        """None when the store answers ClickHouse's `/ping` (an embedded store is in the
        process: nothing to reach); else why not (the DSN shown without its password)."""
        if self._store.kind != "http" or not self._store.url:
            return None
        parts = urlsplit(self._store.url)
        port = f":{parts.port}" if parts.port else ""
        ping = f"{parts.scheme}://{parts.hostname}{port}/ping"
        try:
            with urllib.request.urlopen(ping, timeout=CHECK_TIMEOUT_S) as answer:
                answer.read()
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", None) or exc
            return f"the store {self._store.shown} does not answer ({reason})"
        return None
