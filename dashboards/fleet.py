"""Fleet-wide dashboards: every job at once, and the machines they run on.

- **Fleet** (uid `lagscope-fleet`): all jobs that reported in the time range, one row
  each: slowdown of the latest step, GPU-hours wasted today, the episode going on now
  (series whose latest change point is an onset), the top worker and the node it runs
  on, and how long ago the last step arrived (a job whose data stopped looks stale here,
  not healthy). The job column links to the job's overview.
- **Nodes** (uid `lagscope-nodes`): worker slowdowns of every job joined with the rank
  identity (which node each (job, attempt, dp, pp) worker runs on), summed per node: a
  machine that is slow in several jobs ranks first even when each job blames a different
  rank.

Neither has template variables: the time range is the only input, so no user-supplied
text reaches the SQL. Built with the helpers of `definitions.py` (same query collector,
same expectations, same SDK round trip), so the tests run these queries like the others.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import stat, table, timeseries
from grafana_foundation_sdk.models import dashboard as model

from lagscope.dashboards.definitions import (
    JOB_OVERVIEW_UID,
    BuiltDashboard,
    Expect,
    _Collector,
    _slowdown_thresholds,
)
from lagscope.stream_app.schema import RANK_IDENTITY_TABLE

FLEET_UID = "lagscope-fleet"
NODES_UID = "lagscope-nodes"
#: A worker-step with S_w at or above this counts as straggling (the alerts' threshold).
STRAGGLING_S_W = 1.10

#: The machine of every analysed worker (TP/CP rank 0 of each (dp, pp)); `node_name` is
#: the scheduler's node where known, else the host.
IDENTITY_SQL = f"""
    SELECT job_id, attempt, dp_rank, pp_rank,
           if(node != '', node, host) AS node_name, gpu
    FROM {RANK_IDENTITY_TABLE} FINAL
    WHERE tp_rank = 0 AND cp_rank = 0
