"""`lagscope worker`: the distributed host, a faust-streaming worker (thin adapter).

Configuration is `stream_app.worker_config.WorkerConfig`: defaults < `--config` file (or
$LAGSCOPE_CONFIG) < `LAGSCOPE_<SECTION>__<FIELD>` environment (e.g.
`LAGSCOPE_WORKER__GROUP_ID`, `LAGSCOPE_STORE__DSN`, `LAGSCOPE_PROCESSOR__LATENESS_S`) <
flags. The store, when none of them names one, is the shared default of
`store/dsn.py`.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from lagscope.cli.conventions import add_log_level, add_old_name, configure_logging, examples
from lagscope.cli.kafka_options import add_kafka_options, kafka_overrides
from lagscope.store.dsn import DSN_HELP


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "worker",
        help="analyse rank-step batches from Kafka into the store (faust worker)",
        description="Consumes lagscope.ops (partitioned by job id: run more workers for more "
        "jobs), analyses every step as it closes, writes the results to ClickHouse and "
        "publishes them to lagscope.results. Crash-safe: see stream_app/worker.py.\n\n"
        "Settings: defaults < --config file (or $LAGSCOPE_CONFIG) < "
        "LAGSCOPE_<SECTION>__<FIELD> environment < flags.",
        epilog=examples(
            "lagscope worker --bootstrap-servers kafka:9092",
            "lagscope worker --bootstrap-servers kafka:9092 --dsn http://user:pw@ch:8123/lagscope",
            "lagscope worker --config worker.yaml --idle-exit-s 60   # a backfill that ends",
        ),
    )
    add_kafka_options(
        parser,
        kafka_option_help="extra librdkafka property of the worker's confluent-kafka clients "
        "(repeatable; its faust consumer takes the kafka.security_protocol, sasl_ and ssl_ "
        "settings)",
    )
    parser.add_argument("--dsn", help=DSN_HELP)
    parser.add_argument("--group", help="consumer group / faust app id (default: lagscope-worker)")
    parser.add_argument(
        "--lateness-s",
        type=float,
        metavar="SECONDS",
        help="the most a step waits for a rank that sends nothing (a job's own lateness "
        "follows its pace below it; default: 30, or the settings' processor.lateness_s)",
    )
    idle = parser.add_argument(
        "--idle-exit-s",
        type=float,
        metavar="SECONDS",
        help="exit after this long without messages (backfills, tests; default: run until stopped)",
    )
    add_old_name(parser, "--exit-when-idle-s", idle)
    parser.add_argument(
        "--data-dir",
        type=Path,
        metavar="DIR",
        help="the worker's state directory, made when missing (default: a temporary one, "
        "removed at exit)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on http://0.0.0.0:PORT/metrics (address: "
        "worker.metrics_addr; default: no endpoint)",
    )
    add_log_level(parser)
    parser.set_defaults(handler=run, extra="stream")


def run(args: argparse.Namespace) -> int:
    from lagscope.producers.config import ConfigError, load_config
    from lagscope.store.errors import StoreError
    from lagscope.stream_app.worker import FaustWorker
    from lagscope.stream_app.worker_config import WorkerConfig

    configure_logging(args)
    try:
        config = load_config(
            WorkerConfig,
            file=args.config,
            overrides={
                "kafka": kafka_overrides(args),
                "store": {"dsn": args.dsn},
                "processor": {"lateness_s": args.lateness_s},
                "worker": {
                    "group_id": args.group,
                    "exit_when_idle_s": args.idle_exit_s,
                    "data_dir": args.data_dir,
                    "metrics_port": args.metrics_port,
                },
            },
        )
        worker = FaustWorker(config)
    except (ConfigError, StoreError) as exc:
        print(f"lagscope worker: error: {exc}", file=sys.stderr)
        return 2
    try:
        worker.serve_metrics()
    except OSError as exc:
        print(f"lagscope worker: error: metrics endpoint: {exc}", file=sys.stderr)
        return 2
    # Until faust takes the signals over, SIGTERM (an orchestrator stopping the worker while
    # it waits for Kafka) ends it as Ctrl-C does: one line, and what it made removed.
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        worker.wait_for_broker()
        signal.signal(signal.SIGTERM, previous)
        worker.run()
    except ConfigError as exc:
        print(f"lagscope worker: error: {exc}", file=sys.stderr)
        return 2
    except _Terminated:
        print("lagscope worker: terminated while waiting for Kafka", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        # Ctrl-C while waiting for Kafka (faust handles its own signals once started).
        print("lagscope worker: interrupted", file=sys.stderr)
        return 130
    finally:
        worker.close()
    return 0


class _Terminated(Exception):
    """SIGTERM arrived before faust took the signals over."""


def _terminated(signum: int, frame: object) -> None:
    raise _Terminated
