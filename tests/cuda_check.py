"""The checks a machine with a CUDA device runs, in one go, into one folder.

    python -m tests.cuda_check --out DIR

1. what the machine is (device, driver, torch) -> DIR/facts.json, and what the NCCL
   process group's completion hook reports -> DIR/nccl.json;
2. the four-rank straggler jobs of tests/torch_jobs/cuda_ddp.py, recorded for
   tests/data/recorded-cuda (a clean job, and rank 1 slow on the device in forward, in
   backward, and stalled in its host, for steps 15-29 of 40) -> DIR/<name>.tar.xz;
3. the CUDA tests: the timer's own and tests/test_cuda_jobs.py -> DIR/check.log;
4. the monitor's cost on a real CUDA model (`tests/bench/cuda_bench.py`) -> DIR/bench.json;
5. with `--parts ...,profile`: torch.profiler over recorded and unrecorded steps of it ->
   DIR/profile.json.gz, DIR/profile.txt;
6. with `--parts ...,ablation`: the monitor with one part at a time taken away
   (`tests/bench/cuda_ablation.py`: where a recorded step's extra time comes from) ->
   DIR/ablation.json;
7. with `--parts ...,threads`: the monitor threads' CPU part by part
   (`tests/bench/cuda_threads.py`) -> DIR/threads.json.

Each part runs in its own process with a time limit and says how it ended in check.log, so
one that fails or runs out of time leaves the others' results. The machine needs torch with
CUDA, pytest and lagscope's plain install (numpy, pydantic, pyyaml); nothing else.

On a machine lent with torch but no network (how it ran on an H200, 2026-11-26, and on an
H100, 2026-11-27): build the wheels here (`pip wheel --no-deps -w .whl .`, and `pip
download --no-deps --only-binary :all: --python-version 3.12 -d .whl pydantic
pydantic-core annotated-types typing-inspection typing-extensions` at this venv's
versions), carry `.whl`, and there:

    pip install --no-index --no-deps --target /tmp/site .whl/*.whl
    mkdir /tmp/run && cp -r tests pyproject.toml /tmp/run && cd /tmp/run
    PYTHONPATH=/tmp/site:/tmp/run python3 -P -m tests.cuda_check --out "$OUT"

Run from a copy of `tests/`, not the repository's root: there the source folder
`lagscope/` shadows the installed package, which maps `lagscope.producers` and the rest
from their own folders. All parts take about 3 minutes on an H200, `profile` and
`ablation` one more each. To compare two trees on one machine, install the other tree's
lagscope wheel into its own folder and put it first on PYTHONPATH for its runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: The recorded straggler jobs: name -> knobs of tests/torch_jobs/cuda_ddp.py.
RECORDINGS = {
    "cuda-ddp-clean": {},
    "cuda-ddp-forward": {"slow_rank": 1, "slow_phase": "forward"},
    "cuda-ddp-backward": {"slow_rank": 1, "slow_phase": "backward"},
    "cuda-ddp-host": {"slow_rank": 1, "slow_phase": "host"},
}
WINDOW = {"steps": 40, "world": 4, "slow_start": 15, "slow_end": 30}


def _log(out: Path, text: str) -> None:
    with (out / "check.log").open("a") as log:
        log.write(text if text.endswith("\n") else text + "\n")
    print(text, flush=True)


def _part(
    out: Path, name: str, command: list[str], timeout_s: float, stacks_after_s: float = 0
) -> bool:
    """Run one part; its output and how it ended go to check.log. A process of it that
    still runs `stacks_after_s` after it started (default: shortly before the part's time
    is up) prints every thread's stack first."""
    began = time.monotonic()
    _log(out, f"== {name}: {' '.join(command)}")
    try:
        stacks_after_s = stacks_after_s or max(10, timeout_s - 15)
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "LAGSCOPE_STACKS_AFTER_S": str(stacks_after_s)}  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              env=env)  # fmt: skip
        output, ended = done.stdout + done.stderr, f"exit {done.returncode}"
        ok = done.returncode == 0
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode() + (exc.stderr or b"").decode()
        ended, ok = f"timed out after {timeout_s:.0f} s", False
    _log(out, output[-20_000:])
    _log(out, f"== {name}: {ended} in {time.monotonic() - began:.0f} s")
    return ok


