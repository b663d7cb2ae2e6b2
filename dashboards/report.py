"""The self-contained HTML report: one file, no network at view time, for people without
Grafana. Charts are inline SVG drawn here (no JavaScript library to fetch)."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lagscope.dashboards.colour_scale import ColourScale, colour_scale
from lagscope.dashboards.stragglers import ranked_workers, verified_workers
from lagscope.simulator.diagnose import Diagnosis
from lagscope.simulator.verdict import (
    ABOVE_S,
    MEANINGS,
    escalation_text,
    percent,
    raw_note,
    verdict_of,
)
from lagscope.simulator.whatif import WhatIfResult


@dataclass
class ReportData:
    title: str
    result: WhatIfResult
    subtitle: str = ""
    diagnosis: Diagnosis | None = None
    #: Per-step slowdown to plot (defaults to the result's own steps).
    step_ids: list[int] | None = None
    step_slowdown: list[float] | None = None
    #: Change points: dicts with step, kind ("onset"|"recovery"), series.
    changes: list[dict[str, Any]] = field(default_factory=list)
    gpu_hours: float | None = None
    gpu_hours_wasted: float | None = None
    mfu_actual: float | None = None
    mfu_ideal: float | None = None
    incomplete_steps: int = 0
    timeline_file: str | None = None
    #: Slow episodes (onset step, recovery step or None, their own diagnosis).
    episodes: list[tuple[int, int | None, Diagnosis]] = field(default_factory=list)


def _reds(value: float, scale: ColourScale) -> str:
    """Colour of a heatmap cell: near white at the scale's low end to dark red at its high."""
    if not math.isfinite(value):
        return "#eeeeee"
    t = scale.position(value)
    stops = [(255, 245, 240), (252, 146, 114), (222, 45, 38), (103, 0, 13)]
    pos = t * (len(stops) - 1)
    i = min(int(pos), len(stops) - 2)
    f = pos - i
    r, g, b = (round(a + (c - a) * f) for a, c in zip(stops[i], stops[i + 1], strict=True))
    return f"rgb({r},{g},{b})"


