"""The geometry of the HTML report's worker heatmaps, at any job size (the markup is the
`worker_heatmap` macro of templates/charts.html.j2).

Up to about 70 DP ranks every worker has its own cell. Beyond that the overview bins
consecutive DP ranks (`worker_grid.py`), each cell its worst worker, and the reader drills
down without a script: a binned cell links to its DP ranks' own heatmap, kept in a
`<details>` element the browser opens on the link. Beside a binned overview stand the worst
DP replicas at full resolution and a table of the highest-scoring workers (with their
machines, when the host knows them). Colours are on the fixed S_w 1.0-1.5 scale with the
job's own range stated (`colour_scale.py`); a label is drawn only where it fits, so no two
overlap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from lagscope.dashboards.colour_scale import FIXED_HIGH, FIXED_LOW, ColourScale, colour_scale
from lagscope.dashboards.stragglers import RankedWorker, others_than, ranked_workers
from lagscope.dashboards.worker_grid import (
    WorkerGrid,
    bin_workers,
    nice_step,
    text_width,
    worst_dp_ranks,
    worst_of_replicas,
)
from lagscope.simulator.summary import Others

#: A cell's least and largest side (px): below 12 a cell is a hairline a pointer cannot
#: hit, above 44 a small job's picture is mostly colour.
CELL_MIN, CELL_MAX = 12, 44
#: Rows are at least this tall, so a row label (AXIS_FONT) fits beside each.
ROW_MIN = 16
#: Stages beyond this many are binned too.
MAX_ROWS = 64
CELL_FONT, AXIS_FONT = 10, 11
#: DP replicas in a binned job's "worst" heatmap, and workers in its table.
WORST_DP, TOP_WORKERS = 16, 10
#: The Reds stops from white to dark red.
_REDS = ((255, 245, 240), (252, 146, 114), (222, 45, 38), (103, 0, 13))


def fill(value: float, scale: ColourScale) -> str:
    """Colour of a heatmap cell on `scale`: near white at its low end, dark red at its high.

    >>> scale = colour_scale(np.array([1.0, 1.5]))
    >>> fill(1.0, scale), fill(1.5, scale), fill(float("nan"), scale)
    ('#fff5f0', '#67000d', '#eeeeee')
    """
    if not np.isfinite(value):
        return "#eeeeee"
    pos = scale.position(value) * (len(_REDS) - 1)
    i = min(int(pos), len(_REDS) - 2)
    f = pos - i
    r, g, b = (round(a + (c - a) * f) for a, c in zip(_REDS[i], _REDS[i + 1], strict=True))
    return f"#{r:02x}{g:02x}{b:02x}"


def cell_kinds(shape: tuple[int, int], verified: Sequence[tuple[int, int]]) -> np.ndarray:
    """[stage, dp] "verified" for the verified workers ((dp, stage)), "crossing" for the
    other workers of their DP replicas and stages, "unverified" for the rest (as
    `stragglers.ranked_workers` marks them)."""
    kinds = np.full(shape, "unverified", dtype=object)
    inside = [(dp, stage) for dp, stage in verified if stage < shape[0] and dp < shape[1]]
    for dp, stage in inside:
        kinds[stage, :] = "crossing"
        kinds[:, dp] = "crossing"
    for dp, stage in inside:
        kinds[stage, dp] = "verified"
    return kinds


def _bin_kind(kinds: np.ndarray) -> str:
    """A bin is verified when it holds a verified worker, else a crossing when it holds
    one."""
    for kind in ("verified", "crossing"):
        if (kinds == kind).any():
            return kind
    return "unverified"


def _span_text(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}–{last}"


def grid_chart(
    chart_id: str,
    values: np.ndarray,
    *,
    titles: list[list[str]],
    kinds: list[list[str]],
    row_names: list[str],
    column_names: list[str],
    scale: ColourScale,
    max_width: int,
    axis_title: str,
    links: list[str | None] | None = None,
    every_column_named: bool = False,
) -> dict[str, Any]:
    """The geometry of one heatmap of `values` ([row, column]): cells as large as
    `max_width` allows, a cell's value written in it only where it fits, row labels and
    column ticks spaced so no two labels overlap (`every_column_named`: the columns are not
    consecutive, so each is named, and no more columns are drawn than names fit)."""
    n_rows, n_columns = values.shape
    left = math.ceil(max(text_width(name, AXIS_FONT) for name in row_names)) + 10
    cell = int(min(CELL_MAX, max(CELL_MIN, (max_width - left - 12) // max(n_columns, 1))))
    row = max(ROW_MIN, min(cell, CELL_MAX))
    name_width = max(text_width(name, AXIS_FONT) for name in column_names)
    # Every k-th column is named, k a 1-2-5 step wide enough for a name and a space.
    every = 1 if every_column_named else max(1, int(nice_step((name_width + 8) / cell)))
    top = 4
    cells = [
        _cell(
            float(values[r, c]),
            left + c * cell,
            top + r * row,
            (cell, row),
            scale,
            kind=kinds[r][c],
            title=titles[r][c],
            href=links[c] if links else None,
        )
        for r in range(n_rows)
        for c in range(n_columns)
    ]
    ticks_y = top + n_rows * row + AXIS_FONT + 2
    ticks = [
        {"x": left + c * cell + (cell - 1) / 2, "y": ticks_y, "text": column_names[c]}
        for c in range(0, n_columns, every)
    ]
    width = left + n_columns * cell + max(10, name_width / 2)
    return {
        "id": chart_id,
        "width": round(width),
        "height": ticks_y + AXIS_FONT + 8,
        "cell_width": cell - 1,
        "cell_height": row - 1,
        "cells": cells,
        "rows": _row_labels(row_names, left, top, row),
        "ticks": ticks,
        "axis_title": axis_title,
        "axis_x": left + n_columns * cell / 2,
        "axis_y": ticks_y + AXIS_FONT + 5,
    }


def _row_labels(row_names: list[str], left: int, top: int, row: int) -> list[dict[str, Any]]:
    """Each row's name, right-aligned before the row, centred on it."""
    return [
        {
            "x": left - 6,
            "y": round(top + r * row + (row - 1) / 2 + AXIS_FONT * 0.35, 1),
            "text": name,
        }
        for r, name in enumerate(row_names)
    ]


