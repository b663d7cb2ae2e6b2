"""The job overview's worker panels on a job wider than they draw one cell per worker: a
generated job of 96 DP ranks x 2 stages with one slow worker, through a worker's core into
a chDB store, each panel's SQL rendered as Grafana and the ClickHouse plugin render it and
checked against the stored rows themselves."""

from __future__ import annotations

import datetime as dt
import json
import time
from collections import defaultdict
from pathlib import Path

import pytest

from lagscope.dashboards.definitions import build_all
from lagscope.dashboards.macros import QueryContext, render_sql
from lagscope.dashboards.worker_panels import (
    MATRIX_BLOCKS,
    MATRIX_MAX_DP_COLUMNS,
    MAX_WORKER_SERIES,
    TOP_STRAGGLERS,
)
from tests.generated_store import store_generated_job

JOB = "wide"
DP, PP = 96, 2
SLOW = (70, 1)  # (dp, stage)
RANGE_MATRIX = "Worker score S_w over the time range (DP x PP)"
LATEST_MATRIX = "Worker score S_w, latest ${window} steps (DP x PP)"


@pytest.fixture(scope="module")
def wide_store(chdb_dir: Path):
    """The wide job (40 steps, worker SLOW 1.6x slower over steps 12-31) through a
    `WorkerCore` into a database of the session's chDB directory, concluded."""
    from lagscope.simulator.generate import JobSpec, SlowWorker
    from lagscope.store.sink import ClickHouseSink

    dp, stage = SLOW
    spec = JobSpec(dp=DP, pp=PP, microbatches=4, steps=40, seed=3, stragglers=(
        SlowWorker(dp=dp, stage=stage, factor=1.6, start_step=12, end_step=32),
    ))  # fmt: skip
    sink = ClickHouseSink(f"chdb://{chdb_dir}?database=worker_panels")
    store_generated_job(sink, spec, JOB, time.time() - 1800)
    yield sink


def _panel_sql(title: str) -> str:
    data = build_all()["job-overview"].to_dict()
    (panel,) = [p for p in data["panels"] if p.get("title") == title]
    return panel["targets"][0]["rawSql"]


def _run(sink, title: str, dp_range: str = "") -> list[dict]:
    _, rows = sink.query(f"SELECT min(ts), max(ts) FROM steps WHERE job_id = '{JOB}'")
    first, last = rows[0]
    context = QueryContext(
        first - dt.timedelta(minutes=1),
        last + dt.timedelta(minutes=1),
        interval_s=1.0,
        variables={"job": JOB, "attempt": "0", "window": "10", "dp_range": dp_range},
    )
    result = sink.client.query(render_sql(_panel_sql(title), context))
    return [dict(zip(result.column_names, row, strict=True)) for row in result.result_rows]


def _worker_means(sink) -> dict[tuple[int, int], float]:
    """(dp, stage) -> mean S_w over the whole job, from the stored rows."""
    _, rows = sink.query(
        "SELECT dp_rank, pp_rank, avg(slowdown) FROM worker_slowdown FINAL "
        f"WHERE job_id = '{JOB}' GROUP BY dp_rank, pp_rank"
    )
    return {(int(d), int(s)): float(v) for d, s, v in rows}


def _columns(rows: list[dict]) -> dict[str, list[str]]:
    by_stage = defaultdict(list)
    for row in rows:
        by_stage[row["stage"]].append(row["dp"])
    return by_stage


