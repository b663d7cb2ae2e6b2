"""`lagscope run`: per-rank logs -> the embedded host -> the store (chDB by default), in one
process, with an optional HTML report kept current while it runs.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lagscope.cli.conventions import (
    STDOUT,
    UsageError,
    add_log_level,
    add_old_name,
    check_one_stdout,
    configure_logging,
    examples,
    write_output,
)
from lagscope.cli.job_summary import print_job_summary
from lagscope.cli.progress import pipeline_progress
from lagscope.store.dsn import DSN_HELP

if TYPE_CHECKING:
    from lagscope.store.sink import ClickHouseSink
    from lagscope.stream_app.embedded import EmbeddedRunner, LiveReport, RunReport
    from lagscope.stream_app.worker_config import WorkerConfig

# The pipeline, numpy and the store are imported by the handler when it runs, so that
# registering the command (and `lagscope --help`) stays cheap.


def register(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser(
        "run",
        help="analyse per-rank logs in one process (no Kafka) into the store",
        description="Reads every rank's log under --log-dir, analyses each step as it closes "
        "and writes the results to ClickHouse (embedded chDB by default). With --follow it "
        "keeps tailing until the logs are idle; Ctrl-C stops it after closing the open "
        "steps and printing the summary (exit 130; 143 on SIGTERM). On a machine of "
        "several cores, a large job's analysis (from ~5,000 GPUs) also uses a second "
        "one (processor.analysis_processes; 0 keeps it in this process).",
        epilog=examples(
            "lagscope run --log-dir /local/lagscope",
            "lagscope run --log-dir logs --follow --idle-exit-s 120 --report report.html",
            "lagscope run --log-dir logs --follow --report report.html --report-every-s 5",
            "lagscope run --log-dir logs --dsn http://user:pw@clickhouse:8123/lagscope",
            "lagscope run --log-dir logs --config worker.yaml   # the cluster's settings",
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
        "--config",
        type=Path,
        metavar="PATH",
        help="the workers' yaml/json config file (as `lagscope worker --config`): its "
        "processor section applies here, as LAGSCOPE_* variables do, so these logs tell "
        "the story the cluster's workers tell; its store.dsn is the store unless --dsn "
        "is given",
    )
    run.add_argument(
        "--follow",
        action="store_true",
        help="keep tailing the logs until they are idle, or until every rank of every job "
        "in them closed its monitor (the job ended)",
    )
    run.add_argument(
        "--idle-exit-s",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="with --follow: exit after this long without new records, counted from the "
        "first (a job that has not written yet is waited for)",
    )
    run.add_argument(
        "--lateness-s",
        type=float,
        metavar="SECONDS",
        help="the most a step waits for a rank that sends nothing (a job's own lateness follows "
        "its pace below it; default: 30, or the settings' processor.lateness_s)",
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
    add_log_level(run, service=False)
    run.set_defaults(handler=run_logs_command, extra="demo")


def run_logs_command(args: argparse.Namespace) -> int:
    from lagscope.producers.log import list_rank_dirs

    runner, sink, live = embedded_host(args)
    display, show = pipeline_progress(None)
    if args.follow and not list_rank_dirs(args.log_dir):
        print(f"lagscope run: waiting for the job's rank logs under {args.log_dir} "
              "(Ctrl-C stops)", file=sys.stderr)  # fmt: skip
    stopped_by: int | None = None
    # A scheduler or an orchestrator stops `--follow` with SIGTERM as a user does with
    # Ctrl-C: what was read is analysed, stored and summed up either way.
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        report = runner.run_logs(
            args.log_dir, follow=args.follow, idle_exit_s=args.idle_exit_s, progress=show
        )
    except KeyboardInterrupt as stop:
        stopped_by = signal.SIGTERM if isinstance(stop, _Terminated) else signal.SIGINT
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the first one is being honoured
        report = runner.close_open_steps()
    finally:
        display.close()
    signal.signal(signal.SIGTERM, previous)
    interrupted = stopped_by is not None
    if not print_outcome(args, runner, sink, live, report, interrupted=interrupted):
        return 1
    if stopped_by is not None:
        said = "terminated" if stopped_by == signal.SIGTERM else "interrupted"
        print(f"lagscope run: {said}", file=sys.stderr)
        return 128 + int(stopped_by)
    return 0


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run stands, as Ctrl-C's KeyboardInterrupt is."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated


#: The largest job (dp x pp workers) whose raw ops `lagscope run` keeps unless told: a
#: 12,288-GPU job has 1,536, a 100,000-GPU job 12,544.
RAW_OPS_MAX_WORKERS = 4096


def embedded_host(
    args: argparse.Namespace,
) -> tuple[EmbeddedRunner, ClickHouseSink, LiveReport | None]:
    """The embedded host on the store, set up from `lagscope run`'s options (--dsn,
    --config, --lateness-s, --report, --report-every-s; --log-dir is checked), each checked
    before the store opens: a mistyped directory or setting must not leave an empty store
    behind. Also what `lagscope launch --follow` runs."""
    from lagscope.store.dsn import parse_dsn
    from lagscope.store.sink import ClickHouseSink
    from lagscope.stream_app.embedded import EmbeddedRunner

    configure_logging(args)
    config = _worker_config(args)
    dsn = config.store.resolved_dsn()
    parse_dsn(dsn)  # a DSN that cannot work is named before anything else is looked at
    _check_log_dir(args)
    live = _live_report(args)
    sink = ClickHouseSink(dsn)
    sink.ensure_schema(ops_ttl_days=config.store.ops_ttl_days)
    # Raw ops by default, for drill-down into the replayed job, up to a size (a step of
    # 100,000 GPUs holds 1.2 M ops: ~2.5 s of writes, against ~0.9 s of analysis); as
    # the workers' settings say when they do (a node's logs into the cluster's store).
    store = config.store
    told = "raw_ops" in store.model_fields_set
    processor = config.processor
    if "analysis_processes" not in processor.model_fields_set:
        # One command on a machine of several cores: a large job's compute half runs on a
        # second one while this process decodes the next step (a job under
        # `analysis_process_min_ops` a step stays here); told, as the workers are told.
        processor = processor.model_copy(
            update={"analysis_processes": 1 if _usable_cpus() >= 2 else 0}
        )
    runner = EmbeddedRunner(
        sink, processor, store_raw_ops=store.raw_ops if told else True,
        raw_ops_max_workers=None if told else RAW_OPS_MAX_WORKERS, live_report=live,
        write_every_steps=config.worker.write_every_steps,
        write_interval_s=config.worker.write_interval_s,
    )  # fmt: skip
    return runner, sink, live


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, where the system has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this system
        return os.cpu_count() or 1


def print_outcome(
    args: argparse.Namespace,
    runner: EmbeddedRunner,
    sink: ClickHouseSink,
    live: LiveReport | None,
    report: RunReport,
    *,
    interrupted: bool,
    command: str = "run",
) -> bool:
    """Each job's summary, where its report went and the store; False (after one line
    saying what was found instead) when nothing could be analysed."""
    from lagscope.cli.job_page import render_job_page
    from lagscope.cli.run_outcome import nothing_analysed

    # Success on nothing would read as a healthy job: say what was found instead.
    problem = None if interrupted else nothing_analysed(args.log_dir, report)
    if problem is not None:
        print(f"lagscope {command}: error: {problem}", file=sys.stderr)
        return False
    say = print if args.report != STDOUT else functools.partial(print, file=sys.stderr)
    for key, job in report.jobs.items():
        print_job_summary(job, say=say)
        if job.rollup is None:
            continue
        if live is not None:
            say(f"  report written to {runner.report_path(*key)}")
        elif args.report:
            where = write_output(args.report, render_job_page(job), option="--report")
            say(f"  report written to {where}")
    say(f"  store: {sink.dsn.shown}  ({report.dead_letters} dead letter(s))")
    return True


def _worker_config(args: argparse.Namespace) -> WorkerConfig:
    """The workers' configuration model, layered as theirs (flags > LAGSCOPE_* variables >
    --config file > defaults): one set of analysis settings for both hosts. Its Kafka and
    worker sections are checked and not used."""
    from lagscope.producers.config import load_config
    from lagscope.stream_app.worker_config import WorkerConfig

    return load_config(
        WorkerConfig,
        file=args.config,
        overrides={"processor": {"lateness_s": args.lateness_s}, "store": {"dsn": args.dsn}},
    )


def _check_log_dir(args: argparse.Namespace) -> None:
    """A --log-dir that is no directory, or (unless --follow waits for a job that starts
    later to create them) holds no rank logs, is a usage error."""
    from lagscope.cli.run_outcome import no_rank_logs_message
    from lagscope.producers.log import list_rank_dirs

    if not args.log_dir.is_dir():
        what = "is not a directory" if args.log_dir.exists() else "does not exist"
        raise UsageError(f"--log-dir {args.log_dir}: {what}")
    if not args.follow and not list_rank_dirs(args.log_dir):
        raise UsageError(no_rank_logs_message(args.log_dir))


def _live_report(args: argparse.Namespace) -> LiveReport | None:
    """Where the report is kept current while the run goes on (--report PATH), checked
    before anything is read; None without --report or with `-` (written at the end)."""
    from lagscope.cli.job_page import render_job_page
    from lagscope.stream_app.embedded import LiveReport

    check_one_stdout(args, "report")
    if args.report and args.report != STDOUT and Path(args.report).is_dir():
        raise UsageError(
            f"--report {args.report}: is a directory; give the report's file name, e.g. "
            f"{Path(args.report) / 'report.html'}"
        )
    if args.report_every_s <= 0:
        raise UsageError(f"--report-every-s {args.report_every_s:g}: must be positive")
    if not args.report or args.report == STDOUT:
        return None
    live = LiveReport(Path(args.report), render_job_page, every_s=args.report_every_s)
    try:
        live.path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--report {live.path}: cannot write ({exc.strerror or exc})") from None
    return live
