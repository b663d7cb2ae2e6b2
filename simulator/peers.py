"""A worker's peers, and how its values compare with theirs: "slower than its peers".

A worker's peers are the other DP ranks of its stage, which run the same layers on other
data; with one DP rank, the other stages (`peers_of`). Values come as [..., stage, dp]:
a step's, or a window's of steps and signal kinds.

Two comparisons are made, and they differ on purpose:

- `peer_median`, the median of the *others*: what a single worker's excess is measured
  against (its GC pauses, its host's launch delays, a live episode's ratio). Leaving the
  worker out matters with few peers: with two DP ranks, a median that includes the slow
  one is halfway to it and hides half its excess.
- `relative_to_group`, a worker's value over the median of its *group, itself included*:
  the persistent excess (`noise.persistent_excess`) is this ratio, and the diagnosis's
  `persistent_margin` is a threshold on it. Including the worker keeps it bounded
  (x / median(x, y) < 2 for two ranks) and defined for a job of one worker.
"""

from __future__ import annotations

import numpy as np

from lagscope.simulator.medians import median_along, median_of_others


def peers_of(values: np.ndarray, worker: tuple[int, int]) -> np.ndarray | None:
    """[step, peer]: `values` ([step, stage, dp]) of `worker`'s (dp, stage) peers: the
    other DP ranks of its stage, else the other stages; None for a job of one worker.

    >>> values = np.arange(6.0).reshape(1, 2, 3)  # one step, 2 stages of 3 DP ranks
    >>> peers_of(values, (1, 0)).tolist()
    [[0.0, 2.0]]
    """
    dp, stage = worker
    n_stages, n_dp = values.shape[-2], values.shape[-1]
    if n_dp > 1:
        return np.delete(values[:, stage, :], dp, axis=1)
    if n_stages > 1:
        return np.delete(values[:, :, dp], stage, axis=1)
    return None


def peer_median(values: np.ndarray, *, include_self_above: int | None = None) -> np.ndarray:
    """[..., stage, dp]: for every worker, the median of its peers' values (`peers_of`);
    NaN for a job of one worker.

    With `include_self_above`, a stage of more DP ranks than that takes the median of all
    of them, the worker included, for every worker: one sort instead of one per worker,
    and with that many peers the two medians are at most one value apart in the order
    (the live episodes' per-step cost at thousands of ranks).

    >>> values = np.array([[[1.0, 2.0, 9.0]]])  # one step, one stage of 3 DP ranks
    >>> peer_median(values).tolist()
    [[[5.5, 5.0, 1.5]]]
    >>> peer_median(values, include_self_above=2).tolist()
    [[[2.0, 2.0, 2.0]]]
    """
    n_stages, n_dp = values.shape[-2], values.shape[-1]
    if n_dp > 1:
        if include_self_above is not None and n_dp > include_self_above:
            return np.broadcast_to(median_along(values, axis=-1), values.shape)
        return median_of_others(values, axis=-1)
    if n_stages == 1:
        return np.full_like(values, np.nan)
    return median_of_others(values, axis=-2)


def relative_to_group(work: np.ndarray) -> np.ndarray:
    """[step, stage, dp]: each worker's value over the median of its group in that step,
    itself included (see the module's docstring): its stage's DP ranks, or every worker
    when there is one DP rank.

    >>> relative_to_group(np.array([[[1.0, 3.0]]])).tolist()
    [[[0.5, 1.5]]]
    """
    n_dp = work.shape[2]
    if n_dp > 1:
        peers = np.median(work, axis=2, keepdims=True)
    else:
        peers = np.median(work, axis=(1, 2), keepdims=True)
    return work / np.where(peers > 0, peers, np.nan)
