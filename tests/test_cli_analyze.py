"""`lagscope analyze` end to end: the summary, the JSON document, heatmap and timeline."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lagscope.cli import main


def st_analyze(reference_dir) -> list[str]:
    """`analyze` of the ST reference trace; tests add their own flags."""
    return [
        "analyze",
        "--trace",
        str(reference_dir / "trace-ST.parquet"),
        "--meta",
        str(reference_dir / "meta-ST.yaml"),
    ]


def run_cli(*args: str) -> int:
    return main(list(args))


def test_analyze_writes_json_heatmap_and_timeline(reference_dir, tmp_path, capsys):
    out = tmp_path / "st.json"
    heatmap = tmp_path / "st.png"
    timeline = tmp_path / "timeline.json"
    code = run_cli(
        *st_analyze(reference_dir),
        "--json",
        str(out),
        "--heatmap",
        str(heatmap),
        "--timeline",
        str(timeline),
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "slowdown S          1.1787" in printed
    assert "verdict             last_stage_imbalance: the last stage (pp 3)" in printed

    doc = json.loads(out.read_text())
    for key in (
        "slowdown",
        "launch_slowdown",
        "waste",
        "by_optype",
        "by_dp_rank",
        "by_stage",
        "mw",
        "ms",
        "steps",
        "verdict",
    ):
        assert key in doc
    assert doc["by_stage"]["3"] == pytest.approx(1.2323, rel=1e-3)
    assert doc["launch_by_optype"] is None
    step = doc["steps"]["23"]
    assert set(step) >= {"actual", "simulated", "ideal", "slowdown"}
    assert step["slowdown"] == pytest.approx(step["simulated"] / step["ideal"])

    assert heatmap.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(timeline.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    pids = {e["pid"] for e in spans}
    assert pids == {0, 1, 2}  # dp 0, dp 1 and the ideal
    ideal_spans = [e for e in spans if e["pid"] == 2]
    actual_spans = [e for e in spans if e["pid"] == 0]
    assert len(ideal_spans) == len(actual_spans) == 106 * 32
    assert all(e["dur"] >= 0 for e in spans)


def test_gated_attribution_is_null_below_threshold(reference_dir, tmp_path):
    out = tmp_path / "r.json"
    args = [
        *st_analyze(reference_dir),
        "--json",
        str(out),
        "--decompose-threshold",
        "2.0",
    ]
    assert run_cli(*args) == 0
    assert json.loads(out.read_text())["by_optype"] is None
    assert run_cli(*args, "--always-decompose") == 0
    assert json.loads(out.read_text())["by_optype"]["forward-compute"] > 1.0


def test_steps_subset(reference_dir, tmp_path):
    out = tmp_path / "r.json"
    assert (
        run_cli(
            *st_analyze(reference_dir),
            "--json",
            str(out),
            "--steps",
            "23-34,1048",
        )
        == 0
    )
    assert list(json.loads(out.read_text())["steps"]) == ["23", "25", "33", "34", "1048"]


def test_steps_not_in_trace_is_an_error(reference_dir, capsys):
    code = run_cli(
        *st_analyze(reference_dir),
        "--steps",
        "24",
    )
    assert code == 2
    assert "no step of the trace in '24'" in capsys.readouterr().err


def test_console_script_exit_code(reference_dir, tmp_path):
    """The installed entry point reports errors on stderr with a non-zero exit code."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lagscope.cli",
            "analyze",
            "--trace",
            str(tmp_path / "missing.parquet"),
            "--meta",
            str(reference_dir / "meta-ST.yaml"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    # A missing input is bad data for a well-formed command line: exit 1 (see
    # lagscope/cli/conventions.py for the rule).
    assert proc.returncode == 1
    assert "missing.parquet: no such file" in proc.stderr


def test_a_trace_larger_than_the_memory_available_is_refused_in_one_line(
    reference_dir, tmp_path, monkeypatch, capsys
):
    """A trace whose analysis needs more memory than the machine has left is refused at
    once, in one line naming its ops and the commands that follow it a window of steps at
    a time, nothing written; one that fits is analysed. (The machine's memory is set here;
    small files are weighed too.)"""
    from lagscope.cli import trace_memory

    monkeypatch.setattr(trace_memory, "_WEIGHED_FROM_BYTES", 0)
    ops = 117_216  # the AR trace's
    needed = ops * trace_memory.ANALYZE_BYTES_PER_OP
    out = tmp_path / "ar.json"
    monkeypatch.setattr(trace_memory, "memory_available_bytes", lambda: needed - 1)
    assert run_cli(*ar_analyze(reference_dir), "--json", str(out)) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"trace-AR.parquet: {ops:,} ops; analysing them at once" in err
    assert "lagscope replay --trace" in err and "then lagscope run --log-dir DIR" in err
    assert not out.exists()
    monkeypatch.setattr(trace_memory, "memory_available_bytes", lambda: needed)
    assert run_cli(*ar_analyze(reference_dir), "--json", str(out)) == 0
    assert out.exists()


def test_a_window_of_a_trace_larger_than_memory_is_read_alone(
    reference_dir, tmp_path, monkeypatch, capsys
):
    """A trace too large to analyse whole, written as lagscope writes one (its steps in
    order over several row groups): --steps reads the row groups of those steps alone and
    tells the story of the steps that a whole read with --steps tells, saying so in one
    line. A window that is itself too large, or a file whose steps are not in order, is
    refused in one line."""
    import pyarrow.parquet as pq

    from lagscope.cli import trace_memory

    table = pq.read_table(reference_dir / "trace-AR.parquet")
    ordered, shuffled = tmp_path / "ordered.parquet", tmp_path / "shuffled.parquet"
    pq.write_table(table, ordered, row_group_size=5_000)
    pq.write_table(table.take([*range(1, table.num_rows), 0]), shuffled, row_group_size=5_000)
    meta = str(reference_dir / "meta-AR.yaml")
    window = "404-436"

    def analysed(path, *options: str, meta: str = meta) -> tuple[int, dict | None, str]:
        out = tmp_path / "out.json"
        out.unlink(missing_ok=True)
        code = run_cli("analyze", "--trace", str(path), "--meta", meta, "--json", str(out),
                       *options)  # fmt: skip
        said = capsys.readouterr()
        return code, json.loads(out.read_text()) if out.exists() else None, said.out + said.err

    whole_code, whole, _ = analysed(ordered, "--steps", window)
    assert whole_code == 0
    monkeypatch.setattr(trace_memory, "_WEIGHED_FROM_BYTES", 0)
    ops = table.num_rows
    monkeypatch.setattr(trace_memory, "memory_available_bytes",
                        lambda: ops * trace_memory.ANALYZE_BYTES_PER_OP - 1)  # fmt: skip
    code, alone, said = analysed(ordered, "--steps", window)
    assert code == 0, said
    steps_read = len(whole["steps"])
    assert list(alone["steps"]) == list(whole["steps"]) and steps_read < 44
    assert f"holds {ops:,} ops, more than fit in memory: read the {steps_read} step(s)" in said
    assert alone["slowdown"] == pytest.approx(whole["slowdown"], rel=1e-3)
    assert alone["verdict"]["cause"] == whole["verdict"]["cause"] == "slow_workers"
    assert alone["by_dp_rank"] == pytest.approx(whole["by_dp_rank"], rel=1e-3)

    other = str(reference_dir / "meta-SE.yaml")  # another job: the window is checked too
    code, _, said = analysed(ordered, "--steps", window, meta=other)
    assert code == 1 and "describe different jobs" in said and said.count("\n") == 1, said
    code, _, said = analysed(shuffled, "--steps", window)
    assert code == 1 and "do not hold its steps in order" in said and "lagscope replay" in said
    monkeypatch.setattr(trace_memory, "memory_available_bytes",
                        lambda: ops * trace_memory.ANALYZE_BYTES_PER_OP // 100)  # fmt: skip
    code, _, said = analysed(ordered, "--steps", window)
    assert code == 1 and f"the {steps_read} step(s) of --steps hold about" in said
    assert "choose fewer" in said and said.count("\n") == 1


def ar_analyze(reference_dir) -> list[str]:
    return [
        "analyze",
        "--trace",
        str(reference_dir / "trace-AR.parquet"),
        "--meta",
        str(reference_dir / "meta-AR.yaml"),
    ]


def timeline_spans(path) -> list[dict]:
    return [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]


def test_a_timeline_over_its_slice_budget_holds_the_slowest_steps_and_says_so(
    reference_dir, tmp_path, capsys
):
    """AR whole is 146,520 slices (27 MB); under 50,000 the window keeps the slowest step
    and its neighbours on every DP rank, and one line says what was left out."""
    timeline = tmp_path / "ar.json"
    code = run_cli(
        *ar_analyze(reference_dir), "--timeline", str(timeline), "--timeline-max-slices", "50000"
    )
    assert code == 0
    printed = capsys.readouterr().out
    spans = timeline_spans(timeline)
    assert 40_000 < len(spans) <= 50_000
    assert {e["pid"] for e in spans} == {0, 1, 2, 3, 4}
    kept = sorted({e["args"]["step"] for e in spans})
    line = next(x for x in printed.splitlines() if x.startswith("  timeline: "))
    assert f"({len(kept)} of 44: the slowest and its neighbours)" in line
    assert f"{len(spans):,} slices; left out {44 - len(kept)} steps to stay under 50,000" in line
    # Without a budget it is whole.
    assert run_cli(*ar_analyze(reference_dir), "--timeline", str(timeline),
                   "--timeline-max-slices", "0") == 0  # fmt: skip
    assert len(timeline_spans(timeline)) == 146_520


def test_timeline_steps_and_ranks_choose_the_window(reference_dir, tmp_path, capsys):
    timeline = tmp_path / "ar.json"
    code = run_cli(
        *ar_analyze(reference_dir),
        "--timeline", str(timeline), "--timeline-steps", "404-416", "--timeline-ranks", "1,3",
    )  # fmt: skip
    assert code == 0
    spans = timeline_spans(timeline)
    assert {e["pid"] for e in spans} == {1, 3, 4}  # dp 1, dp 3 and the ideal
    assert sorted({e["args"]["step"] for e in spans}) == [404, 408, 413, 414, 415, 416]
    assert "left out 38 steps and 2 DP ranks (--timeline-steps" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        (["--timeline-ranks", "7"], "--timeline-ranks: no DP rank of the trace in '7'"),
        (["--timeline-steps", "1-3"], "--timeline-steps: no analysed step of the trace in '1-3'"),
        (["--timeline-max-slices", "-1"], "--timeline-max-slices: a count of slices"),
    ],
)
def test_a_timeline_window_naming_nothing_is_a_usage_error(
    reference_dir, tmp_path, capsys, extra, error
):
    code = run_cli(*st_analyze(reference_dir), "--timeline", str(tmp_path / "t.json"), *extra)
    assert code == 2
    assert error in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


def test_timeline_options_without_a_timeline_are_a_usage_error(reference_dir, capsys):
    assert run_cli(*st_analyze(reference_dir), "--timeline-ranks", "0") == 2
    assert "--timeline-ranks chooses what --timeline holds" in capsys.readouterr().err
