"""A what-if analysis written to chDB reads back with the same numbers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lagscope.store.rows import job_rows, rows_from_result, worker_slowdown_per_step
from lagscope.store.sink import ClickHouseSink
from tests.conftest import analyzed_reference, load_reference

T0 = 1_700_000_000.0


@pytest.fixture(scope="module")
def st_result(reference_dir):
    prepared, result = analyzed_reference("ST")
    return prepared, result


def test_st_analysis_round_trips_through_chdb(st_result, chdb_dsn: str) -> None:

    _, meta = load_reference("ST")
    _, result = st_result
    starts = T0 + np.cumsum(result.t_actual) - result.t_actual[0]
    batch = rows_from_result("ST", 0, result, starts, meta, version=1, processed_at=T0)
    batch.add("jobs", job_rows("ST", 0, meta, started=T0, version=1))
    with ClickHouseSink(chdb_dsn) as store:
        store.ensure_schema()
        store.write(batch)
        store.write(batch)  # a replay changes nothing

        _, rows = store.query(
            "SELECT step, avg(slowdown), count() FROM steps FINAL "
            "WHERE job_id = {job:String} AND attempt = {attempt:UInt32} "
            "GROUP BY step ORDER BY step",
            {"job": "ST", "attempt": 0},
        )
        assert [r[0] for r in rows] == result.steps.tolist()
        np.testing.assert_allclose([r[1] for r in rows], result.step_slowdown, rtol=1e-12)
        assert {r[2] for r in rows} == {1}

        _, rows = store.query(
            "SELECT sum(actual_s), sum(gpu_seconds), sum(gpu_seconds_wasted), "
            "countIf(mfu_actual IS NULL), min(ts) FROM steps FINAL"
        )
        total_actual, gpu_seconds, wasted, null_mfu, first_ts = rows[0]
        assert total_actual == pytest.approx(result.t_actual.sum())
        assert gpu_seconds == pytest.approx(result.t_actual.sum() * meta.world_size)
        expected_waste = result.t_actual * meta.world_size * (1 - 1 / result.step_slowdown)
        assert wasted == pytest.approx(expected_waste.sum())
        assert null_mfu == result.steps.size  # the ST meta has no FLOPs: MFU unknown
        assert first_ts.timestamp() == pytest.approx(T0, abs=1e-3)

        _, rows = store.query(
            "SELECT name, step, slowdown FROM attribution FINAL WHERE kind = 'dp_rank' "
            "ORDER BY name, step"
        )
        for dp in range(meta.dp_size):
            got = [r[2] for r in rows if r[0] == str(dp)]
            np.testing.assert_allclose(got, result.by_dp_rank.per_step[str(dp)])

        _, rows = store.query(
            "SELECT step, pp_rank, dp_rank, slowdown FROM worker_slowdown FINAL "
            "ORDER BY step, pp_rank, dp_rank"
        )
        per_step = worker_slowdown_per_step(result)
        assert len(rows) == per_step.size
        np.testing.assert_allclose([r[3] for r in rows], per_step.ravel())

        _, rollup = store.query("SELECT sum(steps), sum(slowdown_sum) FROM steps_1m")
        assert rollup[0][0] == result.steps.size
        assert rollup[0][1] == pytest.approx(result.step_slowdown.sum())

        _, jobs = store.query("SELECT world_size, dp_size, pp_size FROM jobs FINAL")
        assert jobs == [(meta.world_size, meta.dp_size, meta.pp_size)]


def test_mfu_from_model_flops_and_gpu_peak(st_result) -> None:

    _, meta = load_reference("ST")
    meta = dataclasses.replace(meta, model_flops_per_step=1e15, gpu_peak_flops=1e14)
    _, result = st_result
    batch = rows_from_result("ST", 0, result, np.full(result.steps.size, T0), meta)
    steps = batch.tables["steps"]
    expected = 1e15 / (result.t_actual * meta.world_size * 1e14)
    np.testing.assert_allclose(steps["mfu_actual"], expected)
    np.testing.assert_allclose(steps["mfu_ideal"], 1e15 / (result.t_ideal * meta.world_size * 1e14))
    assert batch.dedup_token == f"ST/0/{result.steps.min()}-{result.steps.max()}/0"


def test_step_start_ts_must_match_the_steps(st_result) -> None:

    _, meta = load_reference("ST")
    _, result = st_result
    with pytest.raises(ValueError, match="step_start_ts has shape"):
        rows_from_result("ST", 0, result, np.zeros(3), meta)
