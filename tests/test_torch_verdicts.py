"""The issue's verdicts on real torch jobs recorded through lagscope.torch only.

NEEDS THE ANALYSIS BRANCH (issue 14 part 2): these check the analysis (episodes, diagnosis,
GC and input-wait handling, several gradient buckets in the dependency model) on the jobs
of this branch's harness. Until that work is merged they are expected to fail here, so they
are marked xfail (not strict: the report shows XPASS as soon as one holds); the analysis
branch removes the mark.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from tests.torch_jobs import ddp, pipeline_1f1b
from tests.torch_jobs.harness import Knobs, analyse, launch

needs_analysis = pytest.mark.xfail(
    reason="needs the analysis branch (issue 14 part 2): GC/input-wait ops, bucket model, "
    "episodes from per-worker series, healthy-job noise floor",
    strict=False,
)


def _job(tmp: Path, target: object, **knobs: object) -> tuple[Path, object]:
    settings = Knobs(log_dir=str(tmp / "logs"), **knobs)
    launch(target, settings)  # type: ignore[arg-type]
    report = analyse(settings.log_dir, tmp / "chdb")
    return Path(settings.log_dir), report.jobs[settings.job_id, 0]


def _first_named(text: str) -> tuple[int, int] | None:
    found = re.search(r"\(dp (\d+), pp (\d+)\)", text)
    return (int(found.group(1)), int(found.group(2))) if found else None


@needs_analysis
def test_a_slow_worker_is_named_first_with_onset_and_recovery(tmp_path: Path) -> None:
    """(a) rank 1 (dp 0, pp 1) computes 2x slower in forward for steps 15-29 of 40."""
    _, job = _job(tmp_path, pipeline_1f1b.worker, steps=40, slow_rank=1, slow_phase="forward",
                  slow_start=15, slow_end=30)  # fmt: skip
    episodes = [e for e in job.episodes if abs(e.onset - 15) <= 3]
    assert episodes, [(e.onset, e.recovery) for e in job.episodes]
    episode = episodes[0]
    assert episode.recovery is not None and abs(episode.recovery - 30) <= 3
    assert _first_named(episode.diagnosis.summary) == (0, 1), episode.diagnosis.summary


@needs_analysis
def test_b_a_healthy_job_is_reported_healthy(tmp_path: Path) -> None:
    """(b) no straggler, 60 steps: diagnosis "none", no episode."""
    _, job = _job(tmp_path, pipeline_1f1b.worker, steps=64)
    assert job.diagnosis is not None and job.diagnosis.cause == "none", job.diagnosis
    assert job.episodes == []


@needs_analysis
def test_d_several_buckets_replay_within_5_percent(tmp_path: Path) -> None:
    """(d) DDP with several gradient buckets: each step's own measured durations replayed
    through the what-if engine give its measured step time within 5 %."""
    from lagscope.producers.events import decode_batch
    from lagscope.producers.log import KIND_BATCH, Record, list_rank_dirs, read_all
    from lagscope.simulator.engine import compile_model, simulate
    from lagscope.simulator.prepare import prepare
    from lagscope.stream_app.processor import batches_to_trace

    log_dir, job = _job(tmp_path, ddp.worker, steps=24, **ddp.DEFAULTS)
    records = [item for d in list_rank_dirs(log_dir) for item in read_all(d)]
    batches = [decode_batch(r.payload) for r in records
               if isinstance(r, Record) and r.kind == KIND_BATCH]  # fmt: skip
    prepared = prepare(batches_to_trace(batches, job.info.pp_size), job.info.to_meta())
    n_nodes = prepared.model.n_nodes
    cost = prepared.cost.reshape(n_nodes, -1)
    delay = prepared.launch_delay.reshape(n_nodes, -1)
    offsets = np.arange(0, cost.shape[1], prepared.n_dp)
    replayed = simulate(compile_model(prepared.model), cost, delay, offsets).step_time
    discrepancy = np.abs(replayed - prepared.actual_step_time) / prepared.actual_step_time
    assert discrepancy.max() <= 0.05, discrepancy.round(3).tolist()
