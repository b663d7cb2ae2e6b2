"""A worker's consumer never runs ahead of what its analysis has taken: where Kafka hands a
partition over past the worker's state (a committed offset ahead of the newest snapshot,
records fetched before a rebalance that never reached the analysis), the worker moves
the consumer back and reads them, and only records Kafka no longer holds (retention) are
counted as never read. `lagscope worker` against the real broker and a chDB store."""

from __future__ import annotations

import time

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from lagscope.producers.replay import iter_step_batches
from tests.worker_util import query_store, st_job_announced, start_worker


def _st_job_sent(bootstrap: str, topics: dict[str, str]) -> list[tuple[int, int]]:
    """The ST job announced and all its batches on partition 0: (step, its first offset)."""
    trace, meta, producer = st_job_announced(bootstrap, topics)
    steps, offset = [], 0
    for _, step, batches in iter_step_batches(trace, meta, job_id="ST",
                                              start_wall_ns=time.time_ns()):  # fmt: skip
        steps.append((step, offset))
        for batch in batches:
            producer.produce(topics["topic_ops"], key=b"ST", value=batch.encode())
            offset += 1
    producer.flush(30)
    return steps


def _stored_steps(work) -> list[tuple[int, bool]]:
    rows = query_store(work, "SELECT step, complete FROM steps FINAL ORDER BY step")
    return [(row["step"], row["complete"]) for row in rows]


def test_a_consumer_ahead_of_the_workers_state_is_moved_back_and_every_step_analysed(
    kafka_bootstrap, kafka_topics, tmp_path
):
    """The group's committed offset is past the worker's state (here: a store without the
    snapshot that covered it; in a rebalance: a run fetched before the partition came
    back to the same worker, dropped with its generation, and no offset committed yet).
    Before, the worker took the first record it was handed as the partition's next and
    counted the ones before it as deleted by retention: the job's first steps were lost."""
    steps = _st_job_sent(kafka_bootstrap, kafka_topics)
    ahead = steps[len(steps) // 2][1]
    committer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": "ahead"})
    committer.commit(offsets=[TopicPartition(kafka_topics["topic_ops"], 0, ahead)],
                     asynchronous=False)  # fmt: skip
    committer.close()

    work = tmp_path / "w"
    # Small runs, one a pass: many runs past the analysis are fetched, and wait in faust's
    # buffers, when the worker seeks back. faust's own mark of the last offset it handed
    # over would then drop the records fetched again (the worker waited for them forever).
    small_runs = {"LAGSCOPE_WORKER__FETCH_MAX_BYTES": "8192", "LAGSCOPE_WORKER__TAKE_MAX_RUNS": "1"}
    worker = start_worker(kafka_bootstrap, kafka_topics, work, group="ahead", env=small_runs)
    assert worker.wait(180) == 0, worker.log()[-4000:]
    log = worker.log()
    assert "never read" not in log, log[-4000:]
    assert f"moving the consumer back from offset {ahead} to 0" in log, log[-4000:]
    assert _stored_steps(work) == [(step, True) for step, _ in steps]


def test_records_retention_deleted_are_counted_once_and_the_rest_analysed(
    kafka_bootstrap, kafka_topics, tmp_path
):
    """Records Kafka deleted before the worker read them cannot be read again: the gap is
    named once, the steps after it are analysed, and the worker does not chase them."""
    steps = _st_job_sent(kafka_bootstrap, kafka_topics)
    first_kept_step, first_kept = steps[5]
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    deleted = admin.delete_records([TopicPartition(kafka_topics["topic_ops"], 0, first_kept)])
    for future in deleted.values():
        future.result(timeout=15)

    work = tmp_path / "w"
    worker = start_worker(kafka_bootstrap, kafka_topics, work, group="retention")
    assert worker.wait(180) == 0, worker.log()[-4000:]
    log = worker.log()
    assert log.count("were never read") == 1, log[-4000:]
    assert f"records at offsets 0..{first_kept - 1} were never read" in log
    assert _stored_steps(work) == [(step, True) for step, _ in steps[5:]]
    assert steps[5][0] == first_kept_step
