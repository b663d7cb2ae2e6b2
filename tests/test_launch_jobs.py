"""`lagscope launch` on real training scripts without a line of lagscope (tests/launch_jobs/):
each framework's job runs once (a module fixture) through the command as a user types it,
with a straggler its own arguments plant (rank 1 three times slower in forward for steps
15-29 of 40), and the tests read what every rank recorded and what the analysis names.

The jobs wait on an emulated accelerator (5 ms a forward), so their steps are tens of ms
and the 2 shared cores are not what makes a rank slow.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from tests.torch_jobs.harness import analyse, job_records, recorded_ops

#: `alone`: the jobs' planted straggler must stand out of their own noise, and a test
#: beside them on the two cores adds noise (the Trainer's went unnamed so once); `make
#: test` runs this module after the rest.
pytestmark = pytest.mark.alone

JOBS = Path(__file__).resolve().parent / "launch_jobs"
REPOSITORY = JOBS.parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
#: The straggler every job plants: global rank 1, 3x slower in forward, steps 15-29.
STRAGGLER = ["--slow-rank", "1", "--slow-steps", "15-29", "--slow-factor", "3"]
STEPS = 40


def lagscope_launch(
    tmp: Path, command: list[str], *options: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`lagscope launch --log-dir TMP/logs --job-id JOB OPTIONS -- COMMAND`, run in TMP."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lagscope", "launch", "--log-dir", str(tmp / "logs"),
         "--job-id", "job", *options, "--", *command],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


class Job:
    """A finished launch: its process, what its ranks recorded, its analysis."""

    def __init__(self, tmp: Path, done: subprocess.CompletedProcess[str]) -> None:
        self.tmp = tmp
        self.done = done
        assert done.returncode == 0, done.stderr[-3000:]
        self.log_dir = tmp / "logs"
        self.ops = recorded_ops(self.log_dir)
        self.infos = job_records(self.log_dir)
        self._analysis: Any = None

    @property
    def analysis(self) -> Any:
        """The job as `lagscope run` concludes it."""
        if self._analysis is None:
            self._analysis = analyse(self.log_dir, self.tmp / "chdb").jobs["job", 0]
        return self._analysis

    def per_rank_step(self) -> dict[tuple[int, int], collections.Counter]:
        kinds: dict[tuple[int, int], collections.Counter] = collections.defaultdict(
            collections.Counter
        )
        for op in self.ops:
            kinds[op["rank"], op["step"]][op["optype"]] += 1
        return kinds

    def op_ms(self, rank: int, steps: range, optype: str) -> float:
        """The rank's time in ops of `optype` per step, median over `steps`."""
        import statistics

        per_step = collections.Counter()
        for op in self.ops:
            if op["rank"] == rank and op["step"] in steps and op["optype"] == optype:
                per_step[op["step"]] += op["duration_ns"] / 1e6
        return statistics.median(per_step.values())


def assert_named(job: Any, worker: tuple[int, int], within: int = 2) -> None:
    """An episode opened at step 15 and recovered at 30 (within `within` steps) names
    `worker` first, slow in forward compute; no other episode."""
    spans = [(e.onset, e.recovery, e.diagnosis.summary) for e in job.episodes]
    assert len(job.episodes) == 1, spans
    (episode,) = job.episodes
    assert abs(episode.onset - 15) <= within, spans
    assert episode.recovery is not None and abs(episode.recovery - 30) <= within, spans
    found = re.search(r"\(dp (\d+), pp (\d+)\)", episode.diagnosis.summary)
    assert found and (int(found[1]), int(found[2])) == worker, episode.diagnosis.summary
    assert "slow in forward-compute" in episode.diagnosis.summary


def assert_layout(job: Job, world: int, dp: int, pp: int) -> None:
    """One job record per rank (and its end), the layout read from the job's objects."""
    assert sorted(info.rank_identity.rank for info in job.infos) == list(range(world))
    for info in job.infos:
        assert (info.job_id, info.dp_size, info.pp_size, info.world_size) == ("job", dp, pp, world)


