"""Prometheus metrics of the streamer and the worker (`--metrics-port`).

Both components already count what they do in plain Python (the streamer's
`StreamerStats`, the worker core's counters); the endpoint reads those counts when it is
scraped, so the hot paths pay nothing for it, and a custom collector turns them into
metric families. prometheus_client (the `sidecar` extra) is imported only when a port is
set: a training node's plain install never loads it, and this module imports nothing
heavy. Each Streamer or worker serves its own `CollectorRegistry` (several can live in one
process, as in the tests) from an HTTP server in a daemon thread, with the process's own
metrics (`process_*`, `python_info`) and `lagscope_build_info`.

The same port answers the orchestrator's probes: `/healthz` (liveness) and `/readyz`
(readiness), 200 or 503 with one line saying why. What they judge is the component's:
a heartbeat its own loop updates, not this server's thread, which answers as long as the
process lives (a worker whose loop is wedged would otherwise look alive for ever).

Names follow Prometheus conventions: a `lagscope_streamer_` or `lagscope_worker_` prefix,
base units (seconds, bytes), `_total` for counters. The list is in deploy/README.md.
"""

from __future__ import annotations

import bisect
import logging
import platform
import socket
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
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


#: A probe's answer: healthy or not, and one line saying why.
Verdict = tuple[bool, str]


@dataclass(frozen=True)
class Probes:
    """What `/healthz` and `/readyz` answer (each called in the server's thread)."""

    live: Callable[[], Verdict]
    ready: Callable[[], Verdict]


class Heartbeat:
    """When a loop last went round (monotonic seconds), beaten by the loop itself; `stale`
    says whether it has been quiet for longer than `stall_s`."""

    def __init__(self, stall_s: float, clock: Callable[[], float] | None = None) -> None:
        import time

        self.stall_s = stall_s
        self._clock = clock or time.monotonic
        self.at = self._clock()

    def beat(self) -> None:
        self.at = self._clock()

    def age(self) -> float:
        return self._clock() - self.at

    def stale(self) -> bool:
        return self.age() > self.stall_s


class MetricsServer:
    """The HTTP endpoint (`/metrics`, and with probes `/healthz`, `/readyz`) of one
    registry; `close()` stops it."""

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
    collect: Callable[[], Iterable[Any]],
    port: int,
    addr: str,
    *,
    what: str,
    probes: Probes | None = None,
) -> MetricsServer:
    """Serve the metric families `collect()` yields on http://addr:port/metrics (port 0:
    any free port; `MetricsServer.port` and the log line say which), with the process's
    metrics and `lagscope_build_info{component=what}`, and `probes` on /healthz and
    /readyz. Raises OSError when the port is taken."""
    from wsgiref.simple_server import make_server

    from prometheus_client import (
        CollectorRegistry,
        GCCollector,
        PlatformCollector,
        ProcessCollector,
        make_wsgi_app,
    )

    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    registry.register(_Collector(lambda: [build_info(what), *collect()]))
    app = _with_probes(make_wsgi_app(registry), probes)
    server = make_server(
        addr, port, app, server_class=_server_class(addr, port), handler_class=_quiet_handler()
    )
    thread = threading.Thread(target=server.serve_forever, name=f"{what}-metrics", daemon=True)
    thread.start()
    metrics = MetricsServer(server, thread, registry)
    log.info("%s metrics on http://%s:%d/metrics", what, addr, metrics.port)
    return metrics


def build_info(component: str) -> Any:
    """`lagscope_build_info{component, version, python} 1`: which build runs where (join
    it to any other series by instance), and a series that exists whenever the process
    is scraped."""
    from lagscope import __version__

    return labelled_gauge(
        "lagscope_build_info",
        "The lagscope build of this process (always 1).",
        ["component", "version", "python"],
        {(component, __version__, platform.python_version()): 1},
    )


def _with_probes(metrics_app: Any, probes: Probes | None) -> Any:
    """The WSGI app: /healthz and /readyz from `probes`, everything else the metrics."""
    routes = {} if probes is None else {"/healthz": probes.live, "/readyz": probes.ready}

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        probe = routes.get(environ.get("PATH_INFO", ""))
        if probe is None:
            return metrics_app(environ, start_response)
        try:
            healthy, reason = probe()
        except Exception as exc:  # a probe that cannot answer is not a healthy answer
            healthy, reason = False, f"the probe failed: {exc!r}"
        status = "200 OK" if healthy else "503 Service Unavailable"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
        return [(("ok: " if healthy else "failing: ") + reason + "\n").encode()]

    return app


def _server_class(addr: str, port: int) -> Any:
    """A threading WSGI server of the address family `addr` resolves to (IPv6 too)."""
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIServer

    infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family = infos[0][0] if infos else socket.AF_INET

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        address_family = family

    return Server


def _quiet_handler() -> Any:
    """wsgiref's request handler without its access log line on stderr per scrape."""
    from wsgiref.simple_server import WSGIRequestHandler

    class Handler(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


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
