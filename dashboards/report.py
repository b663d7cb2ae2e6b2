"""The self-contained HTML report: one file, no network at view time, for people without
Grafana. Charts are inline SVG (no JavaScript library to fetch).

The markup lives in jinja2 templates (`dashboards/templates/`) rendered with autoescape on:
every value, a job id or a trial name included, is escaped by the template engine. The
charts are template macros too; this module computes their geometry only, so nothing is
passed to a template as raw markup.

A report is either live (rewritten by the embedded host while it runs: the page refreshes
itself) or final; every page says when it and its data were last updated.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import numpy as np

from lagscope.dashboards.colour_scale import ColourScale, colour_scale
from lagscope.dashboards.stragglers import ranked_workers, verified_in_run, verified_workers
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

if TYPE_CHECKING:
    import jinja2


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
    #: Each episode's worker scores S_w ([stage, dp]) over its own steps, in the order of
    #: `episodes` (None where there are none): drawn beside the whole run's heatmap.
    episode_worker_slowdown: list[np.ndarray | None] = field(default_factory=list)
    #: A live page (the embedded host rewrites it while it runs) refreshes itself every
    #: this many seconds; None: the final page, which does not.
    refresh_s: float | None = None
    #: When the page is rendered (epoch seconds; now when None).
    rendered_at: float | None = None
    #: The data's last update: the last closed step the report covers, when the host closed
    #: it and when it ran (its first op's start), in epoch seconds. The last step of
    #: `result` when None.
    last_step: int | None = None
    last_step_closed_at: float | None = None
    last_step_started_at: float | None = None


@functools.cache
def _environment() -> jinja2.Environment:
    import jinja2

    return jinja2.Environment(
        loader=jinja2.PackageLoader("lagscope.dashboards", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def _charts() -> Any:
    """The chart macros of charts.html.j2, callable from Python."""
    return _environment().get_template("charts.html.j2").module


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


def heatmap_view(
    worker_slowdown: np.ndarray,
    verified: list[tuple[int, int]] = (),
    *,
    chart_id: str = "heatmap",
    max_width: int = 900,
) -> dict[str, Any]:
    """The geometry of a worker heatmap (the `heatmap` macro draws it). Cells of
    `verified` workers ((dp, stage)) get a solid outline, S_w crossings of them (same DP
    replica or stage, not verified) a dashed one."""
    n_stages, n_dp = worker_slowdown.shape
    scale = colour_scale(worker_slowdown)
    kinds = {
        (w.dp, w.stage): w.kind
        for w in ranked_workers(worker_slowdown, list(verified), top=worker_slowdown.size)
    }
    cell = max(14, min(48, max_width // max(n_dp, 1)))
    left, top = 60, 20
    width, height = left + n_dp * cell + 10, top + n_stages * cell + 40
    rows = []
    for stage in range(n_stages):
        cells = []
        for dp in range(n_dp):
            value = float(worker_slowdown[stage, dp])
            x, y = left + dp * cell, top + stage * cell
            kind = kinds.get((dp, stage), "unverified")
            cells.append(
                {
                    "x": x,
                    "y": y,
                    "fill": _reds(value, scale),
                    "value": f"{value:.6f}",
                    "kind": kind,
                    "label": f"dp {dp}, pp {stage}: S_w = {value:.4f}"
                    + ("" if kind == "unverified" else f" ({kind})"),
                    "text": scale.label(value) if cell >= 28 else None,
                    "text_x": x + cell / 2,
                    "text_y": y + cell / 2 + 4,
                    "text_fill": "#fff" if scale.position(value) > 0.6 else "#222",
                }
            )
        rows.append(
            {"stage": stage, "x": left - 8, "y": top + stage * cell + cell / 2 + 4, "cells": cells}
        )
    step = max(1, n_dp // 16)
    return {
        "id": chart_id,
        "aria": "worker heatmap",
        "width": width,
        "height": height,
        "size": cell - 1,
        "rows": rows,
        "ticks": [
            {"dp": dp, "x": left + dp * cell + cell / 2, "y": top + n_stages * cell + 14}
            for dp in range(0, n_dp, step)
        ],
        "caption": scale.describe(),
        "caption_x": left + n_dp * cell / 2,
        "caption_y": height - 6,
    }


def heatmap_svg(
    worker_slowdown: np.ndarray,
    verified: list[tuple[int, int]] = (),
    *,
    chart_id: str = "heatmap",
    max_width: int = 900,
) -> str:
    """The worker heatmap as inline SVG (see `heatmap_view`)."""
    view = heatmap_view(worker_slowdown, verified, chart_id=chart_id, max_width=max_width)
    return str(_charts().heatmap(view))


def line_view(steps: list[int], values: list[float], changes: list[dict[str, Any]]) -> dict:
    """The geometry of the per-step slowdown chart, change points as dashed lines."""
    width, height, left, top, bottom = 900, 260, 50, 15, 35
    view: dict[str, Any] = {
        "width": width,
        "height": height,
        "left": left,
        "right": width - 10,
        "top": top,
        "bottom": height - bottom,
        "has_steps": bool(steps),
    }
    if not steps:
        return view
    xs = np.asarray(steps, dtype=float)
    ys = np.asarray(values, dtype=float)
    x0, x1 = float(xs.min()), float(max(xs.max(), xs.min() + 1))
    y0, y1 = min(1.0, float(np.nanmin(ys))), max(1.05, float(np.nanmax(ys)) * 1.02)

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * (width - left - 10)

    def py(y: float) -> float:
        return top + (y1 - y) / (y1 - y0) * (height - top - bottom)

    view["ticks"] = [
        {"y": f"{py(tick):.1f}", "label_y": f"{py(tick) + 4:.1f}", "label": f"{tick:.2f}"}
        for tick in np.linspace(y0, y1, 5)
    ]
    view["changes"] = [
        {
            "x": f"{px(float(change['step'])):.1f}",
            "colour": "#d62728" if change["kind"] == "onset" else "#2ca02c",
            "label": f"{change['kind']} at step {change['step']} ({change['series']})",
        }
        for change in changes
    ]
    view["runs"] = [
        " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in run) for run in sampled_runs(xs, ys)
    ]
    view["first"], view["last"] = int(x0), int(x1)
    return view


def line_svg(steps: list[int], values: list[float], changes: list[dict[str, Any]]) -> str:
    return str(_charts().line(line_view(steps, values, changes)))


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


def bars_view(items: list[tuple[str, float]], chart_id: str) -> dict[str, Any]:
    """The geometry of an attribution bar chart (S with only this group straggling)."""
    width, row, left = 520, 22, 190
    top = max((v for _, v in items), default=1.0)
    scale_max = max(top, 1.05)
    bars = []
    for i, (name, value) in enumerate(items):
        bar = max((max(value, 1.0) - 1.0) / (scale_max - 1.0) * (width - left - 60), 1)
        bars.append(
            {
                "name": name,
                "y": 5 + i * row,
                "width": f"{bar:.1f}",
                "value_x": f"{left + bar + 4:.1f}",
                "value": f"{value:.3f}",
            }
        )
    return {
        "id": chart_id,
        "width": width,
        "height": 10 + row * max(len(items), 1),
        "row": row,
        "left": left,
        "bars": bars,
    }


def bars_svg(items: list[tuple[str, float]], chart_id: str) -> str:
    return str(_charts().bars(bars_view(items, chart_id)))


def verdict_view(d: Diagnosis | None, recovered_at: int | None = None) -> dict[str, str] | None:
    """The verdict of the run or of an episode: the same verdict (`simulator/verdict.py`)
    the summary and the JSON carry, its action and the escalation's step."""
    if d is None:
        return None
    story = verdict_of(d, recovered_at)
    return {
        "cause": story.cause,
        "headline": story.headline,
        "action": story.action_line(),
        "escalation": escalation_text(d.escalation) if d.escalation else "",
    }