def heatmap_svg(worker_slowdown: np.ndarray, verified: list[tuple[int, int]] = ()) -> str:
    """Cells of `verified` workers ((dp, stage)) get a solid outline, S_w crossings of
    them (same DP replica or stage, not verified) a dashed one."""
    n_stages, n_dp = worker_slowdown.shape
    scale = colour_scale(worker_slowdown)
    kinds = {
        (w.dp, w.stage): w.kind
        for w in ranked_workers(worker_slowdown, list(verified), top=worker_slowdown.size)
    }
    outline = {
        "verified": ' stroke="#000" stroke-width="3"',
        "crossing": ' stroke="#000" stroke-width="1.5" stroke-dasharray="3 2"',
    }
    cell = max(14, min(48, 900 // max(n_dp, 1)))
    left, top = 60, 20
    width, height = left + n_dp * cell + 10, top + n_stages * cell + 40
    parts = [
        f'<svg class="chart" id="heatmap" width="{width}" height="{height}" '
        f'role="img" aria-label="worker heatmap">'
    ]
    for stage in range(n_stages):
        parts.append(
            f'<text x="{left - 8}" y="{top + stage * cell + cell / 2 + 4}" '
            f'text-anchor="end">pp {stage}</text>'
        )
        for dp in range(n_dp):
            value = float(worker_slowdown[stage, dp])
            x, y = left + dp * cell, top + stage * cell
            kind = kinds.get((dp, stage), "unverified")
            label = f"dp {dp}, pp {stage}: S_w = {value:.4f}" + (
                "" if kind == "unverified" else f" ({kind})"
            )
            parts.append(
                f'<rect x="{x}" y="{y}" width="{cell - 1}" height="{cell - 1}" '
                f'fill="{_reds(value, scale)}" data-value="{value:.6f}" data-kind="{kind}"'
                f"{outline.get(kind, '')}><title>{label}</title></rect>"
            )
            if cell >= 28:
                color = "#fff" if scale.position(value) > 0.6 else "#222"
                parts.append(
                    f'<text x="{x + cell / 2}" y="{y + cell / 2 + 4}" '
                    f'text-anchor="middle" font-size="10" fill="{color}">'
                    f"{scale.label(value)}</text>"
                )
    step = max(1, n_dp // 16)
    for dp in range(0, n_dp, step):
        parts.append(
            f'<text x="{left + dp * cell + cell / 2}" y="{top + n_stages * cell + 14}" '
            f'text-anchor="middle" font-size="10">{dp}</text>'
        )
    parts.append(
        f'<text x="{left + n_dp * cell / 2}" y="{height - 6}" '
        f'text-anchor="middle">DP rank; {html.escape(scale.describe())}</text></svg>'
    )
    return "".join(parts)


def line_svg(steps: list[int], values: list[float], changes: list[dict[str, Any]]) -> str:
    width, height, left, top, bottom = 900, 260, 50, 15, 35
    parts = [
        f'<svg class="chart" id="steps" width="{width}" height="{height}" role="img" '
        f'aria-label="slowdown per step">'
    ]
    if not steps:
        return parts[0] + "<text x='20' y='40'>no steps</text></svg>"
    xs = np.asarray(steps, dtype=float)
    ys = np.asarray(values, dtype=float)
    x0, x1 = float(xs.min()), float(max(xs.max(), xs.min() + 1))
    y0, y1 = min(1.0, float(np.nanmin(ys))), max(1.05, float(np.nanmax(ys)) * 1.02)

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - 10)

    def py(y: float) -> float:
        return top + (y1 - y) / (y1 - y0) * (height - top - bottom)

    for tick in np.linspace(y0, y1, 5):
        parts.append(
            f'<line x1="{left}" x2="{width - 10}" y1="{py(tick):.1f}" '
            f'y2="{py(tick):.1f}" stroke="#ddd"/><text x="{left - 6}" '
            f'y="{py(tick) + 4:.1f}" text-anchor="end" font-size="10">{tick:.2f}</text>'
        )
    for change in changes:
        x = px(float(change["step"]))
        color = "#d62728" if change["kind"] == "onset" else "#2ca02c"
        label = html.escape(f"{change['kind']} at step {change['step']} ({change['series']})")
        parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{height - bottom}" '
            f'stroke="{color}" stroke-width="2" stroke-dasharray="4 3">'
            f"<title>{label}</title></line>"
        )
    for run in sampled_runs(xs, ys):
        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in run)
        parts.append(
            f'<polyline class="step-run" points="{points}" fill="none" stroke="#1f77b4" '
            'stroke-width="1.5"/>'
        )
    parts.append(
        f'<text x="{left}" y="{height - 8}" font-size="11">step {int(x0)}</text>'
        f'<text x="{width - 10}" y="{height - 8}" font-size="11" text-anchor="end">'
        f"step {int(x1)}</text></svg>"
    )
    return "".join(parts)


def sampled_runs(xs: np.ndarray, ys: np.ndarray) -> list[list[tuple[float, float]]]:
    """The points of a per-step series cut where steps were not sampled: a step without a
    value, or a jump in step ids wider than the series' usual spacing. A line drawn across
    such a gap would show values nobody measured.

    >>> [[x for x, _ in run] for run in sampled_runs(
    ...     np.array([1, 2, 3, 10, 11, 12]), np.array([1.0, 1.1, np.nan, 1.2, 1.0, 1.1]))]
    [[1.0, 2.0], [10.0, 11.0, 12.0]]
    """
    order = np.argsort(xs, kind="stable")
    xs, ys = np.asarray(xs, dtype=float)[order], np.asarray(ys, dtype=float)[order]
    spacing = float(np.median(np.diff(xs))) if xs.size > 1 else 1.0
    runs: list[list[tuple[float, float]]] = []
    current: list[tuple[float, float]] = []
    previous_x: float | None = None
    for x, y in zip(xs.tolist(), ys.tolist(), strict=True):
        gap = previous_x is not None and x - previous_x > 1.5 * spacing
        if not math.isfinite(y) or gap:
            if current:
                runs.append(current)
            current = []
        if math.isfinite(y):
            current.append((x, y))
        previous_x = x
    if current:
        runs.append(current)
    return runs


