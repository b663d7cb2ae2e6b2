"""Live without Grafana: `lagscope run --follow --report PATH` keeps the job's HTML report
current while the logs grow (a page that refreshes itself, replaced atomically, saying when
it and its data were last updated) and leaves a final page, which does not refresh, at the
end. Real components: the CLI in its own process over per-rank logs written by the timer,
its chDB store, the report file read while it is rewritten, and headless Chromium."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from lagscope.cli.demo import write_logs_with_timers
from lagscope.producers.events import JobInfo
from lagscope.simulator.generate import JobSpec, generate_job
from tests.test_report_browser import chromium_path

LAGSCOPE = [sys.executable, "-m", "lagscope.cli"]
STEPS, CHUNK = 30, 6


class _Document(HTMLParser):
    """The parts of a page a reader needs whole: the root element opened and closed, every
    SVG chart closed, the "updated" line."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.opened: list[str] = []
        self.closed: list[str] = []
        self.refresh: str | None = None
        self.updated: dict[str, str] = {}
        self._in_updated = False
        self.updated_text = ""

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.opened.append(tag)
        values = dict(attrs)
        if tag == "meta" and values.get("http-equiv") == "refresh":
            self.refresh = values.get("content")
        if tag == "p" and "updated" in (values.get("class") or "").split():
            self.updated = {k: v or "" for k, v in values.items()}
            self._in_updated = True

    def handle_endtag(self, tag: str) -> None:
        self.closed.append(tag)
        if tag == "p":
            self._in_updated = False

    def handle_data(self, data: str) -> None:
        if self._in_updated:
            self.updated_text += data


def parse_whole(page: str) -> _Document:
    """The page parsed, asserting it is complete: a doctype, one <html> opened and closed
    last, as many SVG charts closed as opened."""
    assert page.startswith("<!doctype html>"), page[:80]
    assert page.rstrip().endswith("</html>"), page[-200:]
    document = _Document()
    document.feed(page)
    document.close()
    assert document.opened.count("html") == 1 and document.closed[-1] == "html"
    assert document.opened.count("svg") == document.closed.count("svg") > 0
    return document


def write_steps(trace, info: JobInfo, logs: Path, first: int, last: int, base_ns: int) -> None:
    """Steps [first, last) of every rank appended to the logs through the timer."""
    chunk = trace.select((trace.step >= first) & (trace.step < last))
    write_logs_with_timers(chunk, info, logs, base_ns + first * 2_000_000_000)


@pytest.fixture
def job(tmp_path: Path):
    spec = JobSpec(dp=2, pp=2, microbatches=4, steps=STEPS, name="live", seed=5)
    generated = generate_job(spec)
    return generated.trace, JobInfo.from_meta(generated.meta, job_id="live-job")


