"""The images (deploy/Dockerfile): one per role, non-root, with a HEALTHCHECK, installed
from pinned versions, and built from a context that holds no secret.

No Docker engine runs on the test machines (the client does, without a daemon): the build
context is listed here as `docker build` would send it, by .dockerignore's rules (the
last pattern a path matches decides; a pattern also matches everything under a directory
it matches; `*` stays within one path element, `**` spans any), and the images are built
only where an engine answers.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from lagscope import __version__
from lagscope.deploy.constraints import CONSTRAINTS_FILE, closure, pinned_names

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "deploy" / "Dockerfile"


def _pattern(text: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(text):
        if text.startswith("**", i):
            out += ".*"
            i += 2
            if text.startswith("/", i):
                out += "/?"
                i += 1
            continue
        char = text[i]
        out += {"*": "[^/]*", "?": "[^/]"}.get(char, re.escape(char))
        i += 1
    return re.compile(out + "(/.*)?")


def _rules() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keep = line.startswith("!")
        rules.append((keep, _pattern(line.lstrip("!").strip("/"))))
    return rules


def in_context(path: str, rules: list[tuple[bool, re.Pattern[str]]] | None = None) -> bool:
    """Whether `docker build` sends the repository path `path` (relative, '/'-separated)."""
    sent = True
    for keep, pattern in rules or _rules():
        if pattern.fullmatch(path):
            sent = keep
    return sent


def _context_listing() -> list[str]:
    rules = _rules()
    listed = []
    for root, dirs, files in os.walk(REPO):
        relative = Path(root).relative_to(REPO).as_posix()
        dirs[:] = [d for d in dirs if d not in (".git", ".venv")]
        for name in files:
            path = name if relative == "." else f"{relative}/{name}"
            if in_context(path, rules):
                listed.append(path)
    return sorted(listed)


def test_the_build_context_holds_no_secret(tmp_path: Path) -> None:
    secrets = [
        "deploy/.env",  # compose's passwords (git-ignored, present on a deploying machine)
        ".env",
        "deploy/clickhouse/users.d/grafana-readonly.xml",
        "deploy/k8s/secret.example.yaml",
        "certs/ca.pem",
        "lagscope/server.key",
        "lagscope-data/chdb/data.bin",
        "tests/data/reference-traces/trace-AR.parquet",
        ".git/config",
        ".venv/bin/python",
        "out/demo/report.html",
    ]
    for path in secrets:
        assert not in_context(path), f"{path} would be sent to the Docker daemon"
    listing = _context_listing()
    roots = {"lagscope", "producers", "simulator", "stream_app", "store", "dashboards", "deploy"}
    top_files = {"pyproject.toml", "README.md", "LICENSE", "NOTICE"}
    for path in listing:
        head = path.split("/", 1)[0]
        assert head in roots or path in top_files, f"{path} is in the build context"
        assert "__pycache__" not in path and not path.endswith(".env")
    deploy = [p for p in listing if p.startswith("deploy/")]
    assert sorted(deploy) == sorted(
        f"deploy/{name}"
        for name in ("__init__.py", "kafka_local.py", "healthcheck.py", "constraints.py",
                     "constraints.txt")
    )  # fmt: skip
    # what the Dockerfile copies is all there
    for source in re.findall(r"^COPY (.+) \S+$", DOCKERFILE.read_text(), flags=re.M):
        for item in source.split():
            assert any(p == item or p.startswith(item + "/") for p in listing), item


def _stage(name: str) -> str:
    text = DOCKERFILE.read_text()
    match = re.search(rf"^FROM \S+ AS {name}\n(.*?)(?=^FROM |\Z)", text, flags=re.M | re.S)
    assert match is not None, f"no stage {name}"
    return match.group(1)


@pytest.mark.parametrize(
    ("target", "extra", "port"), [("sidecar", "sidecar", "9465"), ("worker", "stream", "9464")]
)
def test_each_role_has_a_light_non_root_image_with_a_healthcheck(
    target: str, extra: str, port: str
) -> None:
    stage = _stage(target)
    (install,) = re.findall(r"^RUN pip install '\.\[(\w+)\]'$", stage, flags=re.M)
    assert install == extra
    assert re.search(r"^USER 10001$", stage, flags=re.M)
    assert f"ENV LAGSCOPE_HEALTH_PORT={port}" in stage
    assert 'CMD ["python", "-m", "lagscope.deploy.healthcheck"]' in stage
    # the port is the one the manifests start the role with
    k8s = (REPO / "deploy/k8s/worker-deployment.yaml").read_text()
    daemonset = (REPO / "deploy/k8s/streamer-daemonset.yaml").read_text()
    assert f'"{port}"' in (daemonset if target == "sidecar" else k8s)


def test_the_install_is_pinned() -> None:
    text = DOCKERFILE.read_text()
    # the base by digest, the packages by the constraints file, which pip also applies to
    # the isolated build of the wheel
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", text, flags=re.M)
    assert base is not None and re.fullmatch(r"python:3\.12-slim@sha256:[0-9a-f]{64}", base[1])
    assert "ENV PYTHONUNBUFFERED=1" in text
    assert "PIP_CONSTRAINT=/opt/lagscope/deploy/constraints.txt" in text
    assert text.index("COPY deploy/constraints.txt") < text.index("RUN pip install")
    label = re.search(r'org\.opencontainers\.image\.version="([^"]+)"', text)
    assert label is not None and label.group(1) == __version__
    lines = [line for line in CONSTRAINTS_FILE.read_text().splitlines() if not line.startswith("#")]
    assert lines and all(re.fullmatch(r"[a-z0-9-]+==\S+", line) for line in lines), lines
    # every distribution the extras need is pinned (the tested environment's closure)
    missing = set(closure()) - pinned_names(CONSTRAINTS_FILE.read_text())
    assert not missing, f"not pinned: {sorted(missing)}: run python -m lagscope.deploy.constraints"
    assert "setuptools" in pinned_names(CONSTRAINTS_FILE.read_text())


def test_the_healthcheck_says_why_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from lagscope.deploy import healthcheck
    from lagscope.deploy.kafka_local import free_port

    port = free_port()
    os.environ[healthcheck.PORT_ENV] = str(port)
    try:
        assert healthcheck.main() == 1
    finally:
        del os.environ[healthcheck.PORT_ENV]
    (line,) = capsys.readouterr().err.splitlines()
    assert f"127.0.0.1:{port}/healthz" in line and f"--metrics-port {port}" in line


def _engine() -> bool:
    if shutil.which("docker") is None:
        return False
    done = subprocess.run(["docker", "info"], capture_output=True, check=False)
    return done.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _engine(), reason="no Docker engine answers on this machine")
@pytest.mark.parametrize("target", ["sidecar", "worker"])
def test_the_image_builds_and_runs_as_its_user(target: str) -> None:
    tag = f"lagscope-{target}:test"
    subprocess.run(
        ["docker", "build", "-f", str(DOCKERFILE), "--target", target, "-t", tag, str(REPO)],
        check=True,
    )
    done = subprocess.run(
        ["docker", "run", "--rm", tag, "sh", "-c", "id -u && lagscope --version"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert done.stdout.split() == ["10001", "lagscope", __version__]