def bars_svg(items: list[tuple[str, float]], chart_id: str) -> str:
    width, row, left = 520, 22, 190
    height = 10 + row * max(len(items), 1)
    top = max((v for _, v in items), default=1.0)
    scale_max = max(top, 1.05)
    parts = [f'<svg class="chart" id="{chart_id}" width="{width}" height="{height}" role="img">']
    for i, (name, value) in enumerate(items):
        y = 5 + i * row
        bar = (max(value, 1.0) - 1.0) / (scale_max - 1.0) * (width - left - 60)
        parts.append(
            f'<text x="{left - 6}" y="{y + 14}" text-anchor="end" font-size="12">'
            f'{html.escape(name)}</text><rect x="{left}" y="{y + 3}" '
            f'width="{max(bar, 1):.1f}" height="{row - 6}" fill="#e6550d"/>'
            f'<text x="{left + max(bar, 1) + 4:.1f}" y="{y + 14}" font-size="11">'
            f"{value:.3f}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def verdict_html(d: Diagnosis | None, scope: str = "run") -> str:
    """The verdict box of the run or of an episode (`scope`): the same verdict
    (`simulator/verdict.py`) the summary and the JSON carry, its action and the
    escalation's step."""
    if d is None:
        return f'<p class="verdict" data-scope="{scope}" data-cause="">not diagnosed</p>'
    story = verdict_of(d)
    escalation = (
        f"<br>Escalation: <span class='escalation'>{html.escape(escalation_text(d.escalation))}"
        "</span>"
        if d.escalation
        else ""
    )
    return (
        f'<p class="verdict" data-scope="{scope}" data-cause="{html.escape(story.cause)}">'
        f"<b>{html.escape(story.cause)}</b>: <span class='headline'>"
        f"{html.escape(story.headline)}</span><br>Action: "
        f"<span class='action'>{html.escape(story.action_line())}</span>{escalation}</p>"
    )


def _diagnosis_html(d: Diagnosis, heading: str, episode: bool = False) -> str:
    """The advice behind one analysis' verdict; an episode's own verdict first (the run's
    stands at the top of the report)."""
    advice = "".join(
        f"<li><b>{html.escape(a.action)}</b> — predicted speed-up "
        f"{a.predicted_speedup:.3f}×: {html.escape(a.detail)}</li>"
        for a in d.advice
    )
    story = verdict_html(d, "episode") if episode else ""
    return f"<h3>{html.escape(heading)}</h3>{story}<ul>{advice}</ul>"


def _share_tile(name: str, value: float) -> tuple[str, str, str]:
    """A share tile: the share clamped to 0-100 %, the raw number's note, the meaning."""
    clamped = percent(min(max(value, 0.0), 1.0))
    note = raw_note(value, name).strip().removeprefix("(").removesuffix(")")
    return clamped, (note + ". " if note else "") + f"{name}: {MEANINGS[name]}"


def render_report(data: ReportData) -> str:
    r = data.result
    verified = verified_workers(data.diagnosis.evidence if data.diagnosis else None)
    steps = data.step_ids if data.step_ids is not None else [int(s) for s in r.steps]
    slowdowns = (
        data.step_slowdown
        if data.step_slowdown is not None
        else [float(v) for v in r.step_slowdown]
    )
    tiles: list[tuple[str, str] | tuple[str, str, str]] = [
        ("slowdown S", f"{r.slowdown:.3f}", f"S: {MEANINGS['S']}"),
        ("waste", percent(r.waste, 1)),
    ]
    if data.gpu_hours_wasted is not None:
        tiles.append(
            (
                "GPU-hours wasted",
                f"{data.gpu_hours_wasted:,.1f}"
                + (f" of {data.gpu_hours:,.1f}" if data.gpu_hours else ""),
            )
        )
    if data.mfu_actual is not None and data.mfu_ideal is not None:
        tiles.append(
            ("MFU actual / straggler-free", f"{data.mfu_actual:.1%} / {data.mfu_ideal:.1%}")
        )
    tiles.append(("M_W (top workers)", *_share_tile("M_W", r.mw.removed_share)))
    tiles.append(("M_S (last stage)", *_share_tile("M_S", r.ms.removed_share)))
    tiles.append(
        (
            "steps",
            f"{len(steps)}"
            + (f" ({data.incomplete_steps} incomplete)" if data.incomplete_steps else ""),
        )
    )
    tile_html = "".join(
        f'<div class="tile"><div class="k">{html.escape(k)}</div>'
        f'<div class="v">{html.escape(v)}</div>'
        + (f'<div class="m">{html.escape(m[0])}</div>' if m else "")
        + "</div>"
        for k, v, *m in tiles
    )
    diagnosis_html = ""
    if data.diagnosis is not None:
        diagnosis_html = "<h2>Diagnosis</h2>" + _diagnosis_html(
            data.diagnosis, "whole run (verdict above): advice"
        )
        for onset, recovery, episode in data.episodes:
            span = f"steps {onset}–{recovery}" if recovery is not None else f"since step {onset}"
            diagnosis_html += _diagnosis_html(episode, f"slow episode, {span}", episode=True)
    changes_rows = "".join(
        f"<tr><td>{c['step']}</td><td class='{c['kind']}'>{c['kind']}</td>"
        f"<td>{html.escape(str(c['series']))}</td><td>{c.get('before_mean', float('nan')):.4g}"
        f"</td><td>{c.get('after_mean', float('nan')):.4g}</td></tr>"
        for c in data.changes
    )
    changes_html = (
        f"<table><tr><th>step</th><th>kind</th><th>series</th><th>before</th>"
        f"<th>after</th></tr>{changes_rows}</table>"
        if data.changes
        else "<p>No verified change point.</p>"
    )
    timeline_html = ""
    if data.timeline_file:
        timeline_html = (
            f"<h2>Timeline</h2><p>Open <code>{html.escape(data.timeline_file)}"
            f"</code> in <a href='https://ui.perfetto.dev'>ui.perfetto.dev</a> "
            f"(Open trace file): one process per DP rank with the measured ops, and "
            f"one with the ideal step.</p>"
        )
    top = 8
    above_s = [
        f"{prefix}{ranked[0][0]}"
        for att, prefix in ((r.by_optype, ""), (r.by_stage, "pp "), (r.by_dp_rank, "dp "))
        if (ranked := att.ranked()) and ranked[0][1] > r.slowdown + 5e-4
    ]
    above_s_html = (
        f"<p class='sub'>{html.escape(', '.join(above_s))}: {html.escape(ABOVE_S)} "
        f"(S = {r.slowdown:.3f}).</p>"
        if above_s
        else ""
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(data.title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1000px; }}
h1 {{ margin-bottom: 0; }} .sub {{ color: #666; margin-top: 4px; }}
.tiles {{ display: flex; flex-wrap: wrap; gap: 12px; margin: 16px 0; }}
.tile {{ border: 1px solid #ddd; border-radius: 6px; padding: 10px 14px; min-width: 140px; }}
.tile .k {{ color: #666; font-size: 12px; }} .tile .v {{ font-size: 22px; font-weight: 600; }}
.tile .m {{ color: #666; font-size: 11px; max-width: 220px; }}
.verdict {{ background: #fff4e5; border-left: 4px solid #e6550d; padding: 8px 12px; }}
svg.chart text {{ font-family: system-ui, sans-serif; font-size: 11px; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #ddd; padding: 3px 8px; }}
td.onset {{ color: #d62728; }} td.recovery {{ color: #2ca02c; }}
.row {{ display: flex; flex-wrap: wrap; gap: 24px; }}
</style></head><body>
<h1>{html.escape(data.title)}</h1><p class="sub">{html.escape(data.subtitle)}</p>
<div class="tiles">{tile_html}</div>
{verdict_html(data.diagnosis)}
{diagnosis_html}
<h2>Worker heatmap (S_w = min(S_dp, S_stage))</h2>
<p class="sub">S_w: {html.escape(MEANINGS["S_w"])}.</p>
<p class="sub">Solid outline: a worker the diagnosis verified slow on its own; dashed: an S_w
crossing of it (its DP replica or stage), not slow itself.</p>
{heatmap_svg(r.worker_slowdown, verified)}
<h2>Slowdown per step</h2><p>Dashed lines: change points (red onset, green recovery).</p>
{line_svg(steps, slowdowns, data.changes)}
<h2>Change points</h2>{changes_html}
<h2>Attribution (S with only this group straggling)</h2>{above_s_html}
<div class="row"><div><h3>by op type</h3>{bars_svg(r.by_optype.ranked()[:top], "by-optype")}</div>
<div><h3>by stage</h3>{bars_svg(r.by_stage.ranked()[:top], "by-stage")}</div>
<div><h3>by DP rank (top {top})</h3>{bars_svg(r.by_dp_rank.ranked()[:top], "by-dp")}</div></div>
{timeline_html}
</body></html>
"""
