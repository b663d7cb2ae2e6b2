"""Diagnosis names the injected cause, and its advice predicts what fixing it gives."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lagscope.simulator.advice import balanced_microbatches, consolidated_placement, escalation
from lagscope.simulator.diagnose import DiagnosisSettings, diagnose
from lagscope.simulator.generate import (
    CostModel,
    GcPauses,
    JobSpec,
    LastStageImbalance,
    LaunchDelay,
    SequenceImbalance,
    SlowLink,
    SlowWorker,
    generate_job,
)
from lagscope.simulator.measures import slow_comm_groups
from lagscope.simulator.prepare import prepare
from lagscope.simulator.whatif import analyze

BALANCED = CostModel(first_stage_extra=0.0, last_stage_extra=0.0, noise_cv=0.02)
PATTERNS = {
    "none": lambda rng: (),
    "slow_workers": lambda rng: (
        SlowWorker(
            dp=int(rng.integers(8)), stage=int(rng.integers(4)), factor=float(rng.uniform(1.3, 2.0))
        ),
    ),
    "last_stage_imbalance": lambda rng: (LastStageImbalance(factor=float(rng.uniform(1.3, 1.8))),),
    "sequence_imbalance": lambda rng: (SequenceImbalance(),),
    "gc_pauses": lambda rng: (
        GcPauses(probability=float(rng.uniform(0.03, 0.08)), pause_s=float(rng.uniform(0.1, 0.3))),
    ),
    "slow_communication": lambda rng: (
        SlowLink(stage=int(rng.integers(4)), factor=float(rng.uniform(6, 12))),
    ),
    "slow_p2p_link": lambda rng: (
        SlowLink(
            stage=int(rng.integers(3)), dp=int(rng.integers(8)), factor=float(rng.uniform(20, 40))
        ),
    ),
}
EXPECTED = {**{k: k for k in PATTERNS}, "slow_p2p_link": "slow_communication"}


def diagnosed(stragglers, seed):
    job = generate_job(
        JobSpec(
            dp=8, pp=4, microbatches=8, steps=5, cost=BALANCED, stragglers=stragglers, seed=seed
        )
    )
    prepared = prepare(job.trace, job.meta)
    result = analyze(prepared)
    return job, result, diagnose(result, prepared)


def test_confusion_table_over_56_generated_jobs():
    confusion: Counter = Counter()
    for pattern, seed in itertools.product(PATTERNS, range(8)):
        rng = np.random.default_rng(1000 + seed)
        job, _, diagnosis = diagnosed(PATTERNS[pattern](rng), seed)
        # An injection that barely slows the job (< 3 %) is rightly not a cause.
        injected = pattern if job.truth.slowdown >= 1.03 else "none"
        confusion[injected, diagnosis.cause] += 1
    causes = sorted({c for _, c in confusion})
    table = ["injected \\ diagnosed".ljust(22) + "".join(c[:12].rjust(14) for c in causes)]
    for pattern in PATTERNS:
        table.append(
            pattern.ljust(22) + "".join(str(confusion[pattern, c]).rjust(14) for c in causes)
        )
    print("\n".join(table))
    correct = sum(n for (p, c), n in confusion.items() if EXPECTED[p] == c)
    assert correct == sum(confusion.values()), "\n".join(table)


def test_removing_the_slow_worker_predicts_the_clean_job():
    job, _, diagnosis = diagnosed((SlowWorker(dp=5, stage=2, factor=1.7),), seed=4)
    remove = next(a for a in diagnosis.advice if a.action == "remove the straggler")
    assert remove.predicted_speedup == pytest.approx(job.truth.slowdown, rel=0.03)
    resplit = next(a for a in diagnosis.advice if a.action == "re-split micro-batches")
    assert 1.0 < resplit.predicted_speedup < remove.predicted_speedup
    assert "5:" in resplit.detail  # the slow replica gets fewer micro-batches


@pytest.mark.parametrize(
    "stragglers",
    [
        (SlowLink(stage=2, factor=9.0),),
        (SlowLink(stage=1, dp=3, factor=30.0),),
    ],
)
def test_repairing_links_predicts_the_clean_job(stragglers):
    job, _, diagnosis = diagnosed(stragglers, seed=2)
    assert diagnosis.cause == "slow_communication"
    assert diagnosis.advice[0].predicted_speedup == pytest.approx(job.truth.slowdown, rel=0.03)


def test_a_dp_group_is_slow_against_other_groups_never_against_its_own_ranks():
    """Plain DDP (one DP group moves each bucket): one rank reading its transfers 1.5x the
    others' is the job's noise, not a slow link; there is nothing to compare the group
    with. With two stages, the stage whose DP group is 3x slower is named, as a group."""
    job = generate_job(JobSpec(dp=4, pp=1, microbatches=2, steps=8, cost=BALANCED, seed=3))
    prepared = prepare(job.trace, job.meta)
    synced = [m for g in prepared.model.groups if g.dp_synchronized for m in g.members]
    assert synced
    cost = prepared.cost.copy()
    cost[synced, :, 2] *= 1.5
    noisy = dataclasses.replace(prepared, cost=cost)
    assert slow_comm_groups(noisy, 1.1) == []

    staged = generate_job(
        JobSpec(dp=4, pp=2, microbatches=2, steps=8, cost=BALANCED, seed=3,
                stragglers=(SlowLink(stage=1, factor=3.0),))
    )  # fmt: skip
    groups = slow_comm_groups(prepare(staged.trace, staged.meta), 1.1)
    assert groups and all(g["dp"] is None and g["ratio"] > 2 for g in groups)
    # Ops are named optype_seq_stage.
    assert {op.rsplit("_", 1)[1] for g in groups for op in g["ops"]} == {"1"}, groups


@pytest.mark.parametrize("microbatches, resplit_helps", [(4, True), (2, False)])
def test_a_resplit_that_would_not_help_is_neither_advice_nor_the_next_step(
    microbatches, resplit_helps
):
    """A replica 2x slow: with 4 micro-batches each, moving one off it helps; with 2, the
    fast replica's 3 take longer than the slow one's 2 did, so re-splitting is left off
    the advice and the ladder's next step is the one after it."""
    job = generate_job(
        JobSpec(dp=2, pp=2, microbatches=microbatches, steps=6, seed=1, cost=BALANCED,
                stragglers=(SlowWorker(dp=1, stage=0, factor=2.0),))
    )  # fmt: skip
    prepared = prepare(job.trace, job.meta)
    diagnosis = diagnose(analyze(prepared), prepared)
    assert diagnosis.cause == "slow_workers"
    resplit = [a for a in diagnosis.advice if a.action == "re-split micro-batches"]
    assert all(a.predicted_speedup > 1 for a in diagnosis.advice)
    assert bool(resplit) == resplit_helps
    expected = "re-split micro-batches" if resplit_helps else "re-arrange topology"
    assert diagnosis.escalation.next_action == expected


