"""One log line per kind of Kafka client complaint, not one per retry.

While the broker is away, aiokafka logs an ERROR at every retry of every request (a
connection, a metadata update, a fetch, the group coordinator), each ~100 ms: a 12 s
broker restart wrote 983 lines to a worker's log, and a ten-minute outage would bury the
one line that says what happened under some 50,000; its confluent-kafka clients (the
results producer, the jobs and dead-letter readers) added 600 more of librdkafka's. The
worker lets each kind of warning or error (its logger and format string; librdkafka's
facility) through once per window, and the next one after the window says how many like
it were held back. Lines below WARNING all pass: they are the clients' news (an
assignment after each rebalance, a coordinator found), not retries.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable

#: Seconds between two lines of one kind.
WINDOW_S = 30.0


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
    ['Unable connect to node 1', 'Unable connect to node 1 (5 like it in the last 30 s)']
    >>> lines.count("Setting newly assigned partitions")
    8
    """

    def __init__(
        self,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
        kind: Callable[[logging.LogRecord], Hashable] = lambda record: str(record.msg),
    ):
        super().__init__()
        self.window_s = window_s
        self._clock = clock
        self._kind = kind
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
            if passed_at is not None and now - passed_at < self.window_s:
                self._seen[key] = (passed_at, held + 1)
                return False
            self._seen[key] = (now, 0)
        if held:
            record.msg = f"{record.msg} ({held} like it in the last {self.window_s:.0f} s)"
        return True


def quiet_repeats(prefix: str, window_s: float = WINDOW_S) -> RepeatedLines:
    """Put one `RepeatedLines` on every logger under `prefix` made so far (a logger's
    filters see only the lines logged to it, not those its children pass up)."""
    repeated = RepeatedLines(window_s)
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
        logger.addFilter(RepeatedLines(window_s, kind=_facility))
    return logger


def _facility(record: logging.LogRecord) -> Hashable:
    return record.args[0] if isinstance(record.args, tuple) and record.args else str(record.msg)
