"""The self-contained HTML report: one file, no network at view time, for people without
Grafana. Charts are inline SVG (no JavaScript library to fetch).

The markup lives in jinja2 templates (`dashboards/templates/`) rendered with autoescape on:
every value, a job id or a trial name included, is escaped by the template engine. The
charts are template macros too, and Python computes their geometry only (the heatmaps in
`heatmap_views.py`, readable from 8 to 100,000 GPUs; the step chart in `step_chart.py`),
so nothing is passed to a template as raw markup.

A report is either live (rewritten by the embedded host while it runs: the page refreshes
itself) or final; every page says when it and its data were last updated.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import numpy as np

from lagscope.dashboards.heatmap_views import heatmap_view
from lagscope.dashboards.step_chart import line_view, sampled_runs
from lagscope.dashboards.stragglers import verified_in_run, verified_workers
from lagscope.simulator.diagnose import Diagnosis
from lagscope.simulator.summary import others_after
from lagscope.simulator.verdict import (
    ABOVE_S,
    MEANINGS,
    escalation_text,
    percent,
    raw_note,
    verdict_of,
)
from lagscope.simulator.whatif import Attribution, WhatIfResult

if TYPE_CHECKING:
    import jinja2

__all__ = ["ReportData", "heatmap_svg", "line_svg", "line_view", "render_report", "sampled_runs"]


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
    #: The machine of each (dp, pp) worker, where the host knows it (`MachineBook`): a
    #: large job's table of its worst workers names them.
    worker_machines: Mapping[tuple[int, int], str] | None = None
    #: What the timeline file holds of the job, when it holds a part (steps, DP ranks).
    timeline_note: str | None = None


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


def heatmap_svg(
    worker_slowdown: np.ndarray,
    verified: Sequence[tuple[int, int]] = (),
    *,
    chart_id: str = "heatmap",
    max_width: int = 900,
    drill_down: bool = False,
) -> str:
    """The worker heatmap as inline SVG with its legend and, for a large job, its binned
    views (see `heatmap_views.heatmap_view`)."""
    view = heatmap_view(
        worker_slowdown, verified, chart_id=chart_id, max_width=max_width, drill_down=drill_down
    )
    return str(_charts().worker_heatmap(view))


def line_svg(steps: list[int], values: list[float], changes: list[dict[str, Any]]) -> str:
    return str(_charts().line(line_view(steps, values, changes)))


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


def _family_bars(
    att: Attribution, top: int, chart_id: str, title: str, noun: str
) -> dict[str, Any]:
    """A family's bar chart of its `top` groups, titled with how many it has, and where
    the groups it leaves out lie."""
    ranked = att.ranked()
    others = others_after(att, top)
    return {
        **bars_view(ranked[:top], chart_id),
        "title": f"{title} (top {top} of {len(ranked):,})" if others else title,
        "others": others.text(noun) if others else "",
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
    steps = data.step_ids if data.step_ids is not None else [int(s) for s in r.steps]
    slowdowns = (
        data.step_slowdown
        if data.step_slowdown is not None
        else [float(v) for v in r.step_slowdown]
    )
    episode_heatmaps = _episode_heatmaps(data)
    top = 8
    context = {
        "title": data.title,
        "subtitle": data.subtitle,
        "updated": _updated_view(data, steps),
        "tiles": _tiles(data, len(steps)),
        "verdict": verdict_view(data.diagnosis),
        "diagnoses": _diagnosis_views(data),
        "meanings": MEANINGS,
        "run_heatmap": _run_heatmap(data, steps, beside_episodes=bool(episode_heatmaps)),
        "episode_heatmaps": episode_heatmaps,
        "step_chart": line_view(steps, slowdowns, data.changes),
        "changes": [_change_view(c) for c in data.changes],
        "above_s": ", ".join(_above_s(r)),
        "above_s_reason": ABOVE_S,
        "slowdown": f"{r.slowdown:.3f}",
        "bars": {
            "optype": _family_bars(r.by_optype, top, "by-optype", "by op type", "op types"),
            "stage": _family_bars(r.by_stage, top, "by-stage", "by stage", "stages"),
            "dp": _family_bars(r.by_dp_rank, top, "by-dp", "by DP rank", "DP ranks"),
        },
        "timeline_file": data.timeline_file,
        "timeline_note": data.timeline_note,
    }
    return _environment().get_template("report.html.j2").render(context)


def _tiles(data: ReportData, n_steps: int) -> list[dict[str, str]]:
    """The headline figures: slowdown, waste, GPU-hours, MFU, M_W, M_S, steps."""
    r = data.result
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
            "value": f"{n_steps}"
            + (f" ({data.incomplete_steps} incomplete)" if data.incomplete_steps else ""),
        }
    )
    for tile in tiles:
        tile.setdefault("meaning", "")
    return tiles


def _diagnosis_views(data: ReportData) -> list[dict[str, Any]]:
    """The run's advice, then each episode's."""
    if data.diagnosis is None:
        return []
    views = [_diagnosis_view(data.diagnosis, "whole run (verdict above): advice")]
    for onset, recovery, episode in data.episodes:
        views.append(
            _diagnosis_view(
                episode, f"slow episode, {_span(onset, recovery)}", True, recovered_at=recovery
            )
        )
    return views


def _episode_heatmaps(data: ReportData) -> list[dict[str, Any]]:
    """A heatmap of the worker scores over each episode's own steps, where known."""
    views = []
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
            machines=data.worker_machines,
        )
        view["heading"] = f"slow episode, {_span(onset, recovery)}"
        view["onset"] = onset
        views.append(view)
    return views


def _run_heatmap(data: ReportData, steps: list[int], *, beside_episodes: bool) -> dict[str, Any]:
    """The whole run's heatmap, the verified workers marked; narrower beside episodes'."""
    verified = verified_in_run(
        data.diagnosis.evidence if data.diagnosis else None,
        [diagnosis.evidence for _, _, diagnosis in data.episodes],
    )
    view = heatmap_view(
        data.result.worker_slowdown,
        verified,
        max_width=440 if beside_episodes else 900,
        machines=data.worker_machines,
        drill_down=True,
    )
    view["heading"] = f"whole run, {_span(steps[0], steps[-1])}" if steps else "whole run"
    return view


def _above_s(r: WhatIfResult) -> list[str]:
    """The groups whose S_X is above S (the rest of the job, idealised, runs slower)."""
    return [
        f"{prefix}{ranked[0][0]}"
        for att, prefix in ((r.by_optype, ""), (r.by_stage, "pp "), (r.by_dp_rank, "dp "))
        if (ranked := att.ranked()) and ranked[0][1] > r.slowdown + 5e-4
    ]


def _change_view(change: dict[str, Any]) -> dict[str, Any]:
    return {
        "step": change["step"],
        "kind": change["kind"],
        "series": str(change["series"]),
        "before": f"{change.get('before_mean', float('nan')):.4g}",
        "after": f"{change.get('after_mean', float('nan')):.4g}",
    }
