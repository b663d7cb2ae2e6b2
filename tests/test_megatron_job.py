"""megatron-core's real 1F1B schedule on 4 gloo ranks (TP 1 x PP 2 x DP 2), monitored by one
`lagscope.megatron.monitor()` call per rank: what each rank recorded, and that
`lagscope run --logs` analyses every step (tests/megatron_jobs/tiny_gpt.py is the job).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        sys.version_info < (3, 12), reason="megatron-core 0.19 is published for Python >= 3.12"
    ),
]

STEPS = 4
MICROBATCHES = 4
PP = 2
WORLD = 4


def _run(entry: Any, out: Path, steps: int) -> dict[str, Any]:
    """Run a job of tests/megatron_jobs/tiny_gpt.py; its ops (by rank and step), job
    records, batch headers and rank summaries."""
    from lagscope.producers.events import peek_header
    from lagscope.producers.log import KIND_BATCH, Record, list_rank_dirs, read_all
    from tests.megatron_jobs import tiny_gpt
    from tests.torch_jobs.harness import Knobs, job_records, launch, recorded_ops

    knobs = Knobs(
        log_dir=str(out / "logs"),
        job_id=tiny_gpt.JOB_ID,
        steps=steps,
        world=WORLD,
        pp=PP,
        microbatches=MICROBATCHES,
        hidden=tiny_gpt.HIDDEN,
    )
    launch(entry, knobs, timeout_s=400)
    headers = [
        peek_header(item.payload)
        for directory in list_rank_dirs(out / "logs")
        for item in read_all(directory)
        if isinstance(item, Record) and item.kind == KIND_BATCH
    ]
    ops: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for op in sorted(recorded_ops(out / "logs"), key=lambda op: (op["start_ns"], op["seq"])):
        ops[op["rank"], op["step"]].append(op)
    summaries = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(WORLD)]
    return {
        "out": out,
        "ops": ops,
        "infos": job_records(out / "logs"),
        "headers": headers,
        "summaries": {s["rank"]: s for s in summaries},
    }


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The 1F1B job (one model chunk per rank), run once for the tests of this module."""
    from tests.megatron_jobs import tiny_gpt

    return _run(tiny_gpt.run_rank, tmp_path_factory.mktemp("megatron-1f1b"), STEPS)


