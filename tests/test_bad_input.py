"""Bad input: every problem gets a clear error that names the file and what is wrong."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lagscope.cli import main
from lagscope.producers.reference_format import load_meta, load_trace, write_trace
from lagscope.simulator.prepare import prepare
from lagscope.simulator.trace import Trace, TraceError
from lagscope.simulator.whatif import analyze
from tests.conftest import load_reference


def st_table(reference_dir) -> pa.Table:
    return pq.read_table(reference_dir / "trace-ST.parquet")


def cli_error(trace_path, meta_path, capsys, *extra) -> str:
    code = main(["analyze", "--trace", str(trace_path), "--meta", str(meta_path), *extra])
    assert code == 1  # bad input data (exit 2 is for a wrong command line)
    return capsys.readouterr().err


def test_missing_column(reference_dir, tmp_path, capsys):
    path = tmp_path / "no-duration.parquet"
    pq.write_table(st_table(reference_dir).drop(["duration"]), path)
    err = cli_error(path, reference_dir / "meta-ST.yaml", capsys)
    assert str(path) in err and "missing column(s) duration" in err


def test_not_a_parquet_file(reference_dir, tmp_path, capsys):
    path = tmp_path / "garbage.parquet"
    path.write_bytes(b"this is not parquet" * 100)
    err = cli_error(path, reference_dir / "meta-ST.yaml", capsys)
    assert "not a readable parquet file" in err


def _with_column(table: pa.Table, name: str, values) -> pa.Table:
    index = table.column_names.index(name)
    return table.set_column(index, name, pa.array(values, type=table.schema.field(name).type))


def test_unknown_op_type(reference_dir, tmp_path, capsys):
    table = st_table(reference_dir)
    optypes = table.column("optype").to_pylist()
    optypes[5] = "forward-compute-fused"
    table = table.set_column(table.column_names.index("optype"), "optype", pa.array(optypes))
    path = tmp_path / "unknown.parquet"
    pq.write_table(table, path)
    err = cli_error(path, reference_dir / "meta-ST.yaml", capsys)
    assert "unknown op type(s) 'forward-compute-fused'" in err and "row 5" in err


@pytest.mark.parametrize("bad", [float("nan"), -0.5, float("inf")])
def test_invalid_duration_names_the_row(reference_dir, tmp_path, capsys, bad):
    table = st_table(reference_dir)
    durations = table.column("duration").to_numpy().copy()
    durations[100] = bad
    path = tmp_path / "bad-duration.parquet"
    pq.write_table(_with_column(table, "duration", durations), path)
    err = cli_error(path, reference_dir / "meta-ST.yaml", capsys)
    trace, _ = load_reference("ST")
    assert "'duration'" in err and "row 100" in err and trace.describe_row(100) in err


def test_worker_lacking_ops_is_named_and_can_be_skipped(reference_dir, tmp_path, capsys):
    trace, meta = load_reference("ST")
    lacking = (trace.step == 261) & (trace.dp_rank == 1) & (trace.stage == 2)
    lacking &= trace.seq_id == 3
    write_trace(trace.select(~lacking), tmp_path / "t.parquet")
    err = cli_error(tmp_path / "t.parquet", reference_dir / "meta-ST.yaml", capsys)
    assert "incomplete step" in err and "step 261, dp 1, stage 2" in err
    assert "--skip-incomplete-steps" in err

    code = main(
        [
            "analyze",
            "--trace",
            str(tmp_path / "t.parquet"),
            "--meta",
            str(reference_dir / "meta-ST.yaml"),
            "--skip-incomplete-steps",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "dropped step 261" in out and "(dp 1, stage 2)" in out
    # The other steps are analysed exactly as before.
    prepared = prepare(load_trace(tmp_path / "t.parquet"), meta, skip_incomplete_steps=True)
    assert 261 not in prepared.steps and prepared.n_steps == 31


def test_inconsistent_meta(reference_dir, tmp_path, capsys):
    meta = tmp_path / "meta.yaml"
    meta.write_text(
        (reference_dir / "meta-ST.yaml").read_text().replace("world_size: 8", "world_size: 16")
    )
    err = cli_error(reference_dir / "trace-ST.parquet", meta, capsys)
    assert str(meta) in err and "world_size: is 16" in err

    meta.write_text("trial_name: ST\ndp_size: 1\npp_size: 4\nworld_size: 4\n")
    err = cli_error(reference_dir / "trace-ST.parquet", meta, capsys)
    assert "the trace has 2 DP ranks (dp_rank 0-1)" in err and "says dp_size 1" in err

    meta.write_text("dp_size: [1, 2]\n")
    with pytest.raises(TraceError, match="dp_size"):
        load_meta(meta)


def test_duplicate_rows_are_rejected(reference_dir):
    trace, meta = load_reference("ST")
    doubled = np.concatenate([np.arange(trace.n_rows), [7]])
    dup = trace.select(doubled)
    with pytest.raises(TraceError, match="recorded more than once"):
        prepare(dup, meta)


def test_op_absent_from_reference_slice(reference_dir):
    trace, meta = load_reference("ST")
    extra = np.flatnonzero((trace.step == 1048) & (trace.dp_rank == 1))[:1]
    columns = trace.select(np.concatenate([np.arange(trace.n_rows), extra])).columns()
    columns["seq_id"][-1] = 99
    bad = Trace.from_columns(columns, source="extra-op")
    with pytest.raises(TraceError, match=r"does not occur on dp 0 in the first step"):
        analyze(prepare(bad, meta))
