"""The DP x PP worker heatmap (cell = worker slowdown S_w): Reds colormap on a range chosen
per trace (`dashboards/colour_scale.py`), stated in the title; each cell annotated with the
decimals that range needs."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import numpy as np

from lagscope.dashboards.colour_scale import colour_scale


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
    grid = np.full((max(pp_size or 0, n_stages), max(dp_size or 0, n_dp)), np.nan)
    grid[:n_stages, :n_dp] = worker_slowdown
    rows, cols = grid.shape
    fig, ax = plt.subplots(figsize=(min(2 + 0.55 * cols, 24), 1.5 + 0.5 * rows))
    scale = colour_scale(grid)
    image = ax.imshow(grid, cmap="Reds", vmin=scale.low, vmax=scale.high, aspect="auto")
    fontsize = 9 if cols <= 16 else 6
    for stage in range(rows):
        for dp in range(cols):
            value = grid[stage, dp]
            if np.isfinite(value):
                color = "white" if scale.position(value) > 0.6 else "black"
                ax.text(
                    dp,
                    stage,
                    scale.label(value),
                    ha="center",
                    va="center",
                    fontsize=fontsize,
                    color=color,
                )
    ax.set_xlabel("DP rank")
    ax.set_ylabel("PP rank")
    ax.set_xticks(range(cols))
    ax.set_yticks(range(rows))
    ax.tick_params(labelsize=fontsize)
    ax.set_title(f"{title}\n{scale.describe()}", fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.03)
    fig.tight_layout()
    target = Path(path) if isinstance(path, str | Path) else path
    fig.savefig(target, dpi=110, format=image_format)
    plt.close(fig)
