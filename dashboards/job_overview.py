"""The job overview dashboard (uid `lagscope-job`): the on-call view of one job attempt,
with `job` and `attempt` variables filled from the `jobs` table, and `dp_range` ("DP
ranks") to zoom the worker panels into (`worker_panels.py`). Top to bottom:

- annotations: straggler episodes and the step time's raw change points;
- Now: the latest slowdown, the data's age, MFU and GPU-hours wasted in range, the current
  diagnosis and the straggler episodes;
- Cost over time: MFU, slowdown per step, the rate of waste;
- Who and what: the slowdown attributed to op types and stages, the worker scores (latest
  window and time range), worker slowdown per step, the top stragglers, change points.

One function per row (`_now`, `_cost_over_time`, `_who_and_what`) and per panel.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import stat, table, timeseries
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model

from lagscope.dashboards.clickhouse_query import ClickHouseAnnotationTarget, datasource_ref
from lagscope.dashboards.panels import (
    ENDED_JOBS,
    IN_RANGE,
    JOB_OVERVIEW_UID,
    ONE_ATTEMPT,
    BuiltDashboard,
    BuiltTarget,
    Collector,
    Expect,
    attempt_variable,
    datasource_variable,
    dedent_sql,
    job_variable,
    one_selected,
    slowdown_thresholds,
    traffic_light,
)
from lagscope.dashboards.worker_panels import (
    dp_range_variable,
    top_stragglers,
    worker_matrix,
    worker_slowdown_per_step,
)

#: Steps averaged by the "latest window" worker heatmap (the `window` variable's default).
DEFAULT_WINDOW_STEPS = 20


def job_overview() -> BuiltDashboard:
    q = Collector()
    builder = _with_annotations(_dashboard(), q)
    builder = _who_and_what(_cost_over_time(_now(builder, q), q), q)
    return BuiltDashboard(JOB_OVERVIEW_UID, builder.build(), q.expectations)


def _dashboard() -> dash.Dashboard:
    """The dashboard's settings, variables and links."""
    return (
        dash.Dashboard("lagscope: job overview")
        .uid(JOB_OVERVIEW_UID)
        .description(
            "One training job attempt: how much stragglers cost (slowdown S, MFU, GPU-hours), "
            "who and what causes them, when it started, and what to do."
        )
        .tags(["lagscope", "stragglers"])
        .time("now-6h", "now")
        .refresh("30s")
        .tooltip(model.DashboardCursorSync.CROSSHAIR)
        .with_variable(datasource_variable())
        .with_variable(job_variable(multi=False))
        .with_variable(attempt_variable(multi=False))
        .with_variable(
            dash.CustomVariable("window")
            .label("latest window (steps)")
            .values("10,20,50,100,500")
            .current(model.VariableOption(text="20", value=str(DEFAULT_WINDOW_STEPS)))
        )
        .with_variable(dp_range_variable())
        .link(
            dash.DashboardLink("Pipeline health")
            .type(model.DashboardLinkType.DASHBOARDS)
            .tags(["lagscope"])
            .include_vars(True)
            .keep_time(True)
        )
    )


