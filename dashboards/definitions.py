"""The Grafana dashboards, as code (grafana-foundation-sdk builders, ClickHouse SQL).

Two dashboards, both with `job` and `attempt` variables filled from the `jobs` table:

- Job overview (uid `lagscope-job`): the on-call view of one job attempt.
- Pipeline health (uid `lagscope-pipeline`): is the pipeline keeping up and losing nothing.

Every SQL query here is declared with the columns its panel needs (`Expect`); the tests
render each query with Grafana's and the ClickHouse plugin's expansion (`macros.py`), run it
against a store filled by the embedded pipeline and check those columns. Reads follow the
schema's rules: replacing tables with `FINAL`, the minute rollup summed by key.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import heatmap, stat, table, text, timeseries
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models import heatmap as heatmap_model
from grafana_foundation_sdk.models import text as text_model

from lagscope.dashboards.clickhouse_query import (
    ClickHouseAnnotationTarget,
    ClickHouseQueryBuilder,
    datasource_ref,
    register_clickhouse_query,
)

JOB_OVERVIEW_UID = "lagscope-job"
PIPELINE_HEALTH_UID = "lagscope-pipeline"
#: Steps averaged by the "latest window" worker heatmap (the `window` variable's default).
DEFAULT_WINDOW_STEPS = 20

ColumnKind = Literal["time", "number", "string"]


@dataclass(frozen=True)
class Expect:
    """The result a query must have for its panel: columns (name -> kind) in any order;
    `may_be_empty` for panels whose data a healthy store may lack (e.g. no dead letters)."""

    columns: dict[str, ColumnKind]
    may_be_empty: bool = False


@dataclass
class BuiltDashboard:
    uid: str
    dashboard: model.Dashboard
    #: (panel title or "annotation: NAME", refId) -> what the query must return.
    expectations: dict[tuple[str, str], Expect] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The dashboard as Grafana's JSON model (plain dicts and lists), in the SDK's
        canonical form: read back through the SDK's `Dashboard` model once, so the file is
        a fixed point of that model (it fills defaults such as an empty `custom` config)."""
        return sdk_round_trip(_encode(self.dashboard))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


def _encode(value: object) -> Any:
    return json.loads(json.dumps(value, cls=JSONEncoder))


