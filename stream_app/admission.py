"""What the step processor lets in: job records within limits, batches that fit their job.

Both hosts decode a record, then ask these rules (through `StepProcessor.admit` and
`StepProcessor.on_job`) before anything is windowed, so a bad record is set aside at the
edge, with its origin, instead of breaking a step, a window or the host. Each rule returns
a reason a person can act on, or "" when the input is fine.

- A job record must describe a job the processor can hold: its world size is bounded
  (`ProcessorSettings.max_world_size`), checked before anything is allocated for it. A
  second, different record for the same (job, attempt) does not replace the first: the
  first stands, and the reason names both values.
- A batch must carry ops, start after 1970 (the store keeps wall-clock times), last less
  than a day per op, and sit inside its job's grid (dp, pp, tp, cp rank and global rank
  below the job's sizes). Ops of an op type outside the analysis' vocabulary are left out
  (the analysis cannot place them) and the rest of the batch goes on.
"""

from __future__ import annotations

import numpy as np

from lagscope.producers.events import (
    PER_RANK_FIELDS,
    RANK_AXIS_SIZES,
    JobInfo,
    RankStepBatch,
    rank_outside,
)
from lagscope.simulator.optypes import KNOWN_OPTYPES

#: No training op lasts a day: a longer duration is a broken clock or a corrupt record.
MAX_OP_DURATION_NS = 86_400 * 10**9

_KNOWN = frozenset(KNOWN_OPTYPES)


def job_problem(info: JobInfo, max_world_size: int) -> str:
    """Why a job record cannot be taken on, or ""."""
    if info.world_size > max_world_size:
        return (
            f"job {info.key}: world size {info.world_size:,} (dp {info.dp_size} x pp "
            f"{info.pp_size} x tp {info.tp_size} x cp {info.cp_size}) exceeds the limit of "
            f"{max_world_size:,} GPUs (processor.max_world_size)"
        )
    return ""


def job_conflict(first: JobInfo, other: JobInfo) -> str:
    """Why `other` does not replace `first` (same job and attempt, other values), or "".

    Each rank's record names its own rank and machine (`rank_identity`), and a rank that
    ended says when (`ended_ns`): those parts differ by design and are no conflict.
    """
    kept = first.model_dump(exclude=PER_RANK_FIELDS)
    offered = other.model_dump(exclude=PER_RANK_FIELDS)
    differing = [name for name in kept if kept[name] != offered[name]]
    if not differing:
        return ""
    shown = ", ".join(f"{n} {kept[n]!r} (kept) vs {offered[n]!r}" for n in differing)
    return f"job {first.key}: a second job record conflicts with the first, which stands: {shown}"


def unknown_optypes(batch: RankStepBatch) -> list[str]:
    """The batch's op types (used by its ops) that the analysis does not know."""
    if _KNOWN.issuperset(batch.optype_names):  # one C call: this runs for every batch
        return []
    used = np.unique(batch.optype).tolist()
    return sorted(batch.optype_names[c] for c in used if batch.optype_names[c] not in _KNOWN)


def without_optypes(batch: RankStepBatch, names: list[str]) -> RankStepBatch:
    """The batch without the ops of the given op types."""
    drop = [i for i, name in enumerate(batch.optype_names) if name in names]
    keep = ~np.isin(batch.optype, drop)
    return RankStepBatch.build(
        job_id=batch.job_id,
        attempt=batch.attempt,
        rank=batch.rank,
        dp_rank=batch.dp_rank,
        pp_rank=batch.pp_rank,
        tp_rank=batch.tp_rank,
        cp_rank=batch.cp_rank,
        step=batch.step,
        optype=batch.optype[keep],
        optype_names=batch.optype_names,
        microbatch=batch.microbatch[keep],
        chunk=batch.chunk[keep],
        seq=batch.seq[keep],
        start_ns=batch.start_ns[keep],
        duration_ns=batch.duration_ns[keep],
    )


def batch_problem(batch: RankStepBatch) -> str:
    """Why a batch cannot be analysed whatever its job, or ""."""
    if not batch.n_ops:
        return f"{_who(batch)}: the batch holds no ops"
    if int(batch.start_ns.min()) < 0:
        row = int(np.argmin(batch.start_ns))
        return (
            f"{_who(batch)}: op {row} starts at {int(batch.start_ns[row])} ns, before 1970 "
            "(start_ns must be wall-clock nanoseconds since the epoch)"
        )
    if int(batch.duration_ns.max()) > MAX_OP_DURATION_NS:
        row = int(np.argmax(batch.duration_ns))
        return (
            f"{_who(batch)}: op {row} lasts {int(batch.duration_ns[row]) / 1e9:,.0f} s, "
            "more than a day"
        )
    return ""


def grid_problem(batch: RankStepBatch, info: JobInfo) -> str:
    """Why a batch does not fit its job's parallel grid, or ""."""
    outside = rank_outside({name: getattr(batch, name) for name in RANK_AXIS_SIZES}, info)
    if outside is None:
        return ""
    name, value, size = outside
    return (
        f"{_who(batch)}: {name} {value} is out of range for job {info.key}, whose "
        f"{RANK_AXIS_SIZES[name]} is {size}"
    )


def _who(batch: RankStepBatch) -> str:
    return (
        f"job {batch.job_id}/{batch.attempt} step {batch.step} rank {batch.rank} "
        f"(dp {batch.dp_rank}, pp {batch.pp_rank})"
    )