def _cell(
    value: float,
    x: float,
    y: float,
    size: tuple[int, int],
    scale: ColourScale,
    *,
    kind: str,
    title: str,
    href: str | None,
) -> dict[str, Any]:
    """One cell of a grid chart at (x, y), `size` (width, height) with its gap: its value
    written in it only where it fits."""
    cell, row = size
    text = scale.label(value) if np.isfinite(value) else None
    fits = text is not None and text_width(text, CELL_FONT) + 4 <= cell - 1
    return {
        "x": x,
        "y": y,
        "fill": fill(value, scale),
        "value": f"{value:.6f}",
        "kind": kind,
        "stroke": max(1.5, min(3.0, cell / 12)),
        "title": title,
        "text": text if fits and row >= CELL_FONT + 4 else None,
        "text_x": x + (cell - 1) / 2,
        "text_y": round(y + (row - 1) / 2 + CELL_FONT * 0.35, 1),
        "light": scale.position(value) > 0.6,
        "href": href,
    }


def legend_view(scale: ColourScale, chart_id: str, width: int = 360) -> dict[str, Any]:
    """A colour bar of the fixed scale, ticked every 0.1, with the job's own range
    bracketed above it and named."""
    x0, x1, bar_y, bar_h = 12, width - 12, 24, 10

    def at(value: float) -> float:
        return x0 + scale.position(value) * (x1 - x0)

    ticks = [
        {"x": round(at(v), 1), "text": f"{v:.1f}"}
        for v in np.round(np.arange(FIXED_LOW, FIXED_HIGH + 1e-9, 0.1), 1).tolist()
    ]
    view: dict[str, Any] = {
        "id": chart_id,
        "width": width,
        "height": bar_y + bar_h + AXIS_FONT + 8,
        "x0": x0,
        "bar_width": x1 - x0,
        "bar_y": bar_y,
        "bar_height": bar_h,
        "stops": [
            {"offset": f"{i / (len(_REDS) - 1):.3f}", "colour": "rgb({},{},{})".format(*rgb)}
            for i, rgb in enumerate(_REDS)
        ],
        "ticks": ticks,
        "tick_y": bar_y + bar_h + AXIS_FONT + 2,
        "job": None,
    }
    if np.isfinite(scale.job_low):
        a, b = at(scale.job_low), max(at(scale.job_high), at(scale.job_low) + 2)
        text = f"this job: {scale.label(scale.job_low)} to {scale.label(scale.job_high)}"
        half = text_width(text, AXIS_FONT) / 2
        view["job"] = {
            "x1": round(a, 1),
            "x2": round(b, 1),
            "y": bar_y - 3,
            "text": text,
            "text_x": round(min(max((a + b) / 2, half + 2), width - half - 2), 1),
            "text_y": bar_y - 9,
        }
    return view


