"""`lagscope worker`: the distributed host, a faust-streaming worker (thin adapter).

Configuration is `stream_app.worker.WorkerConfig`: defaults < `--config` file (or
$LAGSCOPE_CONFIG) < `LAGSCOPE_<SECTION>__<FIELD>` environment (e.g.
`LAGSCOPE_WORKER__GROUP_ID`, `LAGSCOPE_STORE__DSN`, `LAGSCOPE_PROCESSOR__LATENESS_S`) <
flags.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "worker",
        help="analyse rank-step batches from Kafka into the store (faust worker)",
        description="Consumes lagscope.ops (partitioned by job id: run more workers for more "
        "jobs), analyses every step as it closes, writes the results to ClickHouse and "
        "publishes them to lagscope.results. Crash-safe: see stream_app/worker.py.",
    )
    parser.add_argument("--config", type=Path, help="yaml/json config file")
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (host:port,...)")
    parser.add_argument("--dsn", help="store DSN: chdb:///dir or http(s)://host:8123/db")
    parser.add_argument("--group", help="consumer group / faust app id")
    parser.add_argument(
        "--lateness-s",
        type=float,
        help="close a step this long after its first batch even if ranks are missing",
    )
    parser.add_argument(
        "--exit-when-idle-s",
        type=float,
        help="exit after this long without messages (backfills, tests)",
    )
    parser.add_argument("--data-dir", type=Path, help="faust's data directory")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning"))
    parser.set_defaults(handler=run, extra="stream")


def run(args: argparse.Namespace) -> int:
    from lagscope.producers.config import ConfigError, load_config
    from lagscope.stream_app.sink import StoreError
    from lagscope.stream_app.worker import FaustWorker, WorkerConfig

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = load_config(
            WorkerConfig,
            file=args.config,
            overrides={
                "kafka": {"bootstrap_servers": args.bootstrap},
                "store": {"dsn": args.dsn},
                "processor": {"lateness_s": args.lateness_s},
                "worker": {
                    "group_id": args.group,
                    "exit_when_idle_s": args.exit_when_idle_s,
                    "data_dir": args.data_dir,
                },
            },
        )
        worker = FaustWorker(config)
    except (ConfigError, StoreError) as exc:
        print(f"lagscope worker: error: {exc}", file=sys.stderr)
        return 2
    worker.run()
    return 0
