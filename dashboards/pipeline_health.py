"""The pipeline health dashboard (uid `lagscope-pipeline`): is the pipeline keeping up, and is
it losing or rejecting anything? `job` and `attempt` variables (several of each) filled
from the `jobs` table. Rows, top to bottom: Throughput, Completeness, Rejected input,
Latency and lag; one function per row and per panel. Every panel reads the store but the
consumer lag, which reads the workers' metric from Prometheus (`${prometheus}`).
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus, table, timeseries
from grafana_foundation_sdk.models import dashboard as model

from lagscope.dashboards.panels import (
    SELECTED_ATTEMPTS,
    BuiltDashboard,
    Collector,
    Expect,
    attempt_variable,
    datasource_variable,
    job_variable,
)

PIPELINE_HEALTH_UID = "lagscope-pipeline"
#: The dashboard's Prometheus data source variable, and its consumer lag panel.
PROMETHEUS_VARIABLE = "prometheus"
#: The Prometheus data source lagscope provisions (dashboards/provisioning/datasources).
PROMETHEUS_DATASOURCE_UID = "lagscope-prometheus"
CONSUMER_LAG_TITLE = "Kafka consumer lag per partition"
CONSUMER_LAG_EXPR = "sum by (topic, partition) (lagscope_worker_consumer_lag_records)"
#: Missing ranks an incomplete step lists by number; the rest are counted.
MISSING_RANKS_SHOWN = 32


def pipeline_health() -> BuiltDashboard:
    q = Collector()
    builder = _latency_and_lag(
        _rejected_input(_completeness(_throughput(_dashboard(), q), q), q), q
    )
    return BuiltDashboard(PIPELINE_HEALTH_UID, builder.build(), q.expectations)


def _dashboard() -> dash.Dashboard:
    """The dashboard's settings, variables and links."""
    return (
        dash.Dashboard("lagscope: pipeline health")
        .uid(PIPELINE_HEALTH_UID)
        .description("Is the pipeline keeping up, and is it losing or rejecting anything?")
        .tags(["lagscope", "pipeline"])
        .time("now-6h", "now")
        .refresh("1m")
        .with_variable(datasource_variable())
        .with_variable(prometheus_variable())
        .with_variable(job_variable(multi=True))
        .with_variable(attempt_variable(multi=True))
        .link(
            dash.DashboardLink("Job overview")
            .type(model.DashboardLinkType.DASHBOARDS)
            .tags(["lagscope"])
            .include_vars(True)
            .keep_time(True)
        )
    )


def _throughput(builder: dash.Dashboard, q: Collector) -> dash.Dashboard:
    return (
        builder.with_row(dash.Row("Throughput"))
        .with_panel(_ingest_rate(q))
        .with_panel(_steps_rate(q))
    )


def _completeness(builder: dash.Dashboard, q: Collector) -> dash.Dashboard:
    return (
        builder.with_row(dash.Row("Completeness"))
        .with_panel(_incomplete_rate(q))
        .with_panel(_incomplete_steps(q))
    )


def _rejected_input(builder: dash.Dashboard, q: Collector) -> dash.Dashboard:
    return (
        builder.with_row(dash.Row("Rejected input"))
        .with_panel(_dead_letter_rate(q))
        .with_panel(_latest_dead_letters(q))
    )


def _latency_and_lag(builder: dash.Dashboard, q: Collector) -> dash.Dashboard:
    return (
        builder.with_row(dash.Row("Latency and lag"))
        .with_panel(_sink_latency(q))
        .with_panel(_consumer_lag())
    )


# -- the panels ---------------------------------------------------------------------------


def _ingest_rate(q: Collector) -> timeseries.Panel:
    title = "Ingest rate: ops per minute"
    return (
        timeseries.Panel()
        .title(title)
        .unit("opm")
        .description(
            "Raw ops stored per minute, by op start time (the store keeps one TP/CP rank "
            "per (dp, pp) worker, so this is ops analysed, not ops timed)."
        )
        .with_target(
            q.query(
                title,
                f"""
                SELECT $__timeInterval(start) AS time, job_id,
                       count() * 60 / $__interval_s AS ops_per_minute
                FROM ops
                WHERE {SELECTED_ATTEMPTS} AND $__timeFilter(start)
                GROUP BY time, job_id
                ORDER BY time, job_id
                """,
                Expect({"time": "time", "job_id": "string", "ops_per_minute": "number"}),
                time_series=True,
            )
        )
        .display_name("${__field.labels.job_id}")
        .span(12)
        .height(8)
    )


