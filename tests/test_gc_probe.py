"""The GC probe never harms a step: pauses are evidence about the ops they fall in, any
number per worker and step (or none), and GC is named only on the probe's own evidence."""

from __future__ import annotations

import gc

import numpy as np

from lagscope.producers.events import JobInfo, decode_batch
from lagscope.producers.log import KIND_BATCH, Record, rank_dir, read_all
from lagscope.producers.timer import OpTimer
from lagscope.simulator import optypes as ot
from lagscope.simulator.diagnose import diagnose
from lagscope.simulator.generate import (
    CostModel,
    GcPauses,
    JobSpec,
    LastStageImbalance,
    generate_job,
)
from lagscope.simulator.job_story import tell_trace
from lagscope.simulator.measures import gc_beyond_peers
from lagscope.simulator.prepare import prepare
from lagscope.simulator.trace import Trace
from lagscope.simulator.verdict import verdict_of
from lagscope.simulator.whatif import DEFAULT_DECOMPOSE_THRESHOLD, analyze
from lagscope.stream_app.processor import StepProcessor
from tests.test_processor import stream_of

BALANCED = CostModel(first_stage_extra=0.0, last_stage_extra=0.0, noise_cv=0.02)


def _gc_job(seed: int = 1, steps: int = 6):
    return generate_job(
        JobSpec(
            dp=4,
            pp=2,
            microbatches=4,
            steps=steps,
            cost=BALANCED,
            stragglers=(GcPauses(probability=0.08, pause_s=0.2),),
            seed=seed,
        )
    )


def _without_pauses(trace: Trace) -> Trace:
    return trace.select(trace.optype != trace.optype_names.index(ot.GC_PAUSE))


def test_pauses_on_some_workers_only_leave_every_step_analysable():
    job = _gc_job()
    pause = job.trace.optype == job.trace.optype_names.index(ot.GC_PAUSE)
    per_worker_step = {
        (int(s), int(d), int(p))
        for s, d, p in zip(
            job.trace.step[pause], job.trace.dp_rank[pause], job.trace.stage[pause], strict=True
        )
    }
    # The premise: some workers pause in a step and others do not, step 0 included.
    assert 0 < len(per_worker_step) < 6 * 8
    assert any(s == 0 for s, _, _ in per_worker_step)
    info, steps = stream_of(job)
    processor = StepProcessor()
    processor.on_job(info)
    outputs = [out for _, _, batches in steps for out in processor.on_batches(batches)]
    outputs += processor.flush()
    assert sorted(out.step for out in outputs) == list(range(6))
    assert all(out.result is not None and out.complete for out in outputs), [
        out.reason for out in outputs
    ]
    # The pauses reached the analysis as evidence about the ops they stalled.
    assert processor.rollup(info.job_id) is not None
    retained = processor.jobs[info.job_id, 0].retained
    assert sum(float(p.gc_pause.sum()) for p in retained if p.gc_pause is not None) > 0


def test_gc_probe_records_survive_a_real_collection_in_the_stream(tmp_path):
    """The timer's probe output (a real gc.collect() on one rank only) is analysable."""

    info = JobInfo(job_id="gc", dp_size=2, pp_size=1, world_size=2)
    timers = [
        OpTimer(job_id="gc", rank=r, dp_rank=r, pp_rank=0, log_dir=tmp_path, mode="host",
                gc_probe=(r == 0), job_info=info)
        for r in range(2)
    ]  # fmt: skip
    for step in range(3):
        for rank, timer in enumerate(timers):
            timer.step(step)
            with timer.op("forward-compute", microbatch=0):
                if rank == 0:
                    gc.collect()
                sum(range(20_000))
            with timer.op("backward-compute", microbatch=0):
                sum(range(40_000))
            with timer.op("optimizer"):
                pass
    for timer in timers:
        timer.close()
    processor = StepProcessor()
    processor.on_job(info)
    outputs = []
    for rank in range(2):
        for record in read_all(rank_dir(tmp_path, rank)):
            if isinstance(record, Record) and record.kind == KIND_BATCH:
                outputs += processor.on_batch(decode_batch(record.payload))
    outputs += processor.flush()
    assert sorted(out.step for out in outputs) == [0, 1, 2]
    assert all(out.result is not None for out in outputs), [out.reason for out in outputs]