def test_planned_gc_predicts_the_job_without_pauses():
    job, _, diagnosis = diagnosed((GcPauses(probability=0.06, pause_s=0.2),), seed=1)
    assert diagnosis.cause == "gc_pauses"
    assert diagnosis.advice[0].predicted_speedup == pytest.approx(job.truth.slowdown, rel=0.05)


def test_layer_move_and_packing_advice_predict_a_gain():
    _, _, last = diagnosed((LastStageImbalance(factor=1.5),), seed=0)
    assert last.advice[0].action == "move layers off the last stage"
    assert last.advice[0].predicted_speedup > 1.05
    _, _, seq = diagnosed((SequenceImbalance(),), seed=0)
    assert seq.evidence.figures.fwd_bwd_correlation > 0.9
    assert seq.advice[0].predicted_speedup > 1.05


def test_correlation_is_near_zero_without_sequence_imbalance():
    _, _, diagnosis = diagnosed((), seed=3)
    assert abs(diagnosis.evidence.figures.fwd_bwd_correlation) < 0.3


@settings(max_examples=40, deadline=None)
@given(times=st.lists(st.floats(0.1, 5.0), min_size=1, max_size=5), total=st.integers(1, 12))
def test_balanced_microbatches_is_optimal(times, total):
    counts = balanced_microbatches(np.array(times), total)
    assert counts.sum() == total
    best = min(
        max(c * t for c, t in zip(split, times, strict=True))
        for split in itertools.product(range(total + 1), repeat=len(times))
        if sum(split) == total
    )
    assert max(c * t for c, t in zip(counts, times, strict=True)) == pytest.approx(best)


