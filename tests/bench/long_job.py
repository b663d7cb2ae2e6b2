"""A long generated job, step by step, through one host: what the hosts hold over 2,000 steps.

Writing 2,000 steps of a 100,000-GPU job's logs would take 64 GB and hours; what a host
holds is what it keeps between steps, so the job's steps are made as a host receives them:
a cycle of `CYCLE` generated steps, encoded once, each step of the long job a step of the
cycle with its step number and times moved on (`restamp`: the batch's bytes as the timer
would have written them, checksum included). Steps of the cycle repeat, so a straggler or
an episode repeats with them.

`python -m tests.bench.long_job HOST DP STEPS MARKS` feeds DP x pp 8 x tp 8 (16
micro-batches) for STEPS steps to one host and prints a JSON line at each step of MARKS
(comma-separated): the step, the seconds so far, the process' RSS and peak RSS, and the
bytes each structure its job keeps between steps holds (`StepProcessor.held_bytes`).
HOST is `embedded` (`lagscope run`'s host, raw ops kept as it keeps them, fed as its
log reader feeds it, a step a round, caught up) or `worker` (`lagscope worker`'s core,
fed messages as its Kafka passes do, checkpointing into its store as it does).
"""

from __future__ import annotations

import json
import struct
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator

import numpy as np

from lagscope.producers.events import JobInfo, peek_header
from lagscope.producers.replay import iter_step_batches
from lagscope.simulator.generate import JobSpec, generate_job

#: Generated steps the long job cycles through.
CYCLE = 8
#: The offset of the step field in a batch's header (`producers/events.py`: magic,
#: version, flags, n_ops, attempt, rank, dp, pp, tp, cp, then the step).
_STEP_AT = struct.calcsize("<4sHHIIiiiii")
_TRAILER = struct.Struct("<I")
_BYTES_PER_OP = 27


class LongJob:
    """A job of `steps` steps made from a generated cycle (see the module docstring)."""

    def __init__(self, dp: int, *, job_id: str = "long", seed: int = 11) -> None:
        spec = JobSpec(dp=dp, pp=8, tp=8, microbatches=16, steps=CYCLE, seed=seed)
        job = generate_job(spec)
        self.info = JobInfo.from_meta(job.meta, job_id=job_id)
        self.start_ns = (int(time.time()) - 7 * 86400) * 10**9
        self._cycle: list[list[bytes]] = []
        ends = []
        for end_ns, _, batches in iter_step_batches(
            job.trace, job.meta, job_id=job_id, start_wall_ns=0
        ):
            self._cycle.append([batch.encode() for batch in batches])
            ends.append(end_ns)
        self._ends = ends
        self.cycle_ns = ends[-1]

    def step(self, step: int) -> list[bytes]:
        """The batches of the long job's `step`, as its ranks' timers would write them."""
        cycle, index = divmod(step, CYCLE)
        shift = self.start_ns + cycle * self.cycle_ns
        return [restamp(payload, step, shift) for payload in self._cycle[index]]

    def end_s(self, step: int) -> float:
        """When `step` ended (epoch seconds)."""
        cycle, index = divmod(step, CYCLE)
        return (self.start_ns + cycle * self.cycle_ns + self._ends[index]) / 1e9

    @property
    def ops_per_step(self) -> int:
        return sum(peek_header(p)["n_ops"] for p in self._cycle[0])


def restamp(payload: bytes, step: int, shift_ns: int) -> bytes:
    """An encoded batch with its step set and its op starts moved by `shift_ns`."""
    data = bytearray(payload)
    struct.pack_into("<q", data, _STEP_AT, step)
    n_ops = peek_header(payload)["n_ops"]
    body = len(data) - _TRAILER.size
    columns = body - n_ops * _BYTES_PER_OP
    starts = np.frombuffer(data, dtype="<i8", count=n_ops, offset=columns)
    starts += shift_ns
    _TRAILER.pack_into(data, body, zlib.crc32(memoryview(data)[:body]))
    return bytes(data)


