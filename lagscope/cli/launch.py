"""`lagscope launch -- COMMAND...`: run a training command unchanged and record every rank.

The command (torchrun, `python -m torch.distributed.run`, a script that spawns its ranks,
an `srun` line) runs as it would without lagscope, with three more environment variables
(`producers/injection.py`): its Python processes start the automatic monitor
(`producers/auto_monitor.py`), which finds the model, the optimizer, the data loader and
the process groups at the first training step and records each rank from the next one
into `--log-dir`. With `--follow` this process also runs the embedded host on those logs
(`lagscope run --follow`), keeping the report current while the job runs, and prints the
summary at the end; with `--stream` it runs the sidecar streamer toward Kafka instead.
The exit status and signals are the command's (`lagscope/cli/foreground.py`).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from lagscope.cli.conventions import UsageError, add_log_level, examples
from lagscope.store.dsn import DSN_HELP

#: After the command ended, how long the host may take to read what its ranks wrote last
#: when they did not all say they ended (a crash, Ctrl-C): it stops at the first round
#: that read nothing after this long.
_LAST_READ_S = 1.0
#: How long the streamer is given to ship the last records once the command ended.
_STREAM_DRAIN_S = 3.0


def register(subparsers: argparse._SubParsersAction) -> None:
    launch = subparsers.add_parser(
        "launch",
        help="run a training command unchanged and record every rank (no line in the job)",
        description="Runs COMMAND (after --) as it is, and records every rank of the "
        "torch.distributed or megatron-core job it starts as lagscope.torch.monitor() would: "
        "the model DDP or fully_shard wraps (or the pipelining stages), the optimizer, the "
        "data loader's waits, the groups, GC pauses, from the second training step on. A "
        "job that is not distributed, or whose layout cannot be read, runs unrecorded with "
        "one line saying why; a job that calls lagscope's monitor itself keeps its own. "
        "The exit status is COMMAND's; Ctrl-C reaches its ranks.",
        epilog=examples(
            "lagscope launch -- torchrun --standalone --nproc-per-node 8 train.py",
            "lagscope launch --follow --report report.html -- torchrun --nproc-per-node 8 train.py",
            "lagscope launch --log-dir /local/lagscope --stream --bootstrap-servers kafka:9092 "
            "-- python train.py",
            "lagscope launch --log-dir /local/lagscope -- srun python train.py   # each node "
            "writes its ranks' logs",
        ),
    )
    launch.add_argument(
        "--log-dir",
        type=Path,
        metavar="DIR",
        help="where the ranks write their logs (default lagscope-logs/JOB_ID)",
    )
    launch.add_argument(
        "--job-id",
        metavar="ID",
        help="the job's id, the same on every node (default $LAGSCOPE_JOB_ID, else "
        "$SLURM_JOB_ID, else the script's name and the time)",
    )
    after = launch.add_mutually_exclusive_group()
    after.add_argument(
        "--follow",
        action="store_true",
        help="also analyse the logs while the job runs (the embedded host of `lagscope run "
        "--follow`) and print the summary at the end",
    )
    after.add_argument(
        "--stream",
        action="store_true",
        help="also ship the logs to Kafka while the job runs (`lagscope stream`)",
    )
    host = launch.add_argument_group("with --follow")
    host.add_argument("--dsn", help=DSN_HELP)
    host.add_argument(
        "--report",
        metavar="PATH",
        help="keep the job's HTML report current here while it runs (final at the end)",
    )
    host.add_argument(
        "--report-every-s", type=float, default=10.0, metavar="SECONDS",
        help="rewrite the live report at most this often (default: 10.0)",
    )  # fmt: skip
    host.add_argument(
        "--lateness-s",
        type=float,
        metavar="SECONDS",
        help="the most a step waits for a rank that sends nothing (a job's own lateness "
        "follows its pace below it; default: 30, or the settings' processor.lateness_s)",
    )
    launch.add_argument(
        "--config",
        type=Path,
        metavar="PATH",
        help="settings file: the workers' (with --follow, as `lagscope run --config`) or the "
        "sidecar's (with --stream, as `lagscope stream --config`)",
    )
    kafka = launch.add_argument_group("with --stream")
    kafka.add_argument(
        "--bootstrap-servers",
        metavar="HOST:PORT,...",
        help="Kafka bootstrap servers (default: 127.0.0.1:9092)",
    )
    kafka.add_argument(
        "--kafka-option", action="append", default=[], metavar="KEY=VALUE",
        help="extra librdkafka property (repeatable; default: none)",
    )  # fmt: skip
    launch.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="-- COMMAND ...",
        help="the training command, as you would run it",
    )
    add_log_level(launch, service=False)
    launch.set_defaults(handler=launch_command)


def launch_command(args: argparse.Namespace) -> int:
    from lagscope.cli.foreground import Foreground, exit_like
    from lagscope.producers.injection import child_environment

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("no command to run: give it after --, e.g. lagscope launch -- "
                         "torchrun --nproc-per-node 8 train.py")  # fmt: skip
    _check_options(args)
    job_id = args.job_id or _default_job_id(command)
    log_dir = args.log_dir or Path("lagscope-logs") / re.sub(r"[^A-Za-z0-9_.-]+", "_", job_id)
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--log-dir {log_dir}: cannot create it ({exc.strerror or exc})") from None
    args.log_dir = log_dir
    host = _Follower(args) if args.follow else None  # its settings checked before the job
    print(f"lagscope launch: job {job_id}, logs in {log_dir}", file=sys.stderr, flush=True)
    streamer = _start_streamer(args) if args.stream else None
    try:
        job = Foreground(command, child_environment(os.environ, job_id=job_id, log_dir=log_dir))
    except OSError as exc:
        if streamer is not None:
            streamer.terminate()
        print(f"lagscope launch: cannot run {command[0]}: {exc.strerror or exc}", file=sys.stderr)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    if host is not None:
        host.start()
    code = job.wait()
    if host is not None:
        host.conclude()
    if streamer is not None:
        _stop_streamer(streamer)
    if host is None and not args.stream:
        print(f"lagscope launch: analyse with: lagscope run --log-dir {log_dir}", file=sys.stderr)
    exit_like(code)


def _check_options(args: argparse.Namespace) -> None:
    follow_only = {"--dsn": args.dsn, "--report": args.report, "--lateness-s": args.lateness_s}
    for name, value in follow_only.items():
        if value is not None and not args.follow:
            raise UsageError(f"{name} needs --follow (it sets up the analysis while the job runs)")
    stream_only = {
        "--bootstrap-servers": args.bootstrap_servers,
        "--kafka-option": args.kafka_option,
    }
    for name, value in stream_only.items():
        if value and not args.stream:
            raise UsageError(f"{name} needs --stream (it sets up the shipping to Kafka)")


def _default_job_id(command: list[str]) -> str:
    """The id every process of the launch shares: $LAGSCOPE_JOB_ID, $SLURM_JOB_ID (every
    node of a Slurm job agrees on it), else the script's name and the start time."""
    for name in ("LAGSCOPE_JOB_ID", "SLURM_JOB_ID"):
        value = os.environ.get(name)
        if value:
            return value
    scripts = [Path(a).stem for a in command if a.endswith(".py")]
    modules = [command[i + 1] for i, a in enumerate(command[:-1]) if a == "-m"]
    name = (scripts or modules[-1:] or [Path(command[0]).name])[-1]
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