def test_balanced_microbatches_scales_to_512_ranks():
    times = np.ones(512)
    times[7] = 2.0
    counts = balanced_microbatches(times, 512 * 16)
    assert counts[7] == 8 and counts.sum() == 512 * 16


def test_ski_rental_escalation():
    cfg = DiagnosisSettings(resplit_cost_s=60, rearrange_cost_s=600, restart_cost_s=1800)
    assert escalation(0.0, 8, cfg).action == "ignore"
    step = escalation(8 * 100.0, 8, cfg)
    assert step.action == "re-split micro-batches"
    assert step.next_action == "re-arrange topology" and step.next_action_at_loss_s == 600
    assert escalation(8 * 2000.0, 8, cfg).action.startswith("checkpoint and restart")


@pytest.mark.parametrize(
    "name, cause",
    [("AR", "slow_workers"), ("SE", "sequence_imbalance"), ("ST", "last_stage_imbalance")],
)
def test_reference_traces_get_the_papers_diagnosis(reference_dir, name, cause):
    """AR has an artificially slowed worker, SE sequence-length imbalance, ST a heavy last
    stage (the paper's own reading of these traces)."""
    from tests.conftest import analyzed_reference

    prepared, result = analyzed_reference(name)
    diagnosis = diagnose(result, prepared)
    assert diagnosis.cause == cause
    assert all(a.predicted_speedup > 1.0 for a in diagnosis.advice)


def test_consolidating_two_stragglers_into_one_pipeline():
    assert consolidated_placement(((1, 0), (6, 2)), n_stages=4, n_dp=8) == {(6, 2): (1, 2)}
    assert consolidated_placement(((1, 0), (6, 0)), n_stages=4, n_dp=8) == {}
    job = generate_job(
        JobSpec(  # 64 workers: M_W blames the top 2
            dp=16,
            pp=4,
            microbatches=8,
            steps=4,
            cost=BALANCED,
            seed=6,
            stragglers=(
                SlowWorker(dp=1, stage=0, factor=1.6),
                SlowWorker(dp=6, stage=2, factor=1.6),
            ),
        )
    )
    prepared = prepare(job.trace, job.meta)
    diagnosis = diagnose(analyze(prepared), prepared)
    # S_w = min(S_dp, S_stage) also lights up the "ghosts" (1, 2) and (6, 0) at the
    # crossings of the two stragglers' replicas and stages; re-simulating each candidate
    # alone names the real ones.
    verified = {(w.dp, w.stage) for w in diagnosis.evidence.verified_workers}
    assert verified == {(1, 0), (6, 2)}
    consolidate = next(a for a in diagnosis.advice if a.action == "consolidate stragglers")
    resplit = next(a for a in diagnosis.advice if a.action == "re-split micro-batches")
    # Gathered in one replica, the two stragglers cost one slow replica instead of two,
    # which a re-split then relieves: better than re-splitting them where they are.
    assert consolidate.predicted_speedup > resplit.predicted_speedup > 1.0


