"""A worker's host time is the time its host took to start its ops, not the work it did
in between: a slow host is named for its stalls, and a straggler of a 1F1B stage, whose
backward receives are posted after its next forward, never reads as a slow host too."""

from __future__ import annotations

import dataclasses
import tarfile
from pathlib import Path

import numpy as np

from lagscope.simulator import optypes as ot
from lagscope.simulator.generate import JobSpec, LaunchDelay, generate_job
from lagscope.simulator.online_episodes import HOST, worker_signals
from lagscope.simulator.prepare import host_gaps, prepare
from tests.torch_jobs.harness import prepared_logs

RECORDED = Path(__file__).parent / "data" / "recorded"


def _generated(**spec: object) -> object:
    job = generate_job(JobSpec(dp=2, pp=2, microbatches=4, steps=6, seed=3, **spec))
    return prepare(job.trace, job.meta)


def test_a_stalling_host_keeps_its_whole_stall() -> None:
    """Every op of the worker launches late: its host gaps are its launch delays."""
    prepared = _generated(stragglers=(LaunchDelay(dp=1, stage=0, delay_s=0.004),))
    stage = prepared.model.node_stage() == 0
    gaps, delays = host_gaps(prepared), np.clip(prepared.launch_delay, 0, None)
    np.testing.assert_allclose(gaps[stage, :, 1], delays[stage, :, 1], atol=1e-6)
    host = worker_signals(prepared, [HOST])[:, 0]
    assert (host[:, 0, 1] > 3 * host[:, 0, 0] + 0.01).all(), host[:, 0].round(4).tolist()


def test_an_op_that_waited_for_its_worker_s_own_work_has_no_host_gap() -> None:
    """A node whose host predecessor ran past its ready time: the gap starts at that
    predecessor's end; where a step ran the two in the other order, the delay stands."""
    prepared = _generated()
    before = prepared.model.host_predecessor
    op = next(n for n in range(prepared.model.n_nodes) if before[n] >= 0)
    ready = prepared.start[op] - prepared.launch_delay[op]
    # The predecessor's work ends 1 ms before the op starts, well after the op was ready.
    delay = prepared.launch_delay.copy()
    start = prepared.start.copy()
    start[op] = np.maximum(start[op], prepared.start[before[op]] + prepared.duration[before[op]])
    start[op] += 0.001 + 0.02
    delay[op] = start[op] - ready
    duration = prepared.duration.copy()
    duration[before[op]] = start[op] - 0.001 - prepared.start[before[op]]
    waited = dataclasses.replace(prepared, start=start, duration=duration, launch_delay=delay)
    np.testing.assert_allclose(host_gaps(waited)[op], 0.001, atol=1e-5)
    # In step 0 the predecessor ran on past the op's start: there, the delay stands.
    duration[before[op], 0] = start[op, 0] + 0.05 - prepared.start[before[op], 0]
    reordered = dataclasses.replace(waited, duration=duration)
    np.testing.assert_allclose(host_gaps(reordered)[op, 0], delay[op, 0], atol=1e-6)


def test_a_1f1b_forward_straggler_leaves_its_host_time_alone(tmp_path: Path) -> None:
    """The recorded 1F1B job of tests/test_live.py (1f1b-forward-1: the worker at dp 1,
    pp 0 2x slower in its forward for steps 15-44). Its backward receives' launch delays
    hold its next forward, so they rose with the straggler (by about the forward's extra,
    and a live run once named it a slow host first); its host gaps did not."""
    with tarfile.open(RECORDED / "1f1b-forward-1.tar.xz") as packed:
        packed.extractall(tmp_path, filter="data")
    prepared = prepared_logs(tmp_path / "logs")
    steps = prepared.steps
    slow, before = (steps >= 15) & (steps < 45), (steps >= 5) & (steps < 15)
    mine = worker_signals(prepared, [ot.FORWARD_COMPUTE, HOST])[:, :, 0, 1]

    def rise(series: np.ndarray) -> float:
        return float(np.median(series[slow]) / np.median(series[before]))

    delays = prepared.stage_sums(np.clip(prepared.launch_delay, 0, None))[:, 0, 1]
    assert rise(mine[:, 0]) > 1.8, rise(mine[:, 0])
    assert rise(delays) > 1.4, rise(delays)  # what the launch delays alone would say
    assert rise(mine[:, 1]) < 1.15, rise(mine[:, 1])


def _recorded_run(name: str, tmp_path: Path) -> tuple[object, dict]:
    """A recorded run (tests/data/recorded) through the embedded host, and its truth."""
    import json

    from tests.torch_jobs.harness import analyse_archive

    with tarfile.open(RECORDED / f"{name}.tar.xz") as packed:
        truth = json.load(packed.extractfile("truth.json"))  # type: ignore[arg-type]
    return analyse_archive(RECORDED / f"{name}.tar.xz", tmp_path), truth


def test_a_rank_whose_autograd_waits_is_slow_in_backward_alone(tmp_path: Path) -> None:
    """ddp-lateback-0: DDP, rank 1's autograd waits 100 ms before its first gradient in
    steps 20-39. Its gradient buckets, launched from the backward's hooks, start that much
    later, but the host launched them from inside its backward: no host gap. Their launch
    delays, counted from the forward, read as a second episode (`host`), priced at 5 % of
    what the job lost."""
    job, truth = _recorded_run("ddp-lateback-0", tmp_path)
    found = [(s.episode.dp, s.episode.stage, s.episode.kind) for s in job.episode_states]
    assert found == [(*truth["worker"], truth["cause"])], found
    (state,) = job.episode_states
    assert (state.episode.onset, state.episode.recovery) == tuple(truth["slow_steps"])


def test_a_host_stall_between_overlapping_steps_counts_once(tmp_path: Path) -> None:
    """mcore-hostupdate-0: a Megatron-core 1F1B job whose rank (dp 0, pp 1) stalls 100 ms
    after `forward_backward` returns, before its update, in steps 20-39. Its peers begin
    the next step meanwhile, so it begins it late: counted from the step's first op, its
    first op's launch delay held the stall a second time (200 ms of host time a step).
    Counted from its own end of the step before, it holds its own gap only."""
    job, truth = _recorded_run("mcore-hostupdate-0", tmp_path)
    (state,) = job.episode_states
    episode = state.episode
    assert [episode.dp, episode.stage] == truth["worker"] and episode.kind == HOST
    assert 0.09 < episode.extra_s < 0.11, episode.extra_s