def assert_every_step_recorded(job: Job, world: int, first: int = 1) -> None:
    """Each rank recorded steps `first` to 39, nothing before (the steps the monitor
    learns the job in) and nothing after."""
    steps = collections.defaultdict(set)
    for op in job.ops:
        steps[op["rank"]].add(op["step"])
    assert sorted(steps) == list(range(world))
    for rank, seen in steps.items():
        assert seen == set(range(first, STEPS)), (rank, sorted(seen))


# -- plain DDP (torchrun), followed live -------------------------------------------------


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> Job:
    tmp = tmp_path_factory.mktemp("ddp")
    command = [*TORCHRUN, "--nproc-per-node", "2", str(JOBS / "ddp_train.py"), *STRAGGLER]
    done = lagscope_launch(tmp, command, "--follow", "--dsn", f"chdb://{tmp / 'store'}",
                           "--report", str(tmp / "report.html"))  # fmt: skip
    return Job(tmp, done)


@pytest.mark.slow
def test_ddp_is_recorded_from_its_objects(ddp: Job) -> None:
    assert_layout(ddp, world=2, dp=2, pp=1)
    # DDP's first steps are its re-bucketing: recorded from step 2, as lagscope.torch does.
    assert_every_step_recorded(ddp, world=2, first=2)
    buckets = None
    for (rank, step), kinds in ddp.per_rank_step().items():
        assert kinds["input-wait"] == kinds["forward-compute"] == 1, (rank, step, kinds)
        assert kinds["backward-compute"] == kinds["optimizer"] == 1, (rank, step, kinds)
        buckets = buckets or kinds["separate-grads-all-reduce"]
        assert kinds["separate-grads-all-reduce"] == buckets >= 1, (rank, step, kinds)


@pytest.mark.slow
def test_ddp_follow_names_the_straggler_with_its_bounds(ddp: Job) -> None:
    """--follow printed the summary `lagscope run` prints, with the episode, and kept the
    report (final at the end)."""
    out = ddp.done.stdout
    assert "job job attempt 0: 38 steps closed" in out, out
    assert re.search(r"episode 1 from step 1[4-6] to step (29|30|31)", out), out
    assert "(dp 1, pp 0) on" in out and "slow in forward-compute" in out, out
    assert f"report written to {ddp.tmp / 'report.html'}" in out
    assert "http-equiv" not in (ddp.tmp / "report.html").read_text()  # final: no refresh
    assert_named(ddp.analysis, (1, 0))


# -- FSDP2, a script that spawns its ranks -----------------------------------------------


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> Job:
    tmp = tmp_path_factory.mktemp("fsdp")
    return Job(tmp, lagscope_launch(tmp, [sys.executable, str(JOBS / "fsdp_train.py"), *STRAGGLER]))


@pytest.mark.slow
def test_fsdp2_is_recorded_from_fully_shard(fsdp: Job) -> None:
    """Its 1-D mesh is data parallel; every block's parameters are all-gathered for its
    forward and its backward and its gradients reduce-scattered; the planted straggler's
    forward is 3x as long in its steps, and it is named."""
    assert_layout(fsdp, world=2, dp=2, pp=1)
    assert_every_step_recorded(fsdp, world=2)
    blocks = 3
    for (rank, step), kinds in fsdp.per_rank_step().items():
        kinds.pop("gc-pause", None)
        assert kinds == {"params-all-gather": 2 * blocks, "grads-reduce-scatter": blocks,
                         "input-wait": 1, "forward-compute": 1, "backward-compute": 1,
                         "optimizer": 1}, (rank, step, kinds)  # fmt: skip
    # The straggler's forward grows by its 2 x 5 ms; its peer's forward (the root's, which
    # holds the blocks' all-gathers) grows too, by its wait in those all-gathers.
    slow, before = range(15, 30), range(3, 15)

    def grew(rank: int, optype: str) -> float:
        return fsdp.op_ms(rank, slow, optype) - fsdp.op_ms(rank, before, optype)

    assert grew(1, "forward-compute") > 5
    assert grew(0, "params-all-gather") > grew(1, "params-all-gather") + 3
    assert_named(fsdp.analysis, (1, 0), within=3)


