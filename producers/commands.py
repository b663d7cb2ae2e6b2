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
    from lagscope.stream_app.cli_conventions import add_old_name, examples

    stream = subparsers.add_parser(
        "stream",
        help="ship the ranks' local logs to Kafka (sidecar; resumes after crashes)",
        description="Tails every rank's local log under --log-dir and produces its batches "
        "to Kafka, checkpointing what Kafka confirmed. Settings: defaults < --config file "
        "(or $LAGSCOPE_CONFIG) < LAGSCOPE_<SECTION>__<FIELD> environment < flags. When no "
        "Kafka answers, it retries with a growing pause and says so once.",
        epilog=examples(
            "lagscope stream --log-dir /local/lagscope --bootstrap-servers kafka:9092",
            "lagscope stream --log-dir logs --idle-exit-s 30   # a backfill that ends",
            "LAGSCOPE_KAFKA__BOOTSTRAP_SERVERS=kafka:9092 lagscope stream --log-dir logs",
        ),
    )
    _kafka_flags(stream)
    stream.add_argument(
        "--log-dir",
        metavar="DIR",
        help="directory of rank-NNNNNN/ log directories (waited for until the job creates it)",
    )
    stream.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="checkpoint file (default <log-dir>/.streamer-checkpoint.json)",
    )
    stream.add_argument(
        "--compression",
        choices=["zstd", "lz4", "gzip", "snappy", "none"],
        help="Kafka message compression (default zstd)",
    )
    stream.add_argument(
        "--torn-grace-s",
        type=float,
        metavar="SECONDS",
        help="how long a half-written record at a log's end may stay unfinished before it "
        "is a dead letter (default 30)",
    )
    stream.add_argument(
        "--idle-exit-s",
        type=float,
        metavar="SECONDS",
        help="exit after this long with nothing to ship, or, when Kafka has not answered "
        "once since the start, after this long in any case: what was not shipped stays in "
        "the logs (backfills, tests; default: run until stopped)",
    )
    stream.add_argument(
        "--delete-shipped",
        action="store_true",
        default=None,
        help="delete log files once Kafka confirmed everything in them",
    )
    stream.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on http://0.0.0.0:PORT/metrics (address: "
        "streamer.metrics_addr; default: no endpoint)",
    )
    stream.set_defaults(handler=run_stream, extra="sidecar")

    replay = subparsers.add_parser(
        "replay",
        help="replay a reference trace into per-rank logs or straight into Kafka",
        description="Writes a recorded trace as the ranks' timers would have: per-rank "
        "local logs (--log-dir) or batches produced to Kafka (--to-kafka).",
        epilog=examples(
            "lagscope replay --trace trace-AR.parquet --meta meta-AR.yaml --log-dir logs",
            "lagscope replay --trace trace.parquet --meta meta.yaml --to-kafka "
            "--bootstrap-servers kafka:9092 --speed 10",
            "lagscope replay --profiler-trace traces/ --meta meta.yaml --log-dir logs",
        ),
    )
    source = replay.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="PATH", help="reference parquet trace")
    source.add_argument(
        "--profiler-trace",
        nargs="+",
        metavar="PATH",
        help="torch.profiler Chrome-trace JSON, one file per rank (files or a directory)",
    )
    replay.add_argument("--meta", required=True, metavar="PATH", help="job metadata yaml")
    destination = replay.add_mutually_exclusive_group(required=True)
    destination.add_argument("--log-dir", metavar="DIR", help="write per-rank local logs here")
    destination.add_argument(
        "--to-kafka", action="store_true", help="produce batches straight to Kafka"
    )
    _kafka_flags(replay)
    replay.add_argument("--job-id", help="job id (default <trial_name>-<run_id> of the metadata)")
    replay.add_argument("--attempt", type=int, default=0, help="attempt number of the job")
    pace = replay.add_mutually_exclusive_group()
    pace.add_argument(
        "--speed",
        type=float,
        default=0.0,
        help="1 = original pace, N = N times faster, 0 = as fast as possible",
    )
    pace.add_argument(
        "--realtime",
        action="store_const",
        const=1.0,
        dest="speed",
        help="the original pace (same as --speed 1)",
    )
    replay.add_argument("--repeat", type=int, default=1, help="replay the trace N times")
    replay.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    replay.set_defaults(handler=run_replay, extra="analyze")
    for parser in (stream, replay):
        bootstrap = next(a for a in parser._actions if a.dest == "bootstrap_servers")
        add_old_name(parser, "--bootstrap", bootstrap)


