"""A recorded job named the short way: the trace as a plain argument, its metadata found
beside it (`lagscope/cli/trace_inputs.py`), for `analyze` and `replay` alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lagscope.cli import main


def _json_of(argv: list[str], out: Path) -> dict:
    assert main([*argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_a_reference_trace_alone_finds_its_meta_and_gives_the_same_analysis(
    reference_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    trace, meta = reference_dir / "trace-SE.parquet", reference_dir / "meta-SE.yaml"
    named = _json_of(["analyze", "--trace", str(trace), "--meta", str(meta)], tmp_path / "a")
    assert "found beside the trace" not in capsys.readouterr().out

    short = _json_of(["analyze", str(trace)], tmp_path / "b")

    assert f"metadata            {meta}, found beside the trace" in capsys.readouterr().out
    for key in ("slowdown", "by_optype", "by_dp_rank", "by_stage", "mw", "ms", "verdict"):
        assert short[key] == named[key], key


def test_generates_output_directory_is_a_trace(tmp_path: Path, capsys) -> None:
    out = tmp_path / "job"
    generate = ["generate", "--out", str(out), "--dp", "2", "--pp", "2", "--steps", "6"]
    assert main(generate) == 0

    document = _json_of(["analyze", str(out)], tmp_path / "job.json")

    assert document["steps"]
    assert f"{out / 'meta.yaml'}, found beside the trace" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("name", "meta_name"),
    [("trace-X.parquet", "meta-X.yaml"), ("big.parquet", "big.yaml"), ("t.parquet", "meta.yaml")],
)
def test_the_metadata_is_found_under_each_name_it_goes_by(
    reference_dir: Path, tmp_path: Path, name: str, meta_name: str
) -> None:
    shutil.copy(reference_dir / "trace-ST.parquet", tmp_path / name)
    shutil.copy(reference_dir / "meta-ST.yaml", tmp_path / meta_name)

    assert _json_of(["analyze", str(tmp_path / name)], tmp_path / "out.json")["steps"]


def test_a_trace_without_metadata_beside_it_says_where_it_looked(
    reference_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    shutil.copy(reference_dir / "trace-ST.parquet", tmp_path / "trace-ST.parquet")
    out = tmp_path / "out.json"

    assert main(["analyze", str(tmp_path / "trace-ST.parquet"), "--json", str(out)]) == 2

    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("lagscope analyze: error: --meta: not given, and no job metadata")
    assert (
        str(tmp_path / "meta-ST.yaml") in line
        and "name it with --meta: a yaml of the job's dp_size, pp_size" in line
    )
    assert not out.exists()


def test_a_directory_of_several_traces_asks_for_one(reference_dir: Path, capsys) -> None:
    assert main(["analyze", str(reference_dir)]) == 2

    (line,) = capsys.readouterr().err.splitlines()
    assert "holds 3 traces (trace-AR.parquet, trace-SE.parquet, trace-ST.parquet)" in line


def test_a_missing_trace_is_named_before_any_metadata_is_looked_for(tmp_path: Path, capsys):
    missing = tmp_path / "trace.parquet"

    assert main(["analyze", str(missing)]) == 1

    assert capsys.readouterr().err.splitlines() == [
        f"lagscope analyze: error: {missing}: no such file or directory"
    ]


def test_the_trace_is_given_once(reference_dir: Path, capsys) -> None:
    trace = str(reference_dir / "trace-ST.parquet")

    with pytest.raises(SystemExit) as exited:
        main(["analyze", trace, "--trace", trace])

    assert exited.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_replay_takes_the_trace_the_same_way(reference_dir: Path, tmp_path: Path, capsys):
    logs = tmp_path / "logs"

    code = main(
        ["replay", str(reference_dir / "trace-ST.parquet"), "--log-dir", str(logs), "--no-progress"]
    )

    assert code == 0
    assert "meta-ST.yaml, found beside the trace" in capsys.readouterr().err
    # ST is dp 2 x pp 4: one log per rank.
    assert len([p for p in logs.iterdir() if p.name.startswith("rank-")]) == 8


def test_a_folder_of_rank_logs_is_sent_to_lagscope_run(reference_dir: Path, tmp_path: Path, capsys):
    logs = tmp_path / "logs"
    replay = ["replay", "--trace", str(reference_dir / "trace-ST.parquet"), "--log-dir", str(logs)]
    assert main([*replay, "--meta", str(reference_dir / "meta-ST.yaml"), "--no-progress"]) == 0
    capsys.readouterr()

    for given in (logs, logs / "rank-000003"):
        assert main(["analyze", str(given)]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"lagscope analyze: error: {given}: per-rank logs of lagscope's timers, not a "
            f"trace; `lagscope run --log-dir {logs}` analyses them"
        ]
