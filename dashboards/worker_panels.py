"""The job overview's worker panels, readable at any job size: the DP x PP score matrices,
the worker slowdown per step and the top stragglers.

A 100,000-GPU job has 12,480 (DP, PP) workers. Drawn one cell or one series each, the
matrices were tables 1,560 columns wide and the per-step heatmap 12,480 rows tall (13
million points for two hours, which Grafana fetches before it draws anything). So:

- a matrix shows one column per DP rank up to `MATRIX_MAX_DP_COLUMNS` of them; a larger
  job's columns are `MATRIX_BLOCKS` blocks of consecutive DP ranks (neighbouring machines
  in Megatron's rank order), each cell its worst worker's score, as the report bins them
  (`worker_grid.py`): one straggler among 12,500 workers still shows;
- a column's link opens the same dashboard zoomed into its block (the `dp_range`
  variable, "DP ranks"), which every worker panel honours, down to single ranks;
- the per-step heatmap shows at most `MAX_WORKER_SERIES` workers: the ones an episode
  verified, then the highest scores in range.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import heatmap, table
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models import heatmap as heatmap_model

from lagscope.dashboards.panels import (
    IN_RANGE,
    JOB_OVERVIEW_UID,
    ONE_ATTEMPT,
    Collector,
    Expect,
    one_selected,
)

#: DP ranks a worker matrix shows one column each, at most: a full-width panel holds 32
#: columns labelled `dp 1234` on a 1,920-pixel screen.
MATRIX_MAX_DP_COLUMNS = 32
#: Columns of a binned matrix: fewer, as a block's label (`dp 1536-1559`) is twice as long.
MATRIX_BLOCKS = 20
#: Workers in the per-worker time series at most: rows of 18 pixels in its panel.
MAX_WORKER_SERIES = 24
#: Rows of the DP ranks `dp_range` selects (in a query that starts with `dp_range_with()`).
IN_DP_RANGE = "dp_rank BETWEEN dp_lo AND dp_hi"
#: The workers an episode verified, in the selected job attempt.
VERIFIED_WORKERS = f"""
    SELECT toUInt32(dp_rank), toUInt32(pp_rank)
    FROM episodes FINAL WHERE {ONE_ATTEMPT}
"""


def dp_range_variable() -> dash.TextBoxVariable:
    """`dp_range`: the DP ranks the worker panels show, all of them when empty. A matrix
    column's link sets it to the column's label (`dp 384-431`); typed, `384-431` or `17`."""
    return dash.TextBoxVariable("dp_range").label("DP ranks").default_value("")


def dp_range_with() -> str:
    """A WITH clause defining, for the selected job attempt, `dp_lo` and `dp_hi` (the DP
    ranks `dp_range` names, in either order, clipped to the job's) and `dp_width` (DP ranks
    per matrix column). Its aliases reach the query's subqueries (ClickHouse's global WITH).
    """
    first, last = "toInt64OrZero(dp_picked[1])", "toInt64OrZero(dp_picked[-1])"
    columns, blocks = MATRIX_MAX_DP_COLUMNS, MATRIX_BLOCKS
    return f"""
        WITH extractAll({one_selected("dp_range")}, '[0-9]+') AS dp_picked,
             (SELECT toInt64(max(dp_size)) FROM jobs FINAL WHERE {ONE_ATTEMPT}) AS dp_size,
             if(empty(dp_picked), 0, least({first}, {last})) AS dp_lo,
             least(if(empty(dp_picked), dp_size - 1, greatest({first}, {last})),
                   dp_size - 1) AS dp_hi,
             if(dp_hi - dp_lo < {columns}, 1, intDiv(dp_hi - dp_lo + {blocks}, {blocks}))
                 AS dp_width
    """


#: Where a matrix column's link goes: this dashboard, zoomed into the column's DP ranks.
ZOOM_LINK = (
    f"/d/{JOB_OVERVIEW_UID}/?${{job:queryparam}}&${{attempt:queryparam}}"
    "&${window:queryparam}&var-dp_range=${__field.name:percentencode}&${__url_time_range}"
)


def worker_matrix(title: str, description: str, where: str, q: Collector) -> table.Panel:
    """A DP x PP grid (rows: stages; columns: DP ranks, or blocks of them; cell: the mean
    worker slowdown S_w, a block's worst worker's), pivoted by Grafana's `groupingToMatrix`
    from long rows. `where`: which of the job's rows (time range, latest steps)."""
    sql = f"""
        {dp_range_with()}
        SELECT concat('pp ', toString(pp_rank)) AS stage,
               concat('dp ', toString(dp_block),
                      if(dp_block_end = dp_block, '', concat('-', toString(dp_block_end))))
                   AS dp,
               max(worker_S_w) AS S_w
        FROM (
            SELECT pp_rank, dp_rank, avg(slowdown) AS worker_S_w
            FROM worker_slowdown FINAL
            WHERE {ONE_ATTEMPT} AND {IN_DP_RANGE} AND {where}
            GROUP BY pp_rank, dp_rank
        )
        GROUP BY pp_rank, dp_lo + intDiv(dp_rank - dp_lo, dp_width) * dp_width AS dp_block,
                 least(dp_block + dp_width - 1, dp_hi) AS dp_block_end
        ORDER BY pp_rank, dp_block
    """
    zoom_link = {"title": "Zoom into these DP ranks", "url": ZOOM_LINK}
    zoom = [model.DynamicConfigValue(id_val="links", value=[zoom_link])]
    return (
        table.Panel()
        .title(title)
        .description(
            f"{description} One column per DP rank up to {MATRIX_MAX_DP_COLUMNS}; a larger "
            f"job's are {MATRIX_BLOCKS} blocks of consecutive DP ranks, each cell its worst "
            "worker; a column's link (or the 'DP ranks' box) zooms into its ranks."
        )
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
        .override_by_regexp("^dp ", zoom)
        .cell_options(common.TableColoredBackgroundCellOptions())
        .color_scheme(dash.FieldColor().mode(model.FieldColorModeId.CONTINUOUS_YL_RD))
        .min(1.0)
        .max(1.5)
        .decimals(3)
        .span(24)
        .height(9)
    )


