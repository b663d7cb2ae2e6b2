"""`lagscope demo`: the README's main job. A generated 128-GPU job with stragglers, timed
through the real timer API into per-rank logs, analysed by the embedded host (the one
`lagscope run` drives) into a chDB store of its own, summarised and reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lagscope.cli.conventions import add_log_level, claim_output_dir, configure_logging, examples
from lagscope.cli.job_summary import print_job_summary
from lagscope.cli.progress import pipeline_progress

if TYPE_CHECKING:
    from lagscope.producers.events import JobInfo
    from lagscope.simulator.generate import GeneratedJob, JobSpec
    from lagscope.simulator.trace import Trace

# The generator, the pipeline and the store are imported by the handler when it runs, so
# that registering the command (and `lagscope --help`) stays cheap.

H100_BF16_PEAK_FLOPS = 989e12


def register(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="the whole pipeline on a generated job with stragglers (under a minute)",
        description="Generates a 128-GPU job with an injected slow worker, records it "
        "through the real timer API into per-rank logs, analyses it with the embedded "
        "pipeline into a chDB store of its own inside --out, and writes the HTML report "
        "(kept current while it runs: open it and watch). --out must be new, empty or an "
        "earlier demo's: a rerun replaces only the demo's own outputs.",
        epilog=examples("lagscope demo", "lagscope demo --out /tmp/demo --steps 60 --seed 3"),
    )
    demo.add_argument(
        "--out",
        type=Path,
        default=Path("out/demo"),
        metavar="DIR",
        help="where the logs, store and report go (a new or empty folder, or an earlier "
        "demo's, whose outputs are replaced)",
    )
    demo.add_argument("--steps", type=int, default=120, help="training steps to generate")
    demo.add_argument("--seed", type=int, default=7, help="random seed of the generated job")
    add_log_level(demo, service=False)
    demo.set_defaults(handler=demo_command, extra="demo")


def write_logs_with_timers(
    trace: Trace,
    info: JobInfo,
    log_dir: Path,
    start_wall_ns: int,
    *,
    gpus_per_node: int | None = None,
    every_rank: bool = False,
) -> int:
    """Record every op of `trace` through one host-mode `OpTimer` per rank, as a training
    job instrumented with lagscope would, laying steps back to back from `start_wall_ns` as
    `lagscope replay` does.

    `gpus_per_node`: place the ranks on a cluster of such nodes (rank r on GPU r % n of
    node `<job>-node-<r // n>`) in each rank's job record, as the integrations record the
    machine a rank runs on, so a generated job's advice names machines too.
    `every_rank`: the TP/CP ranks the trace leaves out start and close a timer too (off,
    as the integrations run it there), so their logs say that they ran and ended and the
    job reads ended once written; else only the trace's ranks write logs (one per worker:
    what the analysis reads)."""
    import numpy as np

    from lagscope.producers.replay import step_origins_ns

    origin = step_origins_ns(trace, start_wall_ns)
    order = np.lexsort((trace.seq_id, trace.start_ts, trace.step, trace.stage, trace.dp_rank))
    written = 0
    worker = np.stack([trace.dp_rank[order], trace.stage[order]], axis=1)
    cuts = np.flatnonzero(np.any(np.diff(worker, axis=0) != 0, axis=1)) + 1
    for rows in np.split(order, cuts):
        written += _record_worker(trace, rows, info, log_dir, origin, gpus_per_node)
        if every_rank:
            first = rows[0]
            _close_silent_ranks(int(trace.rank[first]), int(trace.dp_rank[first]),
                                int(trace.stage[first]), info, log_dir, gpus_per_node)  # fmt: skip
    return written


def _close_silent_ranks(
    rank: int, dp: int, pp: int, info: JobInfo, log_dir: Path, gpus_per_node: int | None
) -> None:
    """Start and close the timers of the TP/CP ranks after `rank` in its worker (Megatron's
    order: TP fastest, then CP), off: each writes its job record, then its end."""
    from lagscope.producers.timer import OpTimer

    for offset in range(1, info.tp_size * info.cp_size):
        other = rank + offset
        OpTimer(
            job_id=info.job_id, attempt=info.attempt, rank=other, dp_rank=dp, pp_rank=pp,
            tp_rank=offset % info.tp_size, cp_rank=offset // info.tp_size, log_dir=log_dir,
            mode="off", gc_probe=False, job_info=_placed(info, other, dp, pp, gpus_per_node),
        ).close()  # fmt: skip


def _record_worker(
    trace: Trace,
    rows: Any,
    info: JobInfo,
    log_dir: Path,
    origin: dict[int, int],
    gpus_per_node: int | None,
) -> int:
    """Record one worker's ops (`rows` of the trace, in order) through its own timer."""
    import numpy as np

    from lagscope.producers.timer import OpTimer

    first = rows[0]
    rank, dp, pp = int(trace.rank[first]), int(trace.dp_rank[first]), int(trace.stage[first])
    timer = OpTimer(
        job_id=info.job_id,
        attempt=info.attempt,
        rank=rank,
        dp_rank=dp,
        pp_rank=pp,
        log_dir=log_dir,
        mode="host",
        gc_probe=False,
        job_info=_placed(info, rank, dp, pp, gpus_per_node),
    )
    names = np.array(trace.optype_names)
    current = None
    for row in rows.tolist():
        step = int(trace.step[row])
        if step != current:
            timer.step(step)
            current = step
        timer.record(
            str(names[trace.optype[row]]),
            start_ns=origin[step] + round(float(trace.start_ts[row]) * 1e9),
            duration_ns=round(float(trace.duration[row]) * 1e9),
            step=step,
            microbatch=int(trace.mb_id[row]),
            chunk=max(int(trace.mc[row]), 0),
        )
    timer.close()
    return len(rows)


