"""A worker heatmap at any job size: the [stage, dp] S_w matrix binned into as many columns
(and rows) as a picture has room for, each bin standing for its worst worker, so that one
straggler among 12,500 workers still shows; and the text measures the pictures use to keep
labels from overlapping.

The PNG heatmap and the HTML report bin the same way. DP ranks are binned in consecutive
runs: in Megatron's rank order neighbouring DP replicas of a stage sit on neighbouring
nodes, so a bin is a block of machines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Width of a character as a share of the font size: DejaVu Sans' digits (0.636 em), the
#: widest of the fonts a headless Chromium or matplotlib falls back to, rounded up.
CHAR_WIDTH_EM = 0.65


def text_width(text: str, font_px: float) -> float:
    """The width `text` takes at `font_px`, no narrower than the browser draws it."""
    return len(text) * CHAR_WIDTH_EM * font_px


def nice_step(at_least: float) -> float:
    """The smallest of 1, 2, 5 x 10^k that is `at_least` this large.

    >>> nice_step(3), nice_step(0.012), nice_step(51)
    (5, 0.02, 100)
    """
    if at_least <= 0:
        return 1
    power = 10 ** math.floor(math.log10(at_least))
    for factor in (1, 2, 5, 10):
        if factor * power >= at_least * (1 - 1e-9):
            step = factor * power
            return int(step) if step >= 1 else round(step, 12)
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class WorkerGrid:
    """S_w binned: `values[r, c]` is the worst worker of bin (r, c), found at
    (`worst_stage[r, c]`, `worst_dp[r, c]`). Column c covers DP ranks
    `dp_edges[c]` to `dp_edges[c + 1] - 1`; rows likewise over stages."""

    values: np.ndarray
    worst_dp: np.ndarray
    worst_stage: np.ndarray
    dp_edges: np.ndarray
    stage_edges: np.ndarray

    @property
    def dp_per_bin(self) -> int:
        return int(self.dp_edges[1] - self.dp_edges[0]) if len(self.dp_edges) > 1 else 1

    @property
    def stages_per_bin(self) -> int:
        return int(self.stage_edges[1] - self.stage_edges[0]) if len(self.stage_edges) > 1 else 1

    @property
    def binned(self) -> bool:
        return self.dp_per_bin > 1 or self.stages_per_bin > 1

    def dp_span(self, column: int) -> tuple[int, int]:
        """First and last DP rank of a column."""
        return int(self.dp_edges[column]), int(self.dp_edges[column + 1]) - 1

    def stage_span(self, row: int) -> tuple[int, int]:
        return int(self.stage_edges[row]), int(self.stage_edges[row + 1]) - 1


def _edges(n: int, most: int) -> np.ndarray:
    per_bin = max(1, math.ceil(n / max(most, 1)))
    return np.append(np.arange(0, n, per_bin), n)


def bin_workers(worker_slowdown: np.ndarray, max_columns: int, max_rows: int) -> WorkerGrid:
    """`worker_slowdown` ([stage, dp]) in at most `max_columns` x `max_rows` bins of
    consecutive DP ranks and stages, each the worst (highest S_w) worker it holds; NaN
    where a bin holds no finite value.

    >>> s_w = np.array([[1.0, 1.1, 1.0, 1.0, 1.3], [1.0, 1.0, 1.0, 1.2, 1.0]])
    >>> grid = bin_workers(s_w, max_columns=2, max_rows=8)
    >>> grid.values.tolist(), grid.worst_dp.tolist(), grid.dp_span(1)
    ([[1.1, 1.3], [1.0, 1.2]], [[1, 4], [0, 3]], (3, 4))
    """
    values = np.asarray(worker_slowdown, dtype=float)
    n_stages, n_dp = values.shape
    dp_edges, stage_edges = _edges(n_dp, max_columns), _edges(n_stages, max_rows)
    dp_bin, stage_bin = int(dp_edges[1] - dp_edges[0]), int(stage_edges[1] - stage_edges[0])
    rows, columns = len(stage_edges) - 1, len(dp_edges) - 1
    # Padded to whole bins with -inf, so that a bin's argmax is its worst worker.
    padded = np.full((rows * stage_bin, columns * dp_bin), -np.inf)
    padded[:n_stages, :n_dp] = np.where(np.isfinite(values), values, -np.inf)
    blocks = padded.reshape(rows, stage_bin, columns, dp_bin).transpose(0, 2, 1, 3)
    flat = blocks.reshape(rows, columns, stage_bin * dp_bin)
    where = flat.argmax(axis=2)
    worst = np.take_along_axis(flat, where[..., None], axis=2)[..., 0]
    inside_stage, inside_dp = np.divmod(where, dp_bin)
    return WorkerGrid(
        values=np.where(np.isfinite(worst), worst, np.nan),
        worst_dp=dp_edges[:-1][None, :] + inside_dp,
        worst_stage=stage_edges[:-1][:, None] + inside_stage,
        dp_edges=dp_edges,
        stage_edges=stage_edges,
    )


def worst_of_replicas(worker_slowdown: np.ndarray) -> np.ndarray:
    """[dp] each DP replica's highest S_w on any stage (-inf where it has none).

    >>> worst_of_replicas(np.array([[1.0, np.nan], [1.3, np.nan]])).tolist()
    [1.3, -inf]
    """
    return np.max(np.where(np.isfinite(worker_slowdown), worker_slowdown, -np.inf), axis=0)


def worst_dp_ranks(worker_slowdown: np.ndarray, k: int, first: Sequence[int] = ()) -> list[int]:
    """The `k` DP replicas with the highest S_w on any stage, worst first, after the DP
    ranks in `first` (those of verified workers).

    >>> worst_dp_ranks(np.array([[1.0, 1.2, 1.1], [1.3, 1.0, 1.0]]), 2)
    [0, 1]
    """
    by_dp = worst_of_replicas(worker_slowdown)
    chosen = list(dict.fromkeys(int(d) for d in first))[:k]
    for dp in np.argsort(-by_dp, kind="stable").tolist():
        if len(chosen) >= k:
            break
        if dp not in chosen:
            chosen.append(int(dp))
    return chosen
