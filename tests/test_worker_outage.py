"""A Kafka outage in the middle of a job (a broker restarted for maintenance, longer than
the group's session): `lagscope worker` waits it out, the group forms again, and every
step of the job is stored once, and its log says so in a few lines, not one per retry. The
real broker, stopped and started again; a chDB store."""

from __future__ import annotations

import time

from confluent_kafka import Producer

from lagscope.deploy.kafka_local import KafkaBroker
from lagscope.producers.replay import iter_step_batches
from tests.worker_util import query_store, st_job_announced, start_worker, wait_for_log

#: Longer than the workers' session timeout in tests (6 s): the group loses the member.
OUTAGE_S = 12.0


def test_a_broker_restart_mid_job_loses_and_duplicates_no_step(
    own_broker: KafkaBroker, kafka_topics: dict[str, str], tmp_path
):
    bootstrap = own_broker.bootstrap
    trace, meta, producer = st_job_announced(bootstrap, kafka_topics)
    steps = list(iter_step_batches(trace, meta, job_id="ST", start_wall_ns=time.time_ns()))
    half = len(steps) // 2

    def send(part: list, producer: Producer) -> int:
        sent = 0
        for _, _, batches in part:
            for batch in batches:
                producer.produce(kafka_topics["topic_ops"], key=b"ST", value=batch.encode())
                sent += 1
        producer.flush(30)
        return sent

    first_half = send(steps[:half], producer)
    work = tmp_path / "w"
    # Idle exit well past the outage: a worker that cannot reach Kafka is not idle.
    worker = start_worker(bootstrap, kafka_topics, work, group="outage", exit_when_idle_s=25.0,
                          env={"LAGSCOPE_WORKER__CHECKPOINT_INTERVAL_S": "1.0"})  # fmt: skip
    wait_for_log(worker, f"next offset {first_half} ", 1, timeout_s=120)
    own_broker.stop()
    time.sleep(OUTAGE_S)
    assert worker.process.poll() is None, worker.log()[-4000:]
    own_broker.start()
    send(steps[half:], Producer({"bootstrap.servers": bootstrap}))

    assert worker.wait(240) == 0, worker.log()[-4000:]
    log = worker.log()
    assert "never read" not in log, log[-4000:]
    # One line per kind of complaint of the Kafka clients (a handful of kinds), not one
    # per retry: before, this outage wrote 983 ERROR lines of aiokafka's and 607 of
    # librdkafka's (the results producer, the jobs and dead-letter readers).
    errors = [line for line in log.splitlines() if "[ERROR]" in line or "|FAIL|" in line]
    assert len(errors) <= 20, "\n".join(errors[:40])
    # And once records flow again, the log says so (the complaints just stop otherwise).
    lines = log.splitlines()
    back = [i for i, line in enumerate(lines) if "Kafka answers again" in line]
    assert len(back) == 1, "\n".join(lines[-60:])
    exiting = next(i for i, line in enumerate(lines) if "idle for" in line)
    last_error = max(i for i, line in enumerate(lines[:exiting])
                     if "[ERROR]" in line or "|FAIL|" in line)  # fmt: skip
    assert last_error < back[0] < exiting, lines[back[0]]
    # Nor does an outage's line surface late: a client's queued lines, logged as fresh
    # ERRORs while the worker exits, told the on-call of an outage long over.
    late = [line for line in lines[exiting:] if "[ERROR]" in line or "[WARNING]" in line]
    assert not late, "\n".join(late)
    rows = query_store(work, "SELECT step, complete FROM steps ORDER BY step")  # no FINAL
    stored = [(row["step"], row["complete"]) for row in rows]
    assert stored == [(step, True) for _, step, _ in steps]


def test_a_broker_restart_after_the_jobs_last_records_is_told_over(
    own_broker: KafkaBroker, kafka_topics: dict[str, str], tmp_path
):
    """No record comes after this outage: the worker hears Kafka again from its fetches'
    answers (before, only records or an assignment counted, and a client complaining
    after the job's last records kept the line from ever being logged)."""
    bootstrap = own_broker.bootstrap
    trace, meta, producer = st_job_announced(bootstrap, kafka_topics)
    sent = 0
    for _, _, batches in iter_step_batches(trace, meta, job_id="ST",
                                           start_wall_ns=time.time_ns()):  # fmt: skip
        for batch in batches:
            producer.produce(kafka_topics["topic_ops"], key=b"ST", value=batch.encode())
            sent += 1
    producer.flush(30)
    del producer  # its retries while the broker is away would only clutter the test's output
    worker = start_worker(bootstrap, kafka_topics, tmp_path / "w", group="outage-idle",
                          exit_when_idle_s=None,
                          env={"LAGSCOPE_WORKER__CHECKPOINT_INTERVAL_S": "1.0"})  # fmt: skip
    try:
        wait_for_log(worker, f"next offset {sent} ", 1, timeout_s=120)
        own_broker.stop()
        time.sleep(OUTAGE_S)
        own_broker.start()
        wait_for_log(worker, "Kafka answers again", 1, timeout_s=90)
        log = worker.log()
        assert "Kafka answers again" in log, log[-4000:]
        before = log[: log.index("Kafka answers again")]
        assert "[ERROR]" in before, "no outage was complained of: the test proves nothing"
    finally:
        worker.process.terminate()
        assert worker.wait(60) == 0, worker.log()[-4000:]
