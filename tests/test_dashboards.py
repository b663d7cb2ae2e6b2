"""Grafana dashboards as code: the committed JSON is what the code builds, it is a valid
SDK dashboard model, and every query of every panel, annotation and variable, expanded as
Grafana and the ClickHouse plugin expand it, runs on a real store (chDB) filled by the
embedded pipeline and returns the columns its panel needs."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from grafana_foundation_sdk.models import prometheus as prometheus_model

from lagscope.cli import main
from lagscope.dashboards.build import GENERATED_DIR
from lagscope.dashboards.clickhouse_query import (
    DATASOURCE_UID,
    PLUGIN_ID,
    ClickHouseQuery,
    Format,
    datasource_ref,
    register_clickhouse_query,
)
from lagscope.dashboards.definitions import build_all
from lagscope.dashboards.macros import MacroError, QueryContext, expand_macros, render_sql
from lagscope.dashboards.panels import BuiltDashboard, Expect, sdk_round_trip
from tests.demo_store import DEMO_JOB, fill_demo_store

JOB = DEMO_JOB
MISSING_WORKER = (3, 1)  # (dp, pp) that never reports the last step: one incomplete step


@pytest.fixture(scope="module")
def built() -> dict[str, BuiltDashboard]:
    return build_all()


# -- the committed files ------------------------------------------------------------------


def test_generated_json_matches_the_code(built: dict[str, BuiltDashboard]) -> None:
    committed = sorted(p.name for p in GENERATED_DIR.glob("*.json"))
    assert committed == sorted(f"{name}.json" for name in built)
    for name, item in built.items():
        assert (GENERATED_DIR / f"{name}.json").read_text() == item.to_json(), (
            f"dashboards/generated/{name}.json is stale: run `lagscope dashboards build`"
        )


def test_build_check_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dashboards", "build", "--check"]) == 0
    assert main(["dashboards", "build", "--out", str(tmp_path)]) == 0
    assert main(["dashboards", "build", "--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "job-overview.json").write_text("{}")
    (tmp_path / "pipeline-health.json").unlink()
    assert main(["dashboards", "build", "--out", str(tmp_path), "--check"]) == 1
    (message,) = capsys.readouterr().err.splitlines()
    assert f"{tmp_path / 'pipeline-health.json'} missing" in message
    assert f"{tmp_path / 'job-overview.json'} differ from the code" in message


def test_json_is_a_fixed_point_of_the_sdk_model() -> None:
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    register_clickhouse_query()
    for path in GENERATED_DIR.glob("*.json"):
        data = json.loads(path.read_text())
        assert sdk_round_trip(data) == data, f"{path.name} changes through the SDK model"
        decoded = Dashboard.from_json(data)
        targets = [t for p in decoded.panels or [] for t in getattr(p, "targets", None) or []]
        # the store's queries, and the one panel that reads the workers' metric
        kinds = (ClickHouseQuery, prometheus_model.Dataquery)
        assert targets and all(isinstance(t, kinds) for t in targets), path.name
        # annotation targets (which the SDK models for Grafana's own source only) go
        # through the ClickHouse query model unchanged
        for annotation in data["annotations"].get("list", []):
            query = ClickHouseQuery.from_json(annotation["target"])
            encoded = json.loads(json.dumps(query, cls=JSONEncoder))
            assert encoded == annotation["target"]


def test_every_query_targets_the_clickhouse_datasource(built: dict[str, BuiltDashboard]) -> None:
    for item in built.values():
        data = item.to_dict()
        variables = {v["name"]: v for v in data["templating"]["list"]}
        names = [name for name in variables if name != "prometheus"]
        assert names[:3] == ["datasource", "job", "attempt"]
        # a data source variable, not a fixed uid: it starts on the provisioned one
        source = variables["datasource"]
        assert (source["type"], source["query"]) == ("datasource", PLUGIN_ID)
        assert source["current"]["value"] == DATASOURCE_UID
        assert datasource_ref().uid == "${datasource}"
        for _, query, datasource in _queries(data):
            assert datasource == {"type": PLUGIN_ID, "uid": "${datasource}"}
            assert query.get("editorType", "sql") == "sql"
        # every SQL in the JSON has a declared expectation and the reverse
        declared = {key for key in item.expectations}
        present = {(where, ref) for where, ref, _ in _targets(data)}
        assert declared == present


# -- macros -------------------------------------------------------------------------------


def test_macros_expand_like_the_plugin() -> None:
    start = dt.datetime(2025, 1, 2, 3, 4, 5, 678000, tzinfo=dt.UTC)
    end = start + dt.timedelta(hours=1)
    ctx = QueryContext(start, end, interval_s=30.0, variables={"job": "j1", "attempt": "2"})
    s, e = int(start.timestamp()), int(end.timestamp())
    assert expand_macros("WHERE $__timeFilter(ts)", ctx) == (
        f"WHERE ts >= toDateTime({s}) AND ts <= toDateTime({e})"
    )
    assert expand_macros("$__timeInterval(ts)", ctx) == (
        "toStartOfInterval(toDateTime(ts), INTERVAL 30 second)"
    )
    assert expand_macros("$__fromTime, $__toTime", ctx) == f"toDateTime({s}), toDateTime({e})"
    assert expand_macros("$__fromTime_ms", ctx) == f"fromUnixTimestamp64Milli({s * 1000 + 678})"
    assert expand_macros("count() / $__interval_s", ctx) == "count() / 30"
    # sub-second intervals round up to one second, as the plugin does
    assert expand_macros("$__interval_s", QueryContext(start, end, interval_s=0.2)) == "1"
    assert render_sql("job_id = '${job}' AND attempt = $attempt", ctx) == (
        "job_id = 'j1' AND attempt = 2"
    )
    multi = QueryContext(start, end, variables={"job": ["a", "b"]})
    assert render_sql("job_id IN (${job})", multi) == "job_id IN ('a','b')"
    assert render_sql("${job:sqlstring}", QueryContext(start, end, variables={"job": "o'k"})) == (
        "'o''k'"
    )
    with pytest.raises(MacroError):
        expand_macros("$__timeFilter(a, b)", ctx)
    with pytest.raises(MacroError):
        expand_macros("$__nope", ctx)


# -- every query on a real store ------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_store(chdb_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The demo job (40 steps) through timers, per-rank logs and the embedded pipeline into
    a database of the session's chDB directory, plus what a pipeline-health panel needs to
    show: one worker that never reports the last step, and a garbage record in a log."""
    sink = fill_demo_store(
        f"chdb://{chdb_dir}?database=dashboards_demo",
        tmp_path_factory.mktemp("dashboard-logs"),
        missing_worker_at_last_step=MISSING_WORKER,
        garbage_record=True,
    )
    yield sink


