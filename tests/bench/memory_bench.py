"""Bounded memory (issue 16 item 3).

- The embedded host under a backlog burst: peak RSS of `EmbeddedRunner.run_logs` over the
  logs of a 128-GPU job (dp16 x pp8, 16 micro-batches) holding 30 steps (steady: what a
  host that keeps up has in front of it, plus the start-up) and 300 steps (a 10x burst:
  the same job after an outage), each in a fresh process, logs written beforehand by the
  real timers. Target: the burst within 1.5x of steady.
- The retained roll-up of one job at 1,024, 4,096 and 12,288 GPUs (pp 8 x tp 8, 32
  micro-batches), default settings: bytes of the retained steps' arrays once the window
  is full (the processor is fed one step more than it keeps), next to what the uncapped
  256-step window would hold. Target: <= 100 MB.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STEADY_STEPS = 30
BURST_FACTOR = 10


def _child(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "tests.bench.memory_bench", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"memory bench {args} failed:\n{done.stderr[-4000:]}")
    return done.stdout.strip().splitlines()[-1]


def _write_logs(steps: int, log_dir: Path) -> None:
    from lagscope.cli.demo import write_logs_with_timers
    from lagscope.producers.events import JobInfo
    from lagscope.simulator.generate import JobSpec, generate_job

    job = generate_job(JobSpec(dp=16, pp=8, tp=1, microbatches=16, steps=steps, seed=1))
    info = JobInfo.from_meta(job.meta, job_id="burst")
    write_logs_with_timers(job.trace, info, log_dir, time.time_ns() - 3_600_000_000_000)


def _run_logs(log_dir: str, store: str) -> dict:
    import resource

    from lagscope.store.sink import ClickHouseSink
    from lagscope.stream_app.embedded import EmbeddedRunner

    sink = ClickHouseSink(f"chdb://{store}?database=burst")
    sink.ensure_schema()
    report = EmbeddedRunner(sink).run_logs(log_dir)
    job = report.jobs["burst", 0]
    return {
        "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "steps": job.steps,
        "incomplete": len(job.incomplete_steps),
    }


def _rollup_bytes(gpus: int) -> dict:
    from lagscope.producers.events import JobInfo
    from lagscope.producers.replay import iter_step_batches
    from lagscope.simulator.generate import JobSpec, generate_job
    from lagscope.stream_app.processor import ProcessorSettings, StepProcessor

    settings = ProcessorSettings()
    processor = StepProcessor(settings)
    shape = JobSpec(dp=gpus // 64, pp=8, tp=8, microbatches=32, steps=1)
    # The step size decides the window; generate one step more than the window keeps.
    probe = generate_job(shape)
    info = JobInfo.from_meta(probe.meta, job_id=f"rollup-{gpus}")
    processor.on_job(info)
    key = (info.job_id, info.attempt)

    def feed(job, start_wall_ns: int) -> None:
        for _, _, batches in iter_step_batches(
            job.trace, job.meta, job_id=info.job_id, start_wall_ns=start_wall_ns
        ):
            for batch in batches:
                processor.on_batch(batch)

    feed(probe, 0)
    state = processor.jobs[key]
    rest = shape.model_copy(update={"steps": state.retained_capacity, "first_step_id": 1})
    feed(generate_job(rest), 10**12)
    retained = processor.jobs[key].retained
    held = sum(
        a.nbytes
        for p in retained
        for a in (p.start, p.duration, p.cost, p.launch_delay, p.gc_pause)
        if a is not None
    )
    return {
        "held_mb": held / 1e6,
        "steps": len(retained),
        "uncapped_mb": settings.rollup_window_steps * state.compute.step_bytes / 1e6,
    }


def run() -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="lagscope-memory-") as tmp:
        peaks = {}
        for steps in (STEADY_STEPS, STEADY_STEPS * BURST_FACTOR):
            logs = Path(tmp) / f"logs-{steps}"
            _child("write", str(steps), str(logs))
            peaks[steps] = json.loads(_child("run", str(logs), str(Path(tmp) / f"store-{steps}")))
            assert peaks[steps]["steps"] == steps and peaks[steps]["incomplete"] == 0, peaks
        steady, burst = peaks[STEADY_STEPS], peaks[STEADY_STEPS * BURST_FACTOR]
        rows.append(
            {
                "benchmark": f"embedded peak RSS, {STEADY_STEPS}-step backlog (steady)",
                "value": steady["peak_mb"],
                "unit": "MB",
                "target": "",
            }
        )
        rows.append(
            {
                "benchmark": f"embedded peak RSS, {STEADY_STEPS * BURST_FACTOR}-step backlog "
                "(10x burst)",
                "value": burst["peak_mb"],
                "unit": "MB",
                "target": "<= 1.5x steady",
                "ratio_to_steady": burst["peak_mb"] / steady["peak_mb"],
            }
        )
    for gpus in (1024, 4096, 12288):
        size = json.loads(_child("rollup", str(gpus)))
        rows.append(
            {
                "benchmark": f"retained roll-up, {gpus} GPUs ({size['steps']} steps kept)",
                "value": size["held_mb"],
                "unit": "MB",
                "target": "<= 100 MB",
                "uncapped_256_steps_mb": size["uncapped_mb"],
            }
        )
    return rows


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "write":
        _write_logs(int(rest[0]), Path(rest[1]))
        print("{}")
    elif command == "run":
        print(json.dumps(_run_logs(rest[0], rest[1])))
    else:
        print(json.dumps(_rollup_bytes(int(rest[0]))))