class _StopFollowing(Exception):
    """The job ended and its logs have been read."""


class _Follower:
    """The embedded host of `lagscope run --follow` on the job's logs, in a thread of this
    process, until the job ended and its logs are read: then the summary."""

    def __init__(self, args: argparse.Namespace) -> None:
        from lagscope.cli.run import embedded_host

        self.args = args
        args.follow = True
        self.runner, self.sink, self.live = embedded_host(args)
        self.report: Any = None
        self.error: BaseException | None = None
        self._job_ended_at: float | None = None
        self._last_ops = -1
        self._thread = threading.Thread(target=self._follow, name="lagscope-launch-host")

    def start(self) -> None:
        self._thread.start()

    def _follow(self) -> None:
        try:
            self.report = self.runner.run_logs(
                self.args.log_dir, follow=True, idle_exit_s=float("inf"), progress=self._round
            )
        except _StopFollowing:
            self.report = self.runner.close_open_steps()
        except BaseException as exc:  # said at the end; the job goes on
            self.error = exc

    def _round(self, report: Any) -> None:
        """After each round of reading: stop once the job ended and a round after the
        grace read nothing new (its ranks all said they ended: the host stops itself)."""
        ended = self._job_ended_at
        quiet = report.ops == self._last_ops
        if ended is not None and quiet and time.monotonic() - ended >= _LAST_READ_S:
            raise _StopFollowing
        self._last_ops = report.ops

    def conclude(self) -> None:
        from lagscope.cli.run import print_outcome

        self._job_ended_at = time.monotonic()
        self._thread.join()
        if self.error is not None:
            print(f"lagscope launch: the analysis failed: {type(self.error).__name__}: "
                  f"{self.error}", file=sys.stderr)  # fmt: skip
            return
        print_outcome(self.args, self.runner, self.sink, self.live, self.report,
                      interrupted=False, command="launch")  # fmt: skip


def _start_streamer(args: argparse.Namespace) -> subprocess.Popen[bytes]:
    """`lagscope stream` on the job's logs, as its own process (this environment: the
    injection is the command's only)."""
    command = [sys.executable, "-m", "lagscope", "stream", "--log-dir", str(args.log_dir)]
    if args.config is not None:
        command += ["--config", str(args.config)]
    if args.bootstrap_servers:
        command += ["--bootstrap-servers", args.bootstrap_servers]
    for option in args.kafka_option:
        command += ["--kafka-option", option]
    return subprocess.Popen(command)


def _stop_streamer(streamer: subprocess.Popen[bytes]) -> None:
    """Give the streamer time to ship what the ranks wrote last, then stop it (SIGTERM: it
    confirms what is in flight, checkpoints and says what stays unshipped)."""
    time.sleep(_STREAM_DRAIN_S)
    streamer.terminate()
    try:
        code = streamer.wait(timeout=60)
    except subprocess.TimeoutExpired:
        streamer.kill()
        code = streamer.wait()
    if code:
        print(f"lagscope launch: the streamer ended with status {code}", file=sys.stderr)