def sdk_round_trip(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` decoded by the SDK's dashboard model and encoded again.

    Annotation queries are kept as they are: the SDK models annotation targets of Grafana's
    built-in source only and would drop the SQL (`ClickHouseAnnotationTarget`); the tests
    check those through `ClickHouseQuery` instead.
    """
    register_default_plugins()
    register_clickhouse_query()
    decoded = _encode(model.Dashboard.from_json(raw))
    if "annotations" in raw:
        decoded["annotations"] = raw["annotations"]
    return decoded


class _Collector:
    """Keeps each query's expectation next to the panel that runs it."""

    def __init__(self) -> None:
        self.expectations: dict[tuple[str, str], Expect] = {}

    def query(
        self,
        panel_title: str,
        sql: str,
        expect: Expect,
        *,
        time_series: bool,
        ref_id: str = "A",
    ) -> ClickHouseQueryBuilder:
        key = (panel_title, ref_id)
        if key in self.expectations:
            raise ValueError(f"two queries {ref_id} in panel {panel_title!r}")
        self.expectations[key] = expect
        query = ClickHouseQueryBuilder(_dedent(sql)).ref_id(ref_id)
        return query.time_series() if time_series else query.table()


def _dedent(sql: str) -> str:
    return "\n".join(line.strip() for line in sql.strip().splitlines())


# -- shared pieces -----------------------------------------------------------------------


def selected(variable: str) -> str:
    """The values selected in a dashboard variable, as a ClickHouse Array(String).

    No variable is pasted into SQL as is: the ClickHouse plugin inserts a value raw (and
    multi-values only quoted), and Grafana's `sqlstring` format only doubles quotes, while
    ClickHouse string literals also honour backslash escapes (`\\'` ends no string), so a
    crafted job id could break out of the literal. Grafana's `queryparam` format writes
    `var-NAME=VALUE&var-NAME=VALUE...` with every value percent-encoded down to RFC 3986's
    unreserved characters: no quote, backslash, comment or semicolon can reach the SQL, and
    the SQL decodes the values itself.
    """
    prefix = len(f"var-{variable}=")
    return f"arrayMap(v -> decodeURLComponent(substring(v, {prefix + 1})), {_encoded(variable)})"


def _encoded(variable: str) -> str:
    """The variable's `queryparam` parts, still percent-encoded: `['var-job=a%27b', ...]`."""
    return f"splitByChar('&', '${{{variable}:queryparam}}')"


def any_selected(variable: str, value: str) -> str:
    """SQL that is true when `value` is among a multi-value variable's selection. With
    "All" selected, Grafana's `queryparam` format writes `$__all` (the URL state), not
    every option: that matches everything, as "All" means. (Compared still encoded: a
    `$__` in the SQL would be taken for a plugin macro.)"""
    all_selected = f"has({_encoded(variable)}, 'var-{variable}=%24__all')"
    return f"({all_selected} OR has({selected(variable)}, {value}))"


def one_selected(variable: str) -> str:
    """The (single) value selected in a dashboard variable, as a ClickHouse String."""
    return f"{selected(variable)}[1]"


ONE_ATTEMPT = (
    f"job_id = {one_selected('job')} AND attempt = toUInt32OrNull({one_selected('attempt')})"
)
SELECTED_ATTEMPTS = (
    f"{any_selected('job', 'job_id')} AND {any_selected('attempt', 'toString(attempt)')}"
)


def _job_variable(*, multi: bool) -> dash.QueryVariable:
    variable = (
        dash.QueryVariable("job")
        .label("job")
        .datasource(datasource_ref())
        .query("SELECT DISTINCT job_id FROM jobs FINAL ORDER BY job_id")
        .refresh(model.VariableRefresh.ON_DASHBOARD_LOAD)
        .sort(model.VariableSort.ALPHABETICAL_ASC)
    )
    return variable.multi(True).include_all(True) if multi else variable


def _attempt_variable(*, multi: bool) -> dash.QueryVariable:
    where = any_selected("job", "job_id") if multi else f"job_id = {one_selected('job')}"
    variable = (
        dash.QueryVariable("attempt")
        .label("attempt")
        .datasource(datasource_ref())
        .query(f"SELECT DISTINCT attempt FROM jobs FINAL WHERE {where} ORDER BY attempt DESC")
        .refresh(model.VariableRefresh.ON_DASHBOARD_LOAD)
        .sort(model.VariableSort.NUMERICAL_DESC)
    )
    return variable.multi(True).include_all(True) if multi else variable


def _traffic_light(orange: float, red: float) -> dash.ThresholdsConfig:
    """Green below `orange`, orange from it, red from `red`."""
    return (
        dash.ThresholdsConfig()
        .mode(model.ThresholdsMode.ABSOLUTE)
        .steps(
            [
                model.Threshold(value=None, color="green"),
                model.Threshold(value=orange, color="orange"),
                model.Threshold(value=red, color="red"),
            ]
        )
    )


def _slowdown_thresholds() -> dash.ThresholdsConfig:
    return _traffic_light(1.05, 1.2)


def _worker_matrix(title: str, description: str, where: str, q: _Collector) -> table.Panel:
    """A DP x PP grid (rows: stages, columns: DP ranks, cell: mean worker slowdown S_w),
    pivoted by Grafana's `groupingToMatrix` from long rows."""
    sql = f"""
        SELECT concat('pp ', toString(pp_rank)) AS stage, concat('dp ', toString(dp_rank)) AS dp,
               avg(slowdown) AS S_w
        FROM worker_slowdown FINAL
        WHERE {ONE_ATTEMPT} AND {where}
        GROUP BY pp_rank, dp_rank
        ORDER BY pp_rank, dp_rank
    """
    return (
        table.Panel()
        .title(title)
        .description(description)
        .with_target(
            q.query(
                title,
                sql,
                Expect({"stage": "string", "dp": "string", "S_w": "number"}),
                time_series=False,
            )
        )
        .with_transformation(
            model.DataTransformerConfig(
                id_val="groupingToMatrix",
                options={"columnField": "dp", "rowField": "stage", "valueField": "S_w"},
            )
        )
        .cell_options(common.TableColoredBackgroundCellOptions())
        .color_scheme(dash.FieldColor().mode(model.FieldColorModeId.CONTINUOUS_YL_RD))
        .min(1.0)
        .max(1.5)
        .decimals(3)
        .span(12)
        .height(9)
    )


# -- job overview ------------------------------------------------------------------------


def job_overview() -> BuiltDashboard:
    q = _Collector()
    in_range = f"{ONE_ATTEMPT} AND $__timeFilter(ts)"

    latest_s = "Slowdown S (latest step)"
    data_age = "Data age"
    mfu_now = "MFU in range: actual vs straggler-free"
    wasted_total = "GPU-hours wasted in range"
    mfu_series = "MFU: actual vs straggler-free"
    slowdown_series = "Slowdown S per step"
    wasted_rate = "GPU-hours wasted per hour"
    by_optype = "Slowdown attributed to each op type (S_optype)"
    by_stage = "Slowdown attributed to each pipeline stage (S_stage)"
    latest_matrix = "Worker score S_w, latest ${window} steps (DP x PP)"
    range_matrix = "Worker score S_w over the time range (DP x PP)"
    per_step = "Worker slowdown per step"
    diagnosis = "Current diagnosis and advice"
    stragglers = "Top stragglers in range"
    changes = "Change points in range"
    episodes = "Straggler episodes"

    builder = (
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
        .with_variable(_job_variable(multi=False))
        .with_variable(_attempt_variable(multi=False))
        .with_variable(
            dash.CustomVariable("window")
            .label("latest window (steps)")
            .values("10,20,50,100,500")
            .current(model.VariableOption(text="20", value=str(DEFAULT_WINDOW_STEPS)))
        )
        .link(
            dash.DashboardLink("Pipeline health")
            .type(model.DashboardLinkType.DASHBOARDS)
            .tags(["lagscope"])
            .include_vars(True)
            .keep_time(True)
        )
    )
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
        .target(_Built(ClickHouseAnnotationTarget(_dedent(episode_sql))))
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
            WHERE {in_range} AND series = 'step_time' AND kind = '{kind}'
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
            .target(_Built(ClickHouseAnnotationTarget(_dedent(sql))))
        )

    builder = (
        builder.with_row(dash.Row("Now"))
        .with_panel(
            stat.Panel()
            .title(latest_s)
            .description("S = simulated step time / straggler-free step time (1 = no loss).")
            .with_target(
                q.query(
                    latest_s,
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
            .thresholds(_slowdown_thresholds())
            .span(5)
            .height(5)
        )
        .with_panel(
            stat.Panel()
            .title(data_age)
            .description(
                "Seconds since the start of the job attempt's latest stored step: a job that "
                "stopped, or a pipeline (sidecar, Kafka, worker) that stopped delivering, "
                "shows stale here. Green under a minute, red over five."
            )
            .with_target(
                q.query(
                    data_age,
                    f"""
                    SELECT dateDiff('second', maxOrNull(ts), now()) AS age_s
                    FROM steps
                    WHERE {ONE_ATTEMPT}
                    """,
                    Expect({"age_s": "number"}),
                    time_series=False,
                )
            )
            .unit("s")
            .decimals(0)
            .thresholds(_traffic_light(60, 300))
            .span(3)
            .height(5)
        )
        .with_panel(
            stat.Panel()
            .title(mfu_now)
            .description(
                "Model FLOPs utilisation of the job as it ran, and as it would run without "
                "stragglers (empty when the job's FLOPs or the GPU peak are unknown)."
            )
            .with_target(
                q.query(
                    mfu_now,
                    f"""
                    SELECT avg(mfu_actual) AS `MFU actual`, avg(mfu_ideal) AS `MFU straggler-free`
                    FROM steps FINAL
                    WHERE {in_range}
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
        .with_panel(
            stat.Panel()
            .title(wasted_total)
            .description(
                "GPU-hours lost to stragglers: what the verified episodes that overlap the "
                "range cost (their whole cost so far). Above the straggler-free steps: sum "
                "over the range's steps of GPUs x t x (1 - 1/S), which also counts the job's "
                "own jitter (its noise floor), lost with or without stragglers."
            )
            .with_target(
                q.query(
                    wasted_total,
                    f"""
                    SELECT (SELECT sum(gpu_seconds_lost) FROM episodes FINAL
                            WHERE {ONE_ATTEMPT} AND onset_ts <= $__toTime
                              AND ifNull(recovery_ts, last_ts) >= $__fromTime) / 3600
                               AS `GPU-hours lost to stragglers`,
                           sumIf(gpu_seconds_wasted, isFinite(gpu_seconds_wasted)) / 3600
                               AS `GPU-hours above straggler-free`,
                           sumIf(gpu_seconds, isFinite(gpu_seconds)) / 3600 AS `GPU-hours`
                    FROM steps FINAL
                    WHERE {in_range}
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
        .with_panel(
            table.Panel()
            .title(diagnosis)
            .description(
                "The job's verdict, kept current while it runs: built from its diagnosis and "
                "its episodes (the same story as the episodes table, the alerts and the "
                "summary); its cause, one sentence and each mitigation with its predicted "
                "speed-up."
            )
            .with_target(
                q.query(
                    diagnosis,
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
        .with_panel(
            table.Panel()
            .title(episodes)
            .description(
                "Verified straggler episodes, open ones first: which worker, on which node "
                "and GPU, slow in what (an op type, or `host`: its host stalls between its "
                "ops), since when (onset step), seen at which step, until when, and what it "
                "cost. Found while the job runs and kept current every step; a job's end "
                "refines their bounds."
            )
            .with_target(
                q.query(
                    episodes,
                    f"""
                    SELECT episode_id AS episode, state,
                           arrayStringConcat(workers, ', ') AS worker, node,
                           gpu, cause, optype AS op, onset_step,
                           recovery_step, first_seen_step,
                           share AS share_of_slowdown,
                           gpu_seconds_lost / 3600 AS gpu_hours_lost, summary
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
        .with_row(dash.Row("Cost over time"))
        .with_panel(
            timeseries.Panel()
            .title(mfu_series)
            .with_target(
                q.query(
                    mfu_series,
                    f"""
                    SELECT $__timeInterval(ts) AS time, avg(mfu_actual) AS actual,
                           avg(mfu_ideal) AS `straggler-free`
                    FROM steps FINAL
                    WHERE {in_range}
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
        .with_panel(
            timeseries.Panel()
            .title(slowdown_series)
            .description(
                "What-if slowdown of every step, without and with launch (CPU) delays; 1 = "
                "as fast as the straggler-free job. Red/green marks: verified onset/recovery."
            )
            .with_target(
                q.query(
                    slowdown_series,
                    f"""
                    SELECT ts AS time, slowdown AS S, launch_slowdown AS `S with launch delays`
                    FROM steps FINAL
                    WHERE {in_range} AND isFinite(slowdown)
                    ORDER BY time
                    """,
                    Expect({"time": "time", "S": "number", "S with launch delays": "number"}),
                    time_series=True,
                )
            )
            .thresholds(_slowdown_thresholds())
            .thresholds_style(
                common_builders.GraphThresholdsStyleConfig().mode(
                    common.GraphThresholdsStyleMode.LINE
                )
            )
            .span(8)
            .height(8)
        )
        .with_panel(
            timeseries.Panel()
            .title(wasted_rate)
            .description(
                "Rate of waste from the minute rollup: GPU-hours wasted per hour, i.e. the "
                "number of GPUs the stragglers effectively idle."
            )
            .with_target(
                q.query(
                    wasted_rate,
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
        .with_row(dash.Row("Who and what"))
    )
    for title, kind, label in ((by_optype, "optype", "optype"), (by_stage, "stage", "stage")):
        builder = builder.with_panel(
            timeseries.Panel()
            .title(title)
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
                    WHERE {in_range} AND kind = '{kind}'
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
    builder = (
        builder.with_panel(
            _worker_matrix(
                latest_matrix,
                "Mean S_w of each worker (DP rank x PP stage) over the job's latest steps, "
                "whatever the time range: a score, not a verdict (the crossing of a slow DP "
                "replica and a slow stage scores high too); verified stragglers are in "
                "'Straggler episodes' and first in 'Top stragglers in range'.",
                f"step > (SELECT max(step) FROM worker_slowdown WHERE {ONE_ATTEMPT}) - "
                f"toInt64OrZero({one_selected('window')})",
                q,
            )
        )
        .with_panel(
            _worker_matrix(
                range_matrix,
                "Mean S_w of each worker over the dashboard's time range: a score, not a "
                "verdict (see 'Straggler episodes' for the verified stragglers).",
                "$__timeFilter(ts)",
                q,
            )
        )
        .with_panel(
            heatmap.Panel()
            .title(per_step)
            .description(
                "S_w of every worker (rows, pp/dp) over time, the workers an episode verified "
                "first; the others' rows are scores (a hot band of rows is one stage or one "
                "DP replica, and a slow replica's crossing with a slow stage scores high "
                "without being slow itself)."
            )
            .with_target(
                q.query(
                    per_step,
                    f"""
                    SELECT $__timeInterval(ts) AS time,
                           concat(if((dp_rank, pp_rank) IN (
                                         SELECT toUInt32(dp_rank), toUInt32(pp_rank)
                                         FROM episodes FINAL WHERE {ONE_ATTEMPT}),
                                     'verified straggler: ', 'score: '),
                                  'pp ', toString(pp_rank), ' dp ', toString(dp_rank)) AS worker,
                           avg(slowdown) AS S_w
                    FROM worker_slowdown FINAL
                    WHERE {in_range}
                    GROUP BY time, pp_rank, dp_rank
                    ORDER BY time, startsWith(worker, 'verified') DESC, pp_rank, dp_rank
                    """,
                    Expect({"time": "time", "worker": "string", "S_w": "number"}),
                    time_series=True,
                )
            )
            .calculate(False)
            .color(
                heatmap.HeatmapColorOptions()
                .mode(heatmap_model.HeatmapColorMode.SCHEME)
                .scheme("YlOrRd")
                .min(1.0)
                .max(1.5)
            )
            .display_name("${__field.labels.worker}")
            .span(24)
            .height(12)
        )
        .with_panel(
            table.Panel()
            .title(stragglers)
            .description(
                "Workers verified by an episode in the range first (with what they cost), "
                "then the highest worker scores S_w, labelled as scores: S_w = min(S_dp, "
                "S_stage) also lights up the crossings of a slow DP replica and a slow stage "
                "(a score, not a verdict). slow steps = steps with S_w above 1.05."
            )
            .with_target(
                q.query(
                    stragglers,
                    f"""
                    SELECT w.dp AS dp, w.stage AS stage,
                           if(e.episodes > 0,
                              concat('verified: episode ', e.ids, ' (', e.causes, ')'),
                              'score only') AS evidence,
                           e.gpu_hours_lost AS gpu_hours_lost,
                           w.mean_S_w AS mean_S_w, w.max_S_w AS max_S_w,
                           w.slow_steps AS slow_steps
                    FROM (
                        SELECT dp_rank AS dp, pp_rank AS stage, avg(slowdown) AS mean_S_w,
                               max(slowdown) AS max_S_w,
                               countIf(slowdown > 1.05) AS slow_steps
                        FROM worker_slowdown FINAL
                        WHERE {in_range}
                        GROUP BY dp, stage
                    ) AS w
                    LEFT JOIN (
                        SELECT toUInt32(dp_rank) AS dp, toUInt32(pp_rank) AS stage,
                               count() AS episodes,
                               arrayStringConcat(groupArray(toString(episode_id)), ', ') AS ids,
                               arrayStringConcat(groupUniqArray(concat(cause, ' in ', optype)),
                                                 ', ') AS causes,
                               sum(gpu_seconds_lost) / 3600 AS gpu_hours_lost
                        FROM episodes FINAL
                        WHERE {ONE_ATTEMPT} AND onset_ts <= $__toTime
                          AND ifNull(recovery_ts, last_ts) >= $__fromTime
                        GROUP BY dp, stage
                    ) AS e ON e.dp = w.dp AND e.stage = w.stage
                    ORDER BY e.episodes > 0 DESC, e.gpu_hours_lost DESC, w.mean_S_w DESC
                    LIMIT 10
                    """,
                    Expect(
                        {
                            "dp": "number",
                            "stage": "number",
                            "evidence": "string",
                            "mean_S_w": "number",
                            "max_S_w": "number",
                            "slow_steps": "number",
                        }
                    ),
                    time_series=False,
                )
            )
            .decimals(3)
            .span(12)
            .height(8)
        )
        .with_panel(
            table.Panel()
            .title(changes)
            .description(
                "Raw change points (BOCD, at least 10 % change of the mean) of the step time "
                "and of each stage's, DP replica's and worker's own work: when a series "
                "moved, not who is to blame ('Straggler episodes' says that). A series that "
                "only moved against its peers (a stage that looks faster while another is "
                "slow) is not listed."
            )
            .with_target(
                q.query(
                    changes,
                    f"""
                    SELECT ts AS time, series, kind, step, before_mean, after_mean,
                           after_mean / before_mean AS ratio
                    FROM changepoints FINAL
                    WHERE {in_range} AND kind != 'shift'
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
    )
    return BuiltDashboard(JOB_OVERVIEW_UID, builder.build(), q.expectations)


# -- pipeline health ---------------------------------------------------------------------


def pipeline_health() -> BuiltDashboard:
    q = _Collector()
    ingest = "Ingest rate: ops per minute"
    steps_rate = "Steps analysed per minute"
    incomplete_rate = "Late or incomplete steps"
    incomplete_table = "Incomplete steps and their missing ranks"
    dead_rate = "Dead letters by reason"
    dead_table = "Latest dead letters"
    latency = "Sink latency (processed_at - ts)"

    builder = (
        dash.Dashboard("lagscope: pipeline health")
        .uid(PIPELINE_HEALTH_UID)
        .description("Is the pipeline keeping up, and is it losing or rejecting anything?")
        .tags(["lagscope", "pipeline"])
        .time("now-6h", "now")
        .refresh("1m")
        .with_variable(_job_variable(multi=True))
        .with_variable(_attempt_variable(multi=True))
        .link(
            dash.DashboardLink("Job overview")
            .type(model.DashboardLinkType.DASHBOARDS)
            .tags(["lagscope"])
            .include_vars(True)
            .keep_time(True)
        )
        .with_row(dash.Row("Throughput"))
        .with_panel(
            timeseries.Panel()
            .title(ingest)
            .description(
                "Raw ops stored per minute, by op start time (the store keeps one TP/CP rank "
                "per (dp, pp) worker, so this is ops analysed, not ops timed)."
            )
            .with_target(
                q.query(
                    ingest,
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
        .with_panel(
            timeseries.Panel()
            .title(steps_rate)
            .description("Closed steps per minute (complete or not), from the minute rollup.")
            .with_target(
                q.query(
                    steps_rate,
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
        .with_row(dash.Row("Completeness"))
        .with_panel(
            timeseries.Panel()
            .title(incomplete_rate)
            .description(
                "Steps closed by the lateness timeout before every (dp, pp) worker reported: "
                "a dead or lagging rank, or a streamer that stopped."
            )
            .with_target(
                q.query(
                    incomplete_rate,
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
        .with_panel(
            table.Panel()
            .title(incomplete_table)
            .description("Global ranks that never delivered their batch for the step.")
            .with_target(
                q.query(
                    incomplete_table,
                    f"""
                    SELECT ts AS time, job_id, attempt, step,
                           length(missing_ranks) AS missing,
                           -- not aliased `missing_ranks`: ClickHouse would read the alias,
                           -- not the column, in length(missing_ranks) above
                           arrayStringConcat(arrayMap(r -> toString(r), missing_ranks), ', ')
                               AS missing_global_ranks
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
                        }
                    ),
                    time_series=False,
                )
            )
            .span(12)
            .height(8)
        )
        .with_row(dash.Row("Rejected input"))
        .with_panel(
            timeseries.Panel()
            .title(dead_rate)
            .description(
                "Input kept aside with its reason (torn or garbage log records, undecodable "
                "batches, bad metadata). Not filtered by job: a record that cannot be decoded "
                "has no job."
            )
            .with_target(
                q.query(
                    dead_rate,
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
        .with_panel(
            table.Panel()
            .title(dead_table)
            .with_target(
                q.query(
                    dead_table,
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
        .with_row(dash.Row("Latency and lag"))
        .with_panel(
            timeseries.Panel()
            .title(latency)
            .description(
                "From the step's start (ts) to its row being written (processed_at): the step "
                "itself, the wait for the last rank (lateness), analysis and the write."
            )
            .with_target(
                q.query(
                    latency,
                    f"""
                    SELECT $__timeInterval(processed_at) AS time,
                           quantile(0.5)(latency_s) AS p50, quantile(0.99)(latency_s) AS p99,
                           max(latency_s) AS max
                    FROM (
                        SELECT processed_at,
                               (toUnixTimestamp64Milli(processed_at)
                                - toUnixTimestamp64Milli(ts)) / 1000 AS latency_s
                        FROM steps FINAL
                        WHERE {SELECTED_ATTEMPTS} AND $__timeFilter(processed_at)
                    )
                    GROUP BY time
                    ORDER BY time
                    """,
                    Expect({"time": "time", "p50": "number", "p99": "number", "max": "number"}),
                    time_series=True,
                )
            )
            .unit("s")
            .span(12)
            .height(8)
        )
        .with_panel(
            text.Panel()
            .title("Kafka consumer lag per job")
            .description(
                "Not available from the store: consumer-group offsets are not written to "
                "ClickHouse."
            )
            .mode(text_model.TextMode.MARKDOWN)
            .content(
                "**Kafka lag is not in the store yet.** The workers' consumer-group lag on "
                "`lagscope.ops` (partitioned by job id) is not written to ClickHouse, so this "
                "dashboard cannot chart it. Read it from the broker "
                "(`kafka-consumer-groups.sh --describe --group <workers' group>`) or a Kafka "
                "exporter; a job whose partition lags shows here as rising sink latency."
            )
            .span(12)
            .height(8)
        )
    )
    return BuiltDashboard(PIPELINE_HEALTH_UID, builder.build(), q.expectations)


class _Built(cogbuilder.Builder[model.AnnotationTarget]):
    """Wraps an already built object where the SDK wants a builder."""

    def __init__(self, built: model.AnnotationTarget) -> None:
        self._built = built

    def build(self) -> model.AnnotationTarget:
        return self._built


#: Every dashboard lagscope ships, by file name stem.
DASHBOARDS: dict[str, Callable[[], BuiltDashboard]] = {
    "job-overview": job_overview,
    "pipeline-health": pipeline_health,
}


def build_all() -> dict[str, BuiltDashboard]:
    return {name: make() for name, make in DASHBOARDS.items()}
