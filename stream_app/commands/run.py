"""`lagscope run` (logs -> step processor -> chDB, one process) and `lagscope demo` (the
README's main job: a generated 3D-parallel job with stragglers, timed through the real
timer API into per-rank logs, analysed by the embedded pipeline, summarised and reported).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from lagscope.stream_app.cli_conventions import (
    STDOUT,
    UsageError,
    add_old_name,
    check_one_stdout,
    claim_output_dir,
    examples,
    write_output,
)
from lagscope.stream_app.commands.job_summary import print_job_summary
from lagscope.stream_app.store_location import DSN_HELP, resolve_dsn

if TYPE_CHECKING:
    from lagscope.producers.events import JobInfo
    from lagscope.simulator.generate import GeneratedJob, JobSpec
    from lagscope.simulator.trace import Trace
    from lagscope.stream_app.embedded import RunReport
    from lagscope.stream_app.progress import Progress

# The pipeline, numpy and the store are imported by the handlers when they run, so that
# registering these commands (and `lagscope --help`) stays cheap.

H100_BF16_PEAK_FLOPS = 989e12


def register(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser(
        "run",
        help="analyse per-rank logs in one process (no Kafka) into the store",
        description="Reads every rank's log under --log-dir, analyses each step as it closes "
        "and writes the results to ClickHouse (embedded chDB by default). With --follow it "
        "keeps tailing until the logs are idle; Ctrl-C stops it after closing the open "
        "steps and printing the summary (exit 130).",
        epilog=examples(
            "lagscope run --log-dir /local/lagscope",
            "lagscope run --log-dir logs --follow --idle-exit-s 120 --report report.html",
            "lagscope run --log-dir logs --follow --report report.html --report-every-s 5",
            "lagscope run --log-dir logs --dsn http://user:pw@clickhouse:8123/lagscope",
            'lagscope query "SELECT step, slowdown FROM steps FINAL ORDER BY step"   # after',
        ),
    )
    # A required option with an old name: argparse counts either name as given only
    # through a required group of the two.
    log_dir_names = run.add_mutually_exclusive_group(required=True)
    log_dir = log_dir_names.add_argument(
        "--log-dir",
        type=Path,
        metavar="DIR",
        help="directory of the ranks' rank-NNNNNN/ log directories",
    )
    add_old_name(log_dir_names, "--logs", log_dir)
    run.add_argument("--dsn", help=DSN_HELP)
    run.add_argument(
        "--follow", action="store_true", help="keep tailing the logs until they are idle"
    )
    run.add_argument(
        "--idle-exit-s",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="with --follow: exit after this long without new records",
    )
    run.add_argument(
        "--lateness-s",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="close a step this long after its first batch even if ranks miss",
    )
    run.add_argument(
        "--report",
        metavar="PATH",
        help="write the HTML report here ('-': stdout, at the end only); a file is kept "
        "current while the run goes on (a page that refreshes itself) and made final at the "
        "end",
    )
    run.add_argument(
        "--report-every-s",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="with --report PATH: rewrite the live report at most this often while steps "
        "close, and have the page refresh itself as often",
    )
    run.set_defaults(handler=run_logs_command, extra="demo")

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
    demo.set_defaults(handler=demo_command, extra="demo")


def _progress(total_ops: int | None) -> tuple[Progress, Callable[[RunReport], None]]:
    """A progress display of the embedded pipeline, and the callback that feeds it."""
    from lagscope.stream_app.progress import Progress

    display = Progress("pipeline", unit="op", total=total_ops)

    def show(report: RunReport) -> None:
        display.update(report.ops, note=f"{report.steps:,} steps")

    return display, show


def run_logs_command(args: argparse.Namespace) -> int:
    from lagscope.dashboards.report import render_report
    from lagscope.producers.log import list_rank_dirs
    from lagscope.stream_app.embedded import EmbeddedRunner, LiveReport, report_data
    from lagscope.stream_app.processor import ProcessorSettings
    from lagscope.stream_app.run_outcome import no_rank_logs_message, nothing_analysed
    from lagscope.stream_app.sink import ClickHouseSink, parse_dsn

    # Before the store opens: a mistyped directory must not leave an empty store behind.
    dsn = resolve_dsn(args.dsn)
    parse_dsn(dsn)  # a DSN that cannot work is named before anything else is looked at
    if not args.log_dir.is_dir():
        what = "is not a directory" if args.log_dir.exists() else "does not exist"
        raise UsageError(f"--log-dir {args.log_dir}: {what}")
    # A job that starts later may still create its rank logs while --follow waits.
    if not args.follow and not list_rank_dirs(args.log_dir):
        raise UsageError(no_rank_logs_message(args.log_dir))
    check_one_stdout(args, "report")
    if args.report and args.report != STDOUT and Path(args.report).is_dir():
        raise UsageError(
            f"--report {args.report}: is a directory; give the report's file name, e.g. "
            f"{Path(args.report) / 'report.html'}"
        )
    if args.report_every_s <= 0:
        raise UsageError(f"--report-every-s {args.report_every_s:g}: must be positive")
    live = None
    if args.report and args.report != STDOUT:
        live = LiveReport(Path(args.report), every_s=args.report_every_s)
        try:
            live.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(
                f"--report {live.path}: cannot write ({exc.strerror or exc})"
            ) from None
    sink = ClickHouseSink(dsn)
    sink.ensure_schema()
    runner = EmbeddedRunner(sink, ProcessorSettings(lateness_s=args.lateness_s), live_report=live)
    display, show = _progress(None)
    interrupted = False
    try:
        report = runner.run_logs(
            args.log_dir, follow=args.follow, idle_exit_s=args.idle_exit_s, progress=show
        )
    except KeyboardInterrupt:
        # Ctrl-C is how a user stops `--follow`: what was read is analysed and kept.
        interrupted = True
        report = runner.close_open_steps()
    display.close()
    # Success on nothing would read as a healthy job: say what was found instead.
    problem = None if interrupted else nothing_analysed(args.log_dir, report)
    if problem is not None:
        print(f"lagscope run: error: {problem}", file=sys.stderr)
        return 1
    say = print if args.report != STDOUT else functools.partial(print, file=sys.stderr)
    for key, job in report.jobs.items():
        print_job_summary(job, say=say)
        if job.rollup is None:
            continue
        if live is not None:
            say(f"  report written to {runner.report_path(*key)}")
        elif args.report:
            where = write_output(args.report, render_report(report_data(job)), option="--report")
            say(f"  report written to {where}")
    say(f"  store: {sink.dsn.shown}  ({report.dead_letters} dead letter(s))")
    if interrupted:
        print("lagscope run: interrupted", file=sys.stderr)
        return 130
    return 0


def write_logs_with_timers(
    trace: Trace,
    info: JobInfo,
    log_dir: Path,
    start_wall_ns: int,
    *,
    gpus_per_node: int | None = None,
) -> int:
    """Record every op of `trace` through one host-mode `OpTimer` per rank, as a training
    job instrumented with lagscope would, laying steps back to back from `start_wall_ns`.

    `gpus_per_node`: place the ranks on a cluster of such nodes (rank r on GPU r % n of
    node `<job>-node-<r // n>`) in each rank's job record, as the integrations record the
    machine a rank runs on, so a generated job's advice names machines too."""
    import numpy as np

    from lagscope.producers.events import RankIdentity
    from lagscope.producers.timer import OpTimer

    end = trace.start_ts.astype(np.float64) + trace.duration
    steps = np.unique(trace.step)
    spans = np.array([end[trace.step == s].max() for s in steps])
    origin = dict(
        zip(
            steps.tolist(),
            (start_wall_ns + np.concatenate(([0], np.cumsum(spans[:-1]))) * 1e9)
            .astype(np.int64)
            .tolist(),
            strict=True,
        )
    )
    names = np.array(trace.optype_names)
    order = np.lexsort((trace.seq_id, trace.start_ts, trace.step, trace.stage, trace.dp_rank))
    written = 0
    worker = np.stack([trace.dp_rank[order], trace.stage[order]], axis=1)
    cuts = np.flatnonzero(np.any(np.diff(worker, axis=0) != 0, axis=1)) + 1
    for rows in np.split(order, cuts):
        first = rows[0]
        rank, dp, pp = int(trace.rank[first]), int(trace.dp_rank[first]), int(trace.stage[first])
        rank_info = info
        if gpus_per_node:
            node = f"{info.job_id}-node-{rank // gpus_per_node:02d}"
            identity = RankIdentity(
                rank=rank, local_rank=rank % gpus_per_node, dp_rank=dp, pp_rank=pp,
                host=node, node=node, gpu=rank % gpus_per_node,
            )  # fmt: skip
            rank_info = info.model_copy(update={"rank_identity": identity})
        timer = OpTimer(
            job_id=info.job_id,
            attempt=info.attempt,
            rank=rank,
            dp_rank=dp,
            pp_rank=pp,
            log_dir=log_dir,
            mode="host",
            gc_probe=False,
            job_info=rank_info,
        )
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
            written += 1
        timer.close()
    return written


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
    from lagscope.simulator.generate import generate_job
    from lagscope.stream_app.embedded import EmbeddedRunner, LiveReport
    from lagscope.stream_app.processor import ProcessorSettings
    from lagscope.stream_app.sink import ClickHouseSink

    began = time.monotonic()
    out: Path = args.out
    # Only the demo's own outputs are replaced: a folder holding anything else (`--out .`,
    # a folder of the user's) is refused before a file is touched.
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
        job.trace, info, out / "logs", time.time_ns() - int(total_time * 1e9), gpus_per_node=8
    )
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
        sink, ProcessorSettings(lateness_s=5.0), live_report=LiveReport(report_path)
    )
    display, show = _progress(n_ops)
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