# -- torch.distributed.pipelining 1F1B, DP 2 x PP 2 (torchrun) ---------------------------


@pytest.fixture(scope="module")
def pipelining(tmp_path_factory: pytest.TempPathFactory) -> Job:
    tmp = tmp_path_factory.mktemp("pipelining")
    command = [*TORCHRUN, "--nproc-per-node", "4", str(JOBS / "pipelining_train.py"), *STRAGGLER]
    return Job(tmp, lagscope_launch(tmp, command))


@pytest.mark.slow
def test_pipelining_1f1b_names_the_straggler(pipelining: Job) -> None:
    """The schedule's stages give the pipeline group; the job's own data-parallel groups
    (built with new_group) give the replicas: rank 1 is (dp 0, pp 1)."""
    assert_layout(pipelining, world=4, dp=2, pp=2)
    assert_every_step_recorded(pipelining, world=4, first=2)
    for (rank, step), kinds in pipelining.per_rank_step().items():
        assert kinds["forward-compute"] == kinds["backward-compute"] == 4, (rank, step, kinds)
        sends = "forward-send" if rank % 2 == 0 else "backward-send"
        assert kinds[sends] == 4 and kinds["separate-grads-all-reduce"] >= 1, (rank, kinds)
    assert_named(pipelining.analysis, (0, 1))


# -- megatron-core 1F1B, PP 2 x DP 2 (torchrun) ------------------------------------------


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> Job:
    tmp = tmp_path_factory.mktemp("megatron")
    command = [*TORCHRUN, "--nproc-per-node", "4", str(JOBS / "megatron_train.py"), *STRAGGLER]
    return Job(tmp, lagscope_launch(tmp, command))


@pytest.mark.slow
@pytest.mark.skipif(sys.version_info < (3, 12), reason="megatron-core 0.19 needs Python 3.12")
def test_megatron_1f1b_is_recorded_at_its_seams_and_names_the_straggler(megatron: Job) -> None:
    """The schedule fetched before the loop is timed; the optimizer learnt at its first
    update ends every later step: from step 1, each step ends with megatron's finalize
    phases, the grad-norm all-reduce and the update."""
    assert_layout(megatron, world=4, dp=2, pp=2)
    assert_every_step_recorded(megatron, world=4)
    for (rank, step), kinds in megatron.per_rank_step().items():
        assert kinds["forward-compute"] == kinds["backward-compute"] == 4, (rank, step)
        assert kinds["optimizer-clip-main-grad"] == kinds["optimizer"] == 1, (rank, step)
    # megatron's rank order: rank 1 is data-parallel rank 1 of the first stage.
    assert_named(megatron.analysis, (1, 0))


# -- a Hugging Face Trainer (torchrun) ---------------------------------------------------


@pytest.fixture(scope="module")
def hf_trainer(tmp_path_factory: pytest.TempPathFactory) -> Job:
    pytest.importorskip("transformers")
    tmp = tmp_path_factory.mktemp("hf")
    command = [*TORCHRUN, "--nproc-per-node", "2", str(JOBS / "hf_train.py"),
               "--out", str(tmp / "out"), *STRAGGLER]  # fmt: skip
    return Job(tmp, lagscope_launch(tmp, command))


