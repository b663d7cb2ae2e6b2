"""Fleet-wide dashboards: every job at once, and the machines they run on.

- **Fleet** (uid `lagscope-fleet`): all jobs that reported in the time range, one row
  each: slowdown of the latest step, GPU-hours wasted today, its open straggler episodes
  (worker, node, op, since when), the top worker (verified by an episode first, else the
  highest score, labelled as a score) and the node it runs on, and how long ago the last
  step arrived (a job whose data stopped looks stale here, not healthy). The job column
  links to the job's overview.
- **Nodes** (uid `lagscope-nodes`): worker slowdowns of every job joined with the rank
  identity (which node each (job, attempt, dp, pp) worker runs on), summed per node: a
  machine that is slow in several jobs ranks first even when each job blames a different
  rank.

Their variables: the ClickHouse data source, and the jobs to show (all at first: a
team's jobs, or one job's machines), read through `panels.any_selected` like the job
dashboards' (percent-encoded: no text a user picks reaches the SQL as SQL). Built with
the helpers of `panels.py` (same query collector, same expectations, same SDK round
trip), so the tests run these queries like the others.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import stat, table, timeseries
from grafana_foundation_sdk.models import dashboard as model

from lagscope.dashboards.alerts import SILENT_AFTER_S
from lagscope.dashboards.job_overview import JOB_OVERVIEW_UID
from lagscope.dashboards.panels import (
    ENDED_JOBS,
    BuiltDashboard,
    Collector,
    Expect,
    any_selected,
    datasource_variable,
    job_variable,
    slowdown_thresholds,
)
from lagscope.dashboards.runbook import runbook
from lagscope.store.schema import RANK_IDENTITY_TABLE

FLEET_UID = "lagscope-fleet"
#: The jobs the fleet and node views read: the `job` variable's selection ("All" at first),
#: through the same percent-encoded reading as the job dashboards (`panels.selected`).
ANY_JOB = any_selected("job", "job_id")
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

#: The episodes that overlap the time range, each with the machine of its worker: the
#: rank identity's, else the one the episode was stored with (identity may come later).
VERIFIED_SQL = f"""
    SELECT e.job_id AS job_id, e.attempt AS attempt, e.dp_rank AS dp_rank,
           e.pp_rank AS pp_rank, e.gpu_seconds_lost AS gpu_seconds_lost,
           if(i.node_name != '', i.node_name, e.node) AS node_name
    FROM (
        SELECT job_id, attempt, dp_rank, pp_rank, gpu_seconds_lost, node
        FROM episodes FINAL
        WHERE onset_ts <= $__toTime AND ifNull(recovery_ts, last_ts) >= $__fromTime
    ) AS e
    LEFT JOIN ({IDENTITY_SQL}) AS i
        ON i.job_id = e.job_id AND i.attempt = e.attempt
        AND toInt32(i.dp_rank) = e.dp_rank AND toInt32(i.pp_rank) = e.pp_rank