@pytest.fixture(scope="module")
def interleaved_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The interleaved job: 2 model chunks per rank, p2p overlapped with compute."""
    from tests.megatron_jobs import tiny_gpt

    return _run(tiny_gpt.run_rank_interleaved, tmp_path_factory.mktemp("megatron-interleaved"), 2)


def _of(ops: list[dict[str, Any]], optype: str) -> list[dict[str, Any]]:
    return [op for op in ops if op["optype"] == optype]


def _end(op: dict[str, Any]) -> int:
    return op["start_ns"] + op["duration_ns"]


def test_the_schedule_trained_normally_with_the_adapter_on(job: dict[str, Any]) -> None:
    summaries = job["summaries"]
    for stage in range(PP):
        replicas = [s for s in summaries.values() if s["stage"] == stage]
        assert len(replicas) == WORLD // PP
        # DP replicas stay bit-identical: the gradients really were all-reduced.
        assert len({s["checksum"] for s in replicas}) == 1
    last_stage = [s for s in summaries.values() if s["stage"] == PP - 1]
    for summary in last_stage:
        assert [len(losses) for losses in summary["losses"]] == [MICROBATCHES] * STEPS


def test_the_job_record_is_derived_from_megatron_parallel_state(job: dict[str, Any]) -> None:
    infos = job["infos"]
    assert len(infos) == WORLD
    for info in infos:
        assert (info.dp_size, info.pp_size, info.tp_size, info.dsp_size, info.vpp_size) == (
            2, 2, 1, 1, 1,
        )  # fmt: skip
        assert info.world_size == WORLD
        identity = info.rank_identity
        summary = job["summaries"][identity.rank]
        assert (identity.dp_rank, identity.pp_rank) == (summary["dp_rank"], summary["stage"])
        assert identity.host


def test_one_batch_per_rank_and_step(job: dict[str, Any]) -> None:
    keys = Counter((h["rank"], h["step"]) for h in job["headers"])
    assert keys == {(rank, step): 1 for rank in range(WORLD) for step in range(STEPS)}
    for header in job["headers"]:
        summary = job["summaries"][header["rank"]]
        assert (header["dp_rank"], header["pp_rank"]) == (summary["dp_rank"], summary["stage"])


def test_every_microbatch_forward_and_backward_in_1f1b_order(job: dict[str, Any]) -> None:
    for (rank, step), ops in job["ops"].items():
        stage = job["summaries"][rank]["stage"]
        computes = [
            ("F" if op["optype"] == "forward-compute" else "B") + str(op["microbatch"])
            for op in ops
            if op["optype"] in ("forward-compute", "backward-compute")
        ]
        warmup = PP - stage - 1
        expected = [f"F{m}" for m in range(warmup)]
        for m in range(MICROBATCHES - warmup):
            expected += [f"F{m + warmup}", f"B{m}"]
        expected += [f"B{m}" for m in range(MICROBATCHES - warmup, MICROBATCHES)]
        assert computes == expected, (rank, step)
        assert {op["chunk"] for op in ops} == {0}


def test_p2p_in_both_directions_with_fused_calls_as_one_transfer(job: dict[str, Any]) -> None:
    for (rank, step), ops in job["ops"].items():
        stage = job["summaries"][rank]["stage"]
        counts = Counter(op["optype"] for op in ops if op["optype"].endswith(("-send", "-recv")))
        if stage == 0:
            assert counts == {"forward-send": MICROBATCHES, "backward-recv": MICROBATCHES}
            fused_pair = ("forward-send", "backward-recv")
        else:
            assert counts == {"forward-recv": MICROBATCHES, "backward-send": MICROBATCHES}
            fused_pair = ("backward-send", "forward-recv")
        # 1F1B's steady state sends one way and receives the other in one call: those
        # are two ops with the same stamps (the analysis pairs them with their peers).
        sends = {(op["start_ns"], op["duration_ns"]) for op in _of(ops, fused_pair[0])}
        recvs = {(op["start_ns"], op["duration_ns"]) for op in _of(ops, fused_pair[1])}
        assert len(sends & recvs) == MICROBATCHES - (PP - 1), (rank, step)
        # A send ships what its compute produced: same micro-batch, after it ended.
        direction = "forward" if stage == 0 else "backward"
        sent = _of(ops, f"{direction}-send")
        produced = _of(ops, f"{direction}-compute")
        assert [op["microbatch"] for op in sent] == list(range(MICROBATCHES))
        for send in sent:
            compute = next(c for c in produced if c["microbatch"] == send["microbatch"])
            assert send["start_ns"] >= _end(compute)


def test_gradient_finalisation_and_optimizer_end_every_step(job: dict[str, Any]) -> None:
    tail = [
        "separate-grads-all-reduce",
        "layernorm-grads-all-reduce",
        "embedding-grads-all-reduce",
        "optimizer-clip-main-grad",
        "optimizer",
    ]
    for (rank, step), ops in job["ops"].items():
        last_backward = max(_end(op) for op in _of(ops, "backward-compute"))
        after = [
            op
            for op in ops
            if op["start_ns"] >= last_backward and not op["optype"].endswith(("-send", "-recv"))
        ]
        # megatron's finalize_model_grads order (DP sync, layernorm, embedding), then the
        # grad-norm all-reduce and the update: once each, and nothing else but the last
        # backward-send after the last backward.
        assert [op["optype"] for op in after] == tail, (rank, step)
        for earlier, later in itertools.pairwise(after):
            assert later["start_ns"] >= _end(earlier)


def _analyse_every_step(job: dict[str, Any], steps: int) -> None:
    out: Path = job["out"]
    dsn = f"chdb://{out / 'chdb'}"
    lagscope = [sys.executable, "-m", "lagscope.cli"]
    run = subprocess.run(
        [*lagscope, "run", "--logs", str(out / "logs"), "--dsn", dsn, "--idle-exit-s", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert f"job megatron-tiny-gpt attempt 0: {steps} steps closed" in run.stdout
    query = subprocess.run(
        [*lagscope, "query", "--dsn", dsn, "--format", "json",
         "SELECT step, complete, missing_ranks, slowdown FROM steps FINAL ORDER BY step"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    rows = json.loads(query.stdout)
    assert [row["step"] for row in rows] == list(range(steps))
    for row in rows:
        assert row["complete"] and row["missing_ranks"] == []
        # An unanalysable step is stored with a NaN slowdown (JSON null).
        assert row["slowdown"] is not None and row["slowdown"] > 0, row


def test_lagscope_run_analyses_every_step(job: dict[str, Any]) -> None:
    _analyse_every_step(job, STEPS)


# -- the interleaved schedule (virtual pipeline 2, overlap_p2p_comm) ----------------------


def test_interleaved_every_chunk_and_microbatch_once_per_direction(
    interleaved_job: dict[str, Any],
) -> None:
    for summary in _replicas_by_stage(interleaved_job).values():
        assert len({s["checksum"] for s in summary}) == 1
    for (rank, step), ops in interleaved_job["ops"].items():
        for optype in ("forward-compute", "backward-compute"):
            seen = Counter((op["chunk"], op["microbatch"]) for op in _of(ops, optype))
            assert seen == {(c, m): 1 for c in range(2) for m in range(MICROBATCHES)}, (
                rank, step, optype,
            )  # fmt: skip
        # Every compute has its transfer in each direction: 2 chunks x 4 micro-batches.
        counts = Counter(op["optype"] for op in ops if op["optype"].endswith(("-send", "-recv")))
        assert counts == dict.fromkeys(
            ("forward-send", "forward-recv", "backward-send", "backward-recv"), 2 * MICROBATCHES
        ), (rank, step)


def test_interleaved_pipeline_ends_are_zero_length_transfers(
    interleaved_job: dict[str, Any],
) -> None:
    for (rank, _), ops in interleaved_job["ops"].items():
        stage = interleaved_job["summaries"][rank]["stage"]
        zero = Counter(
            (op["optype"], op["chunk"])
            for op in ops
            if op["optype"].endswith(("-send", "-recv")) and op["duration_ns"] == 0
        )
        # Global chunk 0 (stage 0, chunk 0) receives no input and sends no input gradient;
        # the last global chunk (stage 1, chunk 1) sends no output and receives no grad.
        if stage == 0:
            assert zero == {("forward-recv", 0): MICROBATCHES, ("backward-send", 0): MICROBATCHES}
        else:
            assert zero == {("forward-send", 1): MICROBATCHES, ("backward-recv", 1): MICROBATCHES}


def test_interleaved_overlapped_transfers_end_before_the_gradient_sync(
    interleaved_job: dict[str, Any],
) -> None:
    for (rank, step), ops in interleaved_job["ops"].items():
        sync = _of(ops, "separate-grads-all-reduce")
        assert len(sync) == 1
        transfers = [op for op in ops if op["optype"].endswith(("-send", "-recv"))]
        assert max(_end(op) for op in transfers) <= sync[0]["start_ns"], (rank, step)


def test_lagscope_run_analyses_every_interleaved_step(interleaved_job: dict[str, Any]) -> None:
    _analyse_every_step(interleaved_job, 2)


def _replicas_by_stage(job: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    by_stage: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for summary in job["summaries"].values():
        by_stage[summary["stage"]].append(summary)
    return by_stage