def verdict_html(d: Diagnosis | None, scope: str = "run") -> str:
    """The verdict box of the run or of an episode (`scope`)."""
    macros = _environment().get_template("verdict.html.j2").module
    return str(macros.verdict(verdict_view(d), scope))


def _diagnosis_view(
    d: Diagnosis, heading: str, episode: bool = False, recovered_at: int | None = None
) -> dict[str, Any]:
    """The advice behind one analysis' verdict; an episode's own verdict first (the run's
    stands at the top of the report)."""
    return {
        "heading": heading,
        "verdict": verdict_view(d, recovered_at) if episode else None,
        "advice": [
            {"action": a.action, "speedup": f"{a.predicted_speedup:.3f}", "detail": a.detail}
            for a in d.advice
        ],
    }


def _share_tile(name: str, value: float) -> tuple[str, str]:
    """A share tile: the share clamped to 0-100 %, the raw number's note and the meaning."""
    clamped = percent(min(max(value, 0.0), 1.0))
    note = raw_note(value, name).strip().removeprefix("(").removesuffix(")")
    return clamped, (note + ". " if note else "") + f"{name}: {MEANINGS[name]}"


def _utc(seconds: float) -> tuple[str, str]:
    """A time as people read it (UTC, to the second) and as ISO 8601 (to the millisecond)."""
    moment = datetime.fromtimestamp(seconds, UTC)
    return (
        moment.strftime("%Y-%m-%d %H:%M:%S UTC"),
        moment.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
    )


def _updated_view(data: ReportData, steps: list[int]) -> dict[str, Any]:
    """Whether the page is live (and how often it refreshes) and when it and its data were
    last updated."""
    rendered, rendered_iso = _utc(data.rendered_at if data.rendered_at is not None else time.time())
    last_step = data.last_step if data.last_step is not None else (max(steps) if steps else None)
    closed, closed_iso = _utc(data.last_step_closed_at) if data.last_step_closed_at else ("", "")
    started = _utc(data.last_step_started_at)[0] if data.last_step_started_at else ""
    refresh = max(1, math.ceil(data.refresh_s)) if data.refresh_s else None
    return {
        "state": "live" if refresh else "final",
        "refresh_s": refresh,
        "rendered": rendered,
        "rendered_iso": rendered_iso,
        "last_step": last_step,
        "closed": closed,
        "closed_iso": closed_iso,
        "started": started,
    }


