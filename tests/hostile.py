"""Hostile records for the hostile-input tests: each kind is a record as a broken or
malicious producer would write it, with the dead-letter reason it must earn."""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lagscope.cli.demo import write_logs_with_timers
from lagscope.producers.events import JobInfo, RankStepBatch, encode_batch
from lagscope.producers.log import KIND_BATCH, KIND_JOB, frame_record
from lagscope.simulator.generate import JobSpec, generate_job

GOOD_JOB = "good"
GOOD_SPEC = JobSpec(dp=2, pp=2, microbatches=2, steps=6, name=GOOD_JOB, seed=5)
#: Step ids of the good job (the generator numbers them from 0).
GOOD_STEPS = list(range(GOOD_SPEC.steps))


@dataclass(frozen=True)
class Hostile:
    """One hostile record: its log payload (kind, bytes) and the reason it must get."""

    kind: int
    payload: bytes
    reason: str


@functools.cache
def good_info() -> JobInfo:
    return JobInfo.from_meta(generate_job(GOOD_SPEC).meta, job_id=GOOD_JOB)


def write_good_logs(log_dir: Path) -> None:
    """The good job's per-rank logs, recorded through the real timer."""
    job = generate_job(GOOD_SPEC)
    write_logs_with_timers(job.trace, good_info(), log_dir, time.time_ns() - 600 * 10**9)


def _good_batch(step: int = 2, dp: int = 0, pp: int = 0) -> RankStepBatch:
    base = time.time_ns() - 300 * 10**9
    return RankStepBatch.build(
        job_id=GOOD_JOB,
        attempt=0,
        rank=(dp * GOOD_SPEC.pp + pp) * GOOD_SPEC.tp,
        dp_rank=dp,
        pp_rank=pp,
        step=step,
        optype=["forward-compute", "backward-compute"],
        microbatch=[0, 0],
        chunk=[0, 0],
        seq=[0, 0],
        start_ns=[base, base + 10**6],
        duration_ns=[10**6, 2 * 10**6],
    )


def _batch(batch: RankStepBatch, **changes: object) -> bytes:
    # dataclasses.replace skips `build`'s checks: the bytes are what a broken producer sends.
    return encode_batch(dataclasses.replace(batch, **changes))


def _job(**sizes: int) -> bytes:
    info = good_info().model_dump()
    info.update(sizes)
    # model_construct: no validation, exactly the JSON a producer could write.
    return JobInfo.model_construct(**info).model_dump_json().encode()


def hostile_records() -> dict[str, Hostile | list[Hostile]]:
    """Each kind of hostile input: one record, or records that belong together."""
    good = _good_batch()
    empty = np.zeros(0, np.int64)
    unknown = RankStepBatch.build(
        job_id=GOOD_JOB,
        attempt=0,
        rank=0,
        dp_rank=0,
        pp_rank=0,
        step=3,
        optype=["forward-compute-fused"],
        microbatch=[0],
        chunk=[0],
        seq=[0],
        start_ns=[time.time_ns() - 300 * 10**9],
        duration_ns=[10**6],
    )
    return {
        "negative step": Hostile(KIND_BATCH, _batch(good, step=-1), "step is -1"),
        "negative dp rank": Hostile(KIND_BATCH, _batch(good, dp_rank=-3), "dp_rank is -3"),
        "zero ops": Hostile(
            KIND_BATCH,
            _batch(
                good,
                optype=empty.astype(np.uint8),
                optype_names=(),
                microbatch=empty.astype(np.int32),
                chunk=empty.astype(np.int16),
                seq=empty.astype(np.int32),
                start_ns=empty,
                duration_ns=empty,
            ),
            "the batch holds no ops",
        ),
        "dp rank out of range": Hostile(
            KIND_BATCH, _batch(good, dp_rank=7), "dp_rank 7 is out of range"
        ),
        "unknown op type": Hostile(
            KIND_BATCH, unknown.encode(), "'forward-compute-fused' are not in the analysis"
        ),
        "huge job record": [
            Hostile(
                KIND_JOB,
                JobInfo.model_construct(
                    **{
                        **good_info().model_dump(),
                        "job_id": "huge",
                        "dp_size": 100_000,
                        "pp_size": 100_000,
                        "world_size": 100_000 * 100_000 * GOOD_SPEC.tp,
                    }
                )
                .model_dump_json()
                .encode(),
                "exceeds the limit of 131,072 GPUs",
            ),
            Hostile(KIND_BATCH, _batch(good, job_id="huge", step=0), "its job record was rejected"),
        ],
        "conflicting job record": Hostile(
            KIND_JOB,
            _job(dp_size=4, pp_size=1),
            f"dp_size {GOOD_SPEC.dp} (kept) vs 4",
        ),
    }


def append_records(rank_directory: Path, records: list[Hostile]) -> list[tuple[Hostile, str]]:
    """Write the records into a new, last log file of a rank; returns each record with the
    origin a dead letter must name (`<rank dir>/<file>@<offset>`)."""
    name = "99999999999999999999-0001.lglog"
    placed, data = [], b""
    for record in records:
        placed.append((record, f"{rank_directory.name}/{name}@{len(data)}"))
        data += frame_record(record.kind, record.payload)
    (rank_directory / name).write_bytes(data)
    return placed
