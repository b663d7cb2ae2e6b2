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

import numpy as np
import pytest

from lagscope.cli import main
from lagscope.dashboards.colour_scale import colour_scale
from tests.conftest import REPO_ROOT, analyzed_reference

#: Reports opened in a real headless Chromium: slow.
pytestmark = pytest.mark.slow

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


#: The text of every chart as the browser laid it out: pairs of labels whose boxes overlap
#: (sorted by left edge, each box compared with those that start before it ends), cell
#: labels that spill out of their cell, and how wide the page became.
LAYOUT = """() => {
  const drawn = r => r.width > 0 && r.height > 0;
  const overlaps = [], spilled = [];
  let texts = 0;
  for (const svg of document.querySelectorAll('svg.chart')) {
    const boxes = [...svg.querySelectorAll('text')]
      .map(t => [t.textContent, t.getBoundingClientRect()]).filter(([, r]) => drawn(r));
    texts += boxes.length;
    boxes.sort((a, b) => a[1].left - b[1].left);
    for (let i = 0; i < boxes.length; i++) {
      const a = boxes[i][1];
      for (let j = i + 1; j < boxes.length && boxes[j][1].left < a.right - 0.5; j++) {
        const b = boxes[j][1];
        if (a.top < b.bottom - 0.5 && b.top < a.bottom - 0.5)
          overlaps.push([svg.id, boxes[i][0], boxes[j][0]]);
      }
    }
    for (const label of svg.querySelectorAll('text.cell-label')) {
      const r = label.getBoundingClientRect();
      const cell = label.previousElementSibling.getBoundingClientRect();
      if (drawn(r) && (r.left < cell.left - 0.5 || r.right > cell.right + 0.5 ||
                       r.top < cell.top - 0.5 || r.bottom > cell.bottom + 0.5))
        spilled.push([svg.id, label.textContent]);
    }
  }
  const text = s => [...document.querySelectorAll(s)].map(e => e.textContent);
  return {overlaps: overlaps.slice(0, 10), spilled: spilled.slice(0, 10), texts,
          page_width: document.documentElement.scrollWidth, viewport: window.innerWidth,
          scale: text('p.scale'), step_ticks: text('#steps text.step-tick'),
          value_ticks: text('#steps text.value-tick')};
}"""


def check_in_browser(report: Path, screenshot: Path, drill_down: bool = False) -> dict:
    """What a reader sees of `report`: its problems (console errors, failed requests), its
    charts' sizes, its layout (`LAYOUT`); with `drill_down`, what clicking the overview's
    worst cell opens."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=chromium_path(), args=["--no-sandbox", "--disable-gpu"]
        )
        # Offline: any request leaving the file would fail and be recorded.
        context = browser.new_context(offline=True, viewport={"width": 1100, "height": 900})
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
        layout = page.evaluate(LAYOUT)
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(screenshot), full_page=True)
        opened: dict = {}
        if drill_down:
            worst = page.evaluate(
                "[...document.querySelectorAll('svg#heatmap a rect')].reduce((a, r) =>"
                " +r.dataset.value > +a.dataset.value ? r : a).getAttribute('data-value')"
            )
            page.locator(f'svg#heatmap a rect[data-value="{worst}"]').first.click()
            opened = page.evaluate(
                "({open: [...document.querySelectorAll('details[open]')].map(d => d.id),"
                " hash: location.hash, in_view: (() => { const r = document.querySelector("
                "location.hash).getBoundingClientRect(); return r.top >= 0 && r.top < "
                "window.innerHeight; })(), values: [...document.querySelectorAll("
                "'details.group[open] rect')].map(r => r.dataset.value)})"
            )
            opened["worst"] = worst
            page.screenshot(path=str(screenshot.with_name(screenshot.stem + "-drilled.png")))
        browser.close()
    return {
        "problems": problems,
        "charts": charts,
        "title": title,
        "dialogs": dialogs,
        "layout": layout,
        "opened": opened,
        **seen,
    }


def assert_readable(seen: dict, worker_slowdown) -> None:
    """No label over another or out of its cell, nothing wider than the window, the fixed
    scale and the job's own range stated, both axes of the step chart ticked."""
    layout = seen["layout"]
    assert layout["overlaps"] == [], layout["overlaps"]
    assert layout["spilled"] == [], layout["spilled"]
    assert layout["page_width"] <= layout["viewport"]
    low, high = float(np.nanmin(worker_slowdown)), float(np.nanmax(worker_slowdown))
    decimals = colour_scale(worker_slowdown).decimals
    scale = " ".join(layout["scale"][0].split())
    assert scale.startswith("colour scale fixed at S_w 1.0 (palest) to 1.5 (darkest)"), scale
    assert f"this job's S_w: {low:.{decimals}f} to {high:.{decimals}f}" in scale, scale
    assert len(layout["value_ticks"]) >= 4
    step_ticks = [int(t) for t in layout["step_ticks"]]
    assert step_ticks == sorted(step_ticks) and len(step_ticks) >= 2


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
    assert_readable(seen, analyzed_reference("ST")[1].worker_slowdown)


