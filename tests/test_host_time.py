"""The host's part of the launch delays: a DDP gradient bucket launched from a backward hook
is no host time, however long the backward ran before the hook; a delay with nothing of its
worker running is all host time."""

from __future__ import annotations

import numpy as np
import pytest

from lagscope.simulator import optypes as ot
from lagscope.simulator.generate import JobSpec, LaunchDelay, generate_job
from lagscope.simulator.host_time import host_delays
from lagscope.simulator.online_episodes import HOST, worker_signals
from lagscope.simulator.prepare import prepare
from tests.test_depmodel_real_ops import META, ddp_trace


def _bucket_rows(prepared) -> np.ndarray:
    return np.array([t == ot.SEPARATE_GRADS_ALL_REDUCE for t in prepared.node_optype])


def test_buckets_launched_during_the_backward_hold_no_host_time() -> None:
    prepared = prepare(ddp_trace(), META)
    buckets = _bucket_rows(prepared)
    delay = np.clip(prepared.launch_delay, 0.0, None)
    host = host_delays(prepared)
    # The model makes the buckets launched mid-backward follow the forward before it.
    assert delay[buckets].max() > 0.008
    assert host[buckets].max() < 0.001
    np.testing.assert_array_equal(host[~buckets], delay[~buckets])


def test_a_rank_slow_in_backward_is_slow_in_backward_not_in_its_host() -> None:
    healthy = worker_signals(prepare(ddp_trace(), META), [ot.BACKWARD_COMPUTE, HOST])
    slow = worker_signals(prepare(ddp_trace(slow_compute_dp=1), META), [ot.BACKWARD_COMPUTE, HOST])
    backward_rise = slow[:, 0, 0, 1] - healthy[:, 0, 0, 1]
    host_rise = slow[:, 1, 0, 1] - healthy[:, 1, 0, 1]
    assert (backward_rise > 0.03).all()
    assert (np.abs(host_rise) < 0.002).all(), host_rise


@pytest.mark.parametrize("seed", range(3))
def test_a_stalling_host_keeps_all_its_delay(seed: int) -> None:
    """A generated job whose worker (dp 1, pp 0) launches every op 30 ms late in steps 2-3:
    its host time rises by that much on each of its ops, as the raw delays do."""
    stall = LaunchDelay(dp=1, stage=0, delay_s=0.03, start_step=2, end_step=4)
    job = generate_job(JobSpec(dp=2, pp=2, microbatches=4, steps=5, seed=seed, stragglers=(stall,)))
    prepared = prepare(job.trace, job.meta)
    host = host_delays(prepared)
    delay = np.clip(prepared.launch_delay, 0.0, None)
    stage0 = prepared.model.node_stage() == 0
    np.testing.assert_allclose(host[stage0][:, 2:4, 1], delay[stage0][:, 2:4, 1], atol=1e-6)
    signal = worker_signals(prepared, [HOST])[:, 0, 0, 1]
    assert signal[2:4].min() > signal[[0, 1, 4]].max() + 0.03