def _steps_rate(q: Collector) -> timeseries.Panel:
    title = "Steps analysed per minute"
    return (
        timeseries.Panel()
        .title(title)
        .unit("suffix: steps/min")
        .description("Closed steps per minute (complete or not), from the minute rollup.")
        .with_target(
            q.query(
                title,
                f"""
                SELECT minute AS time, job_id, sum(steps) AS steps
                FROM steps_1m
                WHERE {SELECTED_ATTEMPTS}
                  AND $__timeFilter(minute)
                GROUP BY time, job_id
                ORDER BY time, job_id
                """,
                Expect({"time": "time", "job_id": "string", "steps": "number"}),
                time_series=True,
            )
        )
        .display_name("${__field.labels.job_id}")
        .span(12)
        .height(8)
    )


def _incomplete_rate(q: Collector) -> timeseries.Panel:
    title = "Late or incomplete steps"
    return (
        timeseries.Panel()
        .title(title)
        .unit("suffix: steps")
        .description(
            "Steps closed by the lateness timeout before every (dp, pp) worker reported: "
            "a dead or lagging rank, or a streamer that stopped."
        )
        .with_target(
            q.query(
                title,
                f"""
                SELECT $__timeInterval(ts) AS time, job_id, countIf(NOT complete) AS incomplete
                FROM steps FINAL
                WHERE {SELECTED_ATTEMPTS} AND $__timeFilter(ts)
                GROUP BY time, job_id
                ORDER BY time, job_id
                """,
                Expect({"time": "time", "job_id": "string", "incomplete": "number"}),
                time_series=True,
            )
        )
        .display_name("${__field.labels.job_id}")
        .span(12)
        .height(8)
    )


def _incomplete_steps(q: Collector) -> table.Panel:
    title = "Incomplete steps and their missing ranks"
    return (
        table.Panel()
        .title(title)
        .description(
            "Global ranks that never delivered their batch for the step (the first "
            f"{MISSING_RANKS_SHOWN}, and how many more: a rack of a large job can be hundreds), "
            "and why: a rank that sent a later step but not this one, or sent nothing for "
            "longer than the job's lateness (its own pace; a dead or stopped rank or streamer)."
        )
        .with_target(
            q.query(
                title,
                f"""
                SELECT ts AS time, job_id, attempt, step,
                       length(missing_ranks) AS missing,
                       -- not aliased `missing_ranks`: ClickHouse would read the alias,
                       -- not the column, in length(missing_ranks) above
                       concat(arrayStringConcat(arrayMap(r -> toString(r),
                                  arraySlice(missing_ranks, 1, {MISSING_RANKS_SHOWN})), ', '),
                              if(missing > {MISSING_RANKS_SHOWN},
                                 concat(' and ', toString(missing - {MISSING_RANKS_SHOWN}),
                                        ' more'), ''))
                           AS missing_global_ranks,
                       missing_reason AS why
                FROM steps FINAL
                WHERE {SELECTED_ATTEMPTS} AND $__timeFilter(ts) AND NOT complete
                ORDER BY time DESC
                LIMIT 200
                """,
                Expect(
                    {
                        "time": "time",
                        "job_id": "string",
                        "step": "number",
                        "missing": "number",
                        "missing_global_ranks": "string",
                        "why": "string",
                    }
                ),
                time_series=False,
            )
        )
        .span(12)
        .height(8)
    )


def _dead_letter_rate(q: Collector) -> timeseries.Panel:
    title = "Dead letters by reason"
    return (
        timeseries.Panel()
        .title(title)
        .unit("suffix: records")
        .description(
            "Input kept aside with its reason (torn or garbage log records, undecodable "
            "batches, bad metadata). Not filtered by job: a record that cannot be decoded "
            "has no job."
        )
        .with_target(
            q.query(
                title,
                """
                SELECT $__timeInterval(ts) AS time,
                       substring(splitByChar(':', reason)[1], 1, 60) AS reason,
                       count() AS letters
                FROM dead_letters FINAL
                WHERE $__timeFilter(ts)
                GROUP BY time, reason
                ORDER BY time, reason
                """,
                Expect({"time": "time", "reason": "string", "letters": "number"}),
                time_series=True,
            )
        )
        .display_name("${__field.labels.reason}")
        .span(12)
        .height(8)
    )


