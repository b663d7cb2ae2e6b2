"""`lagscope stream`: the sidecar on training nodes that ships the ranks' logs to Kafka."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from lagscope.cli.conventions import add_log_level, configure_logging, examples
from lagscope.cli.kafka_options import add_kafka_options, kafka_config

if TYPE_CHECKING:
    from lagscope.producers.streamer import Streamer

# The streamer and Kafka are imported when the command runs: registering it must stay
# cheap.


def register(subparsers: argparse._SubParsersAction) -> None:
    stream = subparsers.add_parser(
        "stream",
        help="ship the ranks' local logs to Kafka (sidecar; resumes after crashes)",
        description="Tails every rank's local log under --log-dir and produces its batches "
        "to Kafka, checkpointing what Kafka confirmed. Settings: defaults < --config file "
        "(or $LAGSCOPE_CONFIG) < LAGSCOPE_<SECTION>__<FIELD> environment < flags. When no "
        "Kafka answers, it retries with a growing pause and says so once.\n\n"
        "As a job's sidecar (deploy/k8s/streamer-sidecar-example.yaml): --drain-s ships "
        "what the logs hold to its end when SIGTERM comes (the trainer exited), and "
        "--exit-after-job-end-s ends it once every rank wrote its end record. Exit 0 only "
        "when Kafka confirmed everything in the logs; else 1 with the count of unshipped "
        "bytes.",
        epilog=examples(
            "lagscope stream --log-dir /local/lagscope --bootstrap-servers kafka:9092",
            "lagscope stream --log-dir logs --idle-exit-s 30   # a backfill that ends",
            "lagscope stream --log-dir /var/log/lagscope --drain-s 240 "
            "--exit-after-job-end-s 60   # a job's sidecar",
            "LAGSCOPE_KAFKA__BOOTSTRAP_SERVERS=kafka:9092 lagscope stream --log-dir logs",
        ),
    )
    add_kafka_options(stream)
    stream.add_argument(
        "--log-dir",
        metavar="DIR",
        help="directory of rank-NNNNNN/ log directories (waited for until the job creates it)",
    )
    stream.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="checkpoint file (default: <log-dir>/.streamer-checkpoint.json)",
    )
    stream.add_argument(
        "--compression",
        choices=["zstd", "lz4", "gzip", "snappy", "none"],
        help="Kafka message compression (default: zstd)",
    )
    stream.add_argument(
        "--torn-grace-s",
        type=float,
        metavar="SECONDS",
        help="how long a half-written record at a log's end may stay unfinished before it "
        "is a dead letter (default: 30)",
    )
    stream.add_argument(
        "--idle-exit-s",
        type=float,
        metavar="SECONDS",
        help="exit after this long with nothing to ship, counted from the start, or, when "
        "Kafka has not answered once since the start, after this long in any case: what "
        "was not shipped stays in the logs (backfills, tests; a job's sidecar uses "
        "--exit-after-job-end-s; default: run until stopped)",
    )
    stream.add_argument(
        "--exit-after-job-end-s",
        type=float,
        metavar="SECONDS",
        help="exit after this long with nothing new once every rank log under --log-dir "
        "holds its rank's end record (its monitor closed) and Kafka confirmed it all: a "
        "quiet job (model load, a checkpoint) never ends it (default: off)",
    )
    stream.add_argument(
        "--drain-s",
        type=float,
        metavar="SECONDS",
        help="on SIGTERM, keep shipping until Kafka confirmed everything the logs hold, for "
        "at most this long (below the pod's termination grace period), then exit (default: "
        "0, stop at once: the logs keep what is unconfirmed for the next run)",
    )
    stream.add_argument(
        "--delete-shipped",
        action="store_true",
        default=None,
        help="delete log files once Kafka confirmed everything in them (a node's DaemonSet: "
        "else the node's disk fills; default: keep them)",
    )
    stream.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on http://0.0.0.0:PORT/metrics (address: "
        "streamer.metrics_addr; default: no endpoint)",
    )
    add_log_level(stream)
    stream.set_defaults(handler=run_stream, extra="sidecar")


def run_stream(args: argparse.Namespace) -> int:
    from pathlib import Path

    from lagscope.cli.conventions import UsageError
    from lagscope.producers.config import ConfigError
    from lagscope.producers.redact import redact_url
    from lagscope.producers.streamer import Streamer

    configure_logging(args)
    # A directory not there yet is waited for (the sidecar may start first); a file is a
    # mistake.
    if args.log_dir is not None and Path(args.log_dir).exists() and not Path(args.log_dir).is_dir():
        raise UsageError(f"--log-dir {args.log_dir}: is not a directory")
    try:
        config = kafka_config(args, _streamer_flags(args))
        streamer = Streamer(config)
    except (ConfigError, ValueError) as exc:
        print(f"lagscope stream: error: {exc}", file=sys.stderr)
        return 2
    try:
        streamer.serve_metrics()
    except OSError as exc:
        print(f"lagscope stream: error: metrics endpoint: {exc}", file=sys.stderr)
        return 2
    interrupted = _stop_on_signals(streamer)
    streamer.ensure_topics()
    stats = streamer.run()
    # What the logs hold past Kafka's confirmations decides the exit status: a sidecar that
    # leaves data behind must not look done, or its pod (and an emptyDir with the logs)
    # would be cleaned up as if everything had been shipped.
    unshipped = streamer.unshipped_bytes()
    print(json.dumps({**stats.as_dict(), "unshipped_bytes": unshipped}))
    if unshipped:
        print(
            f"lagscope stream: error: {unshipped:,} bytes of the logs under {streamer.log_dir} "
            f"were not delivered to Kafka at {redact_url(config.kafka.bootstrap_servers)}; "
            f"they stay in the logs and the next run sends them (checkpoint "
            f"{streamer.checkpoint_path})",
            file=sys.stderr,
        )
    if interrupted:
        print("lagscope stream: interrupted", file=sys.stderr)
        return 130
    # Exiting on nothing shipped is a success only when there was nothing to ship and
    # Kafka was there to take it: a log directory that never appeared is most often a
    # wrong path, and a Kafka that never answered a wrong address.
    failed = bool(unshipped)
    if not streamer.log_dir.is_dir():
        print(f"lagscope stream: error: --log-dir {streamer.log_dir} never appeared; "
              "nothing was shipped", file=sys.stderr)  # fmt: skip
        failed = True
    if not unshipped and not streamer.kafka_answered:
        print(f"lagscope stream: error: Kafka at {redact_url(config.kafka.bootstrap_servers)} "
              "never answered; nothing was shipped", file=sys.stderr)  # fmt: skip
        failed = True
    return 1 if failed else 0


def _streamer_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The streamer settings given as flags (None: not given, the layers below decide)."""
    return {
        "log_dir": args.log_dir,
        "checkpoint_path": args.checkpoint,
        "compression": args.compression,
        "torn_grace_s": args.torn_grace_s,
        "idle_exit_s": args.idle_exit_s,
        "exit_after_job_end_s": args.exit_after_job_end_s,
        "drain_s": args.drain_s,
        "delete_shipped": args.delete_shipped,
        "metrics_port": args.metrics_port,
    }


def _stop_on_signals(streamer: Streamer) -> list[bool]:
    """SIGTERM (an orchestrator stopping the sidecar) is a normal end: with --drain-s it
    first ships what the logs hold, then exits 0 when Kafka confirmed it all (1 and the
    count otherwise). Ctrl-C ends it at once, the same clean way (what Kafka confirmed is
    checkpointed, the rest stays in the logs), and then says "interrupted" with 130, as
    every lagscope command does: the list returned gets an entry when that happened."""
    import signal

    interrupted: list[bool] = []

    def on_sigint(*_: object) -> None:
        interrupted.append(True)
        streamer.stop()

    signal.signal(signal.SIGTERM, lambda *_: streamer.terminate())
    signal.signal(signal.SIGINT, on_sigint)
    return interrupted
