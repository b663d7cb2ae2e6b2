"""What a step is, what is recorded in it, and what is refused: the Megatron-core adapter on
megatron-core's real no-pipelining schedule, in a world of one gloo rank in this process.

The 4-rank pipeline job (p2p, DP sync across replicas, megatron's optimizer) is in
tests/test_megatron_job.py.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from lagscope.simulator.optypes import GC_PAUSE
from tests.megatron_jobs.world import megatron_world_of_one  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(
    sys.version_info < (3, 12), reason="megatron-core 0.19 is published for Python >= 3.12 only"
)

MICROBATCHES = 3


def test_monitor_before_the_model_parallel_groups_says_what_to_call(tmp_path: Path) -> None:
    import lagscope.megatron

    with pytest.raises(RuntimeError, match=r"call parallel_state.initialize_model_parallel"):
        lagscope.megatron.monitor(job_id="early", log_dir=tmp_path)


@pytest.mark.usefixtures("megatron_world_of_one")
def test_a_job_id_is_required_when_the_environment_has_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lagscope.megatron

    for name in ("LAGSCOPE_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="needs a job id shared by every rank"):
        lagscope.megatron.monitor(log_dir=tmp_path)


class _Job:
    """The tiny GPT (one stage: embedding, layer, tied output) on megatron's schedule."""

    def __init__(self) -> None:
        import torch
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.transformer import TransformerConfig

        from tests.megatron_jobs import tiny_gpt

        torch.manual_seed(0)
        config = TransformerConfig(
            num_layers=1,
            hidden_size=tiny_gpt.HIDDEN,
            num_attention_heads=1,
            pipeline_dtype=torch.float32,
            finalize_model_grads_func=finalize_model_grads,
        )
        self.model = tiny_gpt.TinyGPTStage(config, pre_process=True, post_process=True)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.data = tiny_gpt.batches(dp_rank=0, steps=100, microbatches=MICROBATCHES)
        self._get_schedule = get_forward_backward_func
        self._forward_step = tiny_gpt.forward_step

    def call_schedule(self, forward_only: bool = False, schedule: Any = None) -> None:
        """One call of megatron's schedule, fetched now (or the one given)."""
        from tests.megatron_jobs.cpu import cuda_tensors_on_cpu

        with cuda_tensors_on_cpu():
            (schedule or self._get_schedule())(
                forward_step_func=self._forward_step,
                data_iterator=self.data,
                model=[self.model],
                num_microbatches=MICROBATCHES,
                seq_length=16,
                micro_batch_size=2,
                forward_only=forward_only,
            )

    def update(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()


def _ops(log_dir: Path) -> list[dict[str, Any]]:
    from tests.torch_jobs.harness import recorded_ops

    return sorted(recorded_ops(log_dir), key=lambda op: (op["step"], op["start_ns"]))


@pytest.mark.usefixtures("megatron_world_of_one")
def test_a_step_is_one_update_and_evaluation_records_nothing(tmp_path: Path) -> None:
    import lagscope.megatron

    job = _Job()
    monitor = lagscope.megatron.monitor(
        job_id="steps", log_dir=tmp_path, optimizer=job.optimizer, gc_probe=False, first_step=10
    )
    try:
        job.call_schedule()
        job.update()  # step 10
        job.call_schedule()
        job.call_schedule()  # gradient accumulation: the same step
        job.update()  # step 11
        job.call_schedule(forward_only=True)  # evaluation between updates
        job.call_schedule()
        job.update()  # step 12
    finally:
        monitor.close()

    ops = _ops(tmp_path)
    by_step: dict[int, list[dict[str, Any]]] = {}
    for op in ops:
        by_step.setdefault(op["step"], []).append(op)
    assert sorted(by_step) == [10, 11, 12]
    calls = {10: 1, 11: 2, 12: 1}
    for step, step_ops in by_step.items():
        counts = Counter(op["optype"] for op in step_ops)
        n = calls[step]
        assert counts == {
            "forward-compute": n * MICROBATCHES,
            "backward-compute": n * MICROBATCHES,
            "separate-grads-all-reduce": n,
            "layernorm-grads-all-reduce": n,
            "embedding-grads-all-reduce": n,
            "optimizer": 1,
        }, step
        forwards = [op["microbatch"] for op in step_ops if op["optype"] == "forward-compute"]
        backwards = [op["microbatch"] for op in step_ops if op["optype"] == "backward-compute"]
        assert forwards == backwards == list(range(MICROBATCHES)) * n
        # The update comes last and starts after the gradients were finalised.
        assert step_ops[-1]["optype"] == "optimizer"
        last_sync = max(
            op["start_ns"] + op["duration_ns"]
            for op in step_ops
            if op["optype"] == "embedding-grads-all-reduce"
        )
        assert step_ops[-1]["start_ns"] >= last_sync


@pytest.mark.usefixtures("megatron_world_of_one")
def test_a_sampling_schedule_records_only_its_steps(tmp_path: Path) -> None:
    import lagscope.megatron
    import lagscope.torch

    job = _Job()
    monitor = lagscope.megatron.monitor(
        job_id="sampled",
        log_dir=tmp_path,
        optimizer=job.optimizer,
        gc_probe=False,
        schedule=lagscope.torch.schedule(wait=1, active=1),
    )
    try:
        for _ in range(4):
            job.call_schedule()
            job.update()
    finally:
        monitor.close()
    ops = _ops(tmp_path)
    assert sorted({op["step"] for op in ops}) == [1, 3]
    assert Counter(op["step"] for op in ops if op["optype"] == "optimizer") == {1: 1, 3: 1}


@pytest.mark.usefixtures("megatron_world_of_one")
def test_gc_pauses_are_recorded_only_inside_steps(tmp_path: Path) -> None:
    import gc

    import lagscope.megatron

    job = _Job()
    monitor = lagscope.megatron.monitor(
        job_id="gc", log_dir=tmp_path, optimizer=job.optimizer, gc_probe=True, first_step=5
    )
    try:
        gc.collect()  # before the first step: not recorded
        job.call_schedule()
        gc.collect()  # inside step 5
        job.update()
    finally:
        monitor.close()
    ops = _ops(tmp_path)
    assert {op["step"] for op in ops} == {5}
    assert any(op["optype"] == GC_PAUSE for op in ops)


@pytest.mark.usefixtures("megatron_world_of_one")
def test_a_schedule_fetched_before_the_monitor_is_named_at_once(tmp_path: Path) -> None:
    """The order trap: `get_forward_backward_func()` before `monitor()` hands out the
    unhooked schedule. The first call of it says what to change; fetched again, it records."""
    import warnings

    from megatron.core.pipeline_parallel import get_forward_backward_func

    import lagscope.megatron

    job = _Job()
    fetched_too_early = get_forward_backward_func()
    monitor = lagscope.megatron.monitor(
        job_id="early", log_dir=tmp_path, optimizer=job.optimizer, gc_probe=False
    )
    try:
        with pytest.warns(RuntimeWarning, match=r"get_forward_backward_func\(\) after"):
            job.call_schedule(schedule=fetched_too_early)
        job.update()
        with warnings.catch_warnings():
            # said once, not at every call
            warnings.filterwarnings("error", message="lagscope.megatron")
            job.call_schedule(schedule=fetched_too_early)
            job.update()
            assert not _ops(tmp_path)
            job.call_schedule()  # fetched after monitor(): timed
            job.update()
    finally:
        monitor.close()
    ops = _ops(tmp_path)
    assert {op["step"] for op in ops} == {0}
    assert Counter(op["optype"] for op in ops)["forward-compute"] == MICROBATCHES


@pytest.mark.usefixtures("megatron_world_of_one")
def test_step_ends_a_step_by_hand_on_either_kind_of_job(tmp_path: Path) -> None:
    """`monitor.step()` exists on the Megatron monitor as on the torch one (the README's
    "no optimizer" advice): without an optimizer every schedule call is already a step."""
    import lagscope.megatron

    job = _Job()
    monitor = lagscope.megatron.monitor(job_id="by-hand", log_dir=tmp_path / "a", gc_probe=False)
    try:
        job.call_schedule()
        monitor.step()  # harmless: the call's step has ended already
        job.call_schedule()
        assert monitor.step_id == 1
    finally:
        monitor.close()
    assert sorted({op["step"] for op in _ops(tmp_path / "a")}) == [0, 1]

    monitor = lagscope.megatron.monitor(
        job_id="by-hand", log_dir=tmp_path / "b", optimizer=job.optimizer, gc_probe=False
    )
    try:
        job.call_schedule()
        monitor.step()  # an update the monitor does not see
        job.call_schedule()
        job.update()
    finally:
        monitor.close()
    ops = _ops(tmp_path / "b")
    assert sorted({op["step"] for op in ops}) == [0, 1]
    assert [op["step"] for op in ops if op["optype"] == "optimizer"] == [1]


@pytest.mark.usefixtures("megatron_world_of_one")
def test_run_on_a_job_that_recorded_nothing_fails_and_says_why(tmp_path: Path) -> None:
    import subprocess
    import warnings

    from megatron.core.pipeline_parallel import get_forward_backward_func

    import lagscope.megatron

    job = _Job()
    fetched_too_early = get_forward_backward_func()
    log_dir = tmp_path / "logs"
    monitor = lagscope.megatron.monitor(
        job_id="silent", log_dir=log_dir, optimizer=job.optimizer, gc_probe=False
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(3):
                job.call_schedule(schedule=fetched_too_early)
                job.update()
    finally:
        monitor.close()
    done = subprocess.run(
        [sys.executable, "-m", "lagscope", "run", "--log-dir", str(log_dir)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"lagscope run: error: --log-dir {log_dir}: 1 rank log(s)"), last
    assert "get_forward_backward_func() after lagscope.megatron.monitor" in last
    assert "0 steps closed" not in done.stdout
