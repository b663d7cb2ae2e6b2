"""Medians along one axis of small arrays, the same numbers as numpy's, for the hot paths.

A live job takes a few dozen medians per step over a handful of values each (the DP ranks
of a stage, the stages of a step); `np.median` spends ~25 µs of its wrapper on each, more
than the sort. Sorting once and picking the middle gives numpy's exact result (the mean
of the two middle values as `(a + b) / 2`); an array holding a NaN is handed to numpy, as
its NaN rule (any NaN makes the median NaN) is not worth repeating here.
"""

from __future__ import annotations

import numpy as np


def median_along(values: np.ndarray, axis: int) -> np.ndarray:
    """`np.median(values, axis=axis, keepdims=True)`.

    >>> median_along(np.array([[3.0, 1.0, 2.0, 10.0], [5.0, 5.0, 1.0, 0.0]]), 1).tolist()
    [[2.5], [3.0]]
    """
    if values.shape[axis] == 0 or np.isnan(values).any():
        return np.median(values, axis=axis, keepdims=True)
    ordered = np.sort(values, axis=axis)
    n = values.shape[axis]
    low = np.take(ordered, [(n - 1) // 2], axis=axis)
    if n % 2:
        return low
    return (low + np.take(ordered, [n // 2], axis=axis)) / 2.0


def median_of_others(values: np.ndarray, axis: int) -> np.ndarray:
    """For every element, the median of the others along `axis` (the same shape): each
    worker's peers, without copying the array once per element as `np.delete` does.

    >>> median_of_others(np.array([[4.0, 1.0, 3.0, 2.0]]), 1).tolist()
    [[2.0, 3.0, 2.0, 3.0]]
    """
    n = values.shape[axis]
    if n < 2 or np.isnan(values).any():
        out = np.empty_like(values)
        for index in range(n):
            others = np.delete(values, index, axis=axis)
            np.moveaxis(out, axis, 0)[index] = np.median(others, axis=axis)
        return out
    order = np.argsort(values, axis=axis, kind="stable")
    ordered = np.take_along_axis(values, order, axis=axis)
    # rank: where each element stands in `ordered`; the others' i-th value is ordered[i],
    # or ordered[i + 1] from the element's own rank on.
    rank = np.empty_like(order)
    np.put_along_axis(
        rank,
        order,
        np.arange(n).reshape([-1 if a == axis % values.ndim else 1 for a in range(values.ndim)]),
        axis,
    )
    low, high = (n - 2) // 2, (n - 1) // 2
    a = np.take_along_axis(ordered, low + (low >= rank), axis=axis)
    if low == high:
        return a
    b = np.take_along_axis(ordered, high + (high >= rank), axis=axis)
    return (a + b) / 2.0
