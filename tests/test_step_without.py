"""The step without a worker's extra (`simulator/step_without.py`): replayed with every
measured input it is the step as the job paid for it, and without a stalling host's
extra it loses what the job's own step periods say it lost, on real recorded jobs whose
stall falls between overlapping steps, before a blocking send, or in the order of work."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from lagscope.simulator.engine import Anchors, simulate
from lagscope.simulator.online_episodes import HOST, worker_signals
from lagscope.simulator.step_without import step_times_without
from tests.torch_jobs.harness import chained_logs

RECORDED = Path(__file__).parent / "data" / "recorded"


def _recorded(name: str, tmp_path: Path) -> tuple[object, dict]:
    """A recorded run's steps, chained as the hosts chain them, and its truth."""
    with tarfile.open(RECORDED / f"{name}.tar.xz") as packed:
        packed.extractall(tmp_path, filter="data")
    truth = json.loads((tmp_path / "truth.json").read_text())
    return chained_logs(tmp_path / "logs"), truth


def _job_measured_loss(prepared: object, truth: dict) -> float:
    """What the job's own periods say the slowed steps lost against its other steps (its
    first three, the warm-up, left out)."""
    steps, periods = prepared.steps, prepared.periods
    first, end = truth["slow_steps"]
    slowed = (steps >= first) & (steps < end)
    usual = ~slowed & (steps >= 3) & np.isfinite(periods)
    return float((periods[slowed] - np.median(periods[usual])).sum())


def _host_loss(prepared: object, truth: dict) -> float:
    """The model's price of the truth's worker's host over the slowed steps, its level
    the median of its host time before them."""
    dp, stage = truth["worker"]
    steps = prepared.steps
    own = worker_signals(prepared, [HOST])[:, 0, stage, dp]
    first, end = truth["slow_steps"]
    level = float(np.median(own[(steps >= 3) & (steps < first)]))
    scale = np.where(own > level, level / own, 1.0)
    slowed = np.flatnonzero((steps >= first) & (steps < end))
    return float(step_times_without(prepared, (dp, stage), HOST, scale).lost[slowed].sum())


@pytest.mark.parametrize("name", ["mcore-hostupdate-0", "mcore-hoststep-0", "ddp-lateback-0"])
def test_a_step_replayed_with_its_host_gaps_is_its_period(name: str, tmp_path: Path) -> None:
    """Every step whose previous one is known comes out at its period (one step's last
    end to the next's), to the microsecond, the steps that overlap included."""
    prepared, truth = _recorded(name, tmp_path)
    times = step_times_without(prepared, tuple(truth["worker"]), HOST, np.ones(prepared.n_steps))
    known = np.isfinite(prepared.periods)
    assert known.sum() == prepared.n_steps - 1
    np.testing.assert_allclose(times.measured[known], prepared.periods[known], atol=2e-6)


@pytest.mark.parametrize(
    ("name", "within"),
    [
        # The stall after forward_backward returns: its peers begin the next step while
        # it stalls, and a step's span counted it twice (+100 %).
        ("mcore-hostupdate-0", 0.2),
        # The stall after the update: its pipeline peer's blocking send waits for it, and
        # the send's wait sat in the peer's next launch delay, which stayed put (-95 %).
        ("mcore-hoststep-0", 0.25),
        # The hand-written 1F1B job's stall before its update.
        ("1f1b-hostupdate-0", 0.2),
    ],
)
def test_a_stalling_host_costs_what_the_job_lost(name: str, within: float, tmp_path: Path) -> None:
    prepared, truth = _recorded(name, tmp_path)
    measured = _job_measured_loss(prepared, truth)
    model = _host_loss(prepared, truth)
    assert abs(model / measured - 1) < within, (model, measured)


def test_an_op_moves_with_what_its_worker_waited_on() -> None:
    """A worker's op `b` that the model leaves free of `a` (no edge), launched 1 ms after
    its worker's blocking `a` returned: with its launch delay alone it stays where it
    was when `a` ends 20 ms later; anchored to `a` (`engine.Anchors`, the order of work)
    it moves with it."""
    from lagscope.simulator.depmodel import DependencyModel, OpName

    model = DependencyModel(
        nodes=(OpName(0, "forward-send", 0), OpName(0, "forward-compute", 1)),
        deps=((), ()), groups=(), group_of=np.array([-1, -1]), noop_nodes=frozenset(),
        overlapped_dp=False, has_dp_comm=False, host_predecessor=np.array([-1, 0]),
        host_container=np.array([-1, -1]),
    )  # fmt: skip
    compiled = model.compiled_in_work_order
    cost = np.array([[0.010, 0.030], [0.002, 0.002]])  # column 1: `a` took 20 ms more
    delay = np.array([[0.0, 0.0], [0.011, 0.011]])
    segments = np.array([0, 1])
    np.testing.assert_allclose(simulate(compiled, cost, delay, segments).step_time, [0.013, 0.030])
    anchors = Anchors(np.array([1]), np.array([0]), np.full((1, 2), 0.001))
    own = np.array([[0.0, 0.0], [0.001, 0.001]])
    moved = simulate(compiled, cost, own, segments, anchors=anchors).step_time
    np.testing.assert_allclose(moved, [0.013, 0.033])
