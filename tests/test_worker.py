"""`lagscope worker` (faust-streaming) against the real local broker and a real chDB store:
end to end on the reference traces, kill -9 at many points, a rank that stops reporting."""

from __future__ import annotations

import json
import random
import time

import numpy as np
from confluent_kafka import Producer

from lagscope.producers.replay import iter_step_batches, replay
from tests.conftest import REFERENCE_NAMES, analyzed_reference, load_reference
from tests.kafka_util import consume_all
from tests.worker_util import (
    create_topics,
    kafka_config,
    query_store,
    results_topic,
    st_job_announced,
    start_worker,
    wait_for_log,
)


def test_reference_traces_through_kafka_match_the_batch_analysis(
    kafka_bootstrap, kafka_topics, tmp_path
):
    create_topics(kafka_bootstrap, kafka_topics, ops_partitions=2)
    config = kafka_config(kafka_bootstrap, kafka_topics)
    for name in REFERENCE_NAMES:
        trace, meta = load_reference(name)
        replay(trace, meta, kafka=config, job_id=name, progress=None)
    # A message that is no batch: it must land in dead_letters, the rest flows on.
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    producer.produce(kafka_topics["topic_ops"], key=b"AR", value=b"not a batch")
    producer.flush(10)

    worker = start_worker(kafka_bootstrap, kafka_topics, tmp_path / "w", group="e2e")
    assert worker.wait(180) == 0, worker.log()[-4000:]
    # The idle exit's summary is a line of JSON of its own, for scripts: not a warning.
    summaries = [json.loads(line) for line in worker.log().splitlines()
                 if line.startswith('{"worker_counters"')]  # fmt: skip
    assert len(summaries) == 1 and summaries[0]["worker_counters"]["ops"] > 0, worker.log_path
    assert not [line for line in worker.log().splitlines()
                if "WARN" in line and ("worker_counters" in line or "overlapping" in line)
                ], worker.log_path  # fmt: skip

    steps = query_store(
        tmp_path / "w",
        "SELECT job_id, count() AS n, uniqExact(step) AS unique_steps, "
        "countIf(complete) AS complete FROM steps GROUP BY job_id ORDER BY job_id",
    )
    diagnoses = query_store(
        tmp_path / "w",
        "SELECT job_id, step, JSONExtractFloat(evidence, 'slowdown') AS slowdown "
        "FROM diagnoses FINAL ORDER BY job_id, step",
    )
    per_job = {row["job_id"]: row for row in steps}
    rollups = {row["job_id"]: row for row in diagnoses}
    for name in REFERENCE_NAMES:
        _, result = analyzed_reference(name)
        n_steps = len(np.unique(load_reference(name)[0].step))
        assert per_job[name]["n"] == per_job[name]["unique_steps"] == n_steps
        assert per_job[name]["complete"] == n_steps
        assert rollups[name]["step"] == int(result.steps[-1])
        assert abs(rollups[name]["slowdown"] / result.slowdown - 1) < 1e-3, name

    # Each replay ran to its end: its job reads ended (every rank said so), not silent,
    # and its ranks, which name no machine, add no machine row.
    ended = query_store(
        tmp_path / "w",
        "SELECT job_id, world_size, ranks_ended, ended_at IS NOT NULL AS ended FROM jobs FINAL",
    )
    assert {row["job_id"] for row in ended} == set(REFERENCE_NAMES)
    assert all(row["ranks_ended"] == row["world_size"] and row["ended"] for row in ended), ended
    assert query_store(tmp_path / "w", "SELECT count() AS n FROM rank_identity") == [{"n": 0}]

    dead = query_store(tmp_path / "w", "SELECT source, reason FROM dead_letters")
    assert len(dead) == 1 and "too short" in dead[0]["reason"], dead
    assert kafka_topics["topic_ops"] in dead[0]["source"]

    published = [
        json.loads(m.value) for m in consume_all(kafka_bootstrap, results_topic(kafka_topics))
    ]
    step_messages = {(m["job_id"], m["step"]) for m in published if m["kind"] == "step"}
    assert len(step_messages) == sum(row["n"] for row in steps)
    sample = next(m for m in published if m["kind"] == "step" and m["job_id"] == "AR")
    assert {"slowdown", "waste", "actual_s", "simulated_s", "ideal_s", "complete", "missing",
            "top_attributions", "changepoints"} <= set(sample)  # fmt: skip
    rollup_messages = {m["job_id"]: m for m in published if m["kind"] == "rollup"}
    assert abs(rollup_messages["SE"]["slowdown"] / analyzed_reference("SE")[1].slowdown - 1) < 1e-3