def test_gc_is_named_from_recorded_pauses_and_never_without_the_probe():
    job = _gc_job(seed=2, steps=8)
    prepared = prepare(job.trace, job.meta)
    diagnosis = diagnose(analyze(prepared), prepared)
    assert diagnosis.cause == "gc_pauses", diagnosis.summary
    assert diagnosis.evidence.figures.gc.coincidence > 0.9
    probe_off = prepare(_without_pauses(job.trace), job.meta)
    assert probe_off.gc_pause is None
    off = diagnose(analyze(probe_off), probe_off)
    assert off.cause != "gc_pauses"
    assert off.evidence.figures.gc.recorded is False


def test_pauses_that_do_not_coincide_with_the_slowdown_are_not_the_cause():
    """A heavy last stage with small GC pauses recorded now and then: the stage is named."""
    job = generate_job(
        JobSpec(
            dp=4,
            pp=2,
            microbatches=4,
            steps=8,
            cost=BALANCED,
            stragglers=(
                LastStageImbalance(factor=1.6),
                GcPauses(probability=0.05, pause_s=0.004),
            ),
            seed=3,
        )
    )
    prepared = prepare(job.trace, job.meta)
    assert prepared.gc_pause is not None and np.count_nonzero(prepared.gc_pause) > 0
    diagnosis = diagnose(analyze(prepared), prepared)
    assert diagnosis.cause == "last_stage_imbalance", diagnosis.summary
    assert diagnosis.evidence.figures.gc.explained < 0.2


def _story(trace: Trace, job) -> tuple:
    """The run's verdict and its episodes, as `lagscope analyze` and the hosts tell them."""
    told = tell_trace(
        prepare(trace, job.meta), job.meta, decompose_threshold=DEFAULT_DECOMPOSE_THRESHOLD
    )
    return verdict_of(told.verdict), told.episodes


def test_a_worker_whose_own_collections_stall_it_is_named_for_them():
    """One rank pauses in every forward of steps 12-29 (its heap grew; its peers do not
    collect then): its episode, and the run's verdict, name garbage collection on that
    worker, with planned collections as the fix; without the probe's records the same
    rise is only a slow forward."""
    job = generate_job(
        JobSpec(dp=4, pp=2, microbatches=4, steps=40, cost=BALANCED, seed=5, stragglers=(
            GcPauses(probability=1.0, pause_s=0.06, dp=1, stage=0, start_step=12, end_step=30),
        ))
    )  # fmt: skip
    verdict, [episode] = _story(job.trace, job)
    assert (episode.episode.dp, episode.episode.stage) == (1, 0)
    assert episode.episode.kind == ot.FORWARD_COMPUTE
    assert abs(episode.episode.onset - 12) <= 1 and abs(episode.episode.recovery - 30) <= 1
    assert episode.diagnosis.cause == "gc_pauses", episode.diagnosis.summary
    assert episode.cost.gc_share > 0.9
    assert "garbage collection" in episode.diagnosis.summary
    assert "--manual-gc" in episode.diagnosis.advice[0].detail
    assert verdict.cause == "gc_pauses" and verdict.workers == ((1, 0),)
    assert verdict.action == "planned garbage collection"

    verdict, [episode] = _story(_without_pauses(job.trace), job)
    assert episode.diagnosis.cause == "slow_workers" and episode.cost.gc_s == 0
    assert verdict.cause == "slow_workers" and verdict.workers == ((1, 0),)


def test_pauses_its_peers_have_too_are_not_a_worker_s_own():
    """Every rank pausing in every forward is the job's collector, no one's straggler:
    only the pauses beyond a worker's peers' count as its own."""
    everyone = GcPauses(probability=1.0, pause_s=0.03)
    alone = GcPauses(probability=1.0, pause_s=0.03, dp=1, stage=0)
    for stragglers, own in (((everyone,), 0.0), ((alone,), 0.12), ((everyone, alone), 0.12)):
        job = generate_job(
            JobSpec(dp=4, pp=2, microbatches=4, steps=3, cost=BALANCED, stragglers=stragglers)
        )
        prepared = prepare(job.trace, job.meta)
        for worker in ((1, 0), (2, 0), (1, 1)):
            expected = own if worker == (1, 0) else 0.0
            beyond = gc_beyond_peers(prepared, worker, ot.FORWARD_COMPUTE)
            assert np.allclose(beyond, expected), (stragglers, worker, beyond)