def _with_annotations(builder: dash.Dashboard, q: Collector) -> dash.Dashboard:
    """Straggler episodes as regions; the step time's raw change points as marks."""
    episode_sql = f"""
        SELECT onset_ts AS time,
               ifNull(recovery_ts, last_ts) AS timeEnd,
               concat('episode ', toString(episode_id), ' (', state, '): ',
                      arrayStringConcat(workers, ', '), if(node != '', concat(' on ', node), ''),
                      if(isNull(gpu), '', concat(' GPU ', toString(gpu))), ', ', cause,
                      ' in ', optype, ' from step ', toString(onset_step),
                      if(isNull(recovery_step), ' (ongoing)',
                         concat(' to step ', toString(recovery_step - 1))),
                      ', seen at step ', toString(first_seen_step), ', ',
                      toString(round(gpu_seconds_lost / 3600, 3)), ' GPU-h lost') AS text,
               concat('episode,', cause, ',', optype) AS tags
        FROM episodes FINAL
        WHERE {ONE_ATTEMPT} AND onset_ts <= $__toTime
          AND ifNull(recovery_ts, last_ts) >= $__fromTime
        ORDER BY time
    """
    q.expectations[("annotation: straggler episodes", "Anno")] = Expect(
        {"time": "time", "timeEnd": "time", "text": "string", "tags": "string"},
        may_be_empty=True,
    )
    builder = builder.annotation(
        dash.AnnotationQuery()
        .name("straggler episodes")
        .datasource(datasource_ref())
        .enable(True)
        .icon_color("orange")
        .target(BuiltTarget(ClickHouseAnnotationTarget(dedent_sql(episode_sql))))
    )
    # Raw change points of the step time stay as annotations: when it moved, not why.
    for kind, color in (("onset", "red"), ("recovery", "green")):
        name = f"step-time {kind}"
        sql = f"""
            SELECT ts AS time,
                   concat('step time ', kind, ' at step ', toString(step), ': ',
                          toString(round(before_mean, 3)), ' s -> ',
                          toString(round(after_mean, 3)), ' s') AS text,
                   concat(series, ',', kind) AS tags
            FROM changepoints FINAL
            WHERE {IN_RANGE} AND series = 'step_time' AND kind = '{kind}'
            ORDER BY time
        """
        q.expectations[(f"annotation: {name}", "Anno")] = Expect(
            {"time": "time", "text": "string", "tags": "string"}
        )
        builder = builder.annotation(
            dash.AnnotationQuery()
            .name(name)
            .datasource(datasource_ref())
            .enable(True)
            .icon_color(color)
            .target(BuiltTarget(ClickHouseAnnotationTarget(dedent_sql(sql))))
        )

    return builder


def _now(builder: dash.Dashboard, q: Collector) -> dash.Dashboard:
    """Row "Now": where the job stands, what it costs, what to do."""
    return (
        builder.with_row(dash.Row("Now"))
        .with_panel(_latest_slowdown(q))
        .with_panel(_data_age(q))
        .with_panel(_mfu_in_range(q))
        .with_panel(_gpu_hours_wasted(q))
        .with_panel(_current_diagnosis(q))
        .with_panel(_straggler_episodes(q))
    )


def _cost_over_time(builder: dash.Dashboard, q: Collector) -> dash.Dashboard:
    """Row "Cost over time"."""
    return (
        builder.with_row(dash.Row("Cost over time"))
        .with_panel(_mfu_series(q))
        .with_panel(_slowdown_series(q))
        .with_panel(_waste_rate(q))
    )


def _who_and_what(builder: dash.Dashboard, q: Collector) -> dash.Dashboard:
    """Row "Who and what": which op types, stages and workers the slowdown comes from."""
    builder = builder.with_row(dash.Row("Who and what"))
    for title, kind, label in (
        ("Slowdown attributed to each op type (S_optype)", "optype", "optype"),
        ("Slowdown attributed to each pipeline stage (S_stage)", "stage", "stage"),
    ):
        builder = builder.with_panel(_attributed_slowdown(title, kind, label, q))
    return (
        builder.with_panel(
            worker_matrix(
                "Worker score S_w, latest ${window} steps (DP x PP)",
                "Mean S_w of each worker (DP rank x PP stage) over the job's latest steps, "
                "whatever the time range: a score, not a verdict (the crossing of a slow DP "
                "replica and a slow stage scores high too); verified stragglers are in "
                "'Straggler episodes' and first in 'Top stragglers in range'.",
                f"step > (SELECT max(step) FROM steps FINAL WHERE {ONE_ATTEMPT} AND analysed) - "
                f"toInt64OrZero({one_selected('window')})",
                q,
            )
        )
        .with_panel(
            worker_matrix(
                "Worker score S_w over the time range (DP x PP)",
                "Mean S_w of each worker over the dashboard's time range: a score, not a "
                "verdict (see 'Straggler episodes' for the verified stragglers).",
                "$__timeFilter(ts)",
                q,
            )
        )
        .with_panel(worker_slowdown_per_step(q))
        .with_panel(top_stragglers(q))
        .with_panel(_change_points(q))
    )