def worker_slowdown_per_step(q: Collector) -> heatmap.Panel:
    title = "Worker slowdown per step"
    return (
        heatmap.Panel()
        .title(title)
        .unit("suffix:x")
        .description(
            f"S_w over time of at most {MAX_WORKER_SERIES} workers (rows, pp/dp) of the "
            "selected DP ranks: those an episode verified first, then the highest mean "
            "scores in range, which are scores only (a hot band of rows is one stage or one "
            "DP replica, and a slow replica's crossing with a slow stage scores high "
            "without being slow itself)."
        )
        .with_target(
            q.query(
                title,
                f"""
                {dp_range_with()}
                SELECT $__timeInterval(ts) AS time,
                       concat(if((dp_rank, pp_rank) IN ({VERIFIED_WORKERS}),
                                 'verified straggler: ', 'score: '),
                              'pp ', toString(pp_rank), ' dp ', toString(dp_rank)) AS worker,
                       avg(slowdown) AS S_w
                FROM worker_slowdown FINAL
                WHERE {IN_RANGE} AND (dp_rank, pp_rank) IN (
                    SELECT dp_rank, pp_rank
                    FROM worker_slowdown FINAL
                    WHERE {IN_RANGE} AND {IN_DP_RANGE}
                    GROUP BY dp_rank, pp_rank
                    ORDER BY (toUInt32(dp_rank), toUInt32(pp_rank)) IN ({VERIFIED_WORKERS})
                                 DESC,
                             avg(slowdown) DESC, pp_rank, dp_rank
                    LIMIT {MAX_WORKER_SERIES})
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
        .height(16)
    )


#: Rows of the top stragglers table, before its last row: the other workers' range.
TOP_STRAGGLERS = 10

#: Workers an episode verified first, then the highest worker scores, in range and among
#: the selected DP ranks; then one row for all the others, which says where their scores
#: lie (at 12,480 workers, ten near-equal scores would read as ten stragglers).
TOP_STRAGGLERS_SQL = f"""
    {dp_range_with()}
    SELECT if(place <= {TOP_STRAGGLERS}, any(worker_dp), NULL) AS dp,
           if(place <= {TOP_STRAGGLERS}, any(worker_stage), NULL) AS stage,
           if(place <= {TOP_STRAGGLERS}, any(worker_evidence),
              concat('the other ', toString(count()), ' workers: mean S_w ',
                     toDecimalString(min(worker_mean), 3), '-',
                     toDecimalString(max(worker_mean), 3), ', median ',
                     toDecimalString(median(worker_mean), 3))) AS evidence,
           if(place <= {TOP_STRAGGLERS}, any(worker_lost), NULL) AS gpu_hours_lost,
           if(place <= {TOP_STRAGGLERS}, any(worker_mean), median(worker_mean)) AS mean_S_w,
           max(worker_max) AS max_S_w,
           if(place <= {TOP_STRAGGLERS}, any(worker_slow_steps), NULL) AS slow_steps
    FROM (
        SELECT w.dp AS worker_dp, w.stage AS worker_stage,
               if(e.episodes > 0,
                  concat('verified: episode ', e.ids, ' (', e.causes, ')'),
                  'score only') AS worker_evidence,
               e.gpu_hours_lost AS worker_lost,
               w.mean_S_w AS worker_mean, w.max_S_w AS worker_max,
               w.slow_steps AS worker_slow_steps,
               row_number() OVER (ORDER BY e.episodes > 0 DESC, e.gpu_hours_lost DESC,
                                           w.mean_S_w DESC, w.stage, w.dp) AS position
        FROM (
            SELECT dp_rank AS dp, pp_rank AS stage, avg(slowdown) AS mean_S_w,
                   max(slowdown) AS max_S_w,
                   countIf(slowdown > 1.05) AS slow_steps
            FROM worker_slowdown FINAL
            WHERE {IN_RANGE} AND {IN_DP_RANGE}
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
    )
    GROUP BY least(position, {TOP_STRAGGLERS + 1}) AS place
    ORDER BY place
"""


def top_stragglers(q: Collector) -> table.Panel:
    title = "Top stragglers in range"
    return (
        table.Panel()
        .title(title)
        .description(
            "Workers verified by an episode in the range first (with what they cost), "
            "then the highest worker scores S_w, labelled as scores: S_w = min(S_dp, "
            "S_stage) also lights up the crossings of a slow DP replica and a slow stage "
            "(a score, not a verdict). slow steps = steps with S_w above 1.05. The last "
            "row gives where the other workers' scores lie."
        )
        .with_target(
            q.query(
                title,
                TOP_STRAGGLERS_SQL,
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