def _latest_dead_letters(q: Collector) -> table.Panel:
    title = "Latest dead letters"
    return (
        table.Panel()
        .title(title)
        .with_target(
            q.query(
                title,
                """
                SELECT ts AS time, job_id, source, reason,
                       substring(payload, 1, 200) AS payload_start
                FROM dead_letters FINAL
                WHERE $__timeFilter(ts)
                ORDER BY time DESC
                LIMIT 100
                """,
                Expect(
                    {
                        "time": "time",
                        "source": "string",
                        "reason": "string",
                        "payload_start": "string",
                    }
                ),
                time_series=False,
            )
        )
        .span(12)
        .height(8)
    )


def _sink_latency(q: Collector) -> timeseries.Panel:
    title = "Sink latency (processed_at - ts)"
    return (
        timeseries.Panel()
        .title(title)
        .description(
            "From the step's start (ts) to its row being written (processed_at): the step "
            "itself, the wait for the last rank (lateness), analysis and the write. Its "
            "medians part at the host's having the step's last batch (received_at): "
            "delivery, from the step's end (the ranks' timers, the streamers, Kafka), and "
            "the host (windows, analysis, the write cadence)."
        )
        .with_target(
            q.query(
                title,
                f"""
                SELECT $__timeInterval(processed_at) AS time,
                       quantile(0.5)(latency_s) AS p50, quantile(0.99)(latency_s) AS p99,
                       max(latency_s) AS max,
                       quantile(0.5)(delivery_s) AS delivery_p50,
                       quantile(0.5)(host_s) AS host_p50
                FROM (
                    SELECT processed_at,
                           (toUnixTimestamp64Milli(processed_at)
                            - toUnixTimestamp64Milli(ts)) / 1000 AS latency_s,
                           if(received_at IS NULL OR NOT isFinite(actual_s), NULL,
                              (toUnixTimestamp64Milli(assumeNotNull(received_at))
                               - toUnixTimestamp64Milli(ts)) / 1000 - actual_s) AS delivery_s,
                           if(received_at IS NULL, NULL,
                              (toUnixTimestamp64Milli(processed_at)
                               - toUnixTimestamp64Milli(assumeNotNull(received_at))) / 1000)
                               AS host_s
                    FROM steps FINAL
                    WHERE {SELECTED_ATTEMPTS} AND $__timeFilter(processed_at)
                )
                GROUP BY time
                ORDER BY time
                """,
                Expect(
                    {
                        "time": "time",
                        "p50": "number",
                        "p99": "number",
                        "max": "number",
                        "delivery_p50": "number",
                        "host_p50": "number",
                    }
                ),
                time_series=True,
            )
        )
        .unit("s")
        .span(12)
        .height(8)
    )


def prometheus_variable() -> dash.DatasourceVariable:
    """The Prometheus that scrapes the workers (`${prometheus}`): the consumer lag is a
    metric of theirs, not a row of the store."""
    return (
        dash.DatasourceVariable(PROMETHEUS_VARIABLE)
        .label("Prometheus")
        .type("prometheus")
        .current(
            model.VariableOption(
                selected=True, text="lagscope Prometheus", value=PROMETHEUS_DATASOURCE_UID
            )
        )
    )


def _consumer_lag() -> timeseries.Panel:
    """The workers' consumer lag, per partition of the ops topic (one job or a few each)."""
    return (
        timeseries.Panel()
        .title(CONSUMER_LAG_TITLE)
        .description(
            "Records in Kafka past the last one a worker processed, per partition of the ops "
            "topic (keyed by job: a partition is one job or a few), from the workers' "
            "lagscope_worker_consumer_lag_records metric. A line that keeps rising: that "
            "partition's worker is too slow for its jobs or stuck (alert "
            "LagscopeConsumerLagGrowing)."
        )
        .datasource(_prometheus_ref())
        .with_target(
            prometheus.Dataquery()
            .expr(CONSUMER_LAG_EXPR)
            .legend_format("{{topic}}[{{partition}}]")
            .ref_id("A")
            .datasource(_prometheus_ref())
        )
        .unit("suffix: records")
        .span(12)
        .height(8)
    )


def _prometheus_ref() -> model.DataSourceRef:
    return model.DataSourceRef(type_val="prometheus", uid=f"${{{PROMETHEUS_VARIABLE}}}")
