"""Fleet and node dashboards: committed JSON matches the code and is an SDK fixed point;
every query runs on chDB, on the demo's output (with the rank identity the node view
needs) and on two jobs that share a bad machine."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from pathlib import Path

import pytest

from lagscope.dashboards.build import GENERATED_DIR
from lagscope.dashboards.fleet import build_fleet
from lagscope.dashboards.job_overview import job_overview
from lagscope.dashboards.macros import QueryContext, render_sql
from lagscope.dashboards.panels import BuiltDashboard, sdk_round_trip
from tests.demo_store import DEMO_JOB, fill_demo_store

#: The demo's injected straggler (dp, pp); nodes hold 8 GPUs (`demo_node_of`).
DEMO_SLOW_WORKER = (5, 2)
DEMO_TP = 4
DEMO_DP = 8


def demo_node_of(dp: int, pp: int) -> str:
    rank = (pp * DEMO_DP + dp) * DEMO_TP
    return f"node-{rank // 8:02d}"


@pytest.fixture(scope="module")
def built() -> dict[str, BuiltDashboard]:
    return build_fleet()


def test_generated_json_matches_the_code(built: dict[str, BuiltDashboard]) -> None:
    folder = GENERATED_DIR / "fleet"
    assert sorted(p.name for p in folder.glob("*.json")) == sorted(f"{n}.json" for n in built)
    for name, item in built.items():
        text = (folder / f"{name}.json").read_text()
        assert text == item.to_json(), f"{folder / name}.json is stale: run dashboards build"
        data = json.loads(text)
        assert sdk_round_trip(data) == data
        # The data source and the jobs to show, all at first (the runbook has none).
        variables = data["templating"].get("list", [])
        expected = [] if name == "runbook" else [("datasource", "datasource"), ("job", "query")]
        assert [(v["name"], v["type"]) for v in variables] == expected
        if variables:
            assert variables[1]["multi"] and variables[1]["includeAll"]
            assert variables[1]["current"]["value"] == "$__all"


def test_job_column_links_to_the_job_overview(built: dict[str, BuiltDashboard]) -> None:
    (table,) = [p for p in built["fleet"].to_dict()["panels"] if p["title"] == "All jobs now"]
    links = [
        prop["value"]
        for override in table["fieldConfig"]["overrides"]
        if override["matcher"]["options"] == "job_id"
        for prop in override["properties"]
        if prop["id"] == "links"
    ]
    assert links and "var-job=${__data.fields.job_id:percentencode}" in links[0][0]["url"]


def _context(jobs: tuple[str, ...] = ("$__all",)) -> QueryContext:
    """The last six hours, with `jobs` selected in the `job` variable ("All" by default)."""
    now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
    return QueryContext(
        now - dt.timedelta(hours=6), now + dt.timedelta(minutes=1), 10.0, {"job": list(jobs)}
    )


def _run(sink, item: BuiltDashboard, title: str, jobs: tuple[str, ...] = ("$__all",)) -> list[dict]:
    (target,) = [
        t for p in item.to_dict()["panels"] if p["title"] == title for t in p.get("targets", [])
    ]
    sql = render_sql(target["rawSql"], _context(jobs))
    assert "$" not in sql, sql
    return list(sink.client.query(sql).named_results())


def _insert_identity(sink, job: str, workers: dict[tuple[int, int], str], tp: int = 1) -> None:
    """Rank identity rows of `job` (attempt 0): (dp, pp) -> node, tensor-parallel ranks
    included (the views must keep only rank 0 of each)."""
    dp_size = max(dp for dp, _ in workers) + 1
    rows = []
    for (dp, pp), node in workers.items():
        for tp_rank in range(tp):
            rank = (pp * dp_size + dp) * tp + tp_rank
            rows.append(
                f"('{job}', 0, {rank}, {dp}, {pp}, {tp_rank}, 0, 'host-{node}', '{node}', '', "
                f"{rank % 8}, '', 1)"
            )
    sink.command(
        "INSERT INTO rank_identity (job_id, attempt, rank, dp_rank, pp_rank, tp_rank, "
        "cp_rank, host, node, pod, gpu, pci_bus_id, version) VALUES " + ", ".join(rows)
    )


@pytest.fixture(scope="module")
def demo_sink(chdb_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    sink = fill_demo_store(
        f"chdb://{chdb_dir}?database=fleet_demo", tmp_path_factory.mktemp("fleet-demo")
    )
    workers = {(dp, pp): demo_node_of(dp, pp) for dp in range(DEMO_DP) for pp in range(4)}
    _insert_identity(sink, DEMO_JOB, workers, tp=DEMO_TP)
    return sink


@pytest.mark.parametrize("name", ["fleet", "nodes"])
def test_every_query_runs_on_the_demo_store(demo_sink, built, name: str) -> None:
    item = built[name]
    for (title, _), expect in item.expectations.items():
        rows = _run(demo_sink, item, title)
        assert rows or expect.may_be_empty, f"{title}: no rows"
        for column, kind in expect.columns.items():
            value = rows[0][column]
            wanted = {"string": str, "number": int | float, "time": dt.datetime}[kind]
            assert isinstance(value, wanted), f"{title}: {column} = {value!r}"


def test_fleet_names_the_verified_worker_first_and_its_node(demo_sink, built) -> None:
    """The top worker is the one an episode verified, the demo's slow worker, marked as
    verified, even though the DP x PP heatmap's score (S_w = min(S_dp, S_stage)) ranks the
    crossing of its DP replica with the heavy last stage higher; the node named is the
    machine that worker runs on."""
    (row,) = _run(demo_sink, built["fleet"], "All jobs now")
    assert row["job_id"] == DEMO_JOB
    best = demo_sink.client.query(
        "SELECT dp_rank, pp_rank FROM worker_slowdown FINAL GROUP BY dp_rank, pp_rank "
        "ORDER BY avg(slowdown) DESC LIMIT 1"
    ).result_rows[0]
    assert tuple(int(v) for v in best) != DEMO_SLOW_WORKER  # the crossing scores higher
    dp, pp = DEMO_SLOW_WORKER
    assert row["top_worker"] == f"dp {dp}, pp {pp} (verified)"
    assert row["top_node"] == demo_node_of(dp, pp)
    assert row["latest_S"] > 1.0 and row["wasted_gpu_h_today"] > 0
    assert row["current_episode"] == "" or "since step" in row["current_episode"]
    assert 0 <= row["last_step_age_s"] < 600
    # The demo's job has no rank that says it ended: running while its steps are fresh.
    assert row["status"] == ("silent" if row["last_step_age_s"] > 300 else "running")
    (node_row, *_) = _run(demo_sink, built["nodes"], "Nodes by straggling, across jobs")
    assert node_row["node"] == demo_node_of(dp, pp)


@pytest.fixture(scope="module")
def shared_bad_node(chdb_dir: Path):
    """Jobs `a` and `b`, 2 dp x 2 pp each, 30 steps in the last 10 minutes. In `a` worker
    (dp 1, pp 0) is slow, in `b` worker (dp 0, pp 1): different ranks, one machine,
    `gpu-07`. A third job's worker on `c-node-3` has a single bad step."""
    from lagscope.store.sink import ClickHouseSink

    sink = ClickHouseSink(f"chdb://{chdb_dir}?database=fleet_nodes")
    sink.ensure_schema()

    def workers(job: str, slow: tuple[int, int], slow_s: float, bad_steps: int) -> None:
        for dp in range(2):
            for pp in range(2):
                hot = (dp, pp) == slow
                sink.command(
                    f"""INSERT INTO worker_slowdown
                        (job_id, attempt, step, ts, dp_rank, pp_rank, slowdown, version)
                    SELECT '{job}', 0, number, now64(3) - (600 - number * 20), {dp}, {pp},
                           if({int(hot)} AND number < {bad_steps}, {slow_s},
                              1.0 + (number % 3) * 0.01), 1
                    FROM numbers(30)"""
                )

    workers("a", (1, 0), 1.4, 30)
    workers("b", (0, 1), 1.3, 30)
    workers("c", (1, 1), 1.6, 1)
    _insert_identity(
        sink, "a", {(0, 0): "a-node-0", (1, 0): "gpu-07", (0, 1): "a-node-2", (1, 1): "a-node-3"}
    )
    _insert_identity(
        sink, "b", {(0, 0): "b-node-0", (1, 0): "b-node-1", (0, 1): "gpu-07", (1, 1): "b-node-3"}
    )
    _insert_identity(
        sink, "c", {(0, 0): "c-node-0", (1, 0): "c-node-1", (0, 1): "c-node-2", (1, 1): "c-node-3"}
    )
    return sink


