"""Memory over a long job (issue 69 item 1): a host's RSS at steps 10, 100, 1,000 and 2,000.

One generated job of 1,024, 12,288 and 99,840 GPUs (pp 8 x tp 8, 16 micro-batches) goes
step by step through each host, in a fresh process each (`tests/bench/long_job.py`: the
steps made from a cycle of 8 generated ones, as a host receives them; `lagscope run`'s
embedded host, caught up, raw ops kept as it keeps them, and `lagscope worker`'s core with
its checkpoints). A row per size and host: the process' peak RSS at its last step against
the issue's target (1.5 GB at 12,288 GPUs, 6 GB at ~100,000, from step 40 on), with its RSS
at each step measured and the bytes the job's structures held there
(`StepProcessor.held_bytes`). The process' RSS includes the generated cycle it feeds
from (8 steps' encoded batches: ~30 MB at 12,288 GPUs, ~250 MB at 99,840).

2,000 steps of the 99,840-GPU job take hours on 2 cores; it runs `BIG_JOB_STEPS` unless
`LAGSCOPE_BENCH_LONG_STEPS` sets every size's steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARKS = (10, 40, 100, 1000, 2000)
STEPS = 2000
BIG_JOB_STEPS = 200
#: dp of each size (pp 8 x tp 8), and the issue's peak RSS target from step 40 on (MB).
SIZES = {1024: (16, 1500.0), 12288: (192, 1500.0), 99840: (1560, 6000.0)}
HOSTS = {"embedded": "lagscope run", "worker": "lagscope worker"}


def _marks_of(host: str, dp: int, steps: int) -> list[dict]:
    marks = ",".join(str(m) for m in MARKS if m <= steps)
    done = subprocess.run(
        [sys.executable, "-m", "tests.bench.long_job", host, str(dp), str(steps), marks],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"long job {host} dp {dp} failed:\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def run() -> list[dict]:
    rows = []
    forced = os.environ.get("LAGSCOPE_BENCH_LONG_STEPS")
    for gpus, (dp, target_mb) in SIZES.items():
        steps = int(forced) if forced else (STEPS if gpus < 50_000 else BIG_JOB_STEPS)
        for host, command in HOSTS.items():
            marks = _marks_of(host, dp, steps)
            last = marks[-1]
            at = "/".join(f"{m['rss_mb']:.0f}" for m in marks)
            steps_at = "/".join(str(m["step"]) for m in marks)
            rows.append(
                {
                    "benchmark": f"peak RSS over a long job, {gpus:,} GPUs, {command}",
                    "value": last["peak_rss_mb"],
                    "unit": "MB",
                    "target": f"<= {target_mb:.0f} (RSS at steps {steps_at}: {at} MB)",
                    "steps": steps,
                    "marks": marks,
                }
            )
    return rows
