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