def test_a_node_slow_in_two_jobs_ranks_first(shared_bad_node, built) -> None:
    rows = _run(shared_bad_node, built["nodes"], "Nodes by straggling, across jobs")
    first, second = rows[0], rows[1]
    assert first["node"] == "gpu-07"
    assert (first["jobs"], first["jobs_straggling"]) == (2, 2)
    assert first["straggling_share"] == pytest.approx(1.0)
    # The one-off bad step comes next, far behind.
    assert second["node"] == "c-node-3" and second["excess_per_step"] < first["excess_per_step"]
    series = _run(shared_bad_node, built["nodes"], "Straggling nodes over time")
    assert "gpu-07" in {r["node"] for r in series}


def test_a_finished_job_reads_ended_not_silent(chdb_dir: Path, built) -> None:
    """Three jobs in the table: `live` (a step 10 s ago), `hung` and `done` (their last
    step 8 minutes ago); every rank of `done` said it ended (its records as the host takes
    them), half of `hung`'s did."""
    import time

    from lagscope.producers.events import JobInfo, RankIdentity
    from lagscope.store.sink import ClickHouseSink
    from lagscope.stream_app.host_core import JobRecords

    sink = ClickHouseSink(f"chdb://{chdb_dir}?database=fleet_ended")
    sink.ensure_schema()
    for job, last_age_s in (("live", 10), ("hung", 480), ("done", 480)):
        sink.command(
            f"""INSERT INTO steps (job_id, attempt, step, ts, complete, actual_s, slowdown,
                gpu_seconds_wasted, version)
            SELECT '{job}', 0, number, now64(3) - ({last_age_s} + (29 - number) * 10), 1,
                   10, 1.02, 1.6, 1
            FROM numbers(30)"""
        )
    records = JobRecords(max_world_size=64)
    for job, ended in (("hung", 2), ("done", 4)):
        for rank in range(4):
            info = JobInfo(job_id=job, dp_size=4, pp_size=1, tp_size=1, world_size=4,
                           rank_identity=RankIdentity(rank=rank, dp_rank=rank))  # fmt: skip
            records.take(info.model_dump_json().encode(), "test", time.time() - 780)
            if rank < ended:
                end = info.model_copy(update={"ended_ns": time.time_ns() - 480 * 10**9})
                records.take(end.model_dump_json().encode(), "test", time.time())
    records.write(sink)
    rows = _run(sink, built["fleet"], "All jobs now")
    assert {r["job_id"]: r["status"] for r in rows} == {
        "live": "running",
        "hung": "silent",
        "done": "ended",
    }
    # The job overview tells the same: its data age, or "ended" (null, mapped to the word).
    overview = job_overview().to_dict()
    (panel,) = [p for p in overview["panels"] if p.get("title") == "Data age"]
    (mapping,) = panel["fieldConfig"]["defaults"]["mappings"]
    assert mapping["options"] == {"match": "null", "result": {"color": "blue", "text": "ended"}}
    ages = {}
    for job in ("live", "hung", "done"):
        context = dataclasses.replace(_context(), variables={"job": job, "attempt": "0"})
        (row,) = sink.client.query(render_sql(panel["targets"][0]["rawSql"], context)).result_rows
        ages[job] = row[0]
    assert ages["done"] is None and 10 <= ages["live"] < 60 and ages["hung"] >= 480, ages


def _timeless(rows: list[dict]) -> list[dict]:
    """`rows` without the ages the store counts from now: two queries a second apart
    read them a second apart."""
    return [{k: v for k, v in row.items() if not k.endswith("_age_s")} for row in rows]


def test_the_job_variable_narrows_every_panel(demo_sink, built) -> None:
    """All jobs at first; one picked, only its rows; a name no job has, none (and a
    name that is SQL stays a name)."""
    for name in ("fleet", "nodes"):
        item = built[name]
        for title, _ in item.expectations:
            everything = _timeless(_run(demo_sink, item, title))
            assert _timeless(_run(demo_sink, item, title, (DEMO_JOB,))) == everything, title
            for other in ("no-such-job", "x') OR 1=1 --"):
                narrowed = _run(demo_sink, item, title, (other,))
                values = [v for row in narrowed for v in row.values() if v not in (None, 0)]
                assert not narrowed or not values, (title, other, narrowed)