def _attributed_slowdown(title: str, kind: str, label: str, q: Collector) -> timeseries.Panel:
    """S_X of each name of an attribution kind (op types, stages) over time."""
    return (
        timeseries.Panel()
        .title(title)
        .unit("suffix:x")
        .description(
            f"Slowdown left if only this {label}'s durations were real and everything "
            "else idealised: the largest line is the main cause."
        )
        .with_target(
            q.query(
                title,
                f"""
                SELECT $__timeInterval(ts) AS time, name AS {label}, avg(slowdown) AS S
                FROM attribution FINAL
                WHERE {IN_RANGE} AND kind = '{kind}'
                GROUP BY time, {label}
                ORDER BY time, {label}
                """,
                Expect({"time": "time", label: "string", "S": "number"}),
                time_series=True,
            )
        )
        .display_name("${__field.labels." + label + "}")
        .span(12)
        .height(8)
    )


# -- the panels ---------------------------------------------------------------------------


def _latest_slowdown(q: Collector) -> stat.Panel:
    title = "Slowdown S (latest step)"
    return (
        stat.Panel()
        .title(title)
        .unit("suffix:x")
        .description("S = simulated step time / straggler-free step time (1 = no loss).")
        .with_target(
            q.query(
                title,
                f"""
                SELECT slowdown AS S
                FROM steps FINAL
                WHERE {ONE_ATTEMPT} AND isFinite(slowdown)
                ORDER BY step DESC
                LIMIT 1
                """,
                Expect({"S": "number"}),
                time_series=False,
            )
        )
        .decimals(3)
        .thresholds(slowdown_thresholds())
        .span(5)
        .height(5)
    )


def _data_age(q: Collector) -> stat.Panel:
    title = "Data age"
    return (
        stat.Panel()
        .title(title)
        .description(
            "Seconds since the start of the job attempt's latest stored step: a job that "
            "stopped, or a pipeline (sidecar, Kafka, worker) that stopped delivering, "
            'shows stale here. Green under a minute, red over five. "ended" once every '
            "rank of the job closed its monitor: it finished, nothing more will come."
        )
        .with_target(
            q.query(
                title,
                f"""
                SELECT if((job_id, attempt) IN {ENDED_JOBS}, NULL,
                          dateDiff('second', max(ts), now())) AS age_s
                FROM steps
                WHERE {ONE_ATTEMPT}
                GROUP BY job_id, attempt
                """,
                Expect({"age_s": "number"}),
                time_series=False,
            )
        )
        .unit("s")
        .decimals(0)
        .thresholds(traffic_light(60, 300))
        .mappings([_ended_when_null()])
        .span(3)
        .height(5)
    )


def _ended_when_null() -> model.SpecialValueMap:
    """A job whose ranks all ended has no age to watch: it reads "ended", in blue."""
    return model.SpecialValueMap(
        options=model.DashboardSpecialValueMapOptions(
            match=model.SpecialValueMatch.NULL,
            result=model.ValueMappingResult(text="ended", color="blue"),
        )
    )


def _mfu_in_range(q: Collector) -> stat.Panel:
    title = "MFU in range: actual vs straggler-free"
    return (
        stat.Panel()
        .title(title)
        .description(
            "Model FLOPs utilisation of the job as it ran, and as it would run without "
            "stragglers (empty when the job's FLOPs or the GPU peak are unknown)."
        )
        .with_target(
            q.query(
                title,
                f"""
                SELECT avg(mfu_actual) AS `MFU actual`, avg(mfu_ideal) AS `MFU straggler-free`
                FROM steps FINAL
                WHERE {IN_RANGE}
                """,
                Expect({"MFU actual": "number", "MFU straggler-free": "number"}),
                time_series=False,
            )
        )
        .unit("percentunit")
        .decimals(1)
        .span(5)
        .height(5)
    )


