"""A worker's peers: the leave-one-out median is the median of exactly the peers `peers_of`
names, on any grid; the shortcut for wide stages and the group ratio include the worker."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lagscope.simulator.peers import peer_median, peers_of, relative_to_group

#: [step, stage, dp] grids of up to 3 steps, 3 stages and 5 DP ranks, with ties.
GRIDS = arrays(
    np.float64,
    st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 5)),
    elements=st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.25, 7.0]),
)


@given(values=GRIDS)
def test_the_peer_median_is_the_median_of_the_workers_peers(values: np.ndarray) -> None:
    medians = peer_median(values)
    for stage in range(values.shape[1]):
        for dp in range(values.shape[2]):
            peers = peers_of(values, (dp, stage))
            if peers is None:
                assert np.isnan(medians[:, stage, dp]).all()
            else:
                np.testing.assert_array_equal(medians[:, stage, dp], np.median(peers, axis=1))


def test_a_wide_stage_is_compared_with_its_median_itself_included() -> None:
    values = np.arange(20.0).reshape(1, 1, 20)
    exact = peer_median(values)
    wide = peer_median(values, include_self_above=16)
    assert exact[0, 0, 0] == 10.0 and exact[0, 0, 19] == 9.0  # the others' middle
    np.testing.assert_array_equal(wide, np.full_like(values, 9.5))
    np.testing.assert_array_equal(peer_median(values, include_self_above=20), exact)


def test_the_group_ratio_includes_the_worker() -> None:
    # Two DP ranks, one twice as slow: against its peer it is 2x, against the group 4/3.
    work = np.array([[[2.0, 1.0]]])
    assert peer_median(work)[0, 0, 0] == 1.0
    np.testing.assert_allclose(relative_to_group(work), [[[4 / 3, 2 / 3]]])
    # One DP rank: the group is every worker of the step.
    np.testing.assert_allclose(relative_to_group(np.array([[[1.0], [3.0], [2.0]]])).ravel(),
                               [0.5, 1.5, 1.0])  # fmt: skip
