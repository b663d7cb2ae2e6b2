"""An episode reaches the store with the step that opens it: the worker writes closed
steps on a cadence (every `write_interval_s`, or `write_every_steps` at once), but a step
that opens or closes an episode is written at once, whatever the cadence, once the
partition is caught up (a backlog keeps its batched writes). The worker core runs
in-process on a real chDB store with real encoded batches."""

from __future__ import annotations

import time

from lagscope.producers.events import JobInfo
from lagscope.producers.replay import iter_step_batches
from lagscope.simulator.generate import JobSpec, SlowWorker, generate_job
from lagscope.store.sink import ClickHouseSink
from lagscope.stream_app.processor import ProcessorSettings
from lagscope.stream_app.worker_config import WorkerConfig, WorkerSettings
from lagscope.stream_app.worker_core import OpsMessage, WorkerCore

ONSET, RECOVERY = 12, 26
SPEC = JobSpec(dp=2, pp=2, microbatches=4, steps=40, name="prompt", seed=3,
               stragglers=(SlowWorker(dp=1, stage=0, factor=2.0, start_step=ONSET,
                                      end_step=RECOVERY),))  # fmt: skip


def _follow(chdb_dsn: str, *, behind: bool) -> list[tuple[int, int, list[tuple[int, bool]]]]:
    """Each step's id, the steps stored and the episodes stored (first_seen_step, open)
    once its batches were taken."""
    job = generate_job(SPEC)
    info = JobInfo.from_meta(job.meta, job_id="prompt")
    sink = ClickHouseSink(chdb_dsn)
    sink.ensure_schema()
    # A cadence that never comes due in this test: the clock stands still.
    config = WorkerConfig(
        processor=ProcessorSettings(lateness_s=1_000.0),
        worker=WorkerSettings(write_interval_s=3_600.0, write_every_steps=1_000),
    )
    core = WorkerCore(config, sink, publish=lambda key, value: None, clock=lambda: 0.0)
    core.on_job_record(info.model_dump_json().encode(), time.time(), "jobs@0")
    offset = 0
    seen: list[tuple[int, int, list[tuple[int, bool]]]] = []
    for _, step, batches in iter_step_batches(job.trace, job.meta, job_id="prompt",
                                              start_wall_ns=time.time_ns()):  # fmt: skip
        core.on_messages([OpsMessage(0, offset + i, b"prompt", batch.encode(), time.time())
                          for i, batch in enumerate(batches)])  # fmt: skip
        offset += len(batches)
        core.set_behind(0, behind)  # as the worker does after a fetch, from Kafka's highwater
        _, rows = sink.query("SELECT count() FROM steps")
        _, episodes = sink.query(
            "SELECT first_seen_step, recovery_step IS NULL FROM episodes FINAL ORDER BY "
            "first_seen_step"
        )
        seen.append((step, int(rows[0][0]), [(int(s), bool(o)) for s, o in episodes]))
    sink.close()
    return seen


def test_a_step_that_opens_or_closes_an_episode_is_stored_at_once(chdb_dsn):
    seen = _follow(chdb_dsn, behind=False)
    opened = next(((step, n) for step, n, episodes in seen if episodes), None)
    assert opened is not None, "no episode was stored while the job ran"
    step, stored = opened
    first_seen, is_open = seen[[s for s, _, _ in seen].index(step)][2][0]
    assert first_seen == step and is_open, seen
    assert stored == step + 1, "the steps up to the episode's are stored with it"
    assert ONSET <= step <= ONSET + 8
    closed = next((s for s, _, episodes in seen if episodes and not episodes[0][1]), None)
    assert closed is not None and closed >= RECOVERY, seen
    # Between the two, the steps the open episode covers wait for the cadence.
    stored_between = {n for s, n, _ in seen if step <= s < closed}
    assert stored_between == {step + 1}, stored_between


def test_a_backlog_keeps_its_batched_writes(chdb_dsn):
    seen = _follow(chdb_dsn, behind=True)
    assert {stored for _, stored, _ in seen} == {0}, "a backlog's episode was news"