def test_a_rank_pausing_from_the_start_is_named_by_the_run():
    """One rank pauses in every forward from the first step: no episode (no level before
    to rise from), and the run's GC diagnosis names where the pauses are; a job whose
    ranks all pause now and then names nobody."""
    job = generate_job(
        JobSpec(dp=4, pp=2, microbatches=4, steps=20, cost=BALANCED, seed=5,
                stragglers=(GcPauses(probability=1.0, pause_s=0.03, dp=2, stage=1),))
    )  # fmt: skip
    verdict, episodes = _story(job.trace, job)
    assert episodes == []
    assert verdict.cause == "gc_pauses" and verdict.workers == ((2, 1),), verdict.headline
    assert "100% of the pauses on (dp 2, pp 1)" in verdict.headline, verdict.headline
    everywhere, _ = _story(_gc_job(seed=2, steps=8).trace, _gc_job(seed=2, steps=8))
    assert everywhere.cause == "gc_pauses" and everywhere.workers == (), everywhere.headline


def test_a_host_stalled_by_its_own_collections_between_ops_is_named_for_them():
    """On a GPU the kernels keep their time while the host collects: one rank's pauses
    fall between its ops and hold back its launches. The pauses count toward the host gaps
    they fall in, not toward an op; the episode (a host stall) and the run's verdict name
    garbage collection on that worker; without the probe's records it is a slow host."""
    job = generate_job(
        JobSpec(dp=4, pp=2, microbatches=4, steps=40, cost=BALANCED, seed=5, stragglers=(
            GcPauses(probability=1.0, pause_s=0.06, dp=1, stage=0, start_step=12, end_step=30,
                     between_ops=True),
        ))
    )  # fmt: skip
    prepared = prepare(job.trace, job.meta)
    assert prepared.gc_pause is not None and prepared.gc_gap_pause is not None
    # The computes do not hold them (the transfers in flight meanwhile do).
    assert prepared.stage_sums(prepared.gc_pause, ot.FORWARD_COMPUTE).max() < 1e-6
    in_gaps = prepared.stage_sums(prepared.gc_gap_pause)[:, 0, 1]  # [step] of (dp 1, pp 0)
    # 4 forwards a step, each held back 0.06 s, in the slow steps only.
    assert np.allclose(in_gaps[12:30], 0.24, atol=1e-3) and not in_gaps[:12].any(), in_gaps

    verdict, [episode] = _story(job.trace, job)
    assert (episode.episode.dp, episode.episode.stage, episode.episode.kind) == (1, 0, "host")
    assert abs(episode.episode.onset - 12) <= 1 and abs(episode.episode.recovery - 30) <= 1
    assert episode.diagnosis.cause == "gc_pauses", episode.diagnosis.summary
    assert episode.cost.gc_share > 0.9
    assert episode.diagnosis.summary.startswith("the host of worker (dp 1, pp 0) stalls")
    assert "garbage collection" in episode.diagnosis.summary
    assert verdict.cause == "gc_pauses" and verdict.workers == ((1, 0),), verdict.headline
    assert verdict.action == "planned garbage collection"

    verdict, [episode] = _story(_without_pauses(job.trace), job)
    assert episode.diagnosis.cause == "slow_host" and episode.cost.gc_s == 0
    assert verdict.cause == "slow_host" and verdict.workers == ((1, 0),)


def test_a_host_collecting_between_ops_from_the_start_is_named_by_the_run():
    """The same rank, pausing between its ops from the first step (no episode): the run's
    host-stall diagnosis names its collections; pauses its peers have too do not count."""
    alone = GcPauses(probability=1.0, pause_s=0.03, dp=2, stage=1, between_ops=True)
    job = generate_job(
        JobSpec(dp=4, pp=2, microbatches=4, steps=20, cost=BALANCED, seed=5, stragglers=(alone,))
    )
    verdict, episodes = _story(job.trace, job)
    assert episodes == []
    assert verdict.cause == "gc_pauses" and verdict.workers == ((2, 1),), verdict.headline
    assert "stalls between its ops" in verdict.headline, verdict.headline
    assert verdict.action == "planned garbage collection"
    without, _ = _story(_without_pauses(job.trace), job)
    assert without.cause == "slow_host" and without.workers == ((2, 1),), without.headline

    everyone = GcPauses(probability=1.0, pause_s=0.03, between_ops=True)
    for stragglers, own in (((everyone,), 0.0), ((everyone, alone), 0.12)):
        prepared = prepare(*_job_of(stragglers))
        for worker in ((2, 1), (1, 1), (2, 0)):
            beyond = gc_beyond_peers(prepared, worker, "host")
            expected = own if worker == (2, 1) else 0.0
            assert np.allclose(beyond, expected, atol=0.005), (stragglers, worker, beyond)


def _job_of(stragglers: tuple) -> tuple:
    job = generate_job(
        JobSpec(dp=4, pp=2, microbatches=4, steps=3, cost=BALANCED, stragglers=stragglers)
    )
    return job.trace, job.meta
