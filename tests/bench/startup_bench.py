"""Whole processes, as a user feels them: `lagscope --help` against a bare interpreter, and
`lagscope analyze` (summary, every attribution, M_W, M_S, `--json`) against the paper's
reference analyzer on the three reference traces.

Each command runs as a fresh process pinned to one core; the two sides alternate run by
run so that the machine's load falls on both alike, and the best of the runs counts (the
least disturbed one). Before any time is reported, the two analyses must agree on S, the
attributions by op type, DP rank and stage, M_W and M_S.

The reference analyzer is not part of this project. Point `LAGSCOPE_WIA_DIR` at a checkout
of it (the directory holding `analyzer/wia.py`); its interpreter is `LAGSCOPE_WIA_PYTHON`,
or else a virtual environment with its dependencies that this bench creates once under
~/.cache/lagscope/wia-venv. Without `LAGSCOPE_WIA_DIR` the bench says so and reports
lagscope's times alone.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
REFERENCE = Path(
    os.environ.get("LAGSCOPE_REFERENCE_TRACES", REPO / "tests" / "data" / "reference-traces")
)
WIA_DIR_ENV = "LAGSCOPE_WIA_DIR"
WIA_PYTHON_ENV = "LAGSCOPE_WIA_PYTHON"
#: The reference analyzer's own requirements (its README: pandas 3 breaks it).
WIA_REQUIREMENTS = ("pandas<3", "pyarrow", "numpy", "pyyaml", "tqdm", "ujson")
TRACES = ("AR", "SE", "ST")
HELP_RUNS = 15
ANALYZE_RUNS = 5
#: Relative difference allowed between the two analyzers' numbers (the conformance tests'
#: tolerance): float32 inputs, summed in different orders.
RTOL = 1e-3


def _pinned() -> None:
    """Run the child on one core, as the goals are stated."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def _wall(command: Sequence[str], **kwargs) -> float:
    started = time.perf_counter()
    subprocess.run(
        command,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=_pinned,
        **kwargs,
    )
    return time.perf_counter() - started


def _best_alternating(runs: int, *commands: Callable[[], float]) -> list[float]:
    best = [float("inf")] * len(commands)
    for _ in range(runs):
        for i, command in enumerate(commands):
            best[i] = min(best[i], command())
    return best


def _lagscope() -> list[str]:
    script = Path(sys.executable).with_name("lagscope")
    return [str(script)] if script.exists() else [sys.executable, "-m", "lagscope.cli"]


def _wia_python() -> str:
    explicit = os.environ.get(WIA_PYTHON_ENV)
    if explicit:
        return explicit
    venv = Path.home() / ".cache" / "lagscope" / "wia-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"  creating {venv} for the reference analyzer ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *WIA_REQUIREMENTS], check=True)
    return str(python)


def _wia_commands(wia: Path, python: str, name: str, out: Path) -> list[list[str]]:
    """The reference analyzer's whole job on one trace: S and attributions, then M_S, then
    M_W, each step reading what the previous one wrote (as its own run-all script does)."""
    result = out / f"{name}.json"
    common = ["--dump-dir", str(out), "--root", str(out)]
    return [
        [python, "analyzer/wia.py", "--metadata", str(REFERENCE / f"meta-{name}.yaml"),
         "--trace", str(REFERENCE / f"trace-{name}.parquet"), *common],
        [python, "analyzer/compute_ms.py", "--trial", name, "--analysis-result", str(result),
         *common],
        [python, "analyzer/compute_mw.py", "--trial", name, "--analysis-result", str(result),
         *common],
    ]  # fmt: skip


def _run_wia(wia: Path, python: str, name: str, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(wia)}
    started = time.perf_counter()
    for command in _wia_commands(wia, python, name, out):
        _wall(command, cwd=wia, env=env)
    return time.perf_counter() - started


def _analyze_command(name: str, json_out: Path) -> list[str]:
    return [
        *_lagscope(),
        "analyze",
        "--trace", str(REFERENCE / f"trace-{name}.parquet"),
        "--meta", str(REFERENCE / f"meta-{name}.yaml"),
        "--json", str(json_out),
    ]  # fmt: skip


def check_same_numbers(name: str, ours: dict, wia_out: Path) -> None:
    """Raise if lagscope's JSON and the reference analyzer's results differ."""
    theirs = json.loads((wia_out / f"{name}.json").read_text())
    pairs = [("S", ours["slowdown"], theirs["blocking_slowdown"])]
    for kind in ("optype", "dp_rank", "stage"):
        wanted = theirs[f"blocking_decompose_by_{kind}"] or {}
        got = ours[f"by_{kind}"] or {}
        if set(map(str, got)) != set(map(str, wanted)):
            raise AssertionError(f"{name} by {kind}: groups {sorted(got)} != {sorted(wanted)}")
        pairs += [(f"by {kind} {k}", got[k], wanted[k]) for k in wanted]
    for kind, key in (("mw", "Mw"), ("ms", "Ms")):
        reference = json.loads((wia_out / f"{kind}-{name}.json").read_text())
        pairs.append((key, ours[kind][key], reference[key]))
    for what, got, wanted in pairs:
        if abs(got - wanted) > RTOL * max(abs(wanted), 1e-9):
            raise AssertionError(f"{name} {what}: lagscope {got} != reference {wanted}")


def run() -> list[dict]:
    rows: list[dict] = []
    bare, helped = _best_alternating(
        HELP_RUNS,
        lambda: _wall([sys.executable, "-c", "pass"]),
        lambda: _wall([*_lagscope(), "--help"]),
    )
    rows += [
        {"benchmark": "startup: bare python -c pass", "value": bare, "unit": "s", "target": ""},
        {"benchmark": "startup: lagscope --help", "value": helped, "unit": "s", "target": ""},
        {
            "benchmark": "startup: lagscope --help / bare python",
            "value": helped / bare,
            "unit": "x",
            "target": "<= 5",
        },
    ]
    wia_dir = os.environ.get(WIA_DIR_ENV)
    wia = Path(wia_dir) if wia_dir else None
    if wia is None:
        print(
            f"  {WIA_DIR_ENV} is not set: no reference analyzer to compare with; "
            "lagscope's times alone",
            file=sys.stderr,
        )
    elif not (wia / "analyzer" / "wia.py").exists():
        raise SystemExit(f"{WIA_DIR_ENV}={wia}: no analyzer/wia.py there")
    python = _wia_python() if wia else ""
    with tempfile.TemporaryDirectory() as scratch:
        for name in TRACES:
            ours_json = Path(scratch) / f"lagscope-{name}.json"
            wia_out = Path(scratch) / f"wia-{name}"
            sides = [lambda n=name, j=ours_json: _wall(_analyze_command(n, j))]
            if wia:
                sides.append(lambda n=name, o=wia_out: _run_wia(wia, python, n, o))
            # One untimed round fills the page cache and checks the numbers first.
            for side in sides:
                side()
            if wia:
                check_same_numbers(name, json.loads(ours_json.read_text()), wia_out)
            best = _best_alternating(ANALYZE_RUNS, *sides)
            rows.append(
                {
                    "benchmark": f"whole process: lagscope analyze {name}",
                    "value": best[0],
                    "unit": "s",
                    "target": "",
                }
            )
            if wia:
                rows += [
                    {
                        "benchmark": f"whole process: reference analyzer {name}",
                        "value": best[1],
                        "unit": "s",
                        "target": "",
                    },
                    {
                        "benchmark": f"whole process: reference / lagscope {name}",
                        "value": best[1] / best[0],
                        "unit": "x",
                        "target": ">= 15",
                    },
                ]
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