def test_a_wide_job_matrix_bins_dp_ranks_each_cell_its_worst_worker(wide_store) -> None:
    rows = _run(wide_store, RANGE_MATRIX)
    means = _worker_means(wide_store)
    columns = _columns(rows)
    assert sorted(columns) == [f"pp {s}" for s in range(PP)]
    width = -(-DP // MATRIX_BLOCKS)  # 96 ranks in blocks of 5, the last one rank
    blocks = [(low, min(low + width, DP) - 1) for low in range(0, DP, width)]
    assert len(blocks) <= MATRIX_BLOCKS
    for stage in range(PP):
        assert columns[f"pp {stage}"] == [f"dp {a}-{b}" if b > a else f"dp {a}" for a, b in blocks]
    for row in rows:
        stage = int(row["stage"].removeprefix("pp "))
        low, _, high = row["dp"].removeprefix("dp ").partition("-")
        low, high = int(low), int(high or low)
        worst = max(means[(dp, stage)] for dp in range(low, high + 1))
        assert row["S_w"] == pytest.approx(worst, rel=1e-9)
    # The one slow worker among 192 is the hottest cell of the matrix, in its block.
    hottest = max(rows, key=lambda row: row["S_w"])
    dp, stage = SLOW
    assert hottest["stage"] == f"pp {stage}"
    assert hottest["dp"] == f"dp {dp - dp % width}-{dp - dp % width + width - 1}"


def test_a_column_label_zooms_into_its_ranks(wide_store) -> None:
    """A column's link sets `dp_range` to its label: the panels then show those ranks one
    column each; typed ranges (either order, one rank, past the job) read the same way."""
    means = _worker_means(wide_store)
    zoomed = _run(wide_store, RANGE_MATRIX, dp_range="dp 69-71")
    assert _columns(zoomed) == {f"pp {s}": ["dp 69", "dp 70", "dp 71"] for s in range(PP)}
    for row in zoomed:
        dp, stage = int(row["dp"][3:]), int(row["stage"][3:])
        assert row["S_w"] == pytest.approx(means[(dp, stage)], rel=1e-9)
    reversed_range = _run(wide_store, RANGE_MATRIX, dp_range="71-69")
    assert [(r["stage"], r["dp"]) for r in reversed_range] == [
        (r["stage"], r["dp"]) for r in zoomed
    ]
    # (the store sums in parallel: the same means may differ in their last bits)
    assert [r["S_w"] for r in reversed_range] == pytest.approx([r["S_w"] for r in zoomed])
    assert [r["dp"] for r in _run(wide_store, RANGE_MATRIX, dp_range="70")] == ["dp 70"] * PP
    assert _run(wide_store, RANGE_MATRIX, dp_range="500-900") == []
    # As many ranks as the matrix shows one column each: one each; one more: blocks.
    one_each = f"0-{MATRIX_MAX_DP_COLUMNS - 1}"
    assert (
        len(_columns(_run(wide_store, RANGE_MATRIX, dp_range=one_each))["pp 0"])
        == MATRIX_MAX_DP_COLUMNS
    )
    assert _columns(_run(wide_store, RANGE_MATRIX, dp_range="0-32"))["pp 0"][:2] == [
        "dp 0-1",
        "dp 2-3",
    ]
    latest = _run(wide_store, LATEST_MATRIX, dp_range="dp 69-71")
    assert _columns(latest) == _columns(zoomed)


def test_matrix_columns_link_to_their_zoom() -> None:
    data = build_all()["job-overview"].to_dict()
    (variable,) = [v for v in data["templating"]["list"] if v["name"] == "dp_range"]
    assert variable["type"] == "textbox"
    for title in (RANGE_MATRIX, LATEST_MATRIX):
        (panel,) = [p for p in data["panels"] if p.get("title") == title]
        (override,) = panel["fieldConfig"]["overrides"]
        # The DP columns link (`dp ...`), the stage column does not.
        assert override["matcher"] == {"id": "byRegexp", "options": "^dp "}
        (link,) = override["properties"][0]["value"]
        assert "var-dp_range=${__field.name:percentencode}" in link["url"]
        assert link["url"].startswith(f"/d/{data['uid']}/?")


def test_worker_series_are_the_verified_worker_then_the_top_scores(wide_store) -> None:
    rows = _run(wide_store, "Worker slowdown per step")
    workers = list(dict.fromkeys(row["worker"] for row in rows))
    assert len(workers) == MAX_WORKER_SERIES < DP * PP
    dp, stage = SLOW
    episodes = wide_store.query(
        f"SELECT dp_rank, pp_rank FROM episodes FINAL WHERE job_id = '{JOB}'"
    )[1]
    assert (dp, stage) in {(int(d), int(s)) for d, s in episodes}, episodes
    assert f"verified straggler: pp {stage} dp {dp}" in workers
    # The others are the highest mean scores among the rest.
    means = _worker_means(wide_store)
    shown = {
        (int(w.split(" dp ")[1]), int(w.split("pp ")[1].split(" ")[0]))
        for w in workers if w.startswith("score")
    }  # fmt: skip
    hidden = [v for k, v in means.items() if k not in shown and k != SLOW]
    # (to the last bits: the store sums in parallel, in no fixed order)
    assert min(means[w] for w in shown) >= max(hidden) - 1e-12
    # Within a DP range: only its workers.
    zoomed = _run(wide_store, "Worker slowdown per step", dp_range="0-1")
    assert {row["worker"].split(": ")[1] for row in zoomed} == {
        f"pp {s} dp {d}" for s in range(PP) for d in range(2)
    }


def test_top_stragglers_follow_the_dp_range(wide_store) -> None:
    dp, stage = SLOW
    (first, *_) = _run(wide_store, "Top stragglers in range")
    assert (first["dp"], first["stage"]) == (dp, stage)
    assert first["evidence"].startswith("verified")
    *zoomed, others = _run(wide_store, "Top stragglers in range", dp_range="0-9")
    assert zoomed and all(row["dp"] < 10 for row in zoomed)
    assert json.dumps([r["evidence"] for r in zoomed]).count("verified") == 0
    assert others["evidence"].startswith(f"the other {10 * PP - len(zoomed)} workers: ")


def test_top_stragglers_end_with_where_the_other_workers_lie(wide_store) -> None:
    """Ten rows of 192 workers, nine of them scores only: the last row gives the other
    182 workers' range and median of mean S_w, as the stored rows have them, so the nine
    are read against them."""
    *top, others = _run(wide_store, "Top stragglers in range")
    assert len(top) == TOP_STRAGGLERS and others["dp"] is None and others["stage"] is None
    means = _worker_means(wide_store)
    rest = sorted(v for worker, v in means.items()
                  if worker not in {(row["dp"], row["stage"]) for row in top})  # fmt: skip
    assert len(rest) == DP * PP - TOP_STRAGGLERS
    median = (rest[len(rest) // 2 - 1] + rest[len(rest) // 2]) / 2
    assert others["evidence"] == (
        f"the other {len(rest)} workers: mean S_w {rest[0]:.3f}-{rest[-1]:.3f}, median {median:.3f}"
    )
    assert others["mean_S_w"] == pytest.approx(median, abs=1e-9)
    # The top rows are the highest scores of the rest, after the verified worker.
    assert min(row["mean_S_w"] for row in top[1:]) >= rest[-1]
