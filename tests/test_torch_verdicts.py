"""The issue's verdicts on real torch jobs recorded through lagscope.torch only.

The jobs run a small model on an emulated accelerator (`block_ms`): each block's forward
takes 2 ms more and its backward 4 ms more, waited for as a host waits for its GPU, so ops
last several to tens of ms and steps about 100 ms, as on a real small model, while four
ranks on a few shared cores do not fight over them (real CPU compute of that size made every
op's time depend on what the other ranks did at that moment: a healthy job read S 1.65-1.93,
all of it that contention). The four ranks of a 60-step job use 3-5 s of CPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from tests.torch_jobs import ddp, pipeline_1f1b
from tests.torch_jobs.harness import Knobs, analyse, launch, prepared_logs

#: Real multi-process torch jobs (CPU, gloo), one per scenario: slow. `alone`: a planted
#: straggler must stand out of the job's own noise, and a test beside it on the two cores
#: adds noise (a stalling host went unnamed so once); `make test` runs them after the rest.
pytestmark = [pytest.mark.slow, pytest.mark.alone]

#: DP 2 x PP 2, 1F1B over 4 micro-batches, 3 blocks per stage: steps of about 110 ms.
PIPELINE = {"block_ms": 2.0}
#: DP 4, 6 blocks, three gradient buckets: steps of about 85 ms.
DDP = {**ddp.DEFAULTS, "hidden": 256, "batch": 32, "bucket_mb": 0.3, "block_ms": 2.0}
#: One rank slow for steps 15-29 of 40.
WINDOW = {"steps": 40, "slow_start": 15, "slow_end": 30}


def _job(tmp: Path, target: object, **knobs: object) -> tuple[Path, object]:
    settings = Knobs(log_dir=str(tmp / "logs"), **knobs)
    launch(target, settings)  # type: ignore[arg-type]
    report = analyse(settings.log_dir, tmp / "chdb")
    return Path(settings.log_dir), report.jobs[settings.job_id, 0]


def _first_named(text: str) -> tuple[int, int] | None:
    found = re.search(r"\(dp (\d+), pp (\d+)\)", text)
    return (int(found.group(1)), int(found.group(2))) if found else None


def _the_window_episode(job: object, worker: tuple[int, int], within: int = 3) -> object:
    """The episode of the slow window: onset and recovery within `within` steps, `worker`
    first."""
    spans = [(e.onset, e.recovery, e.diagnosis.summary) for e in job.episodes]
    episodes = [e for e in job.episodes if abs(e.onset - 15) <= within]
    assert episodes, spans
    episode = episodes[0]
    assert episode.recovery is not None and abs(episode.recovery - 30) <= within, spans
    assert _first_named(episode.diagnosis.summary) == worker, episode.diagnosis.summary
    return episode


def _healthy(job: object) -> None:
    diagnosis = job.diagnosis
    assert diagnosis is not None and diagnosis.cause == "none", diagnosis.summary
    assert "floor" in diagnosis.summary, diagnosis.summary
    assert job.episodes == [], [(e.onset, e.recovery, e.diagnosis.summary) for e in job.episodes]
    # S is the job's own noise: near 1, and near the floor it states. (A DDP job's S sits a
    # few hundredths above its floor: its gradient buckets share one op type whose ideal is
    # one median over buckets of different sizes, a persistent excess no fluctuation has.)
    assert diagnosis.evidence.slowdown < 1.35, diagnosis.summary
    assert diagnosis.evidence.slowdown < diagnosis.evidence.noise_floor + 0.1


def test_a_slow_worker_is_named_first_with_onset_and_recovery(tmp_path: Path) -> None:
    """(a) rank 1 (dp 0, pp 1) computes 2x slower in forward for steps 15-29 of 40."""
    _, job = _job(tmp_path, pipeline_1f1b.worker, **PIPELINE, **WINDOW, slow_rank=1,
                  slow_phase="forward")  # fmt: skip
    episode = _the_window_episode(job, (0, 1))
    assert "slow in forward-compute" in episode.diagnosis.summary


def test_b_a_healthy_job_is_reported_healthy(tmp_path: Path) -> None:
    """(b) no straggler, 64 steps: diagnosis "none" with the floor stated, no episode."""
    _, job = _job(tmp_path, pipeline_1f1b.worker, **PIPELINE, steps=64)
    _healthy(job)


def test_a_heavier_last_stage_is_last_stage_imbalance(tmp_path: Path) -> None:
    """An output head (one more block on the last stage): last-stage imbalance, no
    straggler named, no episode."""
    _, job = _job(tmp_path, pipeline_1f1b.worker, **PIPELINE, steps=40, head_layers=1)
    assert job.diagnosis.cause == "last_stage_imbalance", job.diagnosis.summary
    assert job.episodes == [], [(e.onset, e.recovery, e.diagnosis.summary) for e in job.episodes]


@pytest.mark.parametrize(
    ("phase", "slow_in"),
    [("forward", "forward-compute"), ("backward", "backward-compute"), ("input", "input-wait")],
)
def test_ddp_straggler_named_with_its_first_and_last_step(
    tmp_path: Path, phase: str, slow_in: str
) -> None:
    """DDP, rank 1 slow in forward, in backward (its peers' step times stay equal: the
    bucket all-reduces wait for it, so per-rank wall-clock monitors miss it) or in its input
    for steps 15-29: named with what it is slow in, from where it began to where it ended."""
    _, job = _job(tmp_path, ddp.worker, **DDP, **WINDOW, slow_rank=1, slow_phase=phase)
    episode = _the_window_episode(job, (1, 0))
    assert f"slow in {slow_in}" in episode.diagnosis.summary


@pytest.mark.parametrize(
    ("target", "knobs", "rank", "worker"),
    [
        (pipeline_1f1b.worker, PIPELINE, 2, (1, 0)),
        (ddp.worker, DDP, 1, (1, 0)),
    ],
    ids=["1f1b", "ddp"],
)
def test_a_stalling_host_is_named_a_slow_host(
    tmp_path: Path, target: object, knobs: dict, rank: int, worker: tuple[int, int]
) -> None:
    """A worker whose host stalls after its forward and backward return (slow Python, a
    busy CPU) for steps 15-29: its recorded ops keep their durations, the gaps between them
    grow. Named as a slow host (not an input-starved rank, not GC) with its bounds, and
    the run's verdict says the same."""
    _, job = _job(tmp_path, target, **knobs, **WINDOW, slow_rank=rank, slow_phase="host")
    episode = _the_window_episode(job, worker)
    assert episode.diagnosis.cause == "slow_host", episode.diagnosis.summary
    assert "stalls between its ops" in episode.diagnosis.summary
    assert job.diagnosis.cause == "slow_host", job.diagnosis.summary
    assert _first_named(job.diagnosis.summary) == worker


