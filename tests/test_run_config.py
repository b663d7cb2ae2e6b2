"""`lagscope run` and `lagscope analyze` analyse with the workers' settings: the same
configuration model, file and LAGSCOPE_* variables as `lagscope worker`, so a team that
tuned its episodes or its diagnosis for the cluster sees the same story when it replays a
node's logs or analyses a recorded trace locally. Before, both took the defaults whatever
the workers were told."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lagscope.store.sink import ClickHouseSink
from tests.straggler_logs import write_straggler_logs


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tests/straggler_logs.py`'s job: an episode under the default settings."""
    log_dir = tmp_path_factory.mktemp("run-config") / "logs"
    write_straggler_logs(log_dir, "run-config")
    return log_dir


def run(logs: Path, store: Path, *args: str, env: dict[str, str] | None = None) -> str:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("LAGSCOPE_")}
    done = subprocess.run(
        [sys.executable, "-m", "lagscope", "run", "--log-dir", str(logs),
         "--dsn", f"chdb://{store}", *args],
        capture_output=True, text=True, timeout=300, check=False,
        env={**environment, **(env or {})},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def stored_count(store: Path, table: str) -> int:
    sink = ClickHouseSink(f"chdb://{store}")
    try:
        _, rows = sink.query(f"SELECT count() FROM {table}")
    finally:
        sink.close()
    return int(rows[0][0])


def stored_episodes(store: Path) -> int:
    return stored_count(store, "episodes FINAL")


#: An episode must cost 5 steps' time a step to open: none can.
NO_EPISODES = {"LAGSCOPE_PROCESSOR__EPISODES__MIN_COST": "5"}


def test_the_workers_config_file_sets_the_analysis(logs: Path, tmp_path: Path) -> None:
    printed = run(logs, tmp_path / "defaults")
    assert "episode 1 from step" in printed
    assert stored_episodes(tmp_path / "defaults") >= 1

    config = tmp_path / "worker.yaml"
    config.write_text(
        "kafka:\n  bootstrap_servers: kafka:9092\n"  # the workers' file, whole
        "processor:\n  episodes:\n    min_cost: 5.0\n"
    )
    printed = run(logs, tmp_path / "configured", "--config", str(config))
    assert "episode 1 from step" not in printed
    assert stored_episodes(tmp_path / "configured") == 0


def test_the_workers_variables_set_the_analysis_and_flags_win(logs: Path, tmp_path: Path) -> None:
    printed = run(logs, tmp_path / "variables", env=NO_EPISODES)
    assert "episode 1 from step" not in printed
    assert stored_episodes(tmp_path / "variables") == 0
    # --lateness-s over the variable: a lateness that cannot work would fail the run.
    run(logs, tmp_path / "flag", "--lateness-s", "30",
        env={"LAGSCOPE_PROCESSOR__LATENESS_S": "-1"})  # fmt: skip


def test_a_config_that_cannot_work_is_one_line_and_leaves_no_store(tmp_path: Path) -> None:
    (tmp_path / "logs" / "rank-000000").mkdir(parents=True)
    config = tmp_path / "worker.yaml"
    config.write_text("processor:\n  episodes:\n    min_cots: 5.0\n")
    done = subprocess.run(
        [sys.executable, "-m", "lagscope", "run", "--log-dir", str(tmp_path / "logs"),
         "--dsn", f"chdb://{tmp_path / 'store'}", "--config", str(config)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("lagscope run: error: ")
    assert "processor.episodes.min_cots (from " in line
    assert line.endswith("worker.yaml): no such setting")
    assert not (tmp_path / "store").exists()


def test_a_run_into_the_workers_store_keeps_their_raw_ops_ttl(logs: Path, tmp_path: Path) -> None:
    store = tmp_path / "shared"
    sink = ClickHouseSink(f"chdb://{store}")
    try:
        sink.ensure_schema(ops_ttl_days=30)  # as workers with store.ops_ttl_days: 30
    finally:
        sink.close()
    run(logs, store)
    assert ops_ttl_days(store) == 30
    # With the workers' file that names it, their setting applies, as at their start.
    config = tmp_path / "worker.yaml"
    config.write_text("store:\n  ops_ttl_days: 14\n")
    run(logs, store, "--config", str(config))
    assert ops_ttl_days(store) == 14


def test_a_run_stores_raw_ops_unless_the_workers_settings_say_none(
    logs: Path, tmp_path: Path
) -> None:
    """Replayed into the cluster's store with the workers' file, a node's logs add no raw
    ops where the workers keep none; on its own, a run keeps them for drill-down."""
    run(logs, tmp_path / "own")
    assert stored_ops(tmp_path / "own") > 0
    config = tmp_path / "worker.yaml"
    config.write_text("store:\n  raw_ops: false\n")
    run(logs, tmp_path / "shared", "--config", str(config))
    assert stored_ops(tmp_path / "shared") == 0
    assert stored_episodes(tmp_path / "shared") >= 1  # the analysis is stored all the same
    run(logs, tmp_path / "by-variable", env={"LAGSCOPE_STORE__RAW_OPS": "false"})
    assert stored_ops(tmp_path / "by-variable") == 0


def stored_ops(store: Path) -> int:
    return stored_count(store, "ops")


def ops_ttl_days(store: Path) -> int | None:
    sink = ClickHouseSink(f"chdb://{store}")
    try:
        return sink.ops_ttl_days()
    finally:
        sink.close()


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A generated trace whose worker (dp 1, pp 2) is 1.6x slower for steps 20-39 of 60:
    an episode under the default settings."""
    out = tmp_path_factory.mktemp("trace")
    subprocess.run(
        [sys.executable, "-m", "lagscope", "generate", "--out", str(out), "--dp", "8",
         "--pp", "4", "--steps", "60", "--inject",
         "slow_worker:dp=1,stage=2,factor=1.6,start_step=20,end_step=40"],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return ["--trace", str(out / "trace.parquet"), "--meta", str(out / "meta.yaml")]


def analyse(files: list[str], *args: str, env: dict[str, str] | None = None) -> str:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("LAGSCOPE_")}
    program = (
        "import sys; from lagscope.cli import main; code = main(sys.argv[1:]); "
        "print('settings model imported:', 'pydantic_settings' in sys.modules); "
        "sys.exit(code)"
    )
    done = subprocess.run(
        [sys.executable, "-c", program, "analyze", *files, *args],
        capture_output=True, text=True, timeout=300, check=False,
        env={**environment, **(env or {})},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_analyze_takes_the_workers_settings_and_loads_them_only_when_given(
    trace: list[str], tmp_path: Path
) -> None:
    printed = analyse(trace)
    assert "  episode 1 from step" in printed
    assert "settings model imported: False" in printed  # no file, no variable: no cost
    config = tmp_path / "worker.yaml"
    config.write_text("processor:\n  episodes:\n    min_cost: 5.0\n")
    for given in (analyse(trace, "--config", str(config)), analyse(trace, env=NO_EPISODES)):
        assert "episode 1 from step" not in given
        assert "settings model imported: True" in given


def _run_on_cpus(
    logs: Path, store: Path, cpus: set[int], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """`lagscope run` of `logs` into `store`, its process bound to `cpus`."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("LAGSCOPE_")}
    done = subprocess.run(
        [sys.executable, "-m", "lagscope", "run", "--log-dir", str(logs),
         "--dsn", f"chdb://{store}", "--log-level", "info"],
        capture_output=True, text=True, timeout=300, check=False,
        env={**environment, **env}, preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done


def _digest(store: Path) -> str:
    from tests.bench.stored_rows import stored_digest

    sink = ClickHouseSink(f"chdb://{store}")
    try:
        return stored_digest(sink)
    finally:
        sink.close()


@pytest.mark.slow  # three runs of the embedded pipeline
def test_a_run_on_several_cores_gives_a_large_job_a_second_one(logs: Path, tmp_path: Path) -> None:
    """`lagscope run` on a machine of two cores runs a large job's compute half in an
    analysis process (the 100,000-GPU job's marginal step: 1.25 s in one process, 0.8 s
    so), storing the same rows; on one core, or told 0, it keeps it in its process."""
    cpus = sorted(os.sched_getaffinity(0))
    assert len(cpus) >= 2, "this test needs a machine of two cores (CI has two)"
    # This small job counts as large: every job's steps go to the analysis process.
    large = {"LAGSCOPE_PROCESSOR__ANALYSIS_PROCESS_MIN_OPS": "0"}
    started = "analysis process(es) started"
    two = _run_on_cpus(logs, tmp_path / "two", set(cpus[:2]), large)
    assert started in two.stderr
    one = _run_on_cpus(logs, tmp_path / "one", set(cpus[:1]), large)
    assert started not in one.stderr
    told = _run_on_cpus(
        logs, tmp_path / "told", set(cpus[:2]),
        {**large, "LAGSCOPE_PROCESSOR__ANALYSIS_PROCESSES": "0"},
    )  # fmt: skip
    assert started not in told.stderr
    assert _digest(tmp_path / "two") == _digest(tmp_path / "one") == _digest(tmp_path / "told")