def test_se_report_labels_do_not_overlap_and_its_step_axis_is_cut(reference_dir, tmp_path):
    """SE (32 DP ranks) was the measured case: cell values written over each other, a
    colour scale from the job's own minimum to its maximum, a step axis of 822 steps
    labelled at its two ends for three bursts of sampled steps."""
    report = tmp_path / "se.html"
    trace, meta = reference_dir / "trace-SE.parquet", reference_dir / "meta-SE.yaml"
    assert (
        main(["analyze", "--trace", str(trace), "--meta", str(meta), "--report", str(report)]) == 0
    )
    seen = check_in_browser(report, ARTIFACTS / "report-SE.png")
    assert seen["problems"] == []
    assert_readable(seen, analyzed_reference("SE")[1].worker_slowdown)
    # Cut twice; round step ids labelled in each of the three bursts.
    html = report.read_text()
    assert html.count('<g class="axis-cut">') == 2
    step_ticks = [int(t) for t in seen["layout"]["step_ticks"]]
    for first, last in ((16, 39), (403, 437), (808, 838)):
        assert len([t for t in step_ticks if first <= t <= last]) >= 3, step_ticks


def test_demo_report_renders(tmp_path):
    out = tmp_path / "demo"
    # Its own process: chDB opens one data directory per process, and the demo has its own.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lagscope.cli",
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
    from lagscope.cli.demo import write_logs_with_timers
    from lagscope.cli.job_page import render_job_page
    from lagscope.producers.events import JobInfo
    from lagscope.simulator.generate import JobSpec, generate_job
    from lagscope.store.sink import ClickHouseSink
    from lagscope.stream_app.embedded import EmbeddedRunner, LiveReport
    from lagscope.stream_app.processor import ProcessorSettings

    job = generate_job(JobSpec(dp=2, pp=2, microbatches=4, steps=10, name="hostile", seed=3))
    info = JobInfo.from_meta(job.meta, job_id=HOSTILE)
    write_logs_with_timers(job.trace, info, tmp_path / "logs", time.time_ns())
    sink = ClickHouseSink(chdb_dsn)
    sink.ensure_schema()
    report = tmp_path / "hostile.html"
    runner = EmbeddedRunner(
        sink,
        ProcessorSettings(lateness_s=5.0),
        live_report=LiveReport(report, render_job_page, every_s=1.0),
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


#: Jobs of 128, 1,024, 12,288 and 99,968 GPUs: (dp, pp, tp). The straggler runs 1.5x slow
#: on a worker two thirds into the DP ranks, in the middle stage, for half the run.
SIZES = {
    128: (8, 4, 4),
    1024: (32, 4, 8),
    12288: (192, 8, 8),
    99968: (1562, 8, 8),
}


@pytest.mark.parametrize(
    "gpus",
    [
        128,
        1024,
        pytest.param(12288, marks=pytest.mark.slow),
        pytest.param(99968, marks=pytest.mark.slow),
    ],
)
def test_report_stays_readable_at_production_size(gpus: int, tmp_path: Path) -> None:
    """A generated job analysed and reported as the embedded host does, read in Chromium:
    no label overlaps another, the page is no wider than the window, the fixed scale and
    the job's range are stated, and a job too wide for a cell per worker is binned, its
    worst cell opening the heatmap of its own DP ranks, where the worst worker is."""
    from lagscope.dashboards.report import ReportData, render_report
    from lagscope.simulator.diagnose import diagnose
    from lagscope.simulator.generate import JobSpec, SlowWorker, generate_job
    from lagscope.simulator.prepare import prepare
    from lagscope.simulator.whatif import analyze

    dp, pp, tp = SIZES[gpus]
    spec = JobSpec(
        name=f"{gpus}-gpus", dp=dp, pp=pp, tp=tp, microbatches=8, steps=6, seed=7,
        stragglers=(SlowWorker(dp=2 * dp // 3, stage=pp // 2, factor=1.5, start_step=2,
                               end_step=5),),
    )  # fmt: skip
    job = generate_job(spec)
    prepared = prepare(job.trace, job.meta)
    result = analyze(prepared)
    machines = {(d, s): f"node-{(s * dp + d) * tp // 8:05d}" for d in range(dp) for s in range(pp)}
    report = tmp_path / "report.html"
    report.write_text(
        render_report(
            ReportData(
                title=f"lagscope: {gpus:,} GPUs",
                subtitle=f"dp {dp} x pp {pp} x tp {tp}",
                result=result,
                diagnosis=diagnose(result, prepared),
                worker_machines=machines,
            )
        )
    )
    size = report.stat().st_size
    # Every worker is in the page (the drill-down), at a bounded cost each: 2.5 MB at 99,968
    # GPUs (12,496 workers).
    assert size < 150_000 + 300 * dp * pp, size
    binned = dp * pp > 1024
    seen = check_in_browser(report, ARTIFACTS / f"report-{gpus}-gpus.png", drill_down=binned)
    assert seen["problems"] == []
    assert_readable(seen, result.worker_slowdown)
    worst = float(np.nanmax(result.worker_slowdown))
    overview = seen["charts"]["heatmap"]
    if not binned:
        assert overview["n"] == dp * pp
        return
    assert overview["n"] <= 70 * pp and overview["w"] <= 900
    opened = seen["opened"]
    assert float(opened["worst"]) == pytest.approx(worst, abs=1e-6)
    assert len(opened["open"]) == 2 and opened["in_view"], opened
    assert max(float(v) for v in opened["values"]) == pytest.approx(worst, abs=1e-6)
    # The worst worker's machine is named in the table of top workers.
    stage, worst_dp = np.unravel_index(np.nanargmax(result.worker_slowdown), (pp, dp))
    assert f"<td>{machines[int(worst_dp), int(stage)]}</td>" in report.read_text()
