"""One log line per kind of Kafka client complaint, not one per retry.

While the broker is away, aiokafka logs an ERROR at every retry of every request (a
connection, a metadata update, a fetch, the group coordinator), each ~100 ms: a 12 s
broker restart wrote 983 lines to a worker's log, and a ten-minute outage would bury the
one line that says what happened under some 50,000; its confluent-kafka clients (the
results producer, the jobs and dead-letter readers) added 600 more of librdkafka's. The
worker lets each kind of warning or error (its logger and format string; librdkafka's
facility) through once per window, and the next one after the window says how many like
it were held back since the last one shown. Lines below WARNING all pass: they are the
clients' news (an assignment after each rebalance, a coordinator found), not retries.

When the broker is back, the clients' complaints just stop: `Complaints` keeps the count
of an outage's lines (held back or not) so that the worker, once Kafka answers again
after the clients fell quiet (records, or a fetch's empty answer), says so in one line
and what the outage cost in lines.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import NamedTuple

#: Seconds between two lines of one kind.
WINDOW_S = 30.0


class Complaints:
    """The Kafka clients' warnings and errors since they last fell quiet.

    >>> complaints = Complaints()
    >>> for second, shown in ((0.0, True), (0.1, False), (0.2, False), (9.0, True)):
    ...     complaints.note(second, shown)
    >>> complaints.take_outage(now=9.5, quiet_s=2.0, answered_at=9.4) is None  # too soon
    True
    >>> complaints.take_outage(now=12.0, quiet_s=2.0, answered_at=8.0) is None  # no answer
    True
    >>> complaints.take_outage(now=12.0, quiet_s=2.0, answered_at=11.0)
    Outage(seconds=9.0, lines=4, shown=2)
    >>> complaints.take_outage(now=20.0, quiet_s=2.0, answered_at=19.0) is None  # told once
    True
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._first = self._last = 0.0
        self._lines = self._shown = 0

    def note(self, now: float, shown: bool) -> None:
        with self._lock:
            if not self._lines:
                self._first = now
            self._last = now
            self._lines += 1
            self._shown += shown

    def take_outage(self, now: float, quiet_s: float, answered_at: float) -> Outage | None:
        """The complaints so far as one outage, forgotten, if none came for `quiet_s` and
        Kafka answered (`answered_at`: records, a fetch's answer) after the last one."""
        with self._lock:
            if not self._lines or now - self._last < quiet_s or answered_at <= self._last:
                return None
            outage = Outage(round(self._last - self._first, 1), self._lines, self._shown)
            self._lines = self._shown = 0
            return outage


class Outage(NamedTuple):
    """An outage as the Kafka clients told it: seconds from their first complaint to their
    last, the lines they logged, and how many of those passed the filters."""

    seconds: float
    lines: int
    shown: int


#: The worker's Kafka clients' complaints (aiokafka's and librdkafka's filters note here).
KAFKA_COMPLAINTS = Complaints()


class RepeatedLines(logging.Filter):
    """A logger filter passing a kind of warning or error once per `window_s`.

    >>> now = [0.0]
    >>> logger = logging.getLogger("example.client")
    >>> logger.propagate = False
    >>> logger.setLevel(logging.INFO)
    >>> lines = []
    >>> handler = logging.Handler()
    >>> handler.emit = lambda record: lines.append(record.getMessage())
    >>> logger.addHandler(handler)
    >>> logger.addFilter(RepeatedLines(30.0, clock=lambda: now[0]))
    >>> for second in range(0, 40, 5):
    ...     now[0] = second
    ...     logger.error("Unable connect to node %d", 1)
    ...     logger.info("Setting newly assigned partitions")
    >>> [line for line in lines if "node" in line]
    ['Unable connect to node 1', 'Unable connect to node 1 (5 like it since the one 30 s ago)']
    >>> lines.count("Setting newly assigned partitions")
    8
    """

    def __init__(
        self,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        kind: Callable[[logging.LogRecord], Hashable] = lambda record: str(record.msg),
        complaints: Complaints | None = None,
    ):
        super().__init__()
        self.window_s = window_s
        self._clock = clock
        self._kind = kind
        self._complaints = complaints
        self._lock = threading.Lock()
        #: (logger, kind) -> when one last passed, lines held back since.
        self._seen: dict[tuple[str, Hashable], tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, self._kind(record))
        now = self._clock()
        with self._lock:
            passed_at, held = self._seen.get(key, (None, 0))
            shown = passed_at is None or now - passed_at >= self.window_s
            self._seen[key] = (now, 0) if shown else (passed_at, held + 1)
        if self._complaints is not None:
            self._complaints.note(now, shown)
        if not shown:
            return False
        if held:
            # Since the last one shown, however long ago: an outage's count may only be
            # told when the next line of its kind comes, minutes later.
            record.msg = f"{record.msg} ({held} like it since the one {now - passed_at:.0f} s ago)"
        return True


def quiet_repeats(prefix: str, window_s: float = WINDOW_S) -> RepeatedLines:
    """Put one `RepeatedLines` on every logger under `prefix` made so far (a logger's
    filters see only the lines logged to it, not those its children pass up)."""
    repeated = RepeatedLines(window_s, complaints=KAFKA_COMPLAINTS)
    names = [prefix, *(n for n in logging.root.manager.loggerDict if n.startswith(prefix + "."))]
    for name in names:
        logging.getLogger(name).addFilter(repeated)
    return repeated


def librdkafka_logger(name: str, window_s: float = WINDOW_S) -> logging.Logger:
    """A logger for a confluent-kafka client's `logger` setting, its repeated warnings and
    errors held back: the client logs every line as "%s [%s] %s" (facility, client name,
    text), so a kind of line is its facility (FAIL: a connection failed)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, RepeatedLines) for f in logger.filters):
        logger.addFilter(RepeatedLines(window_s, kind=_facility, complaints=KAFKA_COMPLAINTS))
    return logger


def _facility(record: logging.LogRecord) -> Hashable:
    return record.args[0] if isinstance(record.args, tuple) and record.args else str(record.msg)
