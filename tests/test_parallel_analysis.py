"""The compute half of the analysis in a child process (`analysis_processes`) gives the
same numbers as in the host's process: every step's output, the episodes, the diagnoses,
the job's conclusion and the state a snapshot keeps, however the input is cut into calls,
and across a snapshot and resume."""

from __future__ import annotations

import dataclasses
import fcntl
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import BaseModel

from lagscope.producers.events import JobInfo, decode_batch
from lagscope.producers.replay import iter_step_batches
from lagscope.simulator.generate import JobSpec, SlowWorker, generate_job
from lagscope.store.snapshot_format import decode_state, encode_state
from lagscope.stream_app.analysis_process import shared_children
from lagscope.stream_app.processor import (
    HOST_SETTINGS,
    ProcessorSettings,
    StepOutput,
    StepProcessor,
)

#: Fields that say when this host did something, not what it found.
HOST_TIMES = frozenset({"received_at"})


def canonical(value: Any) -> Any:
    """`value` as plain data that compares equal only when every number is bit-equal (the
    host's own times left out)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [f for f in dataclasses.fields(value) if f.name not in HOST_TIMES]
        return (type(value).__name__, {f.name: canonical(getattr(value, f.name)) for f in fields})
    if isinstance(value, BaseModel):
        return canonical(value.model_dump())
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, float | np.floating):
        return "nan" if math.isnan(value) else float(value).hex()
    if isinstance(value, dict):
        return {str(k): canonical(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [canonical(v) for v in value]
    return value


@pytest.fixture(scope="module")
def job_stream() -> tuple[JobInfo, list]:
    """A job with a straggler from step 25 to 45 (an episode, change points, a diagnosis
    naming it), its batches decoded from their bytes as a host receives them."""
    job = generate_job(
        JobSpec(
            dp=4,
            pp=4,
            microbatches=8,
            steps=60,
            seed=5,
            stragglers=(SlowWorker(dp=2, stage=1, factor=1.8, start_step=25, end_step=45),),
        )
    )
    info = JobInfo.from_meta(job.meta, job_id="par")
    batches = [
        decode_batch(batch.encode())
        for _, _, step_batches in iter_step_batches(
            job.trace, job.meta, job_id="par", start_wall_ns=1_700_000_000_000_000_000
        )
        for batch in step_batches
    ]
    return info, batches


def run(
    info: JobInfo, batches: list, processes: int, chunk: int, **settings: Any
) -> dict[str, Any]:
    settings.setdefault("analysis_process_min_ops", 0)  # this small job's steps too
    processor = StepProcessor(ProcessorSettings(analysis_processes=processes, **settings))
    processor.on_job(info)
    outputs: list[StepOutput] = []
    in_flight = deepest = 0
    for i in range(0, len(batches), chunk):
        outputs += processor.on_batches(batches[i : i + chunk])
        in_flight += bool(processor.in_flight)
        deepest = max(deepest, processor.in_flight)
    outputs += processor.flush()
    return {
        "outputs": outputs,
        "conclusion": processor.conclude(info.job_id),
        "state": processor.state_dict(),
        "calls_in_flight": in_flight,
        "deepest_in_flight": deepest,
    }


def test_a_child_process_computes_what_the_host_computes(job_stream):
    info, batches = job_stream
    alone = run(info, batches, processes=0, chunk=16)
    beside = run(info, batches, processes=1, chunk=7)
    steps = [out.step for out in alone["outputs"]]
    assert steps == list(range(60))
    assert [out.step for out in beside["outputs"]] == steps
    # The job's story is there to compare: an episode, change points, diagnoses.
    assert any(out.episodes for out in alone["outputs"])
    assert any(out.changes for out in alone["outputs"])
    assert any(out.diagnosis is not None for out in alone["outputs"])
    for a, b in zip(alone["outputs"], beside["outputs"], strict=True):
        assert canonical(a) == canonical(b), f"step {a.step} differs"
    assert canonical(alone["conclusion"]) == canonical(beside["conclusion"])
    for state in (alone["state"], beside["state"]):
        for name in HOST_SETTINGS:  # where the analysis ran, not what it found
            del state["settings"][name]
        for job in state["jobs"].values():
            del job["arrivals"]  # when this host read the batches, not what they hold
            del job["held_bytes"]  # what this process holds (a child holds the compute)
    assert canonical(alone["state"]) == canonical(beside["state"])
    # The host went on while the child computed: calls returned before their steps did.
    assert alone["calls_in_flight"] == 0
    assert beside["calls_in_flight"] > 0


def test_a_snapshot_taken_while_a_child_computes_resumes_to_the_same_numbers(job_stream):
    """Through the snapshot format itself, with a step's window open at the snapshot."""
    info, batches = job_stream
    straight = run(info, batches, processes=0, chunk=16)
    host = ProcessorSettings(analysis_processes=1, analysis_process_min_ops=0)
    processor = StepProcessor(host)
    processor.on_job(info)
    half = len(batches) // 2 + 5  # a step's window open at the snapshot
    outputs = processor.on_batches(batches[:half])
    assert processor.in_flight
    state = processor.state_dict()  # waits for the child: the state is whole
    assert not processor.in_flight
    assert processor.windows
    outputs += processor.drain()
    processor.close()
    resumed = StepProcessor.from_state(decode_state(encode_state(state)), host=host)
    assert resumed.settings.analysis_processes == 1
    outputs += resumed.on_batches(batches[half:]) + resumed.flush()
    assert [out.step for out in outputs] == list(range(60))
    for a, b in zip(straight["outputs"], outputs, strict=True):
        assert canonical(a.result) == canonical(b.result), f"step {a.step} differs"
        assert canonical(a.episodes) == canonical(b.episodes), f"step {a.step} differs"
    assert canonical(straight["conclusion"]) == canonical(resumed.conclude(info.job_id))


