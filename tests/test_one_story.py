"""One story per analysis: the summary, the JSON, the HTML report and the escalation of
`lagscope analyze` (and the demo's summary and report) carry the same verdict, computed
once from the diagnosis (`simulator/verdict.py`); shares of the slowdown read as shares.

A user found the verdict saying "move layers", the diagnosis "sequence-length imbalance"
and the escalation "re-split micro-batches" for the same trace, and "explains 122 %".
"""

from __future__ import annotations

import html
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lagscope.cli import main
from lagscope.simulator.advice import Advice, escalation
from lagscope.simulator.causes import Cause
from lagscope.simulator.diagnose import Diagnosis, DiagnosisSettings
from lagscope.simulator.evidence import Escalation, Evidence
from lagscope.simulator.verdict import MEANINGS, escalation_text, verdict_of

#: The paper's reading of the reference traces, and the first fix each calls for.
EXPECTED = {
    "AR": ("slow_workers", "re-split micro-batches"),
    "SE": ("sequence_imbalance", "balance sequence lengths"),
    "ST": ("last_stage_imbalance", "move layers off the last stage"),
}

PERCENT = re.compile(r"(-?\d+(?:\.\d+)?)\s?%")
NEGATIVE_ZERO = re.compile(r"-0(?:\.0+)?\s?%")


