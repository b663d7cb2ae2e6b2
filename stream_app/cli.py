"""The `lagscope` command line: one entry point, sub-commands registered by the modules
that own them (each module exposes `register(subparsers)` and stays a thin adapter)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from lagscope.producers.config import ConfigError
from lagscope.simulator.trace import TraceError

#: Modules that contribute sub-commands, in the order `lagscope --help` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "lagscope.stream_app.commands.analyze",
    "lagscope.stream_app.commands.generate",
    "lagscope.stream_app.commands.changepoints",
    "lagscope.stream_app.commands.query",
    "lagscope.stream_app.commands.run",
    "lagscope.stream_app.commands.worker",
    "lagscope.producers.commands",
    "lagscope.dashboards.commands",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lagscope",
        description="Find stragglers in large-scale LLM training: what-if analysis, "
        "change points, diagnosis.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (TraceError, ConfigError) as exc:
        print(f"lagscope {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from lagscope.stream_app.sink import StoreError

        if not isinstance(exc, StoreError):
            raise
        # Store errors name the DSN without its password (`ParsedDsn.shown`).
        print(f"lagscope {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
