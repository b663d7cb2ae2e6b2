"""The step processor: windows, lateness, incremental analysis, roll-up, restart."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from lagscope.producers.events import JobInfo
from lagscope.producers.replay import default_job_id, iter_step_batches
from lagscope.simulator.generate import JobSpec, LastStageImbalance, SlowWorker, generate_job
from lagscope.store.snapshot_format import decode_state, encode_state
from lagscope.stream_app.processor import ProcessorSettings, StepProcessor
from tests.conftest import (
    analyzed_reference,
    assert_same_result,
    load_reference,
    straight_and_resumed,
)


class FakeClock:
    """A clock the test advances by hand (the processor's lateness is processing time)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stream_of(name_or_job, start_ns=1_700_000_000_000_000_000):
    if isinstance(name_or_job, str):
        trace, meta = load_reference(name_or_job)
    else:
        trace, meta = name_or_job.trace, name_or_job.meta
    job_id = default_job_id(meta)
    info = JobInfo.from_meta(meta, job_id=job_id)
    steps = list(iter_step_batches(trace, meta, job_id=job_id, start_wall_ns=start_ns))
    return info, steps


# AR and SE, the larger traces, take 7-11 s each: the edit loop checks ST.
@pytest.mark.parametrize(
    "name",
    [pytest.param("AR", marks=pytest.mark.slow), pytest.param("SE", marks=pytest.mark.slow), "ST"],
)
def test_rollup_equals_batch_analysis(reference_dir, name):
    info, steps = stream_of(name)
    processor = StepProcessor()
    processor.on_job(info)
    outputs = []
    for _, _, batches in steps:
        for batch in batches[::-1]:  # arrival order does not matter
            outputs.extend(processor.on_batch(batch))
    assert [o.step for o in outputs] == [s for _, s, _ in steps]
    assert all(o.complete and o.result is not None for o in outputs)
    rollup = processor.rollup(info.job_id)
    _, batch = analyzed_reference(name)
    assert rollup.slowdown == pytest.approx(batch.slowdown, rel=1e-3)
    assert rollup.launch_slowdown == pytest.approx(batch.launch_slowdown, rel=1e-3)
    assert rollup.mw.removed_share == pytest.approx(batch.mw.removed_share, rel=1e-3, abs=1e-4)
    assert rollup.ms.removed_share == pytest.approx(batch.ms.removed_share, rel=1e-3, abs=1e-4)
    for kind in ("by_optype", "by_dp_rank", "by_stage"):
        got, want = getattr(rollup, kind).overall, getattr(batch, kind).overall
        assert set(got) == set(want)
        for group in want:
            assert got[group] == pytest.approx(want[group], rel=1e-3), (kind, group)
    # Per-step simulated times do not depend on the ideal: they equal the batch ones.
    np.testing.assert_allclose([o.result.t_nodelay[0] for o in outputs], batch.t_nodelay, rtol=1e-4)


def test_missing_rank_closes_after_timeout_and_is_named(reference_dir):
    info, steps = stream_of("ST")
    clock = FakeClock()
    processor = StepProcessor(ProcessorSettings(lateness_s=10.0), clock)
    processor.on_job(info)
    outputs = []
    silent = (1, 2)  # dp 1, pp 2 stops reporting from the 10th step on
    for i, (_, _, batches) in enumerate(steps):
        clock.now += 1.0
        for batch in batches:
            if i >= 10 and (batch.dp_rank, batch.pp_rank) == silent:
                continue
            outputs.extend(processor.on_batch(batch))
        outputs.extend(processor.tick())
    clock.now += 100.0
    outputs.extend(processor.tick())
    assert len(outputs) == len(steps)
    incomplete = [o for o in outputs if not o.complete]
    assert [o.step for o in incomplete] == [s for _, s, _ in steps[10:]]
    for o in incomplete:
        assert o.missing == (silent,)
        # The replica that is whole (dp 0) is still analysed.
        assert o.result is not None and o.analysed_dp_ranks == (0,)
    assert processor.counters["steps_incomplete"] == len(steps) - 10
    # The rank's batch arriving after its step closed closes it again, whole: a new
    # version of its rows.
    late = [b for b in steps[12][2] if (b.dp_rank, b.pp_rank) == silent]
    (again,) = processor.on_batch(late[0])
    assert (again.step, again.complete, again.version) == (steps[12][1], True, 1)
    assert processor.counters["late_batches"] == 1


def test_duplicates_and_other_tp_ranks_are_dropped(reference_dir):
    info, steps = stream_of("ST")
    processor = StepProcessor()
    processor.on_job(info)
    _, _, batches = steps[0]
    for batch in batches[:-1]:
        assert processor.on_batch(batch) == []
    assert processor.on_batch(batches[0]) == []
    assert processor.counters["duplicate_batches"] == 1
    import dataclasses

    assert processor.on_batch(dataclasses.replace(batches[-1], tp_rank=1)) == []
    assert processor.counters["non_representative_batches"] == 1
    assert len(processor.on_batch(batches[-1])) == 1


@pytest.mark.parametrize("inputs_outside", [False, True])
def test_restart_from_state_gives_identical_results(reference_dir, inputs_outside):
    """Resuming from the state as the worker stores it (the safe state format) gives the
    same numbers, also when the retained steps' inputs are kept outside the state (the
    worker persists each once) and handed back on restore."""
    from lagscope.stream_app.processor import encode_step_inputs

    info, steps = stream_of("ST")
    outside: dict[int, bytes] = {}

    def inputs(job, wanted):
        assert job == (info.job_id, info.attempt)
        return {step: outside[step] for step in wanted}

    def run(split: int | None):
        processor = StepProcessor()
        processor.on_job(info)
        outs = []
        for i, (_, _, batches) in enumerate(steps):
            for j, batch in enumerate(batches):
                if split is not None and (i, j) == (split, 3):
                    for job in processor.jobs.values():
                        outside.update(
                            {int(p.steps[0]): encode_step_inputs(p) for p in job.retained}
                        )
                    state = encode_state(
                        processor.state_dict(with_retained_inputs=not inputs_outside)
                    )
                    # Without inputs the state is lighter by (almost) all of them.
                    full = len(encode_state(processor.state_dict()))
                    lean = len(encode_state(processor.state_dict(with_retained_inputs=False)))
                    assert full - lean > 0.8 * sum(len(v) for v in outside.values())
                    processor = StepProcessor.from_state(
                        decode_state(state), retained_inputs=inputs
                    )
                outs.extend(processor.on_batch(batch))
        return outs, processor

    straight, p1 = run(None)
    resumed, p2 = run(17)
    assert [o.step for o in resumed] == [o.step for o in straight]
    for a, b in zip(straight, resumed, strict=True):
        assert_same_result(a.result, b.result, f"step {a.step}")
        assert a.changes == b.changes
    assert p1.rollup(info.job_id).slowdown == p2.rollup(info.job_id).slowdown


def test_retained_inputs_of_an_earlier_version_restore():
    """A snapshot's retained step written before the GC pauses in host gaps were kept
    restores with none (as then); one with a field no version wrote is refused."""
    from lagscope.store.snapshot_format import SnapshotError
    from lagscope.stream_app.processor import decode_step_inputs, encode_step_inputs

    info, steps = stream_of("ST")
    processor = StepProcessor()
    processor.on_job(info)
    for _, _, batches in steps[:3]:
        for batch in batches:
            processor.on_batch(batch)
    (job,) = processor.jobs.values()
    first = job.retained[0]
    inputs = decode_state(encode_step_inputs(first))
    del inputs["gc_gap_pause"]
    restored = decode_step_inputs(encode_state(inputs))
    assert restored["gc_gap_pause"] is None
    assert restored["steps"].tolist() == first.steps.tolist()
    with pytest.raises(SnapshotError, match="not the inputs of a retained step"):
        decode_step_inputs(encode_state({**inputs, "unknown": 1}))


def test_change_points_of_a_slow_worker_episode():
    spec = JobSpec(
        dp=2,
        pp=2,
        microbatches=4,
        steps=90,
        name="episode",
        seed=5,
        stragglers=(SlowWorker(dp=1, stage=0, factor=1.6, start_step=40, end_step=70),),
    )
    changes = [c for out in _outputs(spec)[1] for c in out.changes]
    step_time = [c for c in changes if c.series == "step_time"]
    kinds = [(c.kind, c.step) for c in step_time]
    assert [k for k, _ in kinds] == ["onset", "recovery"], kinds
    assert abs(kinds[0][1] - 40) <= 3 and abs(kinds[1][1] - 70) <= 3
    assert any(c.series == "dp/1" and c.kind == "onset" for c in changes)


def test_a_rank_step_in_several_parts_is_merged(reference_dir):
    """The timer splits huge steps into several batches of the same rank-step: the parts
    are joined, only exact re-sends are dropped, and the result equals the whole's."""
    import dataclasses

    info, steps = stream_of("ST")
    batches = steps[0][2]
    whole = StepProcessor()
    whole.on_job(info)
    expected = next(o for b in batches for o in whole.on_batch(b))

    first, half = batches[0], batches[0].n_ops // 2
    columns = ("optype", "microbatch", "chunk", "seq", "start_ns", "duration_ns")
    parts = [
        dataclasses.replace(first, **{c: getattr(first, c)[sl] for c in columns})
        for sl in (slice(0, half), slice(half, None))
    ]
    split = StepProcessor()
    split.on_job(info)
    outputs = []
    for batch in [parts[0], parts[0], parts[1], *batches[1:]]:
        outputs.extend(split.on_batch(batch))
    assert split.counters["duplicate_batches"] == 1
    assert len(outputs) == 1
    assert outputs[0].result.t_nodelay[0] == expected.result.t_nodelay[0]
    assert outputs[0].result.slowdown == expected.result.slowdown


@pytest.mark.slow  # the processor run over many groupings (~6 s)
def test_outputs_do_not_depend_on_how_input_is_grouped(reference_dir):
    """A backlog is analysed per call, vectorized; a crash replay regroups the input.
    Step results, change points and the ideal must be the same bit for bit."""
    import dataclasses

    job = generate_job(
        JobSpec(
            dp=4,
            pp=2,
            microbatches=4,
            steps=60,
            name="grouping",
            seed=11,
            stragglers=(SlowWorker(dp=2, stage=1, factor=1.7, start_step=25, end_step=45),),
        )
    )
    info, steps = stream_of(job)
    batches = []
    for i, (_, _, step_batches) in enumerate(steps):
        for batch in step_batches:
            if i in (30, 31) and (batch.dp_rank, batch.pp_rank) == (3, 0):
                continue  # two steps close incomplete, at the end of input
            if i == 40 and (batch.dp_rank, batch.pp_rank) == (1, 1):
                # An op the job's model has never seen: the step cannot be analysed.
                batch = dataclasses.replace(batch, seq=batch.seq + 1000)
            batches.append(batch)

    def run(cuts):
        processor = StepProcessor()
        processor.on_job(info)
        outputs = []
        for lo, hi in itertools.pairwise(cuts):
            outputs.extend(processor.on_batches(batches[lo:hi]))
        return outputs + processor.flush()

    one_by_one = run(list(range(len(batches) + 1)))
    rng = np.random.default_rng(3)
    cuts = sorted({0, len(batches), *rng.integers(0, len(batches), 12).tolist()})
    for grouped in (run([0, len(batches)]), run(cuts)):
        assert [(o.step, o.complete, o.missing, o.reason) for o in grouped] == [
            (o.step, o.complete, o.missing, o.reason) for o in one_by_one
        ]
        for a, b in zip(grouped, one_by_one, strict=True):
            assert (a.result is None) == (b.result is None)
            if a.result is not None:
                assert_same_result(a.result, b.result, f"step {a.step}")
            assert a.changes == b.changes
    by_step = {o.step: o for o in one_by_one}
    step_ids = [s for _, s, _ in steps]
    bad = by_step[step_ids[40]]
    assert bad.result is None and "does not occur" in bad.reason
    assert {o.step for o in one_by_one if not o.complete} == {step_ids[30], step_ids[31]}
    assert any(c.kind == "onset" for o in one_by_one for c in o.changes)


def _outputs(
    spec: JobSpec, settings: ProcessorSettings | None = None
) -> tuple[StepProcessor, list]:
    """The generated job through a processor batch by batch: it, and every step's output."""
    info, steps = stream_of(generate_job(spec))
    processor = StepProcessor(settings)
    processor.on_job(info)
    outputs = [out for _, _, batches in steps for b in batches for out in processor.on_batch(b)]
    return processor, outputs


def _episodes_while_running(spec: JobSpec, settings: ProcessorSettings | None = None) -> list:
    """(step, episode state) for every episode state a host would store, step by step."""
    return [(out.step, state) for out in _outputs(spec, settings)[1] for state in out.episodes]


@pytest.mark.parametrize("end_step", [None, 30])
@pytest.mark.parametrize("retained", ["256 steps", "1 step"])
def test_a_worker_slow_from_the_first_step_is_an_episode_from_its_first_diagnosis(
    end_step, retained
):
    """No rise for the detector to see, yet a straggler: the job's first diagnosis verifies
    it, and it is an episode from the job's first step on, named as such, closed when the
    worker recovers. Also where the job retains fewer steps than a stretch needs (a large
    job keeps 4 at 100,000 GPUs): the detector's own history has them."""
    slow = SlowWorker(dp=1, stage=0, factor=1.6, start_step=0, end_step=end_step)
    spec = JobSpec(dp=2, pp=2, microbatches=4, steps=45, name="standing", seed=5,
                   stragglers=(slow,))  # fmt: skip
    settings = ProcessorSettings(rollup_budget_bytes=1 if retained == "1 step" else 96 << 20)
    found = _episodes_while_running(spec, settings)
    assert found, "no episode"
    assert {(s.episode.dp, s.episode.stage) for _, s in found} == {(1, 0)}
    first_step, first = found[0]
    assert first.episode.onset == 0 and first.episode.standing
    # Seen at the first diagnosis (the 10th step), as the store shows it from then on.
    assert first_step == first.episode.first_seen == 9
    assert first.diagnosis.cause == "slow_workers"
    assert "with no quicker level of its own before" in first.diagnosis.summary
    assert first.cost.lost_s > 0 and first.diagnosis.escalation.accumulated_loss_s > 0
    last = found[-1][1]
    if end_step is None:
        assert last.episode.open
    else:
        assert abs(last.episode.recovery - end_step) <= 3


def test_an_episode_found_after_its_steps_left_the_window_counts_their_loss():
    """A job that retains one step finds a worker slow from step 0 at its 10th step:
    the 9 steps it no longer holds are estimated from the detector's history of the
    worker (its rise in each, passed on as the priced step passed its own), so the job's
    loss is that of a job that held them all, not a tenth of it, and says so."""
    slow = SlowWorker(dp=1, stage=0, factor=1.6, start_step=0)
    spec = JobSpec(dp=2, pp=2, microbatches=4, steps=45, name="standing", seed=5,
                   stragglers=(slow,))  # fmt: skip
    firsts = {}
    for retained, budget in (("all", 96 << 20), ("one", 1)):
        found = _episodes_while_running(spec, ProcessorSettings(rollup_budget_bytes=budget))
        firsts[retained] = found[0][1]
    held, estimated = firsts["all"].cost, firsts["one"].cost
    assert held.steps == estimated.steps == 10 and held.estimated_steps == 0
    assert estimated.estimated_steps == 9 and 0 < estimated.estimated_s < estimated.lost_s
    assert estimated.lost_s == pytest.approx(held.lost_s, rel=0.1)
    assert "estimated for its first 9 step(s)" in firsts["one"].diagnosis.summary
    assert "estimated" not in firsts["all"].diagnosis.summary


def test_an_estimated_episode_cost_resumes_from_a_snapshot():
    """The estimated part of an episode's cost is part of the job's state: a worker
    restarted from a snapshot after the episode was found goes on with the same costs."""
    slow = SlowWorker(dp=1, stage=0, factor=1.6, start_step=0)
    spec = JobSpec(dp=2, pp=2, microbatches=4, steps=20, name="standing", seed=5,
                   stragglers=(slow,))  # fmt: skip
    settings = ProcessorSettings(rollup_budget_bytes=1)
    info, steps = stream_of(generate_job(spec))
    straight, resumed = straight_and_resumed(info, steps, settings, cut=12)[:2]
    want = [s for out in straight for s in out.episodes]
    got = [s for out in resumed for s in out.episodes]
    assert want and want[0].cost.estimated_steps == 9
    assert [(s.at_step, s.cost) for s in got] == [(s.at_step, s.cost) for s in want]


def test_a_pause_concluded_mid_run_moves_no_diagnosis():
    """A job concluded at a pause (a checkpoint longer than the worker's idle time)
    and resumed is diagnosed at the steps of a job that never paused, and its straggler
    is found at the same step: what a host stores does not depend on the pauses it saw."""
    slow = SlowWorker(dp=1, stage=0, factor=1.6, start_step=0)
    spec = JobSpec(dp=2, pp=2, microbatches=4, steps=30, name="paused", seed=5,
                   stragglers=(slow,))  # fmt: skip
    info, steps = stream_of(generate_job(spec))

    def run(pause_after: int | None) -> tuple[list, list]:
        processor = StepProcessor()
        processor.on_job(info)
        outputs = []
        for index, (_, _, batches) in enumerate(steps):
            outputs += [o for b in batches for o in processor.on_batch(b)]
            if index == pause_after:
                assert processor.conclude(info.job_id) is not None
        diagnosed = [o.step for o in outputs if o.diagnosis is not None]
        return diagnosed, [(o.step, s.episode.first_seen) for o in outputs for s in o.episodes]

    straight, paused = run(None), run(1)
    assert straight[0] == [9, 29] and straight[1]
    assert paused == straight


def test_a_job_that_ends_on_a_diagnosis_step_concludes_on_its_roll_up():
    """A job that ends right after its diagnosis (its 30th step here) concludes on the
    same retained steps: the conclusion takes that roll-up (at 100,000 GPUs, half a
    second to make again) and says what a roll-up made anew says. A step closed again by
    its late batches is another step: the roll-up after it is made anew."""
    slow = SlowWorker(dp=1, stage=0, factor=1.6, start_step=5)
    spec = JobSpec(dp=2, pp=2, microbatches=4, steps=30, name="ends", seed=5,
                   stragglers=(slow,))  # fmt: skip
    info, steps = stream_of(generate_job(spec))

    def concluded(forget_rollup: bool):
        processor = StepProcessor()
        processor.on_job(info)
        outputs = [o for _, _, batches in steps for b in batches for o in processor.on_batch(b)]
        if forget_rollup:
            processor.live_job(info.job_id)._last_rollup = None
        return outputs[-1].diagnosis, processor.conclude(info.job_id).diagnosis

    last, reused = concluded(forget_rollup=False)
    assert last is not None and last.step == 29, "the job must end on a diagnosis step"
    assert reused.final and reused.rollup is last.rollup
    _, anew = concluded(forget_rollup=True)
    assert anew.rollup is not last.rollup
    assert_same_result(reused.rollup, anew.rollup, "the conclusion")
    assert reused.run == anew.run and reused.verdict.summary == anew.verdict.summary
    assert reused.run.cause == "slow_workers"

    processor = StepProcessor()
    processor.on_job(info)
    for _, _, batches in steps:
        for batch in batches:
            processor.on_batch(batch)
    job = processor.jobs[info.job_id, info.attempt]
    window = list(job.retained)
    first = job.live._roll_up(window, 0.0)[1]
    assert job.live._roll_up(window, 0.0)[1] is first
    assert job.live._roll_up(window, 0.5)[1] is not first  # another threshold
    again = job.live._roll_up(window, 0.0)[1]
    window[3] = dataclasses.replace(window[3])  # the same step, closed again
    assert job.live._roll_up(window, 0.0)[1] is not again


def test_a_healthy_generated_job_adopts_no_episode():
    spec = JobSpec(dp=2, pp=2, microbatches=4, steps=45, name="healthy", seed=5)
    assert _episodes_while_running(spec) == []


def test_a_heavier_last_stage_escalates_on_what_the_job_lost_to_it():
    """No episode prices a heavier last stage (no worker is a straggler): the diagnosis'
    escalation counts the job's loss above its straggler-free time, as `lagscope analyze`
    does, where it read 0 s lost while the stage explained all of the slowdown."""
    spec = JobSpec(dp=2, pp=2, microbatches=4, steps=45, name="heavier", seed=5,
                   stragglers=(LastStageImbalance(factor=1.5),))  # fmt: skip
    processor, outputs = _outputs(spec)
    diagnoses = [out.diagnosis for out in outputs if out.diagnosis is not None]
    assert diagnoses and all(d.run.cause == "last_stage_imbalance" for d in diagnoses)
    losses = [d.run.escalation.accumulated_loss_s for d in diagnoses]
    assert losses[0] > 0 and losses == sorted(losses)
    assert processor.live_job("heavier-0").named == {}  # a stage is no worker's episode


def test_a_backlog_prices_its_open_episodes_as_steps_one_at_a_time():
    """A backlog's steps price an open episode in one engine pass (`LiveJob.price_ahead`):
    every episode state, its cost included, is the one of the steps taken one by one."""
    slow = SlowWorker(dp=1, stage=0, factor=1.6, start_step=0, end_step=30)
    spec = JobSpec(dp=2, pp=2, microbatches=4, steps=45, name="backlog", seed=5,
                   stragglers=(slow,))  # fmt: skip
    one_by_one = [s for _, s in _episodes_while_running(spec)]
    info, steps = stream_of(generate_job(spec))
    processor = StepProcessor()
    processor.on_job(info)
    # Two backlogs: the episode opens in the first, the second prices it ahead.
    at_once = [
        s
        for part in (steps[:15], steps[15:])
        for out in processor.on_batches([b for _, _, batches in part for b in batches])
        for s in out.episodes
    ]
    assert len(one_by_one) > 20
    assert [(s.at_step, s.cost, s.episode.recovery) for s in at_once] == [
        (s.at_step, s.cost, s.episode.recovery) for s in one_by_one
    ]


def test_a_resumed_job_tells_its_story_again_where_an_uninterrupted_one_does():
    """An episode that opens or closes after a resume is told in a diagnosis of its step,
    composed on the job's last roll-up, as an uninterrupted run tells it: the roll-up is
    part of the state. Before, a resumed job had none and stored no diagnosis at those
    steps (a rebalance changed the `diagnoses` rows)."""
    slow = SlowWorker(dp=1, stage=0, factor=1.8, start_step=25, end_step=45)
    spec = JobSpec(dp=2, pp=2, microbatches=4, steps=60, name="story", seed=5,
                   stragglers=(slow,))  # fmt: skip
    info, steps = stream_of(generate_job(spec))
    straight, resumed = straight_and_resumed(info, steps, ProcessorSettings(), cut=35)[:2]

    def diagnoses(outputs: list) -> list[tuple[int, int, str, str]]:
        return [(o.step, int(o.diagnosis.rollup.steps[-1]), o.diagnosis.verdict.summary,
                 o.diagnosis.run.summary) for o in outputs if o.diagnosis is not None]  # fmt: skip

    want = diagnoses(straight)
    # Diagnosed at steps 9 and 29 (the episode opened there), resumed at 35, the episode
    # closed at 47: told there on the roll-up of step 29.
    assert [(step, rolled_up) for step, rolled_up, *_ in want] == [(9, 9), (29, 29), (47, 29)]
    assert diagnoses(resumed) == want


def _two_workers(steps: int) -> tuple[JobInfo, list[list]]:
    """A generated DP 2 job's batches, per step [(dp 0)'s, (dp 1)'s]."""
    info, stream = stream_of(generate_job(
        JobSpec(dp=2, pp=1, microbatches=2, steps=steps, name="paced", seed=3)
    ))  # fmt: skip
    return info, [sorted(batches, key=lambda b: b.dp_rank) for _, _, batches in stream]


def test_a_rank_that_delivers_at_its_own_pace_is_waited_for_and_a_dead_one_is_not():
    """(dp 0) sends each step as it ends; (dp 1) sends 30 steps at a time, every 3 s (its
    timer's seals). Its steps wait for it, far past the 2 s a fixed timeout gave them:
    it still delivers. Then it dies: its steps close without it once it has been silent
    for the job's lateness (3 x its 3 s gaps + 2 steps, ~9 s: not the 30 s ceiling), each
    saying why, and the steps after close as soon as (dp 0)'s batch is in."""
    info, steps = _two_workers(200)
    clock = FakeClock()
    processor = StepProcessor(ProcessorSettings(lateness_s=30.0), clock)
    processor.on_job(info)
    closed: list[tuple[float, object]] = []

    def deliver(batch, at: float) -> None:
        clock.now = at
        closed.extend((at, o) for o in processor.on_batches([batch], arrivals=[(at, 0.0)]))

    for index, (first, _second) in enumerate(steps):
        at = 0.1 * (index + 1)
        if index < 60 and index % 30 == 0:  # (dp 1)'s seals: steps 0-29 at 3 s, 30-59 at 6 s
            for earlier in range(index, index + 30):
                deliver(steps[earlier][1], 3.0 * (index // 30 + 1))
        deliver(first, max(at, clock.now))
        clock.now = max(at, clock.now)
        closed.extend((clock.now, o) for o in processor.tick())
    for _ in range(100):
        clock.now += 0.1
        closed.extend((clock.now, o) for o in processor.tick())
    outputs = [o for _, o in closed]
    assert [o.step for o in outputs] == list(range(200))
    assert all(o.complete for o in outputs[:60])
    dead = [(at, o) for at, o in closed if not o.complete]
    assert [o.step for _, o in dead] == list(range(60, 200))
    first_cut = dead[0][0]
    arrivals = processor.jobs[info.job_id, info.attempt].arrivals
    lateness = arrivals.lateness_s(first_cut)
    step_s = arrivals.step_time_s()  # the generated job's own step time
    assert lateness == pytest.approx(3 * 3.0 + 2 * step_s) and lateness < 30
    assert 6.0 + lateness <= first_cut < 6.0 + lateness + 0.11, (first_cut, lateness)
    assert f"(dp 1, pp 0) sent nothing for {first_cut - 6.0:.1f} s" in dead[0][1].missing_reason
    # Once it is overdue, a step closes at the tick after (dp 0)'s batch.
    assert all(at - 0.1 * (o.step + 1) < 0.2 for at, o in dead if at > first_cut + 0.5)


def test_a_step_every_rank_has_passed_closes_at_once():
    """(dp 1) sends no batch of step 10 (it skipped it) but step 11's: once (dp 0) sent
    step 11 too, step 10 has all the batches it will get and closes there, saying why,
    without waiting for a timeout."""
    info, steps = _two_workers(20)
    clock = FakeClock()
    processor = StepProcessor(ProcessorSettings(lateness_s=30.0), clock)
    processor.on_job(info)
    outputs = []
    for index, (first, second) in enumerate(steps):
        outputs += processor.on_batch(first)
        if index != 10:
            outputs += processor.on_batch(second)
    assert [o.step for o in outputs] == list(range(20))
    (skipped,) = [o for o in outputs if not o.complete]
    assert skipped.step == 10 and skipped.missing == ((1, 0),)
    assert skipped.missing_reason == "(dp 1, pp 0) sent step 11 but not this one"
    assert clock.now == 0.0  # no time passed: no timeout closed it


def test_late_batches_close_their_steps_again_or_are_set_aside_saying_why():
    """(dp 1) goes silent at step 10 and comes back at step 90 with the steps it owed:
    its steps closed without it, and the job holds the batches of its latest 64 such
    steps. Those close again, whole (version 1, the job's totals counting them complete,
    retained for its roll-up); the batches of the older ones are set aside saying so, and
    their steps stand incomplete."""
    info, steps = _two_workers(100)
    clock = FakeClock()
    processor = StepProcessor(ProcessorSettings(lateness_s=2.0), clock)
    processor.on_job(info)
    outputs = []
    for index, (first, second) in enumerate(steps):
        clock.now += 1.0
        if index == 90:
            for owed in range(10, 90):
                outputs += processor.on_batch(steps[owed][1])
        outputs += processor.on_batch(first)
        if not 10 <= index < 90:
            outputs += processor.on_batch(second)
        outputs += processor.tick()
    first_closing = {o.step: o for o in outputs if o.version == 0}
    assert sorted(first_closing) == list(range(100))
    assert [s for s, o in first_closing.items() if not o.complete] == list(range(10, 90))
    again = [o for o in outputs if o.version]
    assert [(o.step, o.version, o.complete) for o in again] == [
        (step, 1, True) for step in range(26, 90)
    ]
    aside = processor.take_rejected()
    assert [b.step for b, _ in aside] == list(range(10, 26))
    assert aside[0][1].startswith("late: step 10 of paced-0/0 closed without (dp 1, pp 0)")
    assert processor.counters["late_batches_set_aside"] == 16
    job = processor.jobs[info.job_id, info.attempt]
    totals = job.live.totals
    assert (totals.complete_steps, totals.incomplete_steps) == (100 - 16, 16)
    assert totals.steps == 100
    assert 89 in {int(p.steps[0]) for p in job.retained}


def test_a_long_job_keeps_its_costliest_closed_episodes_and_the_price_of_all(monkeypatch):
    """A day of a worker that flaps opens hundreds of episodes: a job keeps the costliest
    `CLOSED_EPISODES_KEPT` closed ones (here 1), the price of those it let go stays in
    its straggler cost, and a snapshot carries both. Its detector keeps only the episodes
    its history still holds."""
    from lagscope.simulator import job_story

    spec = JobSpec(dp=2, pp=2, microbatches=4, steps=100, name="flaps", seed=5, stragglers=(
        SlowWorker(dp=1, stage=0, factor=1.8, start_step=15, end_step=30),
        SlowWorker(dp=0, stage=1, factor=1.5, start_step=55, end_step=70),
    ))  # fmt: skip
    everything = next(iter(_outputs(spec)[0].jobs.values())).live
    prices = {s.episode.onset: s.cost.price_s for s in everything.episodes()}
    assert set(prices) == {15, 55} and prices[15] > prices[55]
    assert [e.onset for e in everything.detector.episodes] == [55]
    monkeypatch.setattr(job_story, "CLOSED_EPISODES_KEPT", 1)
    info, steps = stream_of(generate_job(spec))
    _, _, straight, resumed = straight_and_resumed(info, steps, ProcessorSettings(), cut=80)
    for processor in (straight, resumed):
        live = processor.jobs[info.job_id, info.attempt].live
        assert [s.episode.onset for s in live.episodes()] == [15]
        assert (live.forgotten_episodes, live.named_count) == (1, 2)
        assert live.straggler_gpu_seconds() == pytest.approx(everything.straggler_gpu_seconds())