"""

#: Per-job link to its overview; the job id is percent-encoded into the URL.
JOB_LINK = (
    f"/d/{JOB_OVERVIEW_UID}/?var-job=${{__data.fields.job_id:percentencode}}"
    "&var-attempt=${__data.fields.attempt}&${__url_time_range}"
)


#: One row per job attempt with steps in the time range (the "All jobs now" table).
JOBS_SQL = f"""
    SELECT s.job_id AS job_id, s.attempt AS attempt, s.latest_S AS latest_S,
           s.wasted_gpu_h_today AS wasted_gpu_h_today,
           e.current_episode AS current_episode,
           if(v.verified_worker != '', concat(v.verified_worker, ' (verified)'),
              concat(w.top_worker, ' (score only)')) AS top_worker,
           w.top_worker_S_w AS top_worker_S_w,
           if(v.verified_worker != '', v.verified_node, w.top_node) AS top_node,
           s.last_step_age_s AS last_step_age_s,
           multiIf((s.job_id, s.attempt) IN {ENDED_JOBS}, 'ended',
                   s.last_step_age_s > {SILENT_AFTER_S}, 'silent', 'running') AS status
    FROM (
        SELECT job_id, attempt, argMax(slowdown, step) AS latest_S,
               sumIf(gpu_seconds_wasted,
                     ts >= toStartOfDay(now()) AND isFinite(gpu_seconds_wasted))
                 / 3600 AS wasted_gpu_h_today,
               dateDiff('second', max(ts), now()) AS last_step_age_s
        FROM steps FINAL
        WHERE $__timeFilter(ts) AND {ANY_JOB}
        GROUP BY job_id, attempt
    ) AS s
    LEFT JOIN (
        SELECT job_id, attempt,
               arrayStringConcat(
                   groupArray(concat(arrayStringConcat(workers, ', '),
                                     if(node != '', concat(' on ', node), ''),
                                     ' slow in ', optype, ' since step ',
                                     toString(onset_step))), '; '
               ) AS current_episode
        FROM episodes FINAL
        WHERE state = 'open'
        GROUP BY job_id, attempt
    ) AS e ON e.job_id = s.job_id AND e.attempt = s.attempt
    LEFT JOIN (
        SELECT job_id, attempt,
               argMax(concat('dp ', toString(dp_rank), ', pp ', toString(pp_rank)),
                      gpu_seconds_lost) AS verified_worker,
               argMax(node_name, gpu_seconds_lost) AS verified_node
        FROM ({VERIFIED_SQL})
        GROUP BY job_id, attempt
    ) AS v ON v.job_id = s.job_id AND v.attempt = s.attempt
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

#: Each worker's steps in the time range, summed, with the node it runs on: a node's
#: figures are sums over its workers, so the join with the rank identity takes one row per
#: worker, not one per worker-step (18 M of those in two hours of a 99,840-GPU job).
WORKER_TOTALS_SQL = f"""
    SELECT w.job_id AS job_id, i.node_name AS node, w.steps AS steps,
           w.straggling_steps AS straggling_steps, w.excess AS excess, w.max_S_w AS max_S_w
    FROM (
        SELECT job_id, attempt, dp_rank, pp_rank, count() AS steps,
               countIf(slowdown >= {STRAGGLING_S_W}) AS straggling_steps,
               sum(greatest(slowdown - 1, 0)) AS excess, max(slowdown) AS max_S_w
        FROM worker_slowdown FINAL
        WHERE $__timeFilter(ts) AND isFinite(slowdown) AND {ANY_JOB}
        GROUP BY job_id, attempt, dp_rank, pp_rank
    ) AS w
    INNER JOIN ({IDENTITY_SQL}) AS i
        ON i.job_id = w.job_id AND i.attempt = w.attempt
        AND i.dp_rank = w.dp_rank AND i.pp_rank = w.pp_rank
"""


def fleet() -> BuiltDashboard:
    q = Collector()
    builder = (
        _fleet_dashboard()
        .with_panel(_all_jobs(q))
        .with_panel(_wasted_today(q))
        .with_panel(_slowdown_per_job(q))
    )
    return BuiltDashboard(FLEET_UID, builder.build(), q.expectations)


def _jobs_variable() -> dash.QueryVariable:
    """The jobs to show, all of them at first."""
    return job_variable(multi=True).current(
        model.VariableOption(selected=True, text="All", value="$__all")
    )


def _fleet_dashboard() -> dash.Dashboard:
    return (
        dash.Dashboard("lagscope: fleet")
        .uid(FLEET_UID)
        .description(
            "Every job now: which ones lose GPU-hours to stragglers, since when, on which "
            "worker and node. A job whose last step is old has stopped reporting."
        )
        .tags(["lagscope", "stragglers", "fleet"])
        .time("now-6h", "now")
        .refresh("1m")
        .with_variable(datasource_variable())
        .with_variable(_jobs_variable())
        .link(
            dash.DashboardLink("lagscope dashboards")
            .type(model.DashboardLinkType.DASHBOARDS)
            .tags(["lagscope"])
            .keep_time(True)
        )
    )


