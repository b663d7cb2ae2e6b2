"""The dashboards at production size: every query of every dashboard, rendered as Grafana
and the ClickHouse plugin render it, on a store holding a long job of 12,288 or 99,840 GPUs.

The store: a generated job (dp x pp 8 x tp 8, 16 micro-batches, one slow worker, 8 GPUs a
machine) through a worker's core into an embedded chDB store, then its steps, attribution
and worker rows copied forward in SQL (later steps, later times) to a day of 10 s steps
(12,288 GPUs: 13 M worker rows) or two hours of 5 s steps (99,840 GPUs: 18 M), and merged
once. Each query runs RUNS times over the job's last hour and over the whole job, with
Grafana's interval for a panel about 1,000 points wide; a row gives the slowest query's
median time and the most rows one query returns (what Grafana fetches and draws), with
every query's figures beside them in the JSON.
"""

from __future__ import annotations

import datetime as dt
import statistics
import tempfile
import time
from collections.abc import Iterator

RUNS = 3
#: (dp, steps through the pipeline, copies added in SQL): pp 8 x tp 8 each.
SIZES = ((192, 60, 143), (1560, 10, 143))
#: A panel is about this many points wide: Grafana sizes `$__interval` so.
POINTS = 1000


def _fill(path: str, dp: int, steps: int) -> None:
    """The generated job (one worker 1.6x slower over its middle third) through a worker's
    core into the chDB store at `path`."""
    from lagscope.simulator.generate import JobSpec, SlowWorker
    from lagscope.store.sink import ClickHouseSink
    from tests.generated_store import store_generated_job

    slow = SlowWorker(dp=dp // 3, stage=3, factor=1.6, start_step=steps // 3,
                      end_step=2 * steps // 3)  # fmt: skip
    spec = JobSpec(dp=dp, pp=8, tp=8, microbatches=16, steps=steps, seed=11, stragglers=(slow,))
    with ClickHouseSink(f"chdb://{path}") as sink:
        store_generated_job(sink, spec, "big", time.time() - 3600, gpus_per_node=8)


def _stretch(sink, copies: int) -> int:
    """Copy the job's per-step rows `copies` times forward (steps and times shifted by the
    job's length each time); returns the job's steps."""
    _, rows = sink.query("SELECT max(step) + 1, dateDiff('ms', min(ts), max(ts)) FROM steps")
    n_steps, span_ms = rows[0]
    period_ms = int(span_ms / (n_steps - 1) * n_steps)
    for table in ("steps", "attribution", "worker_slowdown"):
        _, columns = sink.query(
            "SELECT name, type FROM system.columns WHERE database = currentDatabase() "
            "AND table = {table:String} AND default_kind NOT IN ('MATERIALIZED', 'ALIAS') "
            "ORDER BY position",
            {"table": table},
        )
        names = ", ".join(name for name, _ in columns)
        shifted = ", ".join(
            f"step + k * {n_steps}" if name == "step"
            else f"{name} + toIntervalMillisecond(k * {period_ms})"
            if "DateTime" in kind else name
            for name, kind in columns
        )  # fmt: skip
        for low in range(1, copies + 1, 16):
            ks = ", ".join(str(k) for k in range(low, min(copies, low + 15) + 1))
            sink.client.command(
                f"INSERT INTO {table} ({names}) SELECT {shifted} FROM {table} "
                f"ARRAY JOIN [{ks}] AS k WHERE step < {n_steps}"
            )
        sink.client.command(f"OPTIMIZE TABLE {table} FINAL")
    return n_steps * (copies + 1)


def _queries() -> Iterator[tuple[str, str, str]]:
    """(dashboard, where, SQL) of every panel, annotation and variable query."""
    from lagscope.dashboards.definitions import build_all
    from lagscope.dashboards.fleet import build_fleet

    for name, built in {**build_all(), **build_fleet()}.items():
        data = built.to_dict()
        for panel in data.get("panels", []):
            for target in panel.get("targets", []):
                yield name, panel["title"], target["rawSql"]
        for annotation in data.get("annotations", {}).get("list", []):
            yield name, f"annotation: {annotation['name']}", annotation["target"]["rawSql"]
        for variable in data.get("templating", {}).get("list", []):
            if variable["type"] == "query":
                yield name, f"variable {variable['name']}", variable["query"]


def _timed(sink, hours: float | None) -> dict[str, tuple[float, int]]:
    """Every query over the job's last `hours` (None: the whole job): where -> (median
    ms, rows returned)."""
    from lagscope.dashboards.macros import QueryContext, render_sql

    _, rows = sink.query("SELECT min(ts), max(ts) FROM steps WHERE job_id = 'big'")
    first, last = rows[0]
    start = first if hours is None else last - dt.timedelta(hours=hours)
    span_s = (last - start).total_seconds()
    out = {}
    for dashboard, where, sql in _queries():
        multi = dashboard == "pipeline-health"
        one = (lambda v: [v]) if multi else (lambda v: v)
        context = QueryContext(
            start - dt.timedelta(minutes=1),
            last + dt.timedelta(minutes=1),
            interval_s=max(1.0, span_s / POINTS),
            variables={"job": one("big"), "attempt": one("0"), "window": "20", "dp_range": ""},
        )
        rendered = render_sql(sql, context)
        times = []
        for _ in range(RUNS):
            began = time.perf_counter()
            result = sink.client.query(rendered)
            times.append((time.perf_counter() - began) * 1e3)
        out[f"{dashboard}: {where}"] = (statistics.median(times), len(result.result_rows))
    return out


def run() -> list[dict]:
    from lagscope.store.sink import ClickHouseSink

    rows = []
    for dp, steps, copies in SIZES:
        gpus = dp * 8 * 8
        with tempfile.TemporaryDirectory(prefix="dashboards-bench-") as tmp:
            _fill(f"{tmp}/store", dp, steps)
            sink = ClickHouseSink(f"chdb://{tmp}/store")
            n_steps = _stretch(sink, copies)
            (workers,) = sink.query("SELECT count() FROM worker_slowdown")[1][0]
            for hours, shown in ((1.0, "last hour"), (None, "whole job")):
                timed = _timed(sink, hours)
                slowest = max(timed, key=lambda k: timed[k][0])
                widest = max(timed, key=lambda k: timed[k][1])
                shape = f"{gpus:,} GPUs x {n_steps:,} steps ({workers / 1e6:.1f} M worker rows)"
                rows.append({
                    "benchmark": f"dashboards: slowest query, {shape}, {shown}",
                    "value": timed[slowest][0], "unit": "ms",
                    "target": "< 1000 on 2 cores (a panel in a second)",
                    "query": slowest,
                    "queries_ms": {k: round(v[0], 1) for k, v in timed.items()},
                })  # fmt: skip
                rows.append({
                    "benchmark": f"dashboards: most rows one query returns, {shape}, {shown}",
                    "value": timed[widest][1], "unit": "rows",
                    "target": "<= 50,000 (what a browser draws)",
                    "query": widest,
                    "queries_rows": {k: v[1] for k, v in timed.items()},
                })  # fmt: skip
            sink.close()
    return rows
