"""The HTML report in a real headless Chromium: loads without console errors, every chart
renders (non-empty SVG), works offline, and a screenshot is kept as a test artefact. A job
id or a trial name is text, never markup: the templates escape every value."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lagscope.stream_app.cli import main
from tests.conftest import REPO_ROOT

ARTIFACTS = REPO_ROOT / "out" / "test-artifacts"
CHARTS = ("heatmap", "steps", "by-optype", "by-stage", "by-dp")


def chromium_path() -> str:
    path = os.environ.get("LAGSCOPE_CHROMIUM") or shutil.which("chromium")
    if not path:
        pytest.fail(
            "chromium not found: `make install` installs Debian's chromium "
            "(or set LAGSCOPE_CHROMIUM)"
        )
    return path


def check_in_browser(report: Path, screenshot: Path) -> dict:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=chromium_path(), args=["--no-sandbox", "--disable-gpu"]
        )
        # Offline: any request leaving the file would fail and be recorded.
        context = browser.new_context(offline=True)
        page = context.new_page()
        problems: list[str] = []
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
        dialogs: list[str] = []

        def dismiss(dialog) -> None:
            dialogs.append(dialog.message)
            dialog.dismiss()

        page.on("dialog", dismiss)
        page.goto(report.as_uri())
        charts = page.evaluate(
            "Object.fromEntries([...document.querySelectorAll('svg.chart')].map("
            "s => [s.id, {w: s.getBBox().width, h: s.getBBox().height, "
            "n: s.querySelectorAll('rect,polyline,line').length}]))"
        )
        title = page.title()
        seen = page.evaluate(
            "({h1: document.querySelector('h1').textContent, scripts: document.scripts.length,"
            " pwned: window.__pwned === undefined ? null : window.__pwned,"
            " images: document.images.length})"
        )
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(screenshot), full_page=True)
        browser.close()
    return {"problems": problems, "charts": charts, "title": title, "dialogs": dialogs, **seen}


def test_analyze_report_renders(reference_dir, tmp_path):
    report = tmp_path / "st.html"
    assert (
        main(
            [
                "analyze",
                "--trace",
                str(reference_dir / "trace-ST.parquet"),
                "--meta",
                str(reference_dir / "meta-ST.yaml"),
                "--report",
                str(report),
            ]
        )
        == 0
    )
    seen = check_in_browser(report, ARTIFACTS / "report-ST.png")
    assert seen["problems"] == []
    assert seen["title"] == "lagscope: ST"
    for chart in CHARTS:
        assert seen["charts"][chart]["w"] > 50 and seen["charts"][chart]["h"] > 20, chart
        assert seen["charts"][chart]["n"] > 0, chart
    # 2 x 4 workers in the heatmap.
    assert seen["charts"]["heatmap"]["n"] == 8
    assert (ARTIFACTS / "report-ST.png").stat().st_size > 10_000


def test_demo_report_renders(tmp_path):
    out = tmp_path / "demo"
    # Its own process: chDB opens one data directory per process, and the demo has its own.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lagscope.stream_app.cli",
            "demo",
            "--out",
            str(out),
            "--steps",
            "40",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "report:" in proc.stdout
    seen = check_in_browser(out / "report.html", ARTIFACTS / "report-demo.png")
    assert seen["problems"] == []
    assert seen["charts"]["heatmap"]["n"] == 32
    assert seen["charts"]["steps"]["n"] >= 1
    html = (out / "report.html").read_text()
    assert "http://" not in html.replace("https://ui.perfetto.dev", "")
    # The slow worker's episode has its own heatmap beside the whole run's: over its own
    # steps the worker the diagnosis verified, (dp 5, pp 2), scores highest, where the
    # whole run's heatmap is led by the heavy last stage.
    episode = seen["charts"]["heatmap-episode-1"]
    assert episode["n"] == 32 and episode["w"] > 50 and episode["h"] > 20
    start = html.index('id="heatmap-episode-1"')
    cells = re.findall(
        r'data-value="([0-9.]+)" data-kind="(\w+)"[^>]*><title>dp (\d), pp (\d)',
        html[start : html.index("</svg>", start)],
    )
    assert max(cells)[1:] == ("verified", "5", "2")
    # The demo's page is final: it does not refresh, and says when it was updated.
    assert 'http-equiv="refresh"' not in html
    assert re.search(r"final</b>, updated at .* UTC</time>\. Data last updated: step 10\d\d", html)


#: A job id or trial name that would run a script, break out of an attribute or add an
#: element if it were pasted into the page as markup.
HOSTILE = (
    '<script>window.__pwned = 1; alert(1)</script>"\'><img src=x onerror="window.__pwned=2">&amp;'
)


def test_a_hostile_job_id_is_text(tmp_path, chdb_dsn, reference_dir):
    """Through the embedded host (its final report of a job whose id is hostile) and
    `lagscope analyze` (a trial name): no script runs, the text shows literally."""
    from lagscope.producers.events import JobInfo
    from lagscope.simulator.generate import JobSpec, generate_job
    from lagscope.stream_app.commands.run import write_logs_with_timers
    from lagscope.stream_app.embedded import EmbeddedRunner, LiveReport
    from lagscope.stream_app.processor import ProcessorSettings
    from lagscope.stream_app.sink import ClickHouseSink

    job = generate_job(JobSpec(dp=2, pp=2, microbatches=4, steps=10, name="hostile", seed=3))
    info = JobInfo.from_meta(job.meta, job_id=HOSTILE)
    write_logs_with_timers(job.trace, info, tmp_path / "logs", time.time_ns())
    sink = ClickHouseSink(chdb_dsn)
    sink.ensure_schema()
    report = tmp_path / "hostile.html"
    runner = EmbeddedRunner(
        sink, ProcessorSettings(lateness_s=5.0), live_report=LiveReport(report, every_s=1.0)
    )
    runner.run_logs(tmp_path / "logs")
    assert runner.report_path(HOSTILE, 0) == report
    seen = check_in_browser(report, ARTIFACTS / "report-hostile.png")
    assert seen["problems"] == [] and seen["dialogs"] == []
    assert seen["pwned"] is None and seen["scripts"] == 0 and seen["images"] == 0
    assert seen["h1"] == f"lagscope: {HOSTILE} (attempt 0)"
    assert seen["title"] == f"lagscope: {HOSTILE} (attempt 0)"
    page = report.read_text()
    assert "<script" not in page and "<img" not in page
    assert "&lt;script&gt;" in page and "&amp;amp;" in page

    meta = tmp_path / "meta.yaml"
    meta.write_text(
        re.sub(
            r"(?m)^trial_name:.*$",
            "trial_name: " + json.dumps(HOSTILE),
            (reference_dir / "meta-ST.yaml").read_text(),
        )
    )
    analysed = tmp_path / "st.html"
    trace = str(reference_dir / "trace-ST.parquet")
    assert main(["analyze", "--trace", trace, "--meta", str(meta), "--report", str(analysed)]) == 0
    seen = check_in_browser(analysed, ARTIFACTS / "report-hostile-st.png")
    assert seen["problems"] == [] and seen["dialogs"] == []
    assert seen["pwned"] is None and seen["scripts"] == 0 and seen["images"] == 0
    assert seen["title"] == seen["h1"] == f"lagscope: {HOSTILE}"
