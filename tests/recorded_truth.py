"""What each recorded real job (tests/data/recorded*, one `.tar.xz` each) planted, and
what the job itself measured: its own step periods (one step's last end to the next's),
against which every price lagscope gives is checked.

A recording's truth is its `truth.json` where it has one; the earlier recordings say it
in their names (`<job>-<case>-<n>`: the rank at dp 1, pp 0 slow in `case` for steps
15-29, or the windows below), and the H100 ones in their README."""

from __future__ import annotations

import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATA = Path(__file__).parent / "data"
#: The op type of each case an earlier recording's name says.
CASE_KIND = {
    "forward": "forward-compute",
    "backward": "backward-compute",
    "input": "input-wait",
    "host": "host",
    "hoststart": "host",
}
#: Healthy recordings: quiet, or beside CPU burners (a busy machine).
HEALTHY_CASES = ("clean", "busy")
#: The slow steps [first, end) of earlier recordings whose window is not 15-29.
WINDOWS = {"1f1b-forward-1": (15, 45), "1f1b-forward-2": (15, 45), "1f1b-backward-0": (15, 45)}


@dataclass(frozen=True)
class Truth:
    """A recording's planted straggler: its worker (dp, pp), the kind of its own time
    lagscope should name (an op type, or `host`), and its slow steps [first, end); no
    worker for a healthy run. `standing`: slow from its first step."""

    name: str
    archive: Path
    worker: tuple[int, int] | None
    kind: str | None
    slow_steps: tuple[int, int] | None
    standing: bool = False

    @property
    def healthy(self) -> bool:
        return self.worker is None


def recordings() -> list[Truth]:
    """Every recorded real job, CPU and GPU, with its truth."""
    found = []
    for folder in ("recorded", "recorded-cuda"):
        for archive in sorted((DATA / folder).glob("*.tar.xz")):
            found.append(truth_of(archive))
    return found


def truth_of(archive: Path) -> Truth:
    name = archive.name.removesuffix(".tar.xz")
    with tarfile.open(archive) as packed:
        if "truth.json" in packed.getnames():
            said = json.load(packed.extractfile("truth.json"))  # type: ignore[arg-type]
            first, end = said["slow_steps"]
            return Truth(name, archive, tuple(said["worker"]), said["cause"], (first, end))
    case = name.removeprefix("cuda-").split("-")[1]
    if case in HEALTHY_CASES:
        return Truth(name, archive, None, None, None)
    first, end = WINDOWS.get(name, (15, 30))
    return Truth(name, archive, (1, 0), CASE_KIND[case], (first, end), case == "hoststart")


def step_periods(log_dir: Path) -> dict[int, float]:
    """Each step's period (seconds from the previous step's last end to its own), from the
    raw ops every rank wrote: what the job paid for it, whatever lagscope makes of it."""
    from tests.torch_jobs.harness import recorded_ops

    ends: dict[int, int] = {}
    for op in recorded_ops(log_dir):
        end = op["start_ns"] + op["duration_ns"]
        ends[op["step"]] = max(ends.get(op["step"], 0), end)
    return {step: (ends[step] - ends[step - 1]) / 1e9 for step in sorted(ends) if step - 1 in ends}


@dataclass(frozen=True)
class Measured:
    """What the job's own step periods say a straggler cost: the median period inside its
    slow steps over the median outside them (its first three, the warm-up, left out), and
    the seconds the slow steps took above that median."""

    speedup: float
    lost_s: float
    usual_s: float


def measured(periods: dict[int, float], slow_steps: tuple[int, int]) -> Measured:
    first, end = slow_steps
    inside = [p for s, p in periods.items() if first <= s < end]
    outside = [p for s, p in periods.items() if (s < first or s >= end) and s >= 3]
    usual = float(np.median(outside))
    return Measured(float(np.median(inside)) / usual, float(sum(p - usual for p in inside)), usual)