@pytest.mark.parametrize("wasted", [-1234.5, float("nan"), -0.0])
def test_escalation_of_negative_or_unknown_waste_is_ignore(wasted):
    """A real run can waste negative GPU-seconds (steps faster than their running ideal):
    nothing was lost, so the ladder stays at its first rung instead of failing."""
    step = escalation(wasted, 4, DiagnosisSettings())
    assert step.action == "ignore"
    assert step.accumulated_loss_s == 0.0
    assert step.next_action == "re-split micro-batches"


NOISY = CostModel(first_stage_extra=0.0, last_stage_extra=0.0, noise_cv=0.15)


def _noisy(stragglers, seed):
    job = generate_job(
        JobSpec(dp=2, pp=2, microbatches=4, steps=60, cost=NOISY, stragglers=stragglers, seed=seed)
    )
    prepared = prepare(job.trace, job.meta)
    result = analyze(prepared)
    return result, diagnose(result, prepared)


@pytest.mark.parametrize("seed", range(4))
def test_a_noisy_healthy_job_is_healthy_and_its_floor_is_stated(seed):
    """15 % jitter on every op and nothing else: S clears the reference's 1.03 gate, yet it
    is the job's own floor, so nothing is named."""
    result, diagnosis = _noisy((), seed)
    assert result.slowdown >= 1.03  # the premise: the old gate alone would diagnose it
    assert diagnosis.cause == "none", diagnosis.summary
    assert "floor" in diagnosis.summary
    assert diagnosis.evidence.noise_floor == pytest.approx(result.slowdown, abs=0.03)


@pytest.mark.parametrize("seed", range(4))
def test_true_causes_stand_out_of_the_same_noise(seed):
    _, heavy = _noisy((LastStageImbalance(factor=1.4),), seed)
    assert heavy.cause == "last_stage_imbalance", heavy.summary
    _, slow = _noisy((SlowWorker(dp=1, stage=0, factor=1.6),), seed)
    assert slow.cause == "slow_workers", slow.summary
    assert [(w.dp, w.stage) for w in slow.evidence.verified_workers][:1] == [(1, 0)]
    assert "slow in backward-compute" in slow.summary


@pytest.mark.parametrize("seed", range(3))
def test_a_slow_worker_costing_more_than_a_stalling_host_is_named_first(seed):
    """A worker 1.6x slower in its ops and another whose host stalls 30 ms before each op:
    the stalls add ~90 ms to a step, the slow worker ~220 ms. Before, the stalling host was
    named first (its detector is asked first, as its stalls leave S alone); the worker that
    costs the job most is named, and the same stalls alone are still a slow host."""
    stall = LaunchDelay(dp=0, stage=1, delay_s=0.03)
    result, both = _noisy((SlowWorker(dp=1, stage=0, factor=1.6), stall), seed)
    assert float(np.mean(result.t_actual - result.t_nodelay)) < float(
        np.mean(result.t_nodelay - result.t_ideal)
    )  # the premise: the stalls cost less than the slow ops
    assert both.cause == "slow_workers", both.summary
    assert [(w.dp, w.stage) for w in both.evidence.verified_workers][:1] == [(1, 0)]
    _, alone = _noisy((stall,), seed)
    assert alone.cause == "slow_host", alone.summary
    assert "(dp 0, pp 1)" in alone.summary


@pytest.mark.parametrize("seed", range(3))
def test_a_stalling_host_beneath_the_job_s_noise_is_still_named(seed):
    """Stalls adding less than the job's own 15 % jitter does: asked after the ops, which
    name nothing beyond noise, so the host is named, not `none`."""
    result, diagnosis = _noisy((LaunchDelay(dp=0, stage=1, delay_s=0.005),), seed)
    assert float(np.mean(result.t_actual - result.t_nodelay)) < float(
        np.mean(result.t_nodelay - result.t_ideal)
    )  # the premise: the stalls were deferred
    assert diagnosis.cause == "slow_host", diagnosis.summary
    assert "(dp 0, pp 1)" in diagnosis.summary