def _gpu_hours_wasted(q: Collector) -> stat.Panel:
    title = "GPU-hours wasted in range"
    return (
        stat.Panel()
        .title(title)
        .unit("suffix: GPU-h")
        .description(
            "GPU-hours lost to stragglers: what the verified episodes that overlap the "
            "range cost (their whole cost so far). Above the straggler-free steps: sum "
            "over the range's steps of GPUs x t x (1 - 1/S), which also counts the job's "
            "own jitter (its noise floor), lost with or without stragglers."
        )
        .with_target(
            q.query(
                title,
                f"""
                SELECT (SELECT sum(gpu_seconds_lost) FROM episodes FINAL
                        WHERE {ONE_ATTEMPT} AND onset_ts <= $__toTime
                          AND ifNull(recovery_ts, last_ts) >= $__fromTime) / 3600
                           AS `GPU-hours lost to stragglers`,
                       sumIf(gpu_seconds_wasted, isFinite(gpu_seconds_wasted)) / 3600
                           AS `GPU-hours above straggler-free`,
                       sumIf(gpu_seconds, isFinite(gpu_seconds)) / 3600 AS `GPU-hours`
                FROM steps FINAL
                WHERE {IN_RANGE}
                """,
                Expect(
                    {
                        "GPU-hours lost to stragglers": "number",
                        "GPU-hours above straggler-free": "number",
                        "GPU-hours": "number",
                    }
                ),
                time_series=False,
            )
        )
        .decimals(2)
        .span(5)
        .height(5)
    )


def _current_diagnosis(q: Collector) -> table.Panel:
    title = "Current diagnosis and advice"
    return (
        table.Panel()
        .title(title)
        .description(
            "The job's verdict, kept current while it runs: built from its diagnosis and "
            "its episodes (the same story as the episodes table, the alerts and the "
            "summary); its cause, one sentence and each mitigation with its predicted "
            "speed-up."
        )
        .with_target(
            q.query(
                title,
                f"""
                SELECT step, cause, JSONExtractString(evidence, 'summary') AS summary,
                       JSONExtractString(item, 'action') AS action,
                       JSONExtractFloat(item, 'predicted_speedup') AS predicted_speedup,
                       JSONExtractString(item, 'detail') AS detail,
                       JSONExtractString(advice, 'escalation', 'action') AS escalation
                FROM (
                    SELECT * FROM diagnoses FINAL
                    WHERE {ONE_ATTEMPT}
                    ORDER BY step DESC, version DESC
                    LIMIT 1
                )
                LEFT ARRAY JOIN JSONExtractArrayRaw(advice, 'advice') AS item
                ORDER BY predicted_speedup DESC
                """,
                Expect(
                    {
                        "step": "number",
                        "cause": "string",
                        "summary": "string",
                        "action": "string",
                        "predicted_speedup": "number",
                    }
                ),
                time_series=False,
            )
        )
        .span(6)
        .height(5)
    )


def _straggler_episodes(q: Collector) -> table.Panel:
    title = "Straggler episodes"
    return (
        table.Panel()
        .title(title)
        .description(
            "Verified straggler episodes, open ones first: which worker, on which node "
            "and GPU, slow in what (an op type, or `host`: its host stalls between its "
            "ops), since when (onset step), seen at which step, until when, and what it "
            "cost (GPU-h lost; of it estimated: the part for early steps no longer held "
            "when it was found, from the worker's rise in them). Found while the job runs "
            "and kept current every step; a job's end refines their bounds."
        )
        .with_target(
            q.query(
                title,
                f"""
                SELECT episode_id AS episode, state,
                       arrayStringConcat(workers, ', ') AS worker, node,
                       gpu, cause, optype AS op, onset_step,
                       recovery_step, first_seen_step,
                       share AS share_of_slowdown,
                       gpu_seconds_lost / 3600 AS gpu_hours_lost,
                       if(lost_s > 0, gpu_seconds_lost * estimated_lost_s / lost_s, 0)
                           / 3600 AS of_it_estimated,
                       summary
                FROM episodes FINAL
                WHERE {ONE_ATTEMPT} AND onset_ts <= $__toTime
                  AND ifNull(recovery_ts, last_ts) >= $__fromTime
                ORDER BY state = 'open' DESC, onset_step DESC
                """,
                Expect(
                    {
                        "episode": "number",
                        "state": "string",
                        "worker": "string",
                        "node": "string",
                        "cause": "string",
                        "op": "string",
                        "onset_step": "number",
                        "first_seen_step": "number",
                        "share_of_slowdown": "number",
                        "gpu_hours_lost": "number",
                        "of_it_estimated": "number",
                        "summary": "string",
                    },
                    may_be_empty=True,
                ),
                time_series=False,
            )
        )
        .decimals(3)
        .span(24)
        .height(6)
    )


