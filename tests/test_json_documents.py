"""The JSON the store and lagscope.results hold is strict JSON (RFC 8259), which
ClickHouse's JSON functions, Grafana and other parsers read: a figure without a value (a
DDP job's forward-backward correlation: one micro-batch per step) is null, not Python's
NaN, which made every JSON function read the whole document as empty."""

from __future__ import annotations

import json
from pathlib import Path

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


def test_a_ddp_job_s_documents_read_in_clickhouse_and_in_strict_parsers(tmp_path: Path) -> None:
    sink = ClickHouseSink(f"chdb://{tmp_path / 'store'}")
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