def _worker_title(dp: int, stage: int, value: float, kind: str, machine: str | None) -> str:
    return (
        f"dp {dp}, pp {stage}: S_w = {value:.4f}"
        + ("" if kind == "unverified" else f" ({kind})")
        + (f" on {machine}" if machine else "")
    )


def _full_chart(
    chart_id: str,
    worker_slowdown: np.ndarray,
    dp_ranks: list[int],
    kinds: np.ndarray,
    scale: ColourScale,
    max_width: int,
    machines: Mapping[tuple[int, int], str],
    *,
    axis_title: str = "DP rank",
    every_column_named: bool = False,
) -> dict[str, Any]:
    """A heatmap of every stage of `dp_ranks`, one cell per worker."""
    values = worker_slowdown[:, dp_ranks]
    n_stages = values.shape[0]
    return grid_chart(
        chart_id,
        values,
        titles=[
            [
                _worker_title(dp, s, float(values[s, c]), kinds[s, dp], machines.get((dp, s)))
                for c, dp in enumerate(dp_ranks)
            ]
            for s in range(n_stages)
        ],
        kinds=[[kinds[s, dp] for dp in dp_ranks] for s in range(n_stages)],
        row_names=[f"pp {s}" for s in range(n_stages)],
        column_names=[str(dp) for dp in dp_ranks],
        scale=scale,
        max_width=max_width,
        axis_title=axis_title,
        every_column_named=every_column_named,
    )


def _binned_chart(
    chart_id: str,
    grid: WorkerGrid,
    kinds: np.ndarray,
    scale: ColourScale,
    max_width: int,
    links: list[str | None] | None,
) -> dict[str, Any]:
    """The overview of a binned job: each cell the worst worker of its DP ranks (and
    stages), named in its tooltip."""
    rows, columns = grid.values.shape
    titles, bin_kinds = [], []
    for r in range(rows):
        s0, s1 = grid.stage_span(r)
        titles.append([])
        bin_kinds.append([])
        for c in range(columns):
            d0, d1 = grid.dp_span(c)
            kind = _bin_kind(kinds[s0 : s1 + 1, d0 : d1 + 1])
            dp, stage = int(grid.worst_dp[r, c]), int(grid.worst_stage[r, c])
            titles[r].append(
                f"dp {_span_text(d0, d1)}, pp {_span_text(s0, s1)}: worst S_w = "
                f"{grid.values[r, c]:.4f} (dp {dp}, pp {stage})"
                + ("" if kind == "unverified" else f"; holds a {kind} worker")
            )
            bin_kinds[r].append(kind)
    return grid_chart(
        chart_id,
        grid.values,
        titles=titles,
        kinds=bin_kinds,
        row_names=[f"pp {_span_text(*grid.stage_span(r))}" for r in range(rows)],
        column_names=[str(grid.dp_span(c)[0]) for c in range(columns)],
        scale=scale,
        max_width=max_width,
        axis_title=f"DP rank (a column: {grid.dp_per_bin} DP ranks, named by the first)",
        links=links,
    )


