"""`lagscope generate` writes a trace the analyzer reads back, with its ground truth."""

from __future__ import annotations

import json

import pytest

from lagscope.cli import main
from lagscope.producers.reference_format import load_meta, load_trace
from lagscope.simulator.prepare import prepare
from lagscope.simulator.whatif import analyze


def test_generate_then_analyze(tmp_path):
    out = tmp_path / "job"
    assert (
        main(
            [
                "generate",
                "--out",
                str(out),
                "--dp",
                "4",
                "--pp",
                "2",
                "--steps",
                "6",
                "--microbatches",
                "4",
                "--inject",
                "slow_worker:dp=3,stage=1,factor=1.8,start_step=2",
            ]
        )
        == 0
    )
    truth = json.loads((out / "truth.json").read_text())
    assert truth["injections"][0]["onset_step"] == 2
    assert truth["slowdown"] > 1.1
    result = analyze(prepare(load_trace(out / "trace.parquet"), load_meta(out / "meta.yaml")))
    assert result.mw.workers == ((3, 1),)
    assert result.simulation_error < 1e-5


@pytest.mark.parametrize(
    "inject, message",
    [
        ("slow_worker:dp=1", "slow_worker.stage: Field required"),
        ("nonsense:x=1", "does not match any of the expected tags"),
        ("slow_worker:dp", "expected name=value"),
    ],
)
def test_bad_injection_is_a_clear_error(tmp_path, capsys, inject, message):
    assert main(["generate", "--out", str(tmp_path), "--inject", inject]) == 2
    assert message in capsys.readouterr().err


def test_a_job_larger_than_a_run_is_written_run_by_run(tmp_path, monkeypatch):
    """Runs of 3 steps (`RUN_OPS` made small): the file holds one row group a run, every
    step once and in order, op type names the same for the GC pauses that start in a
    later run; the truth has every step, and the analysis finds the injected worker."""
    import pyarrow.parquet as pq

    from lagscope.simulator import generate

    spec = generate.JobSpec(dp=4, pp=2, microbatches=4)
    monkeypatch.setattr(generate, "RUN_OPS", 3 * generate.JobGenerator(spec).ops_per_step)
    out = tmp_path / "job"
    injections = ["slow_worker:dp=2,stage=0,factor=1.8,start_step=4",
                  "gc_pauses:probability=0.2,pause_s=0.002,start_step=5"]  # fmt: skip
    argv = ["generate", "--out", str(out), "--dp", "4", "--pp", "2", "--microbatches", "4",
            "--steps", "10", *(a for i in injections for a in ("--inject", i))]  # fmt: skip
    assert main(argv) == 0
    assert pq.ParquetFile(out / "trace.parquet").num_row_groups == 4  # 3 + 3 + 3 + 1 steps
    trace = load_trace(out / "trace.parquet")
    steps = trace.step.tolist()
    assert steps == sorted(steps) and sorted(set(steps)) == list(range(10))
    names = [trace.optype_names[code] for code in trace.optype]
    paused_steps = {s for s, name in zip(steps, names, strict=True) if name == "gc-pause"}
    assert paused_steps and min(paused_steps) >= 5, sorted(paused_steps)
    truth = json.loads((out / "truth.json").read_text())
    assert sorted(truth["steps"], key=int) == [str(s) for s in range(10)]
    result = analyze(prepare(trace, load_meta(out / "meta.yaml")))
    assert result.mw.workers == ((2, 0),)
    assert result.simulation_error < 1e-5