@pytest.mark.slow
def test_hugging_face_trainer_names_the_straggler(hf_trainer: Job) -> None:
    """The Trainer's DDP model, its optimizer inside Accelerate's wrapper and its data
    loader behind Accelerate's prefetching are all found."""
    assert_layout(hf_trainer, world=2, dp=2, pp=1)
    assert_every_step_recorded(hf_trainer, world=2, first=2)
    for (rank, step), kinds in hf_trainer.per_rank_step().items():
        assert kinds["input-wait"] >= 1 and kinds["optimizer"] == 1, (rank, step, kinds)
        assert kinds["forward-compute"] == kinds["backward-compute"] == 1, (rank, step, kinds)
    assert_named(hf_trainer.analysis, (1, 0))


# -- a PyTorch Lightning Trainer (Lightning starts its ranks) ------------------------------


@pytest.fixture(scope="module")
def lightning(tmp_path_factory: pytest.TempPathFactory) -> Job:
    pytest.importorskip("pytorch_lightning")
    tmp = tmp_path_factory.mktemp("lightning")
    command = [sys.executable, str(JOBS / "lightning_train.py"), *STRAGGLER]
    return Job(tmp, lagscope_launch(tmp, command))


@pytest.mark.slow
def test_lightning_trainer_names_the_straggler(lightning: Job) -> None:
    """Lightning runs forward and backward inside the optimizer's step (a closure) and
    points its module's forward at the training step for each call: the optimizer op
    still starts after the backward, and the forward is timed."""
    assert_layout(lightning, world=2, dp=2, pp=1)
    assert_every_step_recorded(lightning, world=2, first=2)
    by_rank_step: dict[tuple[int, int], dict[str, dict]] = collections.defaultdict(dict)
    for op in lightning.ops:
        by_rank_step[op["rank"], op["step"]][op["optype"]] = op
    for (rank, step), ops in by_rank_step.items():
        backward, optimizer = ops["backward-compute"], ops["optimizer"]
        assert "forward-compute" in ops, (rank, step, sorted(ops))
        assert optimizer["start_ns"] >= backward["start_ns"] + backward["duration_ns"]
    assert_named(lightning.analysis, (1, 0))


# -- what launch leaves as it was ---------------------------------------------------------


@pytest.mark.slow
def test_a_job_that_starts_its_own_monitor_is_recorded_once(tmp_path: Path) -> None:
    """The harness's DDP job calls lagscope.torch.monitor() itself (job id torch-job): the
    launch's monitor stands down, and every op is there once, under the job's own id."""
    command = [sys.executable, "-m", "tests.torch_jobs.ddp", "--log-dir", str(tmp_path / "own"),
               "--world", "2", "--steps", "6", "--gc-probe", "false"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "lagscope", "launch", "--log-dir", str(tmp_path / "logs"), "--",
         *command], cwd=REPOSITORY, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert not any((tmp_path / "logs").iterdir()), "the launch's own monitor recorded"
    ops = recorded_ops(tmp_path / "own")
    assert {info.job_id for info in job_records(tmp_path / "own")} == {"torch-job"}
    keys = collections.Counter((o["rank"], o["step"], o["optype"], o["microbatch"]) for o in ops)
    assert ops and max(keys.values()) == 1, keys.most_common(3)


@pytest.mark.slow
def test_a_hand_written_pipeline_runs_unrecorded_with_one_line(tmp_path: Path) -> None:
    """isend/irecv outside a pipelining schedule: stages lagscope cannot tell. One line
    from rank 0 says so and what to do; nothing is recorded; the job's status is its own."""
    command = [sys.executable, "-m", "tests.torch_jobs.pipeline_1f1b", "--log-dir",
               str(tmp_path / "job"), "--world", "2", "--pp", "2", "--steps", "3",
               "--monitor", "false"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "lagscope", "launch", "--log-dir", str(tmp_path / "logs"), "--",
         *command], cwd=REPOSITORY, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "runs unrecorded" in line]
    assert len(said) == 1 and "hand-written pipeline" in said[0], done.stderr[-3000:]
    assert "lagscope.torch.monitor(modules=" in said[0]
    assert not any((tmp_path / "logs").iterdir())