"""

#: Per-job link to its overview; the job id is percent-encoded into the URL.
JOB_LINK = (
    f"/d/{JOB_OVERVIEW_UID}/?var-job=${{__data.fields.job_id:percentencode}}"
    "&var-attempt=${__data.fields.attempt}&${__url_time_range}"
)


def fleet() -> BuiltDashboard:
    q = _Collector()
    all_jobs = "All jobs now"
    wasted_today = "GPU-hours wasted today, all jobs"
    slowdown_series = "Slowdown per job"

    jobs_sql = f"""
        SELECT s.job_id AS job_id, s.attempt AS attempt, s.latest_S AS latest_S,
               s.wasted_gpu_h_today AS wasted_gpu_h_today,
               e.current_episode AS current_episode,
               w.top_worker AS top_worker, w.top_worker_S_w AS top_worker_S_w,
               w.top_node AS top_node, s.last_step_age_s AS last_step_age_s
        FROM (
            SELECT job_id, attempt, argMax(slowdown, step) AS latest_S,
                   sumIf(gpu_seconds_wasted,
                         ts >= toStartOfDay(now()) AND isFinite(gpu_seconds_wasted))
                     / 3600 AS wasted_gpu_h_today,
                   dateDiff('second', max(ts), now()) AS last_step_age_s
            FROM steps FINAL
            WHERE $__timeFilter(ts)
            GROUP BY job_id, attempt
        ) AS s
        LEFT JOIN (
            SELECT job_id, attempt,
                   arrayStringConcat(
                       groupArray(concat(series, ' since step ', toString(onset_step))), ', '
                   ) AS current_episode
            FROM (
                SELECT job_id, attempt, series, argMax(kind, step) AS latest_kind,
                       max(step) AS onset_step
                FROM changepoints FINAL
                GROUP BY job_id, attempt, series
            )
            WHERE latest_kind = 'onset'
            GROUP BY job_id, attempt
        ) AS e ON e.job_id = s.job_id AND e.attempt = s.attempt
        LEFT JOIN (
            SELECT job_id, attempt,
                   argMax(concat('dp ', toString(dp_rank), ', pp ', toString(pp_rank)),
                          mean_S_w) AS top_worker,
                   max(mean_S_w) AS top_worker_S_w,
                   argMax(node_name, mean_S_w) AS top_node
            FROM (
                SELECT w.job_id AS job_id, w.attempt AS attempt, w.dp_rank AS dp_rank,
                       w.pp_rank AS pp_rank, w.mean_S_w AS mean_S_w,
                       i.node_name AS node_name
                FROM (
                    SELECT job_id, attempt, dp_rank, pp_rank, avg(slowdown) AS mean_S_w
                    FROM worker_slowdown FINAL
                    WHERE $__timeFilter(ts)
                    GROUP BY job_id, attempt, dp_rank, pp_rank
                ) AS w
                LEFT JOIN ({IDENTITY_SQL}) AS i
                    ON i.job_id = w.job_id AND i.attempt = w.attempt
                    AND i.dp_rank = w.dp_rank AND i.pp_rank = w.pp_rank
            )
            GROUP BY job_id, attempt
        ) AS w ON w.job_id = s.job_id AND w.attempt = s.attempt
        ORDER BY wasted_gpu_h_today DESC, job_id, attempt
    """
    builder = (
        dash.Dashboard("lagscope: fleet")
        .uid(FLEET_UID)
        .description(
            "Every job now: which ones lose GPU-hours to stragglers, since when, on which "
            "worker and node. A job whose last step is old has stopped reporting."
        )
        .tags(["lagscope", "stragglers", "fleet"])
        .time("now-6h", "now")
        .refresh("1m")
        .link(
            dash.DashboardLink("lagscope dashboards")
            .type(model.DashboardLinkType.DASHBOARDS)
            .tags(["lagscope"])
            .keep_time(True)
        )
        .with_panel(
            table.Panel()
            .title(all_jobs)
            .description(
                "One row per job attempt with steps in the time range. latest_S: slowdown of "
                "its latest step; current_episode: series whose latest change point is an "
                "onset; top_node: where the top worker runs (empty until the job's rank "
                "identity is stored); last_step_age_s: seconds since its last step."
            )
            .with_target(
                q.query(
                    all_jobs,
                    jobs_sql,
                    Expect(
                        {
                            "job_id": "string",
                            "attempt": "number",
                            "latest_S": "number",
                            "wasted_gpu_h_today": "number",
                            "current_episode": "string",
                            "top_worker": "string",
                            "top_worker_S_w": "number",
                            "top_node": "string",
                            "last_step_age_s": "number",
                        }
                    ),
                    time_series=False,
                )
            )
            .override_by_name(
                "job_id",
                [
                    model.DynamicConfigValue(
                        id_val="links",
                        value=[{"title": "Job overview", "url": JOB_LINK}],
                    )
                ],
            )
            .override_by_name(
                "last_step_age_s",
                [
                    model.DynamicConfigValue(id_val="unit", value="s"),
                    model.DynamicConfigValue(
                        id_val="custom.cellOptions", value={"type": "color-background"}
                    ),
                    model.DynamicConfigValue(
                        id_val="thresholds",
                        value={
                            "mode": "absolute",
                            "steps": [
                                {"color": "green", "value": None},
                                {"color": "red", "value": 300},
                            ],
                        },
                    ),
                ],
            )
            .thresholds(_slowdown_thresholds())
            .decimals(3)
            .span(24)
            .height(10)
        )
        .with_panel(
            stat.Panel()
            .title(wasted_today)
            .description("GPU-hours lost to stragglers since midnight, summed over jobs.")
            .with_target(
                q.query(
                    wasted_today,
                    """
                    SELECT sum(gpu_seconds_wasted) / 3600 AS `GPU-hours wasted`
                    FROM steps_1m
                    WHERE minute >= toStartOfDay(now())
                    """,
                    Expect({"GPU-hours wasted": "number"}),
                    time_series=False,
                )
            )
            .decimals(2)
            .span(6)
            .height(8)
        )
        .with_panel(
            timeseries.Panel()
            .title(slowdown_series)
            .description("Mean slowdown S of each job attempt per minute.")
            .with_target(
                q.query(
                    slowdown_series,
                    """
                    SELECT minute AS time, concat(job_id, '/', toString(attempt)) AS job,
                           sum(slowdown_sum) / sum(slowdown_count) AS S
                    FROM steps_1m
                    WHERE $__timeFilter(minute)
                    GROUP BY job_id, attempt, minute
                    HAVING sum(slowdown_count) > 0
                    ORDER BY time
                    """,
                    Expect({"time": "time", "job": "string", "S": "number"}),
                    time_series=True,
                )
            )
            .thresholds(_slowdown_thresholds())
            .span(18)
            .height(8)
        )
    )
    return BuiltDashboard(FLEET_UID, builder.build(), q.expectations)


def nodes() -> BuiltDashboard:
    q = _Collector()
    ranking = "Nodes by straggling, across jobs"
    over_time = "Straggling nodes over time"
    joined = f"""
        SELECT w.job_id AS job_id, w.ts AS ts, w.slowdown AS S_w, i.node_name AS node
        FROM (
            SELECT job_id, attempt, dp_rank, pp_rank, ts, slowdown
            FROM worker_slowdown FINAL
            WHERE $__timeFilter(ts) AND isFinite(slowdown)
        ) AS w
        INNER JOIN ({IDENTITY_SQL}) AS i
            ON i.job_id = w.job_id AND i.attempt = w.attempt
            AND i.dp_rank = w.dp_rank AND i.pp_rank = w.pp_rank
    """
    builder = (
        dash.Dashboard("lagscope: nodes")
        .uid(NODES_UID)
        .description(
            "Machines ranked by how often and how much the workers on them straggle, over "
            "every job: a bad node shows up even when each job blames a different rank."
        )
        .tags(["lagscope", "stragglers", "fleet"])
        .time("now-24h", "now")
        .refresh("5m")
        .link(
            dash.DashboardLink("lagscope dashboards")
            .type(model.DashboardLinkType.DASHBOARDS)
            .tags(["lagscope"])
            .keep_time(True)
        )
        .with_panel(
            table.Panel()
            .title(ranking)
            .description(
                f"straggling_share: share of the node's worker-steps with S_w >= "
                f"{STRAGGLING_S_W}; excess_per_step: mean of max(S_w - 1, 0), how often and "
                "how much in one number (the ranking); jobs_straggling: jobs in which a "
                "worker on the node straggled."
            )
            .with_target(
                q.query(
                    ranking,
                    f"""
                    SELECT node, uniqExact(job_id) AS jobs,
                           uniqExactIf(job_id, S_w >= {STRAGGLING_S_W}) AS jobs_straggling,
                           count() AS worker_steps,
                           countIf(S_w >= {STRAGGLING_S_W}) / count() AS straggling_share,
                           sum(greatest(S_w - 1, 0)) / count() AS excess_per_step,
                           max(S_w) AS max_S_w
                    FROM ({joined})
                    GROUP BY node
                    ORDER BY excess_per_step DESC, node
                    LIMIT 50
                    """,
                    Expect(
                        {
                            "node": "string",
                            "jobs": "number",
                            "jobs_straggling": "number",
                            "worker_steps": "number",
                            "straggling_share": "number",
                            "excess_per_step": "number",
                            "max_S_w": "number",
                        }
                    ),
                    time_series=False,
                )
            )
            .decimals(3)
            .span(24)
            .height(10)
        )
        .with_panel(
            timeseries.Panel()
            .title(over_time)
            .description("Mean excess worker slowdown per node over time (the 10 worst).")
            .with_target(
                q.query(
                    over_time,
                    f"""
                    SELECT $__timeInterval(ts) AS time, node,
                           avg(greatest(S_w - 1, 0)) AS excess_S_w
                    FROM ({joined})
                    WHERE node IN (
                        SELECT node FROM ({joined})
                        GROUP BY node ORDER BY sum(greatest(S_w - 1, 0)) DESC LIMIT 10
                    )
                    GROUP BY time, node
                    ORDER BY time
                    """,
                    Expect({"time": "time", "node": "string", "excess_S_w": "number"}),
                    time_series=True,
                )
            )
            .span(24)
            .height(9)
        )
    )
    return BuiltDashboard(NODES_UID, builder.build(), q.expectations)


#: The fleet-wide dashboards, by file name stem (written to generated/fleet/).
FLEET_DASHBOARDS = {"fleet": fleet, "nodes": nodes}


def build_fleet() -> dict[str, BuiltDashboard]:
    return {name: make() for name, make in FLEET_DASHBOARDS.items()}