def _all_jobs(q: Collector) -> table.Panel:
    title = "All jobs now"
    return (
        table.Panel()
        .title(title)
        .description(
            "One row per job attempt with steps in the time range. latest_S: slowdown of "
            "its latest step; current_episode: its open straggler episodes (worker, node, "
            "op, since when); top_worker: the costliest worker an episode verified in the "
            "range, else the highest worker score S_w, labelled as a score; top_node: "
            "where it runs (empty until the job's rank identity is stored); "
            "last_step_age_s: seconds since its last step; status: running, silent (no "
            "step for 5 minutes: 'Job silent' pages) or ended (every rank's monitor "
            "closed: it finished)."
        )
        .with_target(
            q.query(
                title,
                JOBS_SQL,
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
                        "status": "string",
                    }
                ),
                time_series=False,
            )
        )
        .override_by_name("job_id", _job_overview_link())
        .override_by_name("last_step_age_s", _age_in_seconds_red_after_5_minutes())
        .thresholds(slowdown_thresholds())
        .decimals(3)
        .span(24)
        .height(10)
    )


def _job_overview_link() -> list[model.DynamicConfigValue]:
    return [
        model.DynamicConfigValue(id_val="links", value=[{"title": "Job overview", "url": JOB_LINK}])
    ]


def _age_in_seconds_red_after_5_minutes() -> list[model.DynamicConfigValue]:
    """A stale row is not a healthy one: its age turns red after five minutes."""
    return [
        model.DynamicConfigValue(id_val="unit", value="s"),
        model.DynamicConfigValue(id_val="custom.cellOptions", value={"type": "color-background"}),
        model.DynamicConfigValue(
            id_val="thresholds",
            value={
                "mode": "absolute",
                "steps": [{"color": "green", "value": None}, {"color": "red", "value": 300}],
            },
        ),
    ]


def _wasted_today(q: Collector) -> stat.Panel:
    title = "GPU-hours wasted today, all jobs"
    return (
        stat.Panel()
        .title(title)
        .unit("suffix: GPU-h")
        .description("GPU-hours lost to stragglers since midnight, summed over jobs.")
        .with_target(
            q.query(
                title,
                f"""
                SELECT sum(gpu_seconds_wasted) / 3600 AS `GPU-hours wasted`
                FROM steps_1m
                WHERE minute >= toStartOfDay(now()) AND {ANY_JOB}
                """,
                Expect({"GPU-hours wasted": "number"}),
                time_series=False,
            )
        )
        .decimals(2)
        .span(6)
        .height(8)
    )


def _slowdown_per_job(q: Collector) -> timeseries.Panel:
    title = "Slowdown per job"
    return (
        timeseries.Panel()
        .title(title)
        .unit("suffix:x")
        .description("Mean slowdown S of each job attempt per minute.")
        .with_target(
            q.query(
                title,
                f"""
                SELECT minute AS time, concat(job_id, '/', toString(attempt)) AS job,
                       sum(slowdown_sum) / sum(slowdown_count) AS S
                FROM steps_1m
                WHERE $__timeFilter(minute) AND {ANY_JOB}
                GROUP BY job_id, attempt, minute
                HAVING sum(slowdown_count) > 0
                ORDER BY time
                """,
                Expect({"time": "time", "job": "string", "S": "number"}),
                time_series=True,
            )
        )
        .thresholds(slowdown_thresholds())
        .span(18)
        .height(8)
    )


def nodes() -> BuiltDashboard:
    q = Collector()
    builder = (
        _nodes_dashboard().with_panel(_node_ranking(q)).with_panel(_straggling_nodes_over_time(q))
    )
    return BuiltDashboard(NODES_UID, builder.build(), q.expectations)


def _nodes_dashboard() -> dash.Dashboard:
    return (
        dash.Dashboard("lagscope: nodes")
        .uid(NODES_UID)
        .description(
            "Machines ranked by how often and how much the workers on them straggle, over "
            "every job: a bad node shows up even when each job blames a different rank."
        )
        .tags(["lagscope", "stragglers", "fleet"])
        .time("now-24h", "now")
        .refresh("5m")
        .with_variable(datasource_variable())
        .with_variable(_jobs_variable())
        .link(
            dash.DashboardLink("lagscope dashboards")
            .type(model.DashboardLinkType.DASHBOARDS)
            .tags(["lagscope"])
            .keep_time(True)
        )
    )


