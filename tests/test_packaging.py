"""What a user installs: one import root, a light install for training nodes, one line naming
the extra a command needs, and a repository that needs nothing beside it.

The wheel is built from this checkout and installed, without extras, into a fresh virtual
environment (dependencies from the package index, as a user gets them); ops are recorded
there through the public timer and read back from the log.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from lagscope.cli import COMMAND_MODULE, EXTRA_OF_MODULE

#: Builds the wheel and installs it into fresh virtual environments: slow.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]

#: Distributions a training node must not get from `pip install lagscope` (normalised names).
HEAVY = {
    "confluent-kafka",
    "faust-streaming",
    "aiokafka",
    "chdb",
    "clickhouse-connect",
    "pyarrow",
    "pandas",
    "matplotlib",
    "grafana-foundation-sdk",
    "grafana-client",
    "playwright",
    "torch",
}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("lagscope-*.whl")
    return built


def _oldest_supported_python() -> str:
    """Python 3.11 where the machine has it (the oldest the package supports), else this one."""
    for candidate in (
        "python3.11",
        *sorted(Path.home().glob(".pyenv/versions/3.11*/bin/python3.11")),
    ):
        found = shutil.which(str(candidate))
        if found and subprocess.run([found, "-c", "pass"], capture_output=True).returncode == 0:
            return found
    return sys.executable


@pytest.fixture(scope="module")
def light_env(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    venv = tmp_path_factory.mktemp("light") / "venv"
    subprocess.run([_oldest_supported_python(), "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)],
        check=True,
        capture_output=True,
    )
    return venv


def test_wheel_has_one_top_level_import_name(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        roots = {name.split("/")[0] for name in archive.namelist()}
    code_roots = {root for root in roots if not root.endswith(".dist-info")}
    assert code_roots == {"lagscope"}
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    # The stages of the data's journey are subpackages; data files travel with them.
    for package in ("producers", "simulator", "stream_app", "store", "dashboards", "deploy"):
        assert f"lagscope/{package}/__init__.py" in names
    for data_file in (
        "generated/job-overview.json",
        "generated/fleet/fleet.json",
        "provisioning/alerting/lagscope-alerts.yaml",
        "provisioning/datasources/lagscope-clickhouse.yaml",
        "templates/report.html.j2",
    ):
        assert f"lagscope/dashboards/{data_file}" in names


def test_plain_install_is_light(light_env: Path) -> None:
    listed = subprocess.run(
        [str(light_env / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    installed = {line.split("==")[0].lower().replace("_", "-") for line in listed.splitlines()}
    assert "lagscope" in installed
    assert not installed & HEAVY, f"a plain install pulled in {sorted(installed & HEAVY)}"
    assert {"numpy", "pydantic", "pyyaml"} <= installed


def test_timer_records_ops_into_a_log_in_the_light_install(light_env: Path, tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys
        from lagscope.timer import OpTimer
        from lagscope.producers.events import decode_batch
        from lagscope.producers.log import KIND_BATCH, Record, list_rank_dirs, read_all

        log_dir = sys.argv[1]
        timer = OpTimer(job_id="light", rank=0, dp_rank=0, pp_rank=0, log_dir=log_dir,
                        gc_probe=False)
        for step in range(3):
            timer.step(step)
            for microbatch in range(2):
                with timer.op("forward-compute", microbatch=microbatch):
                    sum(range(1000))
                with timer.op("backward-compute", microbatch=microbatch):
                    sum(range(2000))
            with timer.op("optimizer"):
                pass
        timer.close()
        batches = [
            decode_batch(item.payload)
            for directory in list_rank_dirs(log_dir)
            for item in read_all(directory)
            if isinstance(item, Record) and item.kind == KIND_BATCH
        ]
        print(sorted(b.step for b in batches), sum(len(b.optype) for b in batches))
        heavy = [m for m in ("pyarrow", "pandas", "torch", "chdb", "confluent_kafka")
                 if m in sys.modules]
        print("heavy modules:", heavy)
        """
    )
    done = subprocess.run(
        [str(light_env / "bin" / "python"), "-c", script, str(tmp_path / "logs")],
        # Not from the checkout, whose own lagscope/ folder would shadow the installed one.
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    steps, heavy = done.stdout.splitlines()
    assert steps == "[0, 1, 2] 15"
    assert heavy == "heavy modules: []"


@pytest.mark.parametrize(
    ("command", "extra"),
    [
        (["analyze", "--trace", "t.parquet", "--meta", "m.yaml"], "analyze"),
        (["query", "SELECT 1"], "store"),
        (["worker", "--idle-exit-s", "1"], "stream"),
        (["stream", "--log-dir", "."], "sidecar"),
        (["dashboards", "build", "--out", "."], "dashboards"),
    ],
)
def test_a_command_without_its_extra_names_the_extra_in_one_line(
    light_env: Path, tmp_path: Path, command: list[str], extra: str
) -> None:
    done = subprocess.run(
        [str(light_env / "bin" / "lagscope"), *command],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"pip install 'lagscope[{extra}]'" in lines[0]
    assert lines[0].startswith(f"lagscope {command[0]}: ")


def test_help_and_version_work_without_any_extra(light_env: Path) -> None:
    lagscope = str(light_env / "bin" / "lagscope")
    helped = subprocess.run([lagscope, "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0, helped.stderr
    for command in COMMAND_MODULE:
        assert command in helped.stdout
    version = subprocess.run([lagscope, "--version"], capture_output=True, text=True, timeout=60)
    assert version.stdout.startswith("lagscope ")


def test_every_optional_module_has_an_extra_that_installs_it() -> None:
    """The CLI's module -> extra table names extras that pyproject.toml declares."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for module, extra in EXTRA_OF_MODULE.items():
        assert extra in extras, f"{module}: extra {extra!r} is not declared"


def test_no_tracked_file_reaches_outside_the_repository() -> None:
    """A user's clone has nothing beside it: no tracked file may point at a sibling folder."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    # Spelled apart so this file does not match itself: the sibling folder by a relative
    # path, by the developers' absolute path, or by one of its subfolders.
    needles = ["../" + "shared", "/work/" + "shared"] + [
        "shared/" + sub for sub in ("docs", "peers", "reference-traces", "hooks")
    ]
    offenders = [
        (path, needle)
        for path in tracked
        if (REPO / path).is_file()
        for needle in needles
        if needle in (REPO / path).read_bytes().decode("utf-8", errors="replace")
    ]
    assert offenders == []