_STEP_COLUMNS = (
    "step, complete, actual_s, simulated_s, ideal_s, slowdown, waste, gpu_seconds_wasted"
)


def test_kill_9_at_many_points_loses_and_duplicates_no_step(
    kafka_bootstrap, kafka_topics, tmp_path
):
    create_topics(kafka_bootstrap, kafka_topics)
    config = kafka_config(kafka_bootstrap, kafka_topics)
    trace, meta = load_reference("AR")
    # Enough steps that no run gets through them all before its kill: with these small
    # passes a worker drains AR at ~0.1M ops/s (4.7M ops in 45 s), and each run is killed
    # within ~2 s of its first checkpoint, so 20 repeats (2.3M ops) outlast five runs with
    # most of the job left for the final worker (which processed 95% of 40 repeats).
    repeat = 20
    replay(trace, meta, kafka=config, job_id="AR", repeat=repeat, progress=None)
    n_steps = repeat * len(np.unique(trace.step))
    # Steps are written far more often than snapshots are taken, so most kills leave
    # steps in the store that the next worker re-closes from an older snapshot.
    fast = {
        "LAGSCOPE_WORKER__CHECKPOINT_INTERVAL_S": "1.0",
        "LAGSCOPE_WORKER__WRITE_INTERVAL_S": "0.05",
        "LAGSCOPE_WORKER__WRITE_EVERY_STEPS": "2",
        "LAGSCOPE_WORKER__TICK_INTERVAL_S": "0.2",
        # Small passes (~30 batches), so kills land mid-window and mid-pass.
        "LAGSCOPE_WORKER__FETCH_MAX_BYTES": "131072",
        "LAGSCOPE_WORKER__TAKE_MAX_RUNS": "1",
    }

    # The uninterrupted run: another group, another store.
    reference = start_worker(kafka_bootstrap, kafka_topics, tmp_path / "ref", group="ref", env=fast)
    assert reference.wait(180) == 0, reference.log()[-4000:]

    rng = random.Random(5)
    work = tmp_path / "crash"
    kills = 0
    for attempt in range(5):
        worker = start_worker(kafka_bootstrap, kafka_topics, work, group="crash", env=fast,
                              log_name=f"worker-{attempt}.log")  # fmt: skip
        # Let it make progress past at least one durable checkpoint, then kill it at a
        # random moment: mid-window, mid-write or mid-snapshot.
        wait_for_log(worker, "checkpoint ", 1, timeout_s=120)
        time.sleep(rng.uniform(0.0, 0.5))
        if worker.process.poll() is None:
            worker.kill9()
            kills += 1
    assert kills >= 5
    final = start_worker(kafka_bootstrap, kafka_topics, work, group="crash", env=fast,
                         log_name="worker-final.log")  # fmt: skip
    assert final.wait(180) == 0, final.log()[-4000:]
    logs = "".join(p.read_text() for p in work.glob("worker-*.log"))
    assert logs.count("restored snapshot") >= 5
    assert "were already stored" in logs  # the re-processing path was exercised

    counts = query_store(
        work,
        "SELECT count() AS rows, uniqExact(job_id, attempt, step) AS steps FROM steps",
    )[0]
    assert counts == {"rows": n_steps, "steps": n_steps}
    order = f"SELECT {_STEP_COLUMNS} FROM steps ORDER BY step"
    assert query_store(work, order) == query_store(tmp_path / "ref", order)
    # The derived tables hold no duplicate either (counted without FINAL).
    for table in ("attribution", "worker_slowdown"):
        sql = f"SELECT count() AS n FROM {table}"
        assert query_store(work, sql) == query_store(tmp_path / "ref", sql), table
    rollup = "SELECT step, evidence FROM diagnoses FINAL ORDER BY step"
    assert query_store(work, rollup)[-1] == query_store(tmp_path / "ref", rollup)[-1]


