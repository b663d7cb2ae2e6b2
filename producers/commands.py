"""`lagscope stream` (the streamer sidecar) and `lagscope replay` (trace replay)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lagscope.producers.config import LagscopeConfig

# The settings model (pydantic), the streamer and Kafka are imported when a command runs:
# registering the commands must stay cheap.


def register(subparsers: argparse._SubParsersAction) -> None:
    stream = subparsers.add_parser(
        "stream", help="ship the ranks' local logs to Kafka (sidecar; resumes after crashes)"
    )
    _kafka_flags(stream)
    stream.add_argument("--log-dir", help="directory of rank-NNNNNN/ log directories")
    stream.add_argument("--checkpoint", help="checkpoint file (default <log-dir>/.streamer-...)")
    stream.add_argument("--compression", choices=["zstd", "lz4", "gzip", "snappy", "none"])
    stream.add_argument("--torn-grace-s", type=float)
    stream.add_argument(
        "--idle-exit-s", type=float, help="exit after this many idle seconds (backfills, tests)"
    )
    stream.add_argument(
        "--delete-shipped",
        action="store_true",
        default=None,
        help="delete log files once Kafka confirmed everything in them",
    )
    stream.set_defaults(handler=run_stream, extra="sidecar")

    replay = subparsers.add_parser(
        "replay", help="replay a reference trace into per-rank logs or straight into Kafka"
    )
    source = replay.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="reference parquet trace")
    source.add_argument(
        "--profiler-trace",
        nargs="+",
        metavar="PATH",
        help="torch.profiler Chrome-trace JSON, one file per rank (files or a directory)",
    )
    replay.add_argument("--meta", required=True, help="job metadata yaml")
    destination = replay.add_mutually_exclusive_group(required=True)
    destination.add_argument("--log-dir", help="write per-rank local logs here")
    destination.add_argument(
        "--to-kafka", action="store_true", help="produce batches straight to Kafka"
    )
    _kafka_flags(replay)
    replay.add_argument("--job-id", help="job id (default <trial_name>-<run_id>)")
    replay.add_argument("--attempt", type=int, default=0)
    pace = replay.add_mutually_exclusive_group()
    pace.add_argument(
        "--speed",
        type=float,
        default=0.0,
        help="1 = original pace, N = N times faster, 0 = as fast as possible",
    )
    pace.add_argument("--realtime", action="store_const", const=1.0, dest="speed")
    replay.add_argument("--repeat", type=int, default=1, help="replay the trace N times")
    replay.add_argument("--no-progress", action="store_true")
    replay.set_defaults(handler=run_replay, extra="analyze")


def _kafka_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="config file (yaml/json); env LAGSCOPE_CONFIG")
    parser.add_argument("--bootstrap-servers", help="Kafka bootstrap servers")
    parser.add_argument("--topic-ops")
    parser.add_argument("--topic-deadletter")
    parser.add_argument("--topic-jobs")
    parser.add_argument(
        "--kafka-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra librdkafka property (repeatable), e.g. security settings",
    )


def _config(args: argparse.Namespace, streamer: dict[str, Any]) -> LagscopeConfig:
    from lagscope.producers.config import ConfigError, LagscopeConfig, load_config

    options: dict[str, str] = {}
    for item in args.kafka_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            # The text itself is not echoed: it may be a mistyped password option.
            raise ConfigError(f"--kafka-option number {len(options) + 1}: expected KEY=VALUE")
        options[key] = value
    kafka = {
        "bootstrap_servers": args.bootstrap_servers,
        "topic_ops": args.topic_ops,
        "topic_deadletter": args.topic_deadletter,
        "topic_jobs": args.topic_jobs,
        "client_options": options or None,
    }
    return load_config(LagscopeConfig, file=args.config,
                       overrides={"kafka": kafka, "streamer": streamer})  # fmt: skip


def run_stream(args: argparse.Namespace) -> int:
    from lagscope.producers.config import ConfigError
    from lagscope.producers.streamer import Streamer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        config = _config(
            args,
            {
                "log_dir": args.log_dir,
                "checkpoint_path": args.checkpoint,
                "compression": args.compression,
                "torn_grace_s": args.torn_grace_s,
                "idle_exit_s": args.idle_exit_s,
                "delete_shipped": args.delete_shipped,
            },
        )
        streamer = Streamer(config)
    except (ConfigError, ValueError) as exc:
        print(f"lagscope stream: error: {exc}", file=sys.stderr)
        return 2
    streamer.install_signal_handlers()
    streamer.ensure_topics()
    stats = streamer.run()
    print(json.dumps(stats.as_dict()))
    return 0


def run_replay(args: argparse.Namespace) -> int:
    from lagscope.producers.config import ConfigError
    from lagscope.producers.reference_format import load_meta, load_trace
    from lagscope.producers.replay import replay

    try:
        config = _config(args, {}) if args.to_kafka else None
    except ConfigError as exc:
        print(f"lagscope replay: error: {exc}", file=sys.stderr)
        return 2
    meta = load_meta(args.meta)
    if args.profiler_trace:
        from lagscope.producers.profiler_trace import load_profiler_traces

        trace, read = load_profiler_traces(args.profiler_trace, meta)
        print(f"lagscope replay: read {read.summary()}", file=sys.stderr)
    else:
        trace = load_trace(args.trace)
    stats = replay(
        trace,
        meta,
        log_dir=args.log_dir,
        kafka=config,
        job_id=args.job_id,
        attempt=args.attempt,
        speed=args.speed,
        repeat=args.repeat,
        progress=None if args.no_progress else sys.stderr,
    )
    print(json.dumps(stats.__dict__))
    return 0