def _text(report: str) -> str:
    """The report's visible text, tags dropped and entities decoded."""
    body = re.sub(r"<style>.*?</style>", " ", report, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", body))


def assert_shares_are_shares(text: str, where: str) -> None:
    """No "-0%"; every percentage above 100 % is followed, in its own sentence, by the
    reason it can be."""
    assert not NEGATIVE_ZERO.search(text), f"{where}: -0% in {NEGATIVE_ZERO.search(text)}"
    for match in PERCENT.finditer(text):
        if float(match.group(1)) > 100:
            after = text[match.end() : match.end() + 40]
            assert "because" in after, f"{where}: {match.group(0)} without a reason: {after!r}"
    for match in re.finditer(r"explains? (-?\d+(?:\.\d+)?)%", text):
        assert 0 <= float(match.group(1)) <= 100, f"{where}: {match.group(0)}"


def report_verdicts(report: str) -> list[dict[str, str]]:
    """The verdict boxes of a report, the run's first: scope, cause, headline, action,
    escalation."""
    found = []
    for box in re.finditer(r'<p class="verdict" (.*?)</p>', report, flags=re.S):
        attrs = dict(re.findall(r'data-(\w+)="([^"]*)"', box.group(1)))
        spans = dict(re.findall(r"<span class='(\w+)'>(.*?)</span>", box.group(1), re.S))
        found.append(
            {
                "scope": attrs["scope"],
                "cause": html.unescape(attrs["cause"]),
                **{k: html.unescape(v) for k, v in spans.items()},
            }
        )
    return found


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_analyze_tells_one_story(reference_dir: Path, tmp_path: Path, capsys, name: str):
    out_json, out_report = tmp_path / f"{name}.json", tmp_path / f"{name}.html"
    code = main(
        [
            "analyze",
            "--trace",
            str(reference_dir / f"trace-{name}.parquet"),
            "--meta",
            str(reference_dir / f"meta-{name}.yaml"),
            "--json",
            str(out_json),
            "--report",
            str(out_report),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    document = json.loads(out_json.read_text())
    report = out_report.read_text()
    verdict = document["verdict"]
    cause, action = EXPECTED[name]
    assert (verdict["cause"], verdict["action"]) == (cause, action)

    # The JSON: the verdict is the diagnosis' own.
    assert verdict["headline"] == document["diagnosis"]["summary"]
    assert document["diagnosis"]["cause"] == cause
    # The summary: one verdict line, no second story beside it.
    assert f"  verdict             {cause}: {verdict['headline']}\n" in printed
    assert printed.count("verdict ") == 1 and "diagnosis " not in printed
    assert f"  action              {action}" in printed
    # The report: the run's verdict box says the same.
    boxes = report_verdicts(report)
    # ... then one box per episode: AR's worker, slow from the trace's first step, has no
    # rise to detect, and is an episode all the same (the one its verdict tells).
    assert [b["scope"] for b in boxes] == ["run"] + ["episode"] * len(document["episodes"])
    if name == "AR":
        assert [b["headline"] for b in boxes[1:]] == [verdict["headline"]]
    assert (boxes[0]["cause"], boxes[0]["headline"]) == (cause, verdict["headline"])
    assert boxes[0]["action"].startswith(action)
    # The escalation: the same cause's ladder, its first fix the verdict's action,
    # printed the same in the summary and in the report.
    escalation = document["diagnosis"]["escalation"]
    assert escalation["cause"] == cause
    assert escalation["ladder"][0]["action"] == "ignore"
    assert escalation["ladder"][1]["action"] == action
    assert verdict["now"] == escalation["action"]
    ladder_text = escalation_text(Escalation.from_dict(escalation))
    assert f"  escalation          {ladder_text}\n" in printed
    assert boxes[0]["escalation"] == ladder_text
    if cause != "slow_workers":
        assert "re-split" not in ladder_text

    # Shares are shares; each symbol says what it means, in the summary and the report.
    assert_shares_are_shares(printed, f"{name} summary")
    assert_shares_are_shares(_text(report), f"{name} report")
    for symbol, meaning in MEANINGS.items():
        assert f"{symbol}: {meaning}" in printed, symbol
        assert f"{symbol}: {html.escape(meaning)}" in report, symbol


def test_a_trace_and_its_replay_name_the_same_straggler(tmp_path: Path, capsys):
    """A worker 1.6x slower in steps 20-39 of 60, in a generated job whose last stage is
    heavier throughout: `lagscope analyze` of the trace blamed the last stage (the whole
    trace's diagnosis alone), `lagscope run` of its replayed logs the worker with its
    episode. Both tell the episode's story now, in the same words."""
    job, logs = tmp_path / "job", tmp_path / "logs"
    assert main(["generate", "--out", str(job), "--dp", "8", "--pp", "4", "--steps", "60",
                 "--inject", "slow_worker:dp=1,stage=2,factor=1.6,start_step=20,end_step=40"]
                ) == 0  # fmt: skip
    files = ["--trace", str(job / "trace.parquet"), "--meta", str(job / "meta.yaml")]
    capsys.readouterr()
    assert main(["analyze", *files, "--json", str(tmp_path / "a.json"),
                 "--report", str(tmp_path / "a.html")]) == 0  # fmt: skip
    analysed = capsys.readouterr().out
    document = json.loads((tmp_path / "a.json").read_text())
    assert document["verdict"]["cause"] == "slow_workers"
    assert "(dp 1, pp 2) slow in backward-compute" in document["verdict"]["headline"]
    [episode] = document["episodes"]
    assert (episode["dp"], episode["stage"], episode["kind"]) == (1, 2, "backward-compute")
    assert abs(episode["onset"] - 20) <= 1 and abs(episode["recovery"] - 40) <= 1
    assert "  episode 1 from step " in analysed
    boxes = report_verdicts((tmp_path / "a.html").read_text())
    assert [(b["scope"], b["headline"]) for b in boxes][:1] == [
        ("run", document["verdict"]["headline"])
    ]
    assert any(b["scope"] != "run" for b in boxes), boxes  # the episode's own box

    # The same steps through the embedded pipeline, as a job's rank logs.
    for command in (
        ["replay", *files, "--log-dir", str(logs), "--no-progress"],
        ["run", "--log-dir", str(logs), "--dsn", f"chdb://{tmp_path / 'store'}"],
    ):
        done = subprocess.run([sys.executable, "-m", "lagscope", *command], capture_output=True,
                              text=True, timeout=300, check=True, cwd=tmp_path)  # fmt: skip
    ran = done.stdout
    told = re.search(r"\n    verdict: (.+)\n", ran)
    assert told, ran
    assert f"  verdict             {told.group(1)}\n" in analysed, (analysed, ran)


def test_a_share_over_100_reads_100_with_its_reason(reference_dir: Path, capsys):
    """ST's last stage removes 121.9 % of the slowdown (docs/whatif.md §6.5): the verdict
    says 100 % and gives the raw number with the reason; AR's M_S of -0.1 % is no "-0%"."""
    main(
        [
            "analyze",
            "--trace",
            str(reference_dir / "trace-ST.parquet"),
            "--meta",
            str(reference_dir / "meta-ST.yaml"),
        ]
    )
    printed = capsys.readouterr().out
    assert "the last stage (pp 3) explains 100% of the slowdown (M_S is 122%: above 100%" in (
        printed
    )
    assert "M_S (last stage)    100.0% (M_S is 121.9%: above 100% because" in printed


@pytest.mark.parametrize(
    "cause, fix",
    [
        ("slow_workers", "re-split micro-batches"),
        ("slow_communication", "repair or avoid the slow links"),
        ("last_stage_imbalance", "move layers off the last stage"),
        ("sequence_imbalance", "balance sequence lengths"),
        ("gc_pauses", "planned garbage collection"),
        ("unattributed", None),
        ("none", None),
    ],
)
def test_every_cause_climbs_its_own_ladder(cause: str, fix: str | None):
    """The escalation's first fix is the cause's own (the advice the diagnosis gives for
    it), so the verdict's action and the escalation never name different fixes; a job
    with no cause to act on has nothing to climb, however much time its noise costs."""
    ladder = escalation(8 * 5000.0, 8, DiagnosisSettings(), Cause(cause))
    assert ladder.cause == cause
    assert [r.action for r in ladder.ladder][:2] == (["ignore", fix] if fix else ["ignore"])
    advice = (Advice(fix, "", 1.1),) if fix else ()
    story = verdict_of(Diagnosis(Cause(cause), "headline", Evidence(), advice, ladder))
    assert story.action == (fix or "ignore")
    assert story.predicted_speedup == (1.1 if fix else None)
    assert story.now == ladder.action
    if fix is None:
        assert ladder.action == "ignore" and ladder.next_action is None


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[str, str]:
    """`lagscope demo` once for this module, in its own process (chDB opens one data
    directory per process): its printed summary and its report."""
    out = tmp_path_factory.mktemp("demo")
    command = [sys.executable, "-m", "lagscope.cli", "demo", "--out", str(out)]
    proc = subprocess.run(
        [*command, "--steps", "40"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, (out / "report.html").read_text()


@pytest.mark.slow  # the whole demo (~20 s)
def test_the_demo_tells_one_story(demo: tuple[str, str]):
    printed, report = demo
    boxes = report_verdicts(report)
    run = [b for b in boxes if b["scope"] == "run"]
    episodes = [b for b in boxes if b["scope"] == "episode"]
    assert len(run) == 1
    # The run's verdict, action and escalation: the same in the summary and the report.
    assert f"    verdict: {run[0]['cause']}: {run[0]['headline']}\n" in printed
    assert f"    action: {run[0]['action']}\n" in printed
    assert f"    escalation: {run[0]['escalation']}\n" in printed
    assert "diagnosis:" not in printed
    # Each episode's verdict too, in order (the demo has its slow worker's episode), and
    # the per-series line never drops the culprit's own series.
    assert re.search(r"    per-series changes: [^\n]*worker/5\.2 onset@", printed), printed
    printed_episodes = re.findall(r"    episode \d+ from step \d+ [^:]+: (.*)\n", printed)
    assert episodes and printed_episodes == [f"{b['cause']}: {b['headline']}" for b in episodes]
    # An episode that is over is acted on only if it comes back, in both.
    actions = re.findall(
        r"    episode \d+ from step \d+ to step (\d+) [^:]+: .*\n      action: (.*)\n", printed
    )
    assert actions, printed
    for recovered, action in actions:
        assert action.startswith(f"none now (recovered at step {recovered}); if it comes back: ")
        assert any(b["action"] == action for b in episodes), (action, episodes)
    assert_shares_are_shares(printed, "demo summary")
    assert_shares_are_shares(_text(report), "demo report")


def test_the_demo_names_the_straggler_first_with_its_machine(demo: tuple[str, str]):
    """The injected worker (dp 5, pp 2) leads the top stragglers, verified, with the S_w
    crossing of its DP replica and the heavy last stage marked as such; its episode names
    the node and GPU it runs on (the demo places 128 ranks on 16 nodes of 8 GPUs)."""
    printed, report = demo
    top = re.search(r"    top stragglers (.*)\n", printed)
    assert top and re.match(r"\(dp 5, pp 2\) S_w=[\d.]+ verified, ", top.group(1)), printed
    crossing = re.search(r"\(dp 5, pp 3\) S_w=[\d.]+( S_w crossing)?", top.group(1))
    assert crossing is None or crossing.group(1), top.group(1)
    episode = re.search(r"    episode \d+ from step \d+ [^:]+: (.*)\n", printed)
    assert episode and re.search(r"\(dp 5, pp 2\) on demo-llm-node-\d\d GPU \d", episode.group(1))
    assert re.search(r"\(dp 5, pp 2\) on demo-llm-node-\d\d GPU \d", _text(report))