def _targets(data: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(panel title or "annotation: NAME", refId, query) of every query of the store in a
    dashboard (the Prometheus panel's are checked by `test_the_consumer_lag_panel_...`)."""
    out = []
    for panel in data.get("panels", []):
        for target in panel.get("targets", []):
            if target.get("datasource", {}).get("type") == "prometheus":
                continue
            out.append((panel["title"], target["refId"], target))
    for annotation in data["annotations"].get("list", []):
        out.append((f"annotation: {annotation['name']}", "Anno", annotation["target"]))
    return out


def _queries(data: dict[str, Any]):
    """(where, query dict, datasource) of every panel, annotation and variable query."""
    for where, _, target in _targets(data):
        yield where, target, target["datasource"]
    for variable in data["templating"]["list"]:
        if variable["type"] == "query":
            yield f"variable {variable['name']}", variable, variable["datasource"]


def _context(sink, multi: bool) -> QueryContext:
    _, rows = sink.query("SELECT min(ts), max(processed_at) FROM steps")
    start, end = rows[0]
    now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
    value = (lambda v: [v]) if multi else (lambda v: v)
    return QueryContext(
        start - dt.timedelta(minutes=1),
        max(end, now) + dt.timedelta(minutes=1),
        interval_s=10.0,
        variables={"job": value(JOB), "attempt": value("0"), "window": "20", "dp_range": ""},
    )


def _kind(type_name: str) -> str:
    base = type_name.removeprefix("Nullable(").removeprefix("LowCardinality(")
    if base.startswith(("DateTime", "Date")):
        return "time"
    if base.startswith(("Float", "Int", "UInt", "Decimal", "Bool")):
        return "number"
    if base.startswith(("String", "FixedString", "Enum")):
        return "string"
    return base


@pytest.mark.parametrize("name", ["job-overview", "pipeline-health"])
def test_every_query_runs_on_the_demo_store(
    demo_store, built: dict[str, BuiltDashboard], name: str
) -> None:
    item = built[name]
    data = item.to_dict()
    multi = any(v.get("multi") for v in data["templating"]["list"])
    context = _context(demo_store, multi)
    for where, ref_id, target in _targets(data):
        sql = render_sql(target["rawSql"], context)
        assert "$" not in sql, f"{where}: unexpanded macro or variable in\n{sql}"
        result = demo_store.client.query(sql)
        columns = {
            col: _kind(t.name)
            for col, t in zip(result.column_names, result.column_types, strict=True)
        }
        expect: Expect = item.expectations[(where, ref_id)]
        if not expect.may_be_empty:
            assert result.result_rows, f"{where}: no rows\n{sql}"
        for column, kind in expect.columns.items():
            assert columns.get(column) == kind, (
                f"{where}: column {column!r} should be {kind}, got {columns}"
            )
        if target["format"] == Format.TIME_SERIES:
            # the plugin's time-series frames need a `time` column; the rest are values or
            # string labels (long frames are pivoted to wide by them)
            assert columns.get("time") == "time", f"{where}: no time column"
            assert "number" in columns.values(), f"{where}: no numeric values"
            assert set(columns.values()) <= {"time", "number", "string"}
            times = [row[result.column_names.index("time")] for row in result.result_rows]
            assert times == sorted(times), f"{where}: time series must be ordered by time"
    for variable in data["templating"]["list"]:
        if variable["type"] != "query":
            continue
        result = demo_store.client.query(render_sql(variable["query"], context))
        values = {str(row[0]) for row in result.result_rows}
        assert values == ({JOB} if variable["name"] == "job" else {"0"})


def test_panels_show_the_demo_story(demo_store, built: dict[str, BuiltDashboard]) -> None:
    """A few numbers on the panels say what the demo injected: the slow worker's change
    points, the missing worker of the last step, the garbage record."""
    data = built["pipeline-health"].to_dict()
    context = _context(demo_store, multi=True)
    by_title = {where: t for where, _, t in _targets(data)}
    result = demo_store.client.query(
        render_sql(by_title["Incomplete steps and their missing ranks"]["rawSql"], context)
    )
    (row,) = result.named_results()
    dp, pp = MISSING_WORKER
    global_rank = (pp * 8 + dp) * 4  # demo job: dp 8 x pp 4 x tp 4
    assert (row["missing"], row["step"]) == (1, 1000 + 39)
    assert row["missing_global_ranks"] == str(global_rank)
    reasons = demo_store.client.query(
        render_sql(by_title["Dead letters by reason"]["rawSql"], context)
    )
    assert "garbage" in {r["reason"] for r in reasons.named_results()}

    overview = built["job-overview"].to_dict()
    context = _context(demo_store, multi=False)
    anno = {where: t for where, _, t in _targets(overview)}
    onset = demo_store.client.query(
        render_sql(anno["annotation: step-time onset"]["rawSql"], context)
    ).result_rows
    recovery = demo_store.client.query(
        render_sql(anno["annotation: step-time recovery"]["rawSql"], context)
    ).result_rows
    assert onset and recovery and onset[0][0] < recovery[0][0]
    top = demo_store.client.query(
        render_sql(anno["Top stragglers in range"]["rawSql"], context)
    ).named_results()
    assert np.isfinite([r["mean_S_w"] for r in top]).all()


# -- SQL safety -----------------------------------------------------------------------------

#: Job ids as a hostile user types them: quote and backslash break-outs (ClickHouse string
#: literals honour both `''` and `\'`), comments, semicolons, a second statement.
HOSTILE_IDS = (
    "x' OR 1=1 --",
    "x\\' OR 1=1 --",
    "x\\\\' OR 1=1 --",
    "x'; DROP TABLE steps; --",
    "x\\'; DROP TABLE jobs; SELECT '",
    f"{JOB}' OR job_id != '",
    f"{JOB}\\' OR job_id != \\'",
    "x' /* ",
    "*/ OR 1=1 #",
    "x') OR ('1'='1",
    "%27 OR 1=1 --",
    "'",
    "\\",
    "$__all",
    "j\u00f6b\u200b\U0001f600",
)
_VARIABLE_USE = re.compile(r"\$\{(\w+)(?::(\w+))?\}|\$(?!__)(\w+)")


def _sql_fields(data: dict[str, Any]):
    for where, query, _ in _queries(data):
        yield where, query["query"] if where.startswith("variable ") else query["rawSql"]


@pytest.mark.parametrize("path", sorted(GENERATED_DIR.glob("*.json")), ids=lambda p: p.name)
def test_no_generated_query_pastes_a_variable_raw(path: Path) -> None:
    data = json.loads(path.read_text())
    uses = 0
    for where, sql in _sql_fields(data):
        for match in _VARIABLE_USE.finditer(sql):
            uses += 1
            assert match.group(2) == "queryparam", f"{path.name} {where}: {match.group(0)}"
            # ... and it sits inside a string literal, the only place its output is inert
            before = sql[: match.start()]
            assert before.endswith("'") and sql[match.end()] == "'", f"{path.name} {where}"
    assert uses


def _run_all(store, data: dict[str, Any], context: QueryContext) -> dict[str, list]:
    results = {}
    for where, sql in _sql_fields(data):
        results[where] = store.client.query(render_sql(sql, context)).result_rows
    return results


def _tables(store) -> list[tuple[str, int]]:
    _, rows = store.query(
        "SELECT name, total_rows FROM system.tables WHERE database = currentDatabase() "
        "ORDER BY name"
    )
    return rows


@pytest.mark.parametrize("name", ["job-overview", "pipeline-health"])
def test_hostile_job_ids_change_no_table_and_see_no_other_job(
    demo_store, built: dict[str, BuiltDashboard], name: str
) -> None:
    data = built[name].to_dict()
    multi = any(v.get("multi") for v in data["templating"]["list"])
    tables = _tables(demo_store)
    assert ("steps", 40) in tables
    base = _context(demo_store, multi)

    def context(job: str, attempt: str = "0", window: str = "20") -> QueryContext:
        value = (lambda v: [v, "no-such-job"]) if multi else (lambda v: v)
        return dataclasses.replace(
            base, variables={"job": value(job), "attempt": value(attempt), "window": window}
        )

    nothing = _run_all(demo_store, data, context("no-such-job"))
    for hostile in HOSTILE_IDS:
        if hostile == "$__all" and multi:
            continue  # "All" selected: every job, by design
        got = _run_all(demo_store, data, context(hostile, attempt=hostile, window=hostile))
        assert got == nothing, hostile
        got = _run_all(demo_store, data, context(hostile))
        assert got == nothing, hostile
        assert _tables(demo_store) == tables, hostile
    # the same queries do find the job when it is selected, quote-free or not
    assert _run_all(demo_store, data, context(JOB)) != nothing


def test_a_step_missing_many_ranks_lists_the_first_and_counts_the_rest(
    chdb_dsn: str, built: dict[str, BuiltDashboard]
) -> None:
    """A rack of a large job can leave hundreds of ranks missing from a step: the cell
    names the first MISSING_RANKS_SHOWN and counts the others, instead of a page of text."""
    from lagscope.dashboards.pipeline_health import MISSING_RANKS_SHOWN
    from lagscope.store.sink import ClickHouseSink

    missing = list(range(0, 8 * 100, 8))  # TP rank 0 of 100 machines
    with ClickHouseSink(chdb_dsn) as sink:
        sink.ensure_schema()
        sink.client.command(
            "INSERT INTO steps (job_id, attempt, step, ts, complete, missing_ranks, "
            "processed_at, version) VALUES ('big', 0, 7, now64(3), false, "
            "{missing:Array(UInt32)}, now64(3), 1)",
            parameters={"missing": missing},
        )
        now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
        context = QueryContext(
            now - dt.timedelta(hours=1),
            now + dt.timedelta(minutes=1),
            variables={"job": ["big"], "attempt": ["0"]},
        )
        (panel,) = [
            target
            for where, _, target in _targets(built["pipeline-health"].to_dict())
            if where == "Incomplete steps and their missing ranks"
        ]
        (row,) = sink.client.query(render_sql(panel["rawSql"], context)).named_results()
    shown = ", ".join(str(rank) for rank in missing[:MISSING_RANKS_SHOWN])
    assert row["missing"] == 100
    assert row["missing_global_ranks"] == f"{shown} and {100 - MISSING_RANKS_SHOWN} more"


# -- what operators expect of a Grafana dashboard -----------------------------------------


def _all_built() -> dict[str, BuiltDashboard]:
    from lagscope.dashboards.fleet import build_fleet

    return {**build_all(), **build_fleet()}


def test_every_panel_of_one_measure_has_a_unit() -> None:
    """A number without its unit is a guess at 3 a.m.: every chart and stat says what it
    counts (tables mix columns of several kinds, text panels have none)."""
    for name, item in _all_built().items():
        for panel in item.to_dict()["panels"]:
            if panel["type"] in ("row", "text", "table"):
                continue
            unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
            assert unit, f"{name}: panel {panel['title']!r} has no unit"


def test_the_consumer_lag_panel_reads_the_workers_metric() -> None:
    """The lag is not in the store: the panel asks Prometheus for the metric the workers
    export (its name and labels as worker_metrics.py writes them)."""
    import inspect

    from lagscope.dashboards.pipeline_health import CONSUMER_LAG_TITLE
    from lagscope.stream_app import worker_metrics

    data = build_all()["pipeline-health"].to_dict()
    (panel,) = [p for p in data["panels"] if p["title"] == CONSUMER_LAG_TITLE]
    (target,) = panel["targets"]
    assert target["datasource"] == {"type": "prometheus", "uid": "${prometheus}"}
    (variable,) = [v for v in data["templating"]["list"] if v["name"] == "prometheus"]
    assert (variable["type"], variable["query"]) == ("datasource", "prometheus")
    metric = re.search(r"lagscope_\w+", target["expr"]).group(0)
    source = inspect.getsource(worker_metrics)
    assert f'"{metric}"' in source
    assert '["topic", "partition"]' in source and "by (topic, partition)" in target["expr"]