def _mfu_series(q: Collector) -> timeseries.Panel:
    title = "MFU: actual vs straggler-free"
    return (
        timeseries.Panel()
        .title(title)
        .with_target(
            q.query(
                title,
                f"""
                SELECT $__timeInterval(ts) AS time, avg(mfu_actual) AS actual,
                       avg(mfu_ideal) AS `straggler-free`
                FROM steps FINAL
                WHERE {IN_RANGE}
                GROUP BY time
                ORDER BY time
                """,
                Expect({"time": "time", "actual": "number", "straggler-free": "number"}),
                time_series=True,
            )
        )
        .unit("percentunit")
        .span(8)
        .height(8)
    )


def _slowdown_series(q: Collector) -> timeseries.Panel:
    title = "Slowdown S per step"
    return (
        timeseries.Panel()
        .title(title)
        .unit("suffix:x")
        .description(
            "What-if slowdown of every step, without and with launch (CPU) delays; 1 = "
            "as fast as the straggler-free job. Red/green marks: verified onset/recovery."
        )
        .with_target(
            q.query(
                title,
                f"""
                SELECT ts AS time, slowdown AS S, launch_slowdown AS `S with launch delays`
                FROM steps FINAL
                WHERE {IN_RANGE} AND isFinite(slowdown)
                ORDER BY time
                """,
                Expect({"time": "time", "S": "number", "S with launch delays": "number"}),
                time_series=True,
            )
        )
        .thresholds(slowdown_thresholds())
        .thresholds_style(
            common_builders.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.LINE)
        )
        .span(8)
        .height(8)
    )


def _waste_rate(q: Collector) -> timeseries.Panel:
    title = "GPU-hours wasted per hour"
    return (
        timeseries.Panel()
        .title(title)
        .unit("suffix: GPU-h")
        .description(
            "Rate of waste from the minute rollup: GPU-hours wasted per hour, i.e. the "
            "number of GPUs the stragglers effectively idle."
        )
        .with_target(
            q.query(
                title,
                f"""
                SELECT minute AS time, sum(gpu_seconds_wasted) / 60 AS `GPUs wasted`
                FROM steps_1m
                WHERE {ONE_ATTEMPT}
                  AND $__timeFilter(minute)
                GROUP BY time
                ORDER BY time
                """,
                Expect({"time": "time", "GPUs wasted": "number"}),
                time_series=True,
            )
        )
        .span(8)
        .height(8)
    )


def _change_points(q: Collector) -> table.Panel:
    title = "Change points in range"
    return (
        table.Panel()
        .title(title)
        .description(
            "Raw change points (BOCD, at least 10 % change of the mean) of the step time "
            "and of each stage's, DP replica's and worker's own work: when a series "
            "moved, not who is to blame ('Straggler episodes' says that). A series that "
            "only moved against its peers (a stage that looks faster while another is "
            "slow) is not listed."
        )
        .with_target(
            q.query(
                title,
                f"""
                SELECT ts AS time, series, kind, step, before_mean, after_mean,
                       after_mean / before_mean AS ratio
                FROM changepoints FINAL
                WHERE {IN_RANGE} AND kind != 'shift'
                ORDER BY time DESC, series
                """,
                Expect(
                    {
                        "time": "time",
                        "series": "string",
                        "kind": "string",
                        "step": "number",
                        "ratio": "number",
                    }
                ),
                time_series=False,
            )
        )
        .decimals(3)
        .span(12)
        .height(8)
    )