def facts(out: Path) -> None:
    import torch

    found = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }
    try:
        found["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=30,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        found["nvidia_smi"] = str(exc)
    (out / "facts.json").write_text(json.dumps(found, indent=2))
    _log(out, json.dumps(found))


def nccl_facts(out: Path) -> None:
    """What `producers/torch_nccl.py` relies on, read off this torch: the process group's
    completion hook fires with the collective's sequence number and device duration, and
    a collective's future says it is done before the device ran it (so a host clock on it
    measures nothing) -> DIR/nccl.json."""
    import datetime as dt

    import torch
    import torch.distributed as dist

    from tests.torch_jobs.harness import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    group = dist.group.WORLD
    names = ("_register_on_completion_hook", "_get_sequence_number_for_group",
             "_enable_collectives_timing")  # fmt: skip
    found: dict = {"has": {name: hasattr(group, name) for name in names}, "issued": []}
    completed = []
    if hasattr(group, "_enable_collectives_timing"):
        group._enable_collectives_timing()
    group._register_on_completion_hook(lambda info: completed.append((
        str(info.op_type), info.seq, str(info.time_started), str(info.time_finished),
        info.active_duration / dt.timedelta(microseconds=1),
    )))  # fmt: skip
    x = torch.randn(64 * 2**20, device="cuda")
    for _ in range(4):
        torch.cuda._sleep(50_000_000)  # tens of ms of device work queued before it
        before = group._get_sequence_number_for_group()
        started = time.perf_counter()
        work = dist.all_reduce(x, async_op=True)
        after = group._get_sequence_number_for_group()
        future = work.get_future()
        done_at_once = future.done()
        stamps: list[float] = []
        future.then(lambda _, stamps=stamps: stamps.append(time.perf_counter()))
        work.wait()
        torch.cuda.synchronize()
        synced = time.perf_counter()
        found["issued"].append({
            "seq_before": before, "seq_after": after, "future_done_at_once": done_at_once,
            "then_after_us": (stamps[0] - started) * 1e6 if stamps else None,
            "synced_after_us": (synced - started) * 1e6,
        })  # fmt: skip
    time.sleep(3)  # the watchdog thread calls the hook
    found["completed"] = completed
    dist.destroy_process_group()
    (out / "nccl.json").write_text(json.dumps(found, indent=2))
    _log(out, json.dumps(found))


def record(out: Path, timeout_s: float) -> None:
    """The straggler jobs, each archived as tests/data/recorded-cuda keeps them."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, knobs in RECORDINGS.items():
            job = Path(tmp) / name
            args = [f"--{k.replace('_', '-')}={v}" for k, v in {**WINDOW, **knobs}.items()]
            command = [sys.executable, "-P", "-m", "tests.torch_jobs.cuda_ddp",
                       f"--log-dir={job / 'logs'}", f"--job-id={name}", *args]  # fmt: skip
            if not _part(out, f"record {name}", command, timeout_s):
                continue
            with tarfile.open(out / f"{name}.tar.xz", "w:xz") as archive:
                archive.add(job / "logs", arcname="logs")
                archive.add(job / "truth", arcname="truth")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--parts", default="facts,nccl,tests,bench,record")
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    python = [sys.executable, "-P"]
    if "facts" in parts:
        facts(out)
    if "nccl" in parts:
        _part(out, "NCCL facts", [*python, "-m", "tests.cuda_check", "--out", str(out),
              "--parts", "nccl-here"], 90)  # fmt: skip
    if "nccl-here" in parts:
        nccl_facts(out)
    if "record" in parts:
        record(out, 40)
    if "tests" in parts:
        _part(out, "CUDA tests", [*python, "-m", "pytest", "--noconftest", "-p",
              "no:cacheprovider", "-q", "-rA", "--durations=0", "-o", "faulthandler_timeout=50",
              "tests/test_timer.py::test_cuda_mode_records_events_without_synchronizing",
              "tests/test_cuda_jobs.py"], 150, stacks_after_s=35)  # fmt: skip
    if "ablation" in parts:
        _part(out, "ablation", [*python, "-m", "tests.bench.cuda_ablation",
              str(out / "ablation.json")], 150)  # fmt: skip
    if "profile" in parts:
        _part(out, "profile", [*python, "-m", "tests.bench.cuda_bench", str(out)], 120)
    if "bench" in parts:
        bench_json = HERE.parent / "bench-results" / "bench.json"
        if _part(out, "bench", [*python, "-m", "tests.bench", "cuda"], 150):
            (out / "bench.json").write_text(bench_json.read_text())
    if "threads" in parts:
        _part(out, "threads", [*python, "-m", "tests.bench.cuda_threads",
              str(out / "threads.json")], 170)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