def rss_mb() -> tuple[float, float]:
    """This process' resident memory now and at its peak (MB)."""
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                found[name] = int(value.split()[0]) / 1024
    return found["VmRSS"], found["VmHWM"]


def run_embedded(job: LongJob, steps: int, marks: set[int], store: str) -> Iterator[dict]:
    """`lagscope run`'s host following the job's logs: each round one step of every log."""
    from lagscope.cli.run import RAW_OPS_MAX_WORKERS
    from lagscope.producers.log import KIND_BATCH, KIND_JOB, Record
    from lagscope.store.sink import ClickHouseSink
    from lagscope.stream_app.embedded import EmbeddedRunner

    sink = ClickHouseSink(f"chdb://{store}")
    sink.ensure_schema()
    runner = EmbeddedRunner(sink, raw_ops_max_workers=RAW_OPS_MAX_WORKERS)
    runner._consume("rank-000000", Record(KIND_JOB, job.info.model_dump_json().encode(), "", 0, 0))
    started = time.perf_counter()
    for step in range(steps):
        by_rank: dict[int, list[Record]] = {}
        for payload in job.step(step):
            rank = peek_header(payload)["rank"]
            by_rank.setdefault(rank, []).append(Record(KIND_BATCH, payload, "log", 0, 0))
        for rank, records in by_rank.items():
            runner._take_batches(f"rank-{rank:06d}", records)
        runner.clock.behind = False
        runner.clock.advance(runner._log_times, set())
        runner._close_passed_steps(set())
        runner.core.tick()
        runner._write()
        if step + 1 in marks:
            yield _mark(step + 1, started, runner.processor, job.info)
    runner.close_open_steps()
    sink.close()


def run_worker(job: LongJob, steps: int, marks: set[int], store: str) -> Iterator[dict]:
    """`lagscope worker`'s core: a Kafka pass of messages a step, snapshots as it takes them."""
    from lagscope.store.sink import ClickHouseSink
    from lagscope.stream_app.worker_config import WorkerConfig
    from lagscope.stream_app.worker_core import OpsMessage, WorkerCore

    sink = ClickHouseSink(f"chdb://{store}")
    sink.ensure_schema()
    config = WorkerConfig()
    core = WorkerCore(config, sink, publish=lambda key, value: None)
    core.on_job_record(job.info.model_dump_json().encode(), time.time(), "jobs@0")
    started = time.perf_counter()
    offset = 0
    for step in range(steps):
        payloads = job.step(step)
        at = job.end_s(step)
        messages = [
            OpsMessage(0, offset + i, job.info.job_id.encode(), payload, at)
            for i, payload in enumerate(payloads)
        ]
        offset += len(messages)
        core.on_messages(messages)
        core.set_behind(0, False)
        core.tick()
        core.checkpoint_if_due(0)
        if step + 1 in marks:
            processor = core.partition(0).core.processor
            yield _mark(step + 1, started, processor, job.info)
    core.finish()
    sink.close()


def _mark(step: int, started: float, processor, info: JobInfo) -> dict:
    rss, peak = rss_mb()
    held = processor.held_bytes(info.job_id, info.attempt)
    return {
        "step": step,
        "seconds": round(time.perf_counter() - started, 2),
        "rss_mb": round(rss, 1),
        "peak_rss_mb": round(peak, 1),
        "held_mb": {name: round(value / 1e6, 2) for name, value in held.items()},
    }


def main(host: str, dp: int, steps: int, marks: set[int]) -> None:
    job = LongJob(dp)
    run = {"embedded": run_embedded, "worker": run_worker}[host]
    with tempfile.TemporaryDirectory(prefix=f"long-job-{host}-") as store:
        for mark in run(job, steps, marks, store):
            print(json.dumps(mark), flush=True)


if __name__ == "__main__":
    host, dp, steps, marks = sys.argv[1:5]
    main(host, int(dp), int(steps), {int(m) for m in marks.split(",")})