def heatmap_view(
    worker_slowdown: np.ndarray,
    verified: Sequence[tuple[int, int]] = (),
    *,
    chart_id: str = "heatmap",
    max_width: int = 900,
    machines: Mapping[tuple[int, int], str] | None = None,
    drill_down: bool = False,
) -> dict[str, Any]:
    """Everything the `worker_heatmap` macro draws of one [stage, dp] S_w matrix: the
    overview (binned when the job is too wide for a cell per worker), the colour legend
    and, for a binned job, the worst DP replicas, the top workers and (`drill_down`) a
    heatmap of every bin's own DP ranks. Verified workers ((dp, stage)) get a solid
    outline, their S_w crossings (same DP replica or stage) a dashed one."""
    machines = machines or {}
    scale = colour_scale(worker_slowdown)
    n_stages, n_dp = worker_slowdown.shape
    kinds = cell_kinds((n_stages, n_dp), verified)
    left = text_width(f"pp {n_stages - 1}", AXIS_FONT) + 10
    grid = bin_workers(worker_slowdown, int((max_width - left - 12) // CELL_MIN), MAX_ROWS)
    view: dict[str, Any] = {
        "id": chart_id,
        "fixed": scale.fixed_text(),
        "job": scale.job_text(),
        "legend": legend_view(scale, f"{chart_id}-legend", width=min(max_width, 360)),
        "binned": grid.binned,
        "worst": None,
        "top_workers": [],
        "groups": [],
    }
    ranked = ranked_workers(worker_slowdown, list(verified), top=TOP_WORKERS)
    top_workers = _top_workers(ranked, scale, machines)
    others = others_than(worker_slowdown, ranked)
    view["top_others"] = others.text("workers", "S_w") if others else ""
    view["show_machines"] = bool(machines)
    if not grid.binned:
        view["chart"] = _full_chart(
            chart_id, worker_slowdown, list(range(n_dp)), kinds, scale, max_width, machines
        )
        # Where the cells are too small for their values, the table gives the top ones.
        if any(c["text"] is None for c in view["chart"]["cells"]):
            view["top_workers"] = top_workers
        return view
    view["top_workers"] = top_workers
    parts = _binned_parts(
        chart_id,
        worker_slowdown,
        verified,
        grid,
        kinds,
        scale,
        max_width,
        machines,
        left,
        drill_down=drill_down,
    )
    view.update(parts)
    return view


def _binned_parts(
    chart_id: str,
    worker_slowdown: np.ndarray,
    verified: Sequence[tuple[int, int]],
    grid: WorkerGrid,
    kinds: np.ndarray,
    scale: ColourScale,
    max_width: int,
    machines: Mapping[tuple[int, int], str],
    left: float,
    *,
    drill_down: bool,
) -> dict[str, Any]:
    """What a binned job's heatmap shows beside the binned overview: the worst DP replicas
    worker by worker, and (`drill_down`) every bin's own DP ranks."""
    n_stages, n_dp = worker_slowdown.shape
    parts: dict[str, Any] = {}
    columns = grid.values.shape[1]
    links: list[str | None] | None = None
    if drill_down:
        # To the group's chart, inside its <details>: the browser opens the ancestors of
        # the target of a link.
        links = [f"#{chart_id}-dp-{grid.dp_span(c)[0]}-chart" for c in range(columns)]
    parts["chart"] = _binned_chart(chart_id, grid, kinds, scale, max_width, links)
    parts["binning"] = (
        f"{n_dp:,} DP ranks x {n_stages} stages: each cell is the worst worker of "
        f"{grid.dp_per_bin} consecutive DP ranks"
        + (f" and {grid.stages_per_bin} stages" if grid.stages_per_bin > 1 else "")
        + (", and opens their own heatmap" if drill_down else "")
    )
    # As many of the worst DP replicas as their names fit across the width.
    name_width = text_width(str(n_dp - 1), AXIS_FONT) + 8
    fit = int((max_width - left - 12) // max(name_width, CELL_MIN))
    worst = worst_dp_ranks(worker_slowdown, min(WORST_DP, fit), [dp for dp, _ in verified])
    parts["worst_heading"] = (
        f"The {len(worst)} DP replicas with the highest S_w, every worker (worst first)"
    )
    # Their worst workers against the other replicas' worst: 15 replicas as slow as the
    # 1,544 others are no stragglers.
    others = Others.of(np.delete(worst_of_replicas(worker_slowdown), worst))
    parts["worst_others"] = (
        others.text("DP replicas", "worst worker's S_w") if others is not None else ""
    )
    parts["worst"] = _worst_replicas_chart(
        chart_id, worker_slowdown, worst, kinds, scale, max_width, machines
    )
    if drill_down:
        parts["groups_heading"] = (
            f"Every worker: {columns} groups of {grid.dp_per_bin} DP ranks (open one, or "
            "click its column above)"
        )
        parts["groups"] = [
            _dp_group(chart_id, worker_slowdown, grid.dp_span(c), kinds, scale, max_width, machines)
            for c in range(columns)
        ]
    return parts


def _worst_replicas_chart(
    chart_id: str,
    worker_slowdown: np.ndarray,
    worst: list[int],
    kinds: np.ndarray,
    scale: ColourScale,
    max_width: int,
    machines: Mapping[tuple[int, int], str],
) -> dict[str, Any]:
    """Every worker of the worst DP replicas, each column named."""
    return _full_chart(
        f"{chart_id}-worst",
        worker_slowdown,
        worst,
        kinds,
        scale,
        max_width,
        machines,
        axis_title="DP rank",
        every_column_named=True,
    )


def _top_workers(
    ranked: list[RankedWorker], scale: ColourScale, machines: Mapping[tuple[int, int], str]
) -> list[dict[str, Any]]:
    """The table of the top workers, verified ones first, each with its machine."""
    return [
        {
            "dp": w.dp,
            "stage": w.stage,
            "value": scale.label(w.worker_slowdown),
            "kind": w.kind,
            "machine": machines.get((w.dp, w.stage), ""),
        }
        for w in ranked
    ]


def _dp_group(
    chart_id: str,
    worker_slowdown: np.ndarray,
    dp_span: tuple[int, int],
    kinds: np.ndarray,
    scale: ColourScale,
    max_width: int,
    machines: Mapping[tuple[int, int], str],
) -> dict[str, Any]:
    """The drill-down of one bin of DP ranks: its worst worker named, every worker drawn."""
    d0, d1 = dp_span
    block = worker_slowdown[:, d0 : d1 + 1]
    if np.isfinite(block).any():
        stage, offset = np.unravel_index(np.nanargmax(block), block.shape)
    else:
        stage, offset = 0, 0
    dp, stage = d0 + int(offset), int(stage)
    kind = kinds[stage, dp]
    return {
        "id": f"{chart_id}-dp-{d0}",
        "summary": f"dp {_span_text(d0, d1)}: worst S_w "
        f"{scale.label(float(block[stage, offset]))} (dp {dp}, pp {stage})"
        + ("" if kind == "unverified" else f", {kind}"),
        "chart": _full_chart(
            f"{chart_id}-dp-{d0}-chart",
            worker_slowdown,
            list(range(d0, d1 + 1)),
            kinds,
            scale,
            max_width,
            machines,
        ),
    }
