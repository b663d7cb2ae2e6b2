"""`lagscope changepoints`: CSV in, verified change points out (table and JSON)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lagscope.cli import main


def write_csv(path: Path, rows: list[tuple[str, int, float]]) -> Path:
    lines = ["series,index,value", *(f"{name},{index},{value!r}" for name, index, value in rows)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def stepped(levels: list[tuple[int, float]], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    values = np.concatenate([np.full(n, level) for n, level in levels])
    return values * (1.0 + 0.02 * rng.standard_normal(values.size))


def test_changepoints_reports_onset_and_recovery_per_series(tmp_path, capsys) -> None:
    slow = stepped([(200, 4.0), (150, 5.0), (200, 4.0)], seed=1)
    steady = stepped([(550, 2.0)], seed=2)
    rows = [("job-step", 1000 + i, float(v)) for i, v in enumerate(slow)]
    # the second series reports every other step only, and rows arrive interleaved
    rows += [("stage-3", 1000 + 2 * i, float(v)) for i, v in enumerate(steady[:275])]
    rows.sort(key=lambda row: (row[1], row[0]))
    source = write_csv(tmp_path / "series.csv", rows)
    output = tmp_path / "out" / "changes.json"

    assert main(["changepoints", "--input", str(source), "--json", str(output)]) == 0

    changes = json.loads(output.read_text())
    assert [(c["series"], c["kind"]) for c in changes] == [
        ("job-step", "onset"),
        ("job-step", "recovery"),
    ]
    assert abs(changes[0]["index"] - 1200) <= 3
    assert abs(changes[1]["index"] - 1350) <= 3
    assert changes[0]["before_mean"] == pytest.approx(4.0, rel=0.02)
    assert changes[0]["after_mean"] == pytest.approx(5.0, rel=0.02)
    assert all(0.0 < c["probability"] <= 1.0 for c in changes)
    assert set(changes[0]) == {
        "series",
        "index",
        "kind",
        "before_mean",
        "after_mean",
        "probability",
    }
    table = capsys.readouterr().out
    assert "job-step" in table and "onset" in table and "recovery" in table
    assert "+25.0%" in table or "+24." in table or "+25." in table


def test_threshold_option_is_the_verification_threshold(tmp_path) -> None:
    values = stepped([(200, 4.0), (200, 4.3)], seed=3)  # a 7.5 % step
    source = write_csv(tmp_path / "s.csv", [("a", i, float(v)) for i, v in enumerate(values)])
    strict, lenient = tmp_path / "strict.json", tmp_path / "lenient.json"
    assert main(["changepoints", "--input", str(source), "--json", str(strict)]) == 0
    args = ["changepoints", "--input", str(source), "--json", str(lenient), "--min-change", "0.05"]
    assert main(args) == 0
    assert json.loads(strict.read_text()) == []
    assert [c["kind"] for c in json.loads(lenient.read_text())] == ["onset"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("series,index\na,1\n", "line 1: missing column(s) value"),
        ("series,index,value\na,1,2.0\na,x,2.0\n", "line 3, column 'index'"),
        ("series,index,value\na,1,2.0\na,2,slow\n", "line 3, column 'value'"),
        ("series,index,value\na,1,2.0\na,2,-1\n", "line 3, column 'value'"),
        ("series,index,value\na,1,2.0\na,1,2.5\n", "already has index 1 (line 2)"),
        ("series,index,value\na,1,2.0,9\n", "line 2: 4 field(s)"),
        ("series,index,value\n,1,2.0\n", "line 2, column 'series'"),
        ("", "empty file"),
    ],
)
def test_bad_rows_name_line_and_column(tmp_path, capsys, content: str, message: str) -> None:
    source = tmp_path / "bad.csv"
    source.write_text(content, encoding="utf-8")
    assert main(["changepoints", "--input", str(source)]) == 1  # bad input data
    error = capsys.readouterr().err
    assert "lagscope changepoints: error:" in error
    assert message in error
    assert str(source) in error


def test_missing_file_is_a_clear_error(tmp_path, capsys) -> None:
    assert main(["changepoints", "--input", str(tmp_path / "nope.csv")]) == 1  # bad input data
    assert "cannot read" in capsys.readouterr().err