def _placed(info: JobInfo, rank: int, dp: int, pp: int, gpus_per_node: int | None) -> JobInfo:
    """The rank's job record, with the machine it runs on when the job is placed on nodes."""
    if not gpus_per_node:
        return info
    from lagscope.producers.events import RankIdentity

    node = f"{info.job_id}-node-{rank // gpus_per_node:02d}"
    identity = RankIdentity(
        rank=rank, local_rank=rank % gpus_per_node, dp_rank=dp, pp_rank=pp,
        host=node, node=node, gpu=rank % gpus_per_node,
    )  # fmt: skip
    return info.model_copy(update={"rank_identity": identity})


def demo_job_info(job: GeneratedJob, job_id: str) -> JobInfo:
    """The demo job's record, with model FLOPs chosen so that its straggler-free steps run
    at 45 % MFU on H100s (so the dashboards' MFU panels have something to show)."""
    from lagscope.producers.events import JobInfo

    flops = 0.45 * float(job.truth.t_clean.mean()) * job.meta.world_size * H100_BF16_PEAK_FLOPS
    meta = dataclasses.replace(
        job.meta, model_flops_per_step=flops, gpu_peak_flops=H100_BF16_PEAK_FLOPS
    )
    return JobInfo.from_meta(meta, job_id=job_id, attempt=0)


def demo_spec(steps: int, seed: int) -> JobSpec:
    """A 128-GPU job (dp 8 x pp 4 x tp 4): a worker slows down from step 40% to 70% of the
    run, rare GC pauses, and a last stage 15% heavier than the others."""
    from lagscope.simulator.generate import GcPauses, JobSpec, LastStageImbalance, SlowWorker

    return JobSpec(
        name="demo-llm",
        dp=8,
        pp=4,
        tp=4,
        microbatches=8,
        steps=steps,
        seed=seed,
        first_step_id=1000,
        stragglers=(
            SlowWorker(
                dp=5, stage=2, factor=1.6, start_step=int(steps * 0.4), end_step=int(steps * 0.7)
            ),
            GcPauses(probability=0.01, pause_s=0.08),
            LastStageImbalance(factor=1.15),
        ),
    )


