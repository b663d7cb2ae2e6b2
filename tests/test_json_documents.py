"""The JSON the store and lagscope.results hold is strict JSON (RFC 8259), which
ClickHouse's JSON functions, Grafana and other parsers read: a figure without a value (a
DDP job's forward-backward correlation: one micro-batch per step) is null, not Python's
NaN, which made every JSON function read the whole document as empty."""

from __future__ import annotations

import datetime as dt
import json

from lagscope.dashboards.definitions import build_all
from lagscope.dashboards.macros import QueryContext, render_sql
from lagscope.simulator.generate import CostModel, JobSpec, SlowWorker
from lagscope.store.sink import ClickHouseSink
from tests.generated_store import store_generated_job

T0 = 1_790_000_000.0
#: DP 8, one micro-batch a step; one rank 1.8x slower from step 30 to step 59.
DDP = JobSpec(
    dp=8, pp=1, microbatches=1, steps=90, seed=5,
    cost=CostModel(first_stage_extra=0.0, last_stage_extra=0.0, noise_cv=0.03),
    stragglers=(SlowWorker(dp=3, stage=0, factor=1.8, start_step=30, end_step=60),),
)  # fmt: skip


def _strict(text: str | bytes) -> object:
    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_a_ddp_job_s_documents_read_in_clickhouse_and_in_strict_parsers(chdb_dsn: str) -> None:
    sink = ClickHouseSink(chdb_dsn)
    published: list[bytes] = []
    store_generated_job(sink, DDP, "ddp", T0, publish=lambda _key, value: published.append(value))

    _, diagnoses = sink.query(
        "SELECT evidence, advice, JSONExtractString(evidence, 'summary'), "
        "JSONExtractFloat(evidence, 'noise_floor'), "
        "JSONExtractRaw(evidence, 'fwd_bwd_correlation') FROM diagnoses FINAL"
    )
    # The premise: figures without a value.
    assert "null" in {correlation for *_, correlation in diagnoses}
    for evidence, advice, summary, floor, _ in diagnoses:
        document = _strict(evidence)
        assert summary and summary == document["summary"]
        # The alert rule "Slowdown sustained" divides by it: 0 would page on the raw S.
        assert floor == document.get("noise_floor", 0.0)
        _strict(advice)
    assert any(floor >= 1.0 for _, _, _, floor, _ in diagnoses)
    _, episodes = sink.query("SELECT evidence, advice, summary FROM episodes FINAL")
    assert episodes, "the slow rank's episode"
    for evidence, advice, _ in episodes:
        _strict(evidence), _strict(advice)
    _, metas = sink.query("SELECT meta FROM jobs FINAL")
    for (meta,) in metas:
        _strict(meta)
    _, invalid = sink.query(
        "SELECT count() FROM diagnoses WHERE NOT (isValidJSON(evidence) AND isValidJSON(advice))"
    )
    assert invalid == [(0,)]
    assert published
    for message in published:
        _strict(message)


def test_the_job_overview_states_a_ddp_job_s_diagnosis(chdb_dsn: str) -> None:
    """The on-call's panel "Current diagnosis and advice" on a healthy DDP job: the
    sentence of its latest diagnosis, which states the undefined correlation (before, an
    empty cell)."""
    sink = ClickHouseSink(chdb_dsn)
    store_generated_job(sink, DDP.model_copy(update={"stragglers": ()}), "ddp", T0)
    overview = build_all()["job-overview"]
    (target,) = [
        t
        for panel in overview.to_dict()["panels"]
        if panel.get("title") == "Current diagnosis and advice"
        for t in panel["targets"]
    ]
    start = dt.datetime.fromtimestamp(T0, dt.UTC).replace(tzinfo=None)
    context = QueryContext(
        start - dt.timedelta(minutes=1), start + dt.timedelta(hours=1), interval_s=10.0,
        variables={"job": "ddp", "attempt": "0", "window": "20", "dp_range": ""},
    )  # fmt: skip
    names, rows = sink.query(render_sql(target["rawSql"], context))
    summaries = {row[names.index("summary")] for row in rows}
    _, latest = sink.query(
        "SELECT evidence FROM diagnoses FINAL ORDER BY step DESC, version DESC LIMIT 1"
    )
    document = _strict(latest[0][0])
    assert document["fwd_bwd_correlation"] is None  # the premise
    assert summaries == {document["summary"]}
    assert "straggling" in summaries.pop()