@pytest.mark.slow  # a live run followed for its report (~20 s)
def test_follow_keeps_the_report_current_and_leaves_a_final_one(tmp_path: Path, job) -> None:
    trace, info = job
    logs, report = tmp_path / "logs", tmp_path / "site" / "report.html"
    base_ns = time.time_ns() - 600_000_000_000
    write_steps(trace, info, logs, 0, CHUNK, base_ns)
    env = {k: v for k, v in os.environ.items() if k != "LAGSCOPE_CLICKHOUSE_DSN"}
    command = [
        *LAGSCOPE, "run", "--log-dir", str(logs), "--dsn", f"chdb://{tmp_path / 'chdb'}",
        "--follow", "--idle-exit-s", "4", "--lateness-s", "2",
        "--report", str(report), "--report-every-s", "1",
    ]  # fmt: skip
    began = time.monotonic()
    with subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        while not report.exists():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() - began < 60, "no live report"
            time.sleep(0.05)
        # The report appears while the run goes on; the logs grow under it, a few steps a
        # second, and every read of the file while it is rewritten is a whole page.
        seen: dict[str, _Document] = {}
        first = CHUNK
        next_chunk = time.monotonic()
        reads = 0
        while process.poll() is None:
            if first < STEPS and time.monotonic() >= next_chunk:
                write_steps(trace, info, logs, first, min(first + CHUNK, STEPS), base_ns)
                first += CHUNK
                next_chunk = time.monotonic() + 1.2
            page = report.read_text(encoding="utf-8")
            reads += 1
            document = parse_whole(page)
            if document.updated.get("data-state") == "live":
                seen.setdefault(document.updated["data-rendered"], document)
                if len(seen) == 1:
                    (tmp_path / "live.html").write_text(page, encoding="utf-8")
            assert time.monotonic() - began < 60, "the run did not end"
            time.sleep(0.005)
        out, err = process.communicate()
    assert process.returncode == 0, err
    assert "Traceback" not in err
    assert f"report written to {report}" in out

    # Live pages: several, each refreshing itself and saying so, their times advancing.
    assert len(seen) >= 3, (reads, list(seen))
    pages = list(seen.values())  # in the order they were read
    for document in pages:
        assert document.refresh == "1"
        text = " ".join(document.updated_text.split())
        assert re.search(
            r"live, updated at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC, refreshes every 1 s\. "
            r"Data last updated: step \d+, closed at .* UTC",
            text,
        ), text
    rendered = [d.updated["data-rendered"] for d in pages]
    assert rendered == sorted(rendered) and len(set(rendered)) == len(rendered)
    last_steps = [int(d.updated["data-last-step"]) for d in pages]
    assert last_steps == sorted(last_steps) and last_steps[-1] > last_steps[0]
    assert last_steps[0] < STEPS - 1  # the first page came before the last step closed

    # The final page: no refresh, says final, covers every step; no temporary file left.
    final = parse_whole(report.read_text(encoding="utf-8"))
    assert final.refresh is None
    assert final.updated["data-state"] == "final"
    assert final.updated["data-last-step"] == str(STEPS - 1)
    assert " ".join(final.updated_text.split()).startswith("final, updated at ")
    assert final.updated["data-rendered"] > rendered[-1]
    assert sorted(p.name for p in report.parent.iterdir()) == ["report.html"]

    # In a real browser the live page reloads itself; it renders without errors.
    reloads, problems = watch_in_browser(tmp_path / "live.html", seconds=2.6)
    assert problems == []
    assert reloads >= 2, reloads


def watch_in_browser(page_file: Path, seconds: float) -> tuple[int, list[str]]:
    """How many times a page loaded in `seconds` (its own refreshes), and its errors."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=chromium_path(), args=["--no-sandbox", "--disable-gpu"]
        )
        context = browser.new_context(offline=True)
        page = context.new_page()
        loads: list[float] = []
        problems: list[str] = []
        page.on("load", lambda _: loads.append(time.monotonic()))
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.goto(page_file.as_uri())
        page.wait_for_timeout(seconds * 1000)
        browser.close()
    return len(loads), problems


def test_the_live_report_does_not_change_what_the_store_is_given(tmp_path: Path, job) -> None:
    """A page rendered before the job's first diagnosis is due diagnoses the steps so far
    for itself: the store's diagnoses come at the same steps, with the same causes, as
    when no page is kept (the page's timing is the wall clock's, the store's is not)."""
    from lagscope.cli.job_page import render_job_page
    from lagscope.store.sink import ClickHouseSink
    from lagscope.stream_app.embedded import EmbeddedRunner, LiveReport
    from lagscope.stream_app.processor import ProcessorSettings

    trace, info = job
    write_steps(trace, info, tmp_path / "logs", 0, STEPS, time.time_ns() - 600_000_000_000)
    stored = {}
    for name, page in (("without", None), ("with", tmp_path / "report.html")):
        sink = ClickHouseSink(f"chdb://{tmp_path / name}")
        sink.ensure_schema()
        live = LiveReport(page, render_job_page, every_s=0.0) if page is not None else None
        runner = EmbeddedRunner(sink, ProcessorSettings(lateness_s=5.0), live_report=live)
        # Small reads: the steps close over many rounds, and a page is due after each.
        runner.run_logs(tmp_path / "logs", read_chunk_bytes=2048)
        _, rows = sink.query(
            "SELECT step, version, cause, evidence FROM diagnoses WHERE job_id = 'live-job' "
            "ORDER BY step, version"
        )
        stored[name] = [tuple(row) for row in rows]
        sink.close()
    assert (tmp_path / "report.html").exists()
    assert len(stored["without"]) >= 2  # a cadence of diagnoses, and the final one
    assert stored["with"] == stored["without"]
