"""The HTML report in a real headless Chromium: loads without console errors, every chart
renders (non-empty SVG), works offline, and a screenshot is kept as a test artefact."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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
        page.goto(report.as_uri())
        charts = page.evaluate(
            "Object.fromEntries([...document.querySelectorAll('svg.chart')].map("
            "s => [s.id, {w: s.getBBox().width, h: s.getBBox().height, "
            "n: s.querySelectorAll('rect,polyline,line').length}]))"
        )
        title = page.title()
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(screenshot), full_page=True)
        browser.close()
    return {"problems": problems, "charts": charts, "title": title}


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
