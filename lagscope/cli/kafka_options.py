"""The Kafka options `lagscope stream`, `lagscope worker` and `lagscope replay
--to-kafka` share (one name each for one thing), and the settings they make."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from lagscope.cli.conventions import add_old_name

if TYPE_CHECKING:
    from lagscope.producers.config import LagscopeConfig

# The settings model (pydantic) is imported when a command runs: registering the commands
# must stay cheap.


#: What `--kafka-option` does, unless a command says more.
KAFKA_OPTION_HELP = "extra librdkafka property (repeatable), e.g. security settings"


def add_kafka_options(
    parser: argparse.ArgumentParser, *, kafka_option_help: str = KAFKA_OPTION_HELP
) -> None:
    """--config, the brokers, the topics and extra librdkafka properties."""
    parser.add_argument(
        "--config", metavar="PATH", help="config file (yaml/json; default: $LAGSCOPE_CONFIG)"
    )
    bootstrap = parser.add_argument(
        "--bootstrap-servers",
        metavar="HOST:PORT,...",
        help="Kafka bootstrap servers (default: 127.0.0.1:9092)",
    )
    add_old_name(parser, "--bootstrap", bootstrap)
    parser.add_argument(
        "--topic-ops", metavar="TOPIC", help="topic of the ops batches (default: lagscope.ops)"
    )
    parser.add_argument(
        "--topic-deadletter",
        metavar="TOPIC",
        help="topic of records that cannot be shipped (default: lagscope.deadletter)",
    )
    parser.add_argument(
        "--topic-jobs",
        metavar="TOPIC",
        help="compacted topic of job descriptions (default: lagscope.jobs)",
    )
    parser.add_argument(
        "--kafka-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"{kafka_option_help} (default: none)",
    )


def kafka_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The `kafka` settings these flags give (None: not given, the layers below decide)."""
    from lagscope.producers.config import ConfigError

    options: dict[str, str] = {}
    for item in args.kafka_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            # The text itself is not echoed: it may be a mistyped password option.
            raise ConfigError(f"--kafka-option number {len(options) + 1}: expected KEY=VALUE")
        options[key] = value
    return {
        "bootstrap_servers": args.bootstrap_servers,
        "topic_ops": args.topic_ops,
        "topic_deadletter": args.topic_deadletter,
        "topic_jobs": args.topic_jobs,
        "client_options": options or None,
    }


def kafka_config(args: argparse.Namespace, streamer: dict[str, Any]) -> LagscopeConfig:
    """The settings of a command with these options: defaults < --config file (or
    $LAGSCOPE_CONFIG) < LAGSCOPE_<SECTION>__<FIELD> environment < flags."""
    from lagscope.producers.config import LagscopeConfig, load_config

    return load_config(LagscopeConfig, file=args.config,
                       overrides={"kafka": kafka_overrides(args),
                                  "streamer": streamer})  # fmt: skip