#: Nodes by verified episodes, then by how often and how much their workers straggle.
NODE_RANKING_SQL = f"""
    SELECT n.node AS node, ifNull(v.episodes, 0) AS verified_episodes,
           ifNull(v.gpu_hours_lost, 0) AS verified_gpu_hours_lost,
           n.jobs AS jobs, n.jobs_straggling AS jobs_straggling,
           n.worker_steps AS worker_steps,
           n.straggling_share AS straggling_share,
           n.excess_per_step AS excess_per_step, n.max_S_w AS max_S_w
    FROM (
        SELECT node, uniqExact(job_id) AS jobs,
               uniqExactIf(job_id, straggling_steps > 0) AS jobs_straggling,
               sum(steps) AS worker_steps,
               sum(straggling_steps) / sum(steps) AS straggling_share,
               sum(excess) / sum(steps) AS excess_per_step,
               max(max_S_w) AS max_S_w
        FROM ({WORKER_TOTALS_SQL})
        GROUP BY node
    ) AS n
    LEFT JOIN (
        SELECT node_name AS node, count() AS episodes,
               sum(gpu_seconds_lost) / 3600 AS gpu_hours_lost
        FROM ({VERIFIED_SQL})
        WHERE node_name != ''
        GROUP BY node
    ) AS v ON v.node = n.node
    ORDER BY verified_episodes DESC, verified_gpu_hours_lost DESC,
             excess_per_step DESC, node
    LIMIT 50
"""


def _node_ranking(q: Collector) -> table.Panel:
    title = "Nodes by straggling, across jobs"
    return (
        table.Panel()
        .title(title)
        .description(
            "Nodes with verified straggler episodes first (how many, and the GPU-hours "
            "they cost), then by their workers' scores: "
            f"straggling_share: share of the node's worker-steps with S_w >= "
            f"{STRAGGLING_S_W}; excess_per_step: mean of max(S_w - 1, 0), how often and "
            "how much in one number; jobs_straggling: jobs in which a worker on the node "
            "scored as straggling."
        )
        .with_target(
            q.query(
                title,
                NODE_RANKING_SQL,
                Expect(
                    {
                        "node": "string",
                        "verified_episodes": "number",
                        "verified_gpu_hours_lost": "number",
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


def _straggling_nodes_over_time(q: Collector) -> timeseries.Panel:
    title = "Straggling nodes over time"
    return (
        timeseries.Panel()
        .title(title)
        .unit("percentunit")
        .description("Mean excess worker slowdown per node over time (the 10 worst).")
        .with_target(
            q.query(
                title,
                f"""
                SELECT $__timeInterval(w.ts) AS time, i.node_name AS node,
                       avg(greatest(w.slowdown - 1, 0)) AS excess_S_w
                FROM (
                    SELECT job_id, attempt, dp_rank, pp_rank, ts, slowdown
                    FROM worker_slowdown FINAL
                    WHERE $__timeFilter(ts) AND isFinite(slowdown)
                      AND (job_id, attempt, dp_rank, pp_rank) IN (
                          SELECT job_id, attempt, dp_rank, pp_rank
                          FROM ({IDENTITY_SQL})
                          WHERE node_name IN (
                              SELECT node FROM ({WORKER_TOTALS_SQL})
                              GROUP BY node ORDER BY sum(excess) DESC, node LIMIT 10))
                ) AS w
                INNER JOIN ({IDENTITY_SQL}) AS i
                    ON i.job_id = w.job_id AND i.attempt = w.attempt
                    AND i.dp_rank = w.dp_rank AND i.pp_rank = w.pp_rank
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


#: The fleet-wide dashboards, by file name stem (written to generated/fleet/).
FLEET_DASHBOARDS = {"fleet": fleet, "nodes": nodes, "runbook": runbook}


def build_fleet() -> dict[str, BuiltDashboard]:
    return {name: make() for name, make in FLEET_DASHBOARDS.items()}
