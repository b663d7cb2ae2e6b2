"""`lagscope analyze`: batch what-if analysis of a recorded trace."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("analyze", help="what-if analysis of a recorded trace")
    parser.add_argument("--trace", required=True)
    parser.add_argument("--meta", required=True)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    raise NotImplementedError("analysis engine lands in the next commits")