def test_a_rank_that_stops_reporting_closes_its_steps_after_the_timeout(
    kafka_bootstrap, kafka_topics, tmp_path
):
    trace, meta, producer = st_job_announced(kafka_bootstrap, kafka_topics)
    silent = (1, 2)  # (dp, pp) that goes quiet from step index 16 on
    steps = []
    for index, (_, step, batches) in enumerate(
        iter_step_batches(trace, meta, job_id="ST", start_wall_ns=time.time_ns())
    ):
        steps.append(step)
        for batch in batches:
            if index >= 16 and (batch.dp_rank, batch.pp_rank) == silent:
                continue
            producer.produce(kafka_topics["topic_ops"], key=b"ST", value=batch.encode())
    producer.flush(30)

    worker = start_worker(
        kafka_bootstrap,
        kafka_topics,
        tmp_path / "w",
        group="late",
        env={"LAGSCOPE_PROCESSOR__LATENESS_S": "2"},
    )
    assert worker.wait(180) == 0, worker.log()[-4000:]
    rows = query_store(
        tmp_path / "w",
        "SELECT step, complete, missing_ranks, slowdown FROM steps FINAL ORDER BY step",
    )
    assert [r["step"] for r in rows] == steps
    silent_rank = (silent[1] * meta.dp_size + silent[0]) * meta.tp_size * meta.dsp_size
    for index, row in enumerate(rows):
        if index < 16:
            assert row["complete"] and row["missing_ranks"] == []
        else:
            assert not row["complete"] and row["missing_ranks"] == [silent_rank]
            # the replicas that did report are still analysed
            assert row["slowdown"] is not None and row["slowdown"] >= 1.0
    published = [
        json.loads(m.value) for m in consume_all(kafka_bootstrap, results_topic(kafka_topics))
    ]
    late = [m for m in published if m["kind"] == "step" and not m["complete"]]
    assert late and all(m["missing"] == [{"dp": silent[0], "pp": silent[1]}] for m in late)


def test_a_worker_restored_at_the_end_of_a_job_closes_the_step_a_rank_never_finished(
    kafka_bootstrap, kafka_topics, tmp_path
):
    """The job's last step reached a worker that had caught up, from every rank but one (a
    rank that died, or ops of a step its training loop never finished); the worker
    snapshotted it open and was killed before its lateness timeout. The next worker
    restores that snapshot at the partition's end: no record will come to move the
    record-time clock the window waits on, so the wall clock must close the step, and the
    worker must conclude the job and idle out. (Seen in CI: a rebalance after a job's last
    records left the window open, and the worker up, for good.)"""
    trace, meta, producer = st_job_announced(kafka_bootstrap, kafka_topics)
    steps = list(iter_step_batches(trace, meta, job_id="ST", start_wall_ns=time.time_ns()))
    sent = 0

    def send(batches: list) -> None:
        nonlocal sent
        for batch in batches:
            producer.produce(kafka_topics["topic_ops"], key=b"ST", value=batch.encode())
            sent += 1
        producer.flush(30)

    work = tmp_path / "w"
    first = start_worker(kafka_bootstrap, kafka_topics, work, group="end", exit_when_idle_s=None,
                         env={"LAGSCOPE_PROCESSOR__LATENESS_S": "600",
                              "LAGSCOPE_WORKER__CHECKPOINT_INTERVAL_S": "1.0"},
                         log_name="first.log")  # fmt: skip
    send([batch for _, _, batches in steps[:-1] for batch in batches])
    wait_for_log(first, f"next offset {sent} ", 1, timeout_s=120)  # caught up
    send(steps[-1][2][:-1])  # the last step, one rank short, while the worker is live
    wait_for_log(first, f"next offset {sent} ", 1, timeout_s=60)
    time.sleep(3.0)  # its offset committed too (every second): the next worker reads nothing
    first.kill9()
    second = start_worker(kafka_bootstrap, kafka_topics, work, group="end",
                          env={"LAGSCOPE_PROCESSOR__LATENESS_S": "2"},
                          log_name="second.log")  # fmt: skip
    assert second.wait(90) == 0, second.log()[-4000:]
    assert "restored snapshot" in second.log()
    assert "idle for" in second.log()  # after concluding the job
    rows = query_store(work, "SELECT step, complete FROM steps FINAL ORDER BY step")
    assert [r["step"] for r in rows] == [step for _, step, _ in steps]
    assert [r["complete"] for r in rows] == [True] * (len(steps) - 1) + [False]
