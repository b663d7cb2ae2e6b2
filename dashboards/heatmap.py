"""The DP x PP worker heatmap (cell = worker slowdown S_w), drawn like the reference's
figure: Reds colormap on 1-1.5, each cell annotated to two significant digits."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import numpy as np

VMIN, VMAX = 1.0, 1.5


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
    image = ax.imshow(grid, cmap="Reds", vmin=VMIN, vmax=VMAX, aspect="auto")
    fontsize = 9 if cols <= 16 else 6
    for stage in range(rows):
        for dp in range(cols):
            value = grid[stage, dp]
            if np.isfinite(value):
                color = "white" if value > VMIN + 0.6 * (VMAX - VMIN) else "black"
                ax.text(
                    dp,
                    stage,
                    f"{value:.2g}",
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
    ax.set_title(title)
    fig.colorbar(image, ax=ax, fraction=0.03)
    fig.tight_layout()
    target = Path(path) if isinstance(path, str | Path) else path
    fig.savefig(target, dpi=110, format=image_format)
    plt.close(fig)