def test_a_host_stalling_from_the_start_is_the_runs_slow_host(tmp_path: Path) -> None:
    """A host that stalls between its worker's ops from the first step has no episode
    (there is no level before to rise from): the run's diagnosis names it from the launch
    delays, not from S, which its ops' usual durations leave alone."""
    _, job = _job(tmp_path, pipeline_1f1b.worker, **PIPELINE, steps=40, slow_rank=2,
                  slow_phase="host")  # fmt: skip
    assert job.diagnosis.cause == "slow_host", job.diagnosis.summary
    assert _first_named(job.diagnosis.summary) == (1, 0), job.diagnosis.summary
    assert job.diagnosis.advice[0].action == "relieve the straggler's host"


@pytest.mark.parametrize(
    ("target", "knobs", "rank"), [(pipeline_1f1b.worker, PIPELINE, 2), (ddp.worker, DDP, 1)],
    ids=["1f1b", "ddp"],
)  # fmt: skip
def test_a_rank_starved_of_input_from_the_start_is_the_runs_slow_input(
    tmp_path: Path, target: object, knobs: dict, rank: int
) -> None:
    """A rank that waits for its input from the first step has no episode: the run's
    diagnosis names it slow_input (its own excess is its input wait), its loader first,
    and re-splitting micro-batches is not offered (a slow loader stays slow with fewer
    batches). Before, the run named it slow_workers with a re-split."""
    _, job = _job(tmp_path, target, **knobs, steps=40, slow_rank=rank, slow_phase="input")
    assert job.diagnosis.cause == "slow_input", job.diagnosis.summary
    assert _first_named(job.diagnosis.summary) == (1, 0), job.diagnosis.summary
    assert "slow in input-wait" in job.diagnosis.summary
    actions = [a.action for a in job.diagnosis.advice]
    assert actions[0] == "speed up the straggler's input"
    assert "re-split micro-batches" not in actions
    assert job.diagnosis.escalation.ladder[1].action == "speed up the straggler's input"


def test_ddp_clean_run_is_quiet(tmp_path: Path) -> None:
    _, job = _job(tmp_path, ddp.worker, **DDP, steps=60)
    _healthy(job)


def test_d_several_buckets_replay_within_5_percent(tmp_path: Path) -> None:
    """(d) DDP with several gradient buckets: every bucket is linked into the step (after
    a compute, before the optimizer), and each step's own measured durations and launch
    delays replayed through the what-if engine give its measured step time within 5 %."""
    from lagscope.simulator import optypes as ot
    from lagscope.simulator.engine import compile_model, simulate

    log_dir, _ = _job(tmp_path, ddp.worker, **DDP, steps=24)
    prepared = prepared_logs(log_dir)
    model = prepared.model
    buckets = [i for i, n in enumerate(model.nodes) if n.optype == ot.SEPARATE_GRADS_ALL_REDUCE]
    assert len(buckets) >= 3, [str(n) for n in model.nodes]
    computes = {i for i, n in enumerate(model.nodes) if ot.is_compute(n.optype)}
    optimizer = next(i for i, n in enumerate(model.nodes) if n.optype == ot.OPTIMIZER)
    for bucket in buckets:
        assert set(model.deps[bucket]) & computes, model.nodes[bucket]
    assert _ancestors(model.deps, optimizer) >= set(buckets)

    n_nodes = model.n_nodes
    cost = prepared.cost.reshape(n_nodes, -1)
    delay = prepared.launch_delay.reshape(n_nodes, -1)
    offsets = np.arange(0, cost.shape[1], prepared.n_dp)
    replayed = simulate(compile_model(model), cost, delay, offsets).step_time
    discrepancy = np.abs(replayed - prepared.actual_step_time) / prepared.actual_step_time
    assert discrepancy.max() <= 0.05, discrepancy.round(3).tolist()


