"""The compute half's running comm window: kept sorted, step in, oldest step out."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from lagscope.stream_app.step_compute import _replace_sorted

# Few distinct values: repeats (in the window, in what leaves, in what comes) are the
# hard case of a sorted multiset.
_values = st.lists(st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 7.25]), max_size=30)


@given(_values, st.data(), _values)
def test_the_window_is_the_sorted_multiset_after_the_swap(held, data, new):
    held = sorted(held)
    # What leaves is a sub-multiset of what the window holds, as the evicted step is.
    leaves = data.draw(st.lists(st.booleans(), min_size=len(held), max_size=len(held)))
    leaving = [value for value, out in zip(held, leaves, strict=True) if out]
    remaining = [value for value, out in zip(held, leaves, strict=True) if not out]
    got = _replace_sorted(np.array(held), np.array(leaving), np.array(sorted(new)))
    assert got.tolist() == sorted(remaining + new)
