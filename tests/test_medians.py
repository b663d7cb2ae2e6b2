"""The hot-path medians give numpy's numbers exactly, NaN included, on any small shape."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lagscope.simulator.medians import median_along, median_of_others

#: Small arrays of up to 3 axes, with ties (values from a short list) and sometimes NaN.
SMALL = arrays(
    np.float64,
    st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple),
    elements=st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 3.25, 1e-9, 7.0, np.nan]),
)


@given(values=SMALL, data=st.data())
def test_the_median_along_an_axis_is_numpy_s(values: np.ndarray, data: st.DataObject) -> None:
    axis = data.draw(st.integers(0, values.ndim - 1))
    expected = np.median(values, axis=axis, keepdims=True)
    np.testing.assert_array_equal(median_along(values, axis), expected)


@given(values=SMALL, data=st.data())
def test_the_median_of_the_others_is_numpy_s_without_the_element(
    values: np.ndarray, data: st.DataObject
) -> None:
    axis = data.draw(st.integers(0, values.ndim - 1))
    n = values.shape[axis]
    if n < 2:
        return
    expected = np.stack(
        [np.median(np.delete(values, i, axis=axis), axis=axis) for i in range(n)], axis=axis
    )
    np.testing.assert_array_equal(median_of_others(values, axis), expected)