def _ancestors(deps: tuple[tuple[int, ...], ...], node: int) -> set[int]:
    seen: set[int] = set()
    todo = list(deps[node])
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo.extend(deps[current])
    return seen


#: The same jobs with their real CPU compute only (no emulated device): every op jitters by
#: tens of percent as four ranks share two cores, steps of ~25-60 ms.
REAL_COMPUTE = {"hidden": 512, "batch": 64}


#: The real-compute straggler is 4x slower in forward: beside three ranks sharing two cores a
#: 2x forward read 1.6x its own level, whose own spread is +-10 ms: no episode in 1 of 12
#: runs with a busy loop beside them, and once in CI. A straggler is named once the job's
#: own step periods show its cost clear of their noise: at 3x (spinning) the job paid 5-19 %
#: of its steps, within its noise in 1 of 5 runs with the machine loaded 4 deep; at 4x 8-31 %.
REAL_COMPUTE_SLOW_FACTOR = 4.0


def test_a_forward_straggler_on_real_compute_is_named(tmp_path: Path) -> None:
    """(a) on the pipeline job's real compute: a slower forward adds a few tens of ms to
    steps whose ops jitter by tens of ms; the worker's own forward series names it, from
    where it began to where it ended. (Four DDP ranks computing at once on two cores jitter
    too much for a 3-step bound to hold every time: the DDP cases run on the emulated
    device above.) The straggler spins (a sleeping one frees its core, and its peers run
    faster), on the first stage: the second stage's forward, 3x slower there, left the
    job's own step periods where they were (1.02x against 1.19x for the first stage's),
    and a straggler the job does not pay for is not named.

    Within 5 steps here, not 3: with the machine busy the slow worker's own forward after
    its window can run 1.2-1.5x its level before it for a few steps (measured in 1 of 10
    runs beside a busy core: 37, 43, 37, 31 ms at steps 31-34 against 9-45 ms, ~25 ms
    typical, before step 15), and the end-of-run fit then ends it at 34, as the data say."""
    _, job = _job(tmp_path, pipeline_1f1b.worker, **REAL_COMPUTE, **WINDOW, slow_rank=2,
                  slow_phase="forward", slow_factor=REAL_COMPUTE_SLOW_FACTOR,
                  block_ms=0.0, busy=True)  # fmt: skip
    episode = _the_window_episode(job, (1, 0), within=5)
    assert "slow in forward-compute" in episode.diagnosis.summary


def test_a_healthy_job_on_real_compute_has_no_episode(tmp_path: Path) -> None:
    _, job = _job(tmp_path, pipeline_1f1b.worker, **REAL_COMPUTE, steps=64)
    assert job.episodes == [], [(e.onset, e.recovery, e.diagnosis.summary) for e in job.episodes]
    assert job.diagnosis.cause == "none", job.diagnosis.summary


@pytest.mark.parametrize(
    ("phase", "said"),
    [("gc", ("of the pauses on (dp 1, pp 0)",)),
     ("host_gc", ("the host of worker (dp 1, pp 0)", "garbage collection"))],
)  # fmt: skip
@pytest.mark.parametrize(
    ("target", "knobs", "rank"), [(pipeline_1f1b.worker, PIPELINE, 2), (ddp.worker, DDP, 1)],
    ids=["1f1b", "ddp"],
)  # fmt: skip
def test_a_rank_pausing_for_its_own_gc_from_the_start_is_named(
    tmp_path: Path, target: object, knobs: dict, rank: int, phase: str, said: tuple[str, ...]
) -> None:
    """A rank whose grown heap makes it collect as long as its forward, from the first
    step, inside its forwards (`gc`) or between its ops (`host_gc`, as on a GPU, whose
    kernels keep their time while the host collects): no episode (no level before), and
    the run's diagnosis names garbage collection on that worker, with planned collections
    as the fix. Before, it named GC and no worker (`gc`), or a slow host (`host_gc`)."""
    _, job = _job(tmp_path, target, **knobs, steps=40, slow_rank=rank, slow_phase=phase)
    summary = job.diagnosis.summary
    assert job.diagnosis.cause == "gc_pauses", summary
    assert all(phrase in summary for phrase in said), summary
    assert job.diagnosis.advice[0].action == "planned garbage collection"