def _span(onset: int, recovery: int | None) -> str:
    return f"steps {onset}–{recovery}" if recovery is not None else f"since step {onset}"


def render_report(data: ReportData) -> str:
    r = data.result
    verified = verified_in_run(
        data.diagnosis.evidence if data.diagnosis else None,
        [diagnosis.evidence for _, _, diagnosis in data.episodes],
    )
    steps = data.step_ids if data.step_ids is not None else [int(s) for s in r.steps]
    slowdowns = (
        data.step_slowdown
        if data.step_slowdown is not None
        else [float(v) for v in r.step_slowdown]
    )
    tiles: list[dict[str, str]] = [
        {"key": "slowdown S", "value": f"{r.slowdown:.3f}", "meaning": f"S: {MEANINGS['S']}"},
        {"key": "waste", "value": percent(r.waste, 1)},
    ]
    if data.gpu_hours_wasted is not None:
        tiles.append(
            {
                "key": "GPU-hours wasted",
                "value": f"{data.gpu_hours_wasted:,.1f}"
                + (f" of {data.gpu_hours:,.1f}" if data.gpu_hours else ""),
            }
        )
    if data.mfu_actual is not None and data.mfu_ideal is not None:
        tiles.append(
            {
                "key": "MFU actual / straggler-free",
                "value": f"{data.mfu_actual:.1%} / {data.mfu_ideal:.1%}",
            }
        )
    for key, name, value in (
        ("M_W (top workers)", "M_W", r.mw.removed_share),
        ("M_S (last stage)", "M_S", r.ms.removed_share),
    ):
        shown, meaning = _share_tile(name, value)
        tiles.append({"key": key, "value": shown, "meaning": meaning})
    tiles.append(
        {
            "key": "steps",
            "value": f"{len(steps)}"
            + (f" ({data.incomplete_steps} incomplete)" if data.incomplete_steps else ""),
        }
    )
    for tile in tiles:
        tile.setdefault("meaning", "")
    diagnoses = []
    if data.diagnosis is not None:
        diagnoses.append(_diagnosis_view(data.diagnosis, "whole run (verdict above): advice"))
        for onset, recovery, episode in data.episodes:
            diagnoses.append(
                _diagnosis_view(
                    episode, f"slow episode, {_span(onset, recovery)}", True, recovered_at=recovery
                )
            )
    episode_heatmaps = []
    for i, ((onset, recovery, episode), worker_slowdown) in enumerate(
        zip(data.episodes, data.episode_worker_slowdown, strict=False), start=1
    ):
        if worker_slowdown is None:
            continue
        view = heatmap_view(
            worker_slowdown,
            verified_workers(episode.evidence),
            chart_id=f"heatmap-episode-{i}",
            max_width=440,
        )
        view["heading"] = f"slow episode, {_span(onset, recovery)}"
        view["onset"] = onset
        episode_heatmaps.append(view)
    run_heatmap = heatmap_view(
        r.worker_slowdown, verified, max_width=440 if episode_heatmaps else 900
    )
    run_heatmap["heading"] = f"whole run, {_span(steps[0], steps[-1])}" if steps else "whole run"
    top = 8
    above_s = [
        f"{prefix}{ranked[0][0]}"
        for att, prefix in ((r.by_optype, ""), (r.by_stage, "pp "), (r.by_dp_rank, "dp "))
        if (ranked := att.ranked()) and ranked[0][1] > r.slowdown + 5e-4
    ]
    context = {
        "title": data.title,
        "subtitle": data.subtitle,
        "updated": _updated_view(data, steps),
        "tiles": tiles,
        "verdict": verdict_view(data.diagnosis),
        "diagnoses": diagnoses,
        "meanings": MEANINGS,
        "run_heatmap": run_heatmap,
        "episode_heatmaps": episode_heatmaps,
        "step_chart": line_view(steps, slowdowns, data.changes),
        "changes": [
            {
                "step": c["step"],
                "kind": c["kind"],
                "series": str(c["series"]),
                "before": f"{c.get('before_mean', float('nan')):.4g}",
                "after": f"{c.get('after_mean', float('nan')):.4g}",
            }
            for c in data.changes
        ],
        "above_s": ", ".join(above_s),
        "above_s_reason": ABOVE_S,
        "slowdown": f"{r.slowdown:.3f}",
        "top": top,
        "bars": {
            "optype": bars_view(r.by_optype.ranked()[:top], "by-optype"),
            "stage": bars_view(r.by_stage.ranked()[:top], "by-stage"),
            "dp": bars_view(r.by_dp_rank.ranked()[:top], "by-dp"),
        },
        "timeline_file": data.timeline_file,
    }
    return _environment().get_template("report.html.j2").render(context)
