"""`lagscope replay`: a recorded trace written as the ranks' timers would have, into
per-rank logs or straight into Kafka."""

from __future__ import annotations

import argparse
import json
import sys

from lagscope.cli.conventions import add_log_level, configure_logging, examples
from lagscope.cli.kafka_options import add_kafka_options, kafka_config
from lagscope.cli.trace_inputs import add_trace_inputs, resolve_trace_inputs, trace_usage

# The trace readers, the settings model and Kafka are imported when the command runs:
# registering it must stay cheap.


def register(subparsers: argparse._SubParsersAction) -> None:
    replay = subparsers.add_parser(
        "replay",
        help="replay a reference trace into per-rank logs or straight into Kafka",
        usage=trace_usage("(--log-dir DIR | --to-kafka) [options]"),
        description="Writes a recorded trace as the ranks' timers would have: per-rank "
        "local logs (--log-dir) or batches produced to Kafka (--to-kafka).",
        epilog=examples(
            "lagscope replay trace-AR.parquet --log-dir logs",
            "lagscope replay --trace trace-AR.parquet --meta meta-AR.yaml --log-dir logs",
            "lagscope replay --trace trace.parquet --meta meta.yaml --to-kafka "
            "--bootstrap-servers kafka:9092 --speed 10",
            "lagscope replay --profiler-trace traces/ --meta meta.yaml --log-dir logs",
        ),
    )
    add_trace_inputs(replay)
    destination = replay.add_mutually_exclusive_group(required=True)
    destination.add_argument("--log-dir", metavar="DIR", help="write per-rank local logs here")
    destination.add_argument(
        "--to-kafka", action="store_true", help="produce batches straight to Kafka"
    )
    add_kafka_options(replay)
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
    add_log_level(replay, service=False)
    replay.set_defaults(handler=run_replay, extra="analyze")


def run_replay(args: argparse.Namespace) -> int:
    configure_logging(args)
    from lagscope.cli.progress import Progress
    from lagscope.producers.config import ConfigError
    from lagscope.producers.kafka_login import check_kafka_settings
    from lagscope.producers.reference_format import load_meta, open_trace
    from lagscope.producers.replay import LogDirInUse, UndeliveredError, replay

    try:
        config = kafka_config(args, {}) if args.to_kafka else None
        if config is not None:
            check_kafka_settings(config.kafka)  # before the trace is read, not after
    except ConfigError as exc:
        print(f"lagscope replay: error: {exc}", file=sys.stderr)
        return 2
    meta_found = resolve_trace_inputs(args)
    if meta_found is not None:
        print(f"lagscope replay: metadata {meta_found}, found beside the trace", file=sys.stderr)
    meta = load_meta(args.meta)
    if args.profiler_trace:
        from lagscope.producers.profiler_trace import load_profiler_traces

        trace, read = load_profiler_traces(args.profiler_trace, meta)
        print(f"lagscope replay: read {read.summary()}", file=sys.stderr)
    else:
        # A large trace of lagscope's (a generated job of many steps) is read a part of
        # whole steps at a time, not held whole.
        trace = open_trace(args.trace, meta=meta, meta_path=args.meta)
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
    except LogDirInUse as exc:
        print(f"lagscope replay: error: --log-dir {exc}", file=sys.stderr)
        return 2
    finally:
        if bar is not None:
            bar.close()
    print(json.dumps(stats.__dict__))
    return 0
