"""The DP x PP worker heatmap as an image (cell = worker slowdown S_w): Reds on the fixed
S_w 1.0-1.5 scale with the job's own range stated and marked on the colour bar
(`dashboards/colour_scale.py`). A job wider than MAX_COLUMNS DP ranks is binned, each
column the worst of its consecutive DP ranks (`dashboards/worker_grid.py`); cells are
annotated only where the label fits, and ticks are thinned so that none overlap."""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from lagscope.dashboards.colour_scale import ColourScale, colour_scale
from lagscope.dashboards.worker_grid import WorkerGrid, bin_workers, nice_step

#: The most columns and rows drawn; wider jobs are binned.
MAX_COLUMNS, MAX_ROWS = 64, 64
#: Cells are annotated up to this many columns (a label then has 0.55 in of width).
MAX_ANNOTATED_COLUMNS = 32
DPI = 110
FONT_PT = 9


def draw_worker_heatmap(
    worker_slowdown: np.ndarray,
    path: str | Path | BinaryIO,
    *,
    image_format: str | None = None,
    dp_size: int | None = None,
    pp_size: int | None = None,
    title: str = "worker slowdown S_w",
) -> None:
    """Draw `worker_slowdown` ([stage, dp]) into a file or binary stream, as PNG unless
    `image_format` (or the path's suffix) says otherwise; cells beyond the data stay blank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_stages, n_dp = worker_slowdown.shape
    full = np.full((max(pp_size or 0, n_stages), max(dp_size or 0, n_dp)), np.nan)
    full[:n_stages, :n_dp] = worker_slowdown
    scale = colour_scale(full)
    grid = bin_workers(full, MAX_COLUMNS, MAX_ROWS)
    rows, cols = grid.values.shape
    width_in = min(2.5 + 0.55 * cols, 24)
    fig, ax = plt.subplots(figsize=(width_in, 1.9 + 0.45 * rows))
    image = ax.imshow(
        grid.values,
        cmap="Reds",
        vmin=scale.low,
        vmax=scale.high,
        aspect="auto",
        interpolation="nearest",
    )
    if cols <= MAX_ANNOTATED_COLUMNS:
        _annotate_cells(ax, grid.values, scale)
    _label_axes(ax, grid, width_in, n_dp)
    ax.set_title(f"{title}\n{scale.fixed_text()}; {scale.job_text()}", fontsize=10)
    bar = fig.colorbar(image, ax=ax, fraction=0.03)
    bar.set_ticks(np.round(np.arange(scale.low, scale.high + 1e-9, 0.1), 1))
    if np.isfinite(scale.job_low):
        # The job's own range, bracketed on the colour bar.
        for value in (scale.job_low, scale.job_high):
            bar.ax.axhline(min(max(value, scale.low), scale.high), color="black", linewidth=1.5)
    fig.tight_layout()
    target = Path(path) if isinstance(path, str | Path) else path
    fig.savefig(target, dpi=DPI, format=image_format)
    plt.close(fig)


def _annotate_cells(ax: Any, values: np.ndarray, scale: ColourScale) -> None:
    """Each cell's S_w written in it, white on the dark ones."""
    rows, cols = values.shape
    for row in range(rows):
        for col in range(cols):
            value = values[row, col]
            if np.isfinite(value):
                ax.text(
                    col,
                    row,
                    scale.label(value),
                    ha="center",
                    va="center",
                    fontsize=FONT_PT if cols <= 16 else FONT_PT - 2,
                    color="white" if scale.position(value) > 0.6 else "black",
                )


def _label_axes(ax: Any, grid: WorkerGrid, width_in: float, n_dp: int) -> None:
    """DP ranks along x (thinned so no two overlap), stages along y."""
    rows, cols = grid.values.shape
    # A tick label is at most len(str(n)) digits; every k-th column is named so that the
    # names (about 0.6 em a digit) keep a gap between them.
    cell_pt = (width_in - 2.5) * 72 / cols
    label_pt = (len(str(n_dp - 1)) * 0.65 + 1) * FONT_PT
    every = max(1, int(nice_step(label_pt / cell_pt)))
    ax.set_xticks(range(0, cols, every), [str(grid.dp_span(c)[0]) for c in range(0, cols, every)])
    ax.set_yticks(range(rows), [_span(*grid.stage_span(r)) for r in range(rows)])
    ax.tick_params(labelsize=FONT_PT)
    ax.set_xlabel(
        "DP rank"
        + (
            f" (each column: the worst of {grid.dp_per_bin} DP ranks, named by the first)"
            if grid.dp_per_bin > 1
            else ""
        )
    )
    ax.set_ylabel("PP rank")


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"