@pytest.mark.slow
def test_a_job_that_is_not_distributed_runs_unrecorded_with_one_line(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import torch\n"
        "model = torch.nn.Linear(4, 4)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    model(torch.ones(4)).sum().backward()\n"
        "    optimizer.step()\n"
        "print('trained')\n"
    )
    done = lagscope_launch(tmp_path, [sys.executable, str(script)])
    assert done.returncode == 0 and done.stdout == "trained\n", done.stderr
    said = [line for line in done.stderr.splitlines() if "runs unrecorded" in line]
    assert len(said) == 1 and "not distributed" in said[0], done.stderr
    assert not any((tmp_path / "logs").iterdir())


def test_the_exit_status_is_the_commands(tmp_path: Path) -> None:
    done = lagscope_launch(tmp_path, [sys.executable, "-c", "import sys; sys.exit(3)"])
    assert done.returncode == 3, done.stderr
    done = lagscope_launch(tmp_path, ["no-such-command-anywhere"])
    assert done.returncode == 127 and "cannot run no-such-command-anywhere" in done.stderr


def test_ctrl_c_reaches_the_command_and_its_status_is_kept(tmp_path: Path) -> None:
    """SIGINT to lagscope (no terminal here: what a terminal's Ctrl-C does to the
    command's own process group is the kernel's) is passed on: the command's Python
    raises KeyboardInterrupt, dies by SIGINT, and lagscope ends the same way."""
    started = tmp_path / "started"
    child = (
        "import pathlib, sys, time\n"
        f"pathlib.Path({str(started)!r}).write_text('')\n"
        "try:\n    time.sleep(60)\n"
        "except KeyboardInterrupt:\n    print('interrupted', flush=True)\n    raise\n"
    )
    launch = subprocess.Popen(
        [sys.executable, "-m", "lagscope", "launch", "--log-dir", str(tmp_path / "logs"), "--",
         sys.executable, "-c", child],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    launch.send_signal(signal.SIGINT)
    out, err = launch.communicate(timeout=60)
    assert "interrupted" in out, err
    assert launch.returncode == -signal.SIGINT, (launch.returncode, err)


def test_no_command_is_a_usage_error(tmp_path: Path) -> None:
    done = lagscope_launch(tmp_path, [])
    assert done.returncode == 2 and "no command to run" in done.stderr
    assert not (tmp_path / "logs").exists()


@pytest.mark.slow
def test_stream_ships_every_recorded_step_to_kafka(
    tmp_path: Path, kafka_bootstrap: str, kafka_topics: dict[str, str]
) -> None:
    """--stream runs the sidecar beside the job and stops it once the last steps shipped:
    one Kafka message per rank-step the ranks recorded, and the streamer ended cleanly."""
    from lagscope.producers.events import peek_header
    from tests.kafka_util import consume_all

    env = {**os.environ, **{f"LAGSCOPE_KAFKA__{k.upper()}": v for k, v in kafka_topics.items()}}
    command = [*TORCHRUN, "--nproc-per-node", "2", str(JOBS / "ddp_train.py"), "--steps", "8"]
    done = subprocess.run(
        [sys.executable, "-m", "lagscope", "launch", "--log-dir", str(tmp_path / "logs"),
         "--job-id", "job", "--stream", "--bootstrap-servers", kafka_bootstrap, "--",
         *command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the streamer ended with status" not in done.stderr, done.stderr[-3000:]
    recorded = {(op["rank"], op["step"]) for op in recorded_ops(tmp_path / "logs")}
    shipped = [
        peek_header(m.value) for m in consume_all(kafka_bootstrap, kafka_topics["topic_ops"])
    ]
    assert recorded and {(h["rank"], h["step"]) for h in shipped} == recorded
    assert len(shipped) == len(recorded)