def demo_command(args: argparse.Namespace) -> int:
    configure_logging(args)
    from lagscope.cli.job_page import render_job_page
    from lagscope.simulator.generate import generate_job
    from lagscope.store.sink import ClickHouseSink
    from lagscope.stream_app.embedded import EmbeddedRunner, LiveReport
    from lagscope.stream_app.processor import ProcessorSettings

    began = time.monotonic()
    out: Path = args.out
    _take_out_dir(out)
    (out / "logs").mkdir()
    spec = demo_spec(args.steps, args.seed)
    print(
        f"lagscope demo: {spec.dp * spec.pp * spec.tp} GPUs (dp {spec.dp} x pp {spec.pp} x "
        f"tp {spec.tp}), {spec.microbatches} micro-batches, {spec.steps} steps"
    )
    job = generate_job(spec)
    info = demo_job_info(job, "demo-llm")
    total_time = float(job.truth.t_injected.sum())
    # 16 nodes of 8 GPUs: the summary and the report name the straggler's machine.
    n_ops = write_logs_with_timers(
        job.trace, info, out / "logs", time.time_ns() - int(total_time * 1e9), gpus_per_node=8,
        every_rank=True,
    )  # fmt: skip
    print(
        f"  1. generated the job and recorded {n_ops:,} ops through OpTimer (host mode) into "
        f"{out / 'logs'}"
    )
    dsn = f"chdb://{out.resolve()}/chdb"
    sink = ClickHouseSink(dsn)
    sink.ensure_schema()
    report_path = out / "report.html"
    # The report is kept current while the pipeline runs: open it and watch.
    runner = EmbeddedRunner(
        sink,
        ProcessorSettings(lateness_s=5.0),
        live_report=LiveReport(report_path, render_job_page),
    )
    display, show = pipeline_progress(n_ops)
    report = runner.run_logs(out / "logs", progress=show)
    display.close()
    print(f"  2. embedded pipeline: {report.ops:,} ops in {report.seconds:.1f} s into {dsn}")
    job_report = report.jobs["demo-llm", 0]
    print_job_summary(job_report)
    truth = job.truth
    print(
        f"  ground truth: slowdown {truth.slowdown:.3f} over the clean job; slow worker "
        f"(dp 5, pp 2) from step {1000 + int(spec.steps * 0.4)} to "
        f"{1000 + int(spec.steps * 0.7)}"
    )
    print(f"  report: {runner.report_path('demo-llm', 0)}")
    print(
        f"  try:    .venv/bin/lagscope query --dsn {dsn} "
        f'"SELECT step, slowdown, mfu_actual FROM steps FINAL ORDER BY slowdown DESC LIMIT 5"'
    )
    print(f"  done in {time.monotonic() - began:.1f} s")
    return 0


def _take_out_dir(out: Path) -> None:
    """Make `out` the demo's, its earlier outputs removed. Only the demo's own outputs are
    replaced: a folder holding anything else (`--out .`, a folder of the user's) is
    refused before a file is touched."""
    own = ("logs", "chdb", "report.html", "report-*.html", ".report*.tmp")

    def written_by_an_older_demo(folder: Path) -> bool:
        names = {entry.name for entry in folder.iterdir()}
        logs = folder / "logs"
        return (
            "logs" in names
            and names <= {"logs", "chdb", "report.html"}
            and logs.is_dir()
            and all(entry.name.startswith("rank-") for entry in logs.iterdir())
        )

    for earlier in claim_output_dir(
        out, command="demo", own=own, looks_own=written_by_an_older_demo
    ):
        if earlier.is_dir() and not earlier.is_symlink():
            import shutil

            shutil.rmtree(earlier)
        else:
            earlier.unlink()
