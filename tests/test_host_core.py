"""The host core's idea of a job that stopped: no batch of it arrived and no step of it
closed for the idle time, however long its steps take to fill."""

from __future__ import annotations

from lagscope.simulator.generate import JobSpec, generate_job
from lagscope.stream_app.host_core import HostCore, JobRecords
from lagscope.stream_app.processor import ProcessorSettings
from tests.test_processor import stream_of

IDLE_S = 3.0


def test_a_job_whose_batches_still_arrive_is_not_concluded_until_they_stop() -> None:
    job = generate_job(JobSpec(dp=2, pp=2, microbatches=2, steps=2, seed=0))
    info, steps = stream_of(job)
    now = [0.0]
    settings = ProcessorSettings(lateness_s=1_000.0)
    core = HostCore(settings, JobRecords(settings.max_world_size), clock=lambda: now[0])
    core.on_job_record(info.model_dump_json().encode(), "jobs@0", 0.0)

    def arrive(batch) -> list:
        core.on_batches([(batch.encode(), "ops@0", now[0])])
        return core.conclude_idle(IDLE_S)

    (_, _, first), (_, _, second) = steps
    for batch in first:
        assert arrive(batch) == []
    assert len(core.pending) == 1, "the first step closes with its last batch"
    # The second step fills slowly: a batch every 2 s, 6 s and more after the first closed.
    for batch in second[:-1]:
        now[0] += 2.0
        assert arrive(batch) == [], f"concluded at {now[0]} s while its batches still arrive"
    now[0] += IDLE_S
    assert core.conclude_idle(IDLE_S) == [(info.job_id, info.attempt)]
    assert len(core.conclusions) == 1