def _kafka_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", metavar="PATH", help="config file (yaml/json; default $LAGSCOPE_CONFIG)"
    )
    parser.add_argument(
        "--bootstrap-servers",
        metavar="HOST:PORT,...",
        help="Kafka bootstrap servers (default 127.0.0.1:9092)",
    )
    parser.add_argument(
        "--topic-ops", metavar="TOPIC", help="topic of the ops batches (default lagscope.ops)"
    )
    parser.add_argument(
        "--topic-deadletter",
        metavar="TOPIC",
        help="topic of records that cannot be shipped (default lagscope.deadletter)",
    )
    parser.add_argument(
        "--topic-jobs",
        metavar="TOPIC",
        help="compacted topic of job descriptions (default lagscope.jobs)",
    )
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
    import signal
    from pathlib import Path

    from lagscope.producers.config import ConfigError
    from lagscope.producers.redact import redact_url
    from lagscope.producers.streamer import Streamer
    from lagscope.stream_app.cli_conventions import UsageError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # A directory not there yet is waited for (the sidecar may start first); a file is a
    # mistake.
    if args.log_dir is not None and Path(args.log_dir).exists() and not Path(args.log_dir).is_dir():
        raise UsageError(f"--log-dir {args.log_dir}: is not a directory")
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
                "metrics_port": args.metrics_port,
            },
        )
        streamer = Streamer(config)
    except (ConfigError, ValueError) as exc:
        print(f"lagscope stream: error: {exc}", file=sys.stderr)
        return 2
    try:
        streamer.serve_metrics()
    except OSError as exc:
        print(f"lagscope stream: error: metrics endpoint: {exc}", file=sys.stderr)
        return 2
    # SIGTERM (an orchestrator stopping the sidecar) is a normal end: exit 0. Ctrl-C ends
    # it the same clean way (what Kafka confirmed is checkpointed, the rest stays in the
    # logs) and then says "interrupted" with 130, as every lagscope command does.
    interrupted: list[bool] = []

    def on_sigint(*_: object) -> None:
        interrupted.append(True)
        streamer.stop()

    signal.signal(signal.SIGTERM, lambda *_: streamer.stop())
    signal.signal(signal.SIGINT, on_sigint)
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
    return 1 if unshipped else 0


def run_replay(args: argparse.Namespace) -> int:
    from lagscope.producers.config import ConfigError
    from lagscope.producers.kafka_login import check_kafka_settings
    from lagscope.producers.reference_format import load_meta, load_trace
    from lagscope.producers.replay import UndeliveredError, replay
    from lagscope.stream_app.progress import Progress

    try:
        config = _config(args, {}) if args.to_kafka else None
        if config is not None:
            check_kafka_settings(config.kafka)  # before the trace is read, not after
    except ConfigError as exc:
        print(f"lagscope replay: error: {exc}", file=sys.stderr)
        return 2
    meta = load_meta(args.meta)
    if args.profiler_trace:
        from lagscope.producers.profiler_trace import load_profiler_traces

        trace, read = load_profiler_traces(args.profiler_trace, meta)
        print(f"lagscope replay: read {read.summary()}", file=sys.stderr)
    else:
        trace = load_trace(args.trace, meta=meta, meta_path=args.meta)
    bar = None if args.no_progress else Progress("replay", unit="step")
    try:
        stats = replay(
            trace,
            meta,
            log_dir=args.log_dir,
            kafka=config,
            job_id=args.job_id,
            attempt=args.attempt,
            speed=args.speed,
            repeat=args.repeat,
            progress=bar,
        )
    except UndeliveredError as exc:
        print(f"lagscope replay: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if bar is not None:
            bar.close()
    print(json.dumps(stats.__dict__))
    return 0
