"""Prometheus metrics of the streamer and the worker (`--metrics-port`).

Both components already count what they do in plain Python (the streamer's
`StreamerStats`, the worker core's counters); the endpoint reads those counts when it is
scraped, so the hot paths pay nothing for it, and a custom collector turns them into
metric families. prometheus_client (the `sidecar` extra) is imported only when a port is
set: a training node's plain install never loads it, and this module imports nothing
heavy. Each Streamer or worker serves its own `CollectorRegistry` (several can live in one
process, as in the tests), over `prometheus_client.start_http_server` in a daemon thread.

Names follow Prometheus conventions: a `lagscope_streamer_` or `lagscope_worker_` prefix,
base units (seconds, bytes), `_total` for counters. The list is in deploy/README.md.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

log = logging.getLogger("lagscope.metrics")

#: Upper bounds (seconds) of the step processing histogram's buckets.
STEP_SECONDS_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class SecondsHistogram:
    """A histogram kept in plain Python: `observe` is one bisect and two additions, and
    the exposition (cumulative buckets) is built at scrape time. The +Inf bucket and the
    count both come from the same bucket counts, so a scrape never shows them apart."""

    def __init__(self, bounds: Sequence[float] = STEP_SECONDS_BUCKETS) -> None:
        self.bounds = tuple(sorted(bounds))
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        # Prometheus buckets are `le` (less or equal): the first bound >= the value.
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        counts = list(self.counts)  # one copy: the buckets of a scrape add up
        out, running = [], 0
        for bound, n in zip((*self.bounds, float("inf")), counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


class MetricsServer:
    """The HTTP endpoint (`/metrics`) of one registry; `close()` stops it."""

    def __init__(self, server: Any, thread: Any, registry: Any) -> None:
        self._server = server
        self._thread = thread
        self.registry = registry

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    @property
    def address(self) -> str:
        return str(self._server.server_address[0])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


class _Collector:
    def __init__(self, collect: Callable[[], Iterable[Any]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Any]:
        return self._collect()


def serve(
    collect: Callable[[], Iterable[Any]], port: int, addr: str, *, what: str
) -> MetricsServer:
    """Serve the metric families `collect()` yields on http://addr:port/metrics (port 0:
    any free port; `MetricsServer.port` and the log line say which). Raises OSError when
    the port is taken."""
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(collect))
    server, thread = start_http_server(port, addr, registry=registry)
    metrics = MetricsServer(server, thread, registry)
    log.info("%s metrics on http://%s:%d/metrics", what, addr, metrics.port)
    return metrics


def counter(name: str, documentation: str, value: float) -> Any:
    from prometheus_client.core import CounterMetricFamily

    return CounterMetricFamily(name, documentation, value=value)


def labelled_counter(
    name: str, documentation: str, labels: Sequence[str], values: Mapping[tuple[str, ...], float]
) -> Any:
    from prometheus_client.core import CounterMetricFamily

    return _labelled(CounterMetricFamily, name, documentation, labels, values)


def gauge(name: str, documentation: str, value: float) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    return GaugeMetricFamily(name, documentation, value=value)


def labelled_gauge(
    name: str, documentation: str, labels: Sequence[str], values: Mapping[tuple[str, ...], float]
) -> Any:
    from prometheus_client.core import GaugeMetricFamily

    return _labelled(GaugeMetricFamily, name, documentation, labels, values)


def _labelled(
    family_type: Any,
    name: str,
    documentation: str,
    labels: Sequence[str],
    values: Mapping[tuple[str, ...], float],
) -> Any:
    family = family_type(name, documentation, labels=list(labels))
    for label_values, value in values.items():
        family.add_metric(list(label_values), value)
    return family


def histogram(name: str, documentation: str, hist: SecondsHistogram) -> Any:
    from prometheus_client.core import HistogramMetricFamily

    return HistogramMetricFamily(
        name, documentation, buckets=hist.cumulative(), sum_value=hist.sum, unit="seconds"
    )