def test_the_host_runs_ahead_of_its_child_as_far_as_the_bounds_let_it(job_stream):
    """Calls in flight stay within `analysis_in_flight` and, past the first, within the
    bytes their ops hold; the numbers are the same however deep."""
    info, batches = job_stream
    step_ops = sum(b.n_ops for b in batches if b.step == 0)
    runs = {
        bounds: run(info, batches, processes=1, chunk=4, analysis_in_flight=bounds[0],
                    analysis_in_flight_bytes=bounds[1])
        for bounds in ((1, 1 << 30), (3, 1 << 30), (64, 2 * 60 * step_ops))
    }  # fmt: skip
    deepest = [r["deepest_in_flight"] for r in runs.values()]
    # The host feeds four batches a call, the child computes a step in several ms: the
    # host gets ahead as far as each bound lets it.
    assert deepest[0] == 1 and 1 < deepest[1] <= 3 and 1 < deepest[2] <= 2
    first = [canonical(out) for out in runs[1, 1 << 30]["outputs"]]
    for found in runs.values():
        assert [canonical(out) for out in found["outputs"]] == first


def test_two_jobs_on_two_children_come_back_in_closing_order(job_stream):
    """Each job on a child of its own: their results come back in any order, the
    outputs in the order the steps closed, each job's numbers its own."""
    info, batches = job_stream
    other = info.model_copy(update={"job_id": "par-2"})
    twin = [decode_batch(dataclasses.replace(b, job_id="par-2").encode()) for b in batches]
    mixed = [b for pair in zip(batches, twin, strict=True) for b in pair]
    runs = []
    for processes in (0, 2):
        processor = StepProcessor(
            ProcessorSettings(analysis_processes=processes, analysis_process_min_ops=0)
        )
        processor.on_job(info)
        processor.on_job(other)
        outputs = []
        for i in range(0, len(mixed), 40):
            outputs += processor.on_batches(mixed[i : i + 40])
        runs.append(outputs + processor.flush())
    alone, beside = runs
    assert [(o.job_id, o.step) for o in beside] == [(o.job_id, o.step) for o in alone]
    assert len(alone) == 120
    for a, b in zip(alone, beside, strict=True):
        assert canonical(a) == canonical(b), f"{a.job_id} step {a.step} differs"


def test_a_worker_that_ends_with_its_steps_in_the_child_stores_what_it_stores_alone(
    job_stream, tmp_path
):
    """A worker's idle exit right after its last pass, every step still with its analysis
    process: the job is concluded with all of them (its final diagnosis stored), and the
    store holds row for row what a worker without the process stores."""
    from lagscope.store.sink import ClickHouseSink
    from lagscope.stream_app.worker_config import WorkerConfig
    from lagscope.stream_app.worker_core import OpsMessage, WorkerCore
    from tests.bench.stored_rows import stored_digest

    info, batches = job_stream
    messages = [
        OpsMessage(0, offset, info.job_id.encode(), batch.encode(), 1_700_000_000.0)
        for offset, batch in enumerate(batches)
    ]
    stored = {}
    for processes in (0, 1):
        sink = ClickHouseSink(f"chdb://{tmp_path / str(processes)}")
        sink.ensure_schema()
        config = WorkerConfig()
        config.processor.analysis_processes = processes
        config.processor.analysis_process_min_ops = 0
        core = WorkerCore(config, sink, publish=lambda key, value: None)
        core.on_job_record(info.model_dump_json().encode(), 1_700_000_000.0, "jobs@0")
        core.on_messages(messages)
        if processes:
            assert core.partitions[0].core.processor.in_flight  # the case this is about
        core.finish()
        _, final = sink.query("SELECT step FROM diagnoses FINAL WHERE version % 2 = 1")
        stored[processes] = (stored_digest(sink), [row[0] for row in final])
        core.drop_partition(0)  # stops its analysis process
        sink.close()
    assert stored[0][1] == [59]  # the conclusion's diagnosis, at the last step
    assert stored[1] == stored[0]


def test_a_job_of_small_steps_stays_in_the_hosts_process(job_stream):
    """Steps below `analysis_process_min_ops` cost more to hand over than to compute: with
    an analysis process at hand, such a job is computed at once in the host's process
    (nothing in flight), with the same numbers; a job of large steps goes to the child."""
    info, batches = job_stream
    step_ops = sum(b.n_ops for b in batches if b.step == 0)
    small = run(info, batches, processes=1, chunk=7, analysis_process_min_ops=step_ops + 1)
    large = run(info, batches, processes=1, chunk=7, analysis_process_min_ops=step_ops)
    assert small["calls_in_flight"] == 0
    assert large["calls_in_flight"] > 0
    for a, b in zip(small["outputs"], large["outputs"], strict=True):
        assert canonical(a) == canonical(b), f"step {a.step} differs"


@pytest.mark.skipif(not hasattr(fcntl, "F_GETPIPE_SZ"), reason="pipe sizes are Linux's")
def test_a_childs_pipes_are_as_wide_as_the_system_allows():
    """A large job's frames (MBs a step each way) cross in a few copies: each copy is a
    thread taking the interpreter lock back from the host's busy main thread, and 64 KB
    at a time held the child to ~13 MB/s (`_widen`; `make bench` measures both)."""
    widest = int(Path("/proc/sys/fs/pipe-max-size").read_text())
    child = shared_children(1)._children[0]
    for pipe in (child.process.stdin, child.process.stdout):
        assert fcntl.fcntl(pipe.fileno(), fcntl.F_GETPIPE_SZ) == widest
