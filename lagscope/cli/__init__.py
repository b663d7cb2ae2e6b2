"""The `lagscope` command line, all of it in this package: the entry point (here), the
conventions every command shares (`conventions.py`, `progress.py`), and one module per
command, which exposes `register(subparsers)` and stays a thin adapter over the stages it
drives (`producers`, `simulator`, `stream_app`, `store`, `dashboards`). No stage imports
the command line.

Registering a command imports nothing heavy: each handler imports what it needs when it
runs, so `lagscope --help` costs little more than the interpreter's own start. A handler
whose optional dependencies are not installed ends with one line naming the extra to
install (`pip install 'lagscope[store]'`), never a traceback.

Exit codes (0 done, 1 bad input data, 2 bad command line or settings, 130 interrupted,
141 reader gone) and the shared option habits live in `lagscope/cli/conventions.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from lagscope import __version__
from lagscope.cli.conventions import HelpFormatter, UsageError
from lagscope.simulator.errors import TraceError

#: The module that registers each sub-command, in the order `lagscope --help` lists them.
#: A command line that names one command imports only that command's module.
COMMAND_MODULE: dict[str, str] = {
    "analyze": "lagscope.cli.analyze",
    "generate": "lagscope.cli.generate",
    "changepoints": "lagscope.cli.changepoints",
    "query": "lagscope.cli.query",
    "run": "lagscope.cli.run",
    "launch": "lagscope.cli.launch",
    "demo": "lagscope.cli.demo",
    "worker": "lagscope.cli.worker",
    "stream": "lagscope.cli.stream",
    "replay": "lagscope.cli.replay",
    "dashboards": "lagscope.cli.dashboards",
}
COMMAND_MODULES: tuple[str, ...] = tuple(dict.fromkeys(COMMAND_MODULE.values()))

#: The extra that installs each optional top-level module a command may import.
EXTRA_OF_MODULE: dict[str, str] = {
    "pyarrow": "analyze",
    "cramjam": "analyze",
    "matplotlib": "analyze",
    "tqdm": "analyze",
    "jinja2": "analyze",
    "chdb": "store",
    "clickhouse_connect": "store",
    "confluent_kafka": "sidecar",
    "prometheus_client": "sidecar",
    # the settings layering of stream, replay and worker (each command names its own extra)
    "pydantic_settings": "sidecar",
    "faust": "stream",
    "aiokafka": "stream",
    "grafana_foundation_sdk": "dashboards",
    "grafana_client": "dashboards",
}


class _Parser(argparse.ArgumentParser):
    """argparse without prefix matching: `--tr` must not silently mean `--trace`, and a new
    option must never change what an old abbreviation meant."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of `command` alone (only its module is imported)."""
    parser = _Parser(
        prog="lagscope",
        description="Find stragglers in large-scale LLM training: what-if analysis, "
        "change points, diagnosis.",
    )
    parser.add_argument("--version", action="version", version=f"lagscope {__version__}")
    subparsers = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )
    modules = (COMMAND_MODULE[command],) if command in COMMAND_MODULE else COMMAND_MODULES
    for module_name in modules:
        importlib.import_module(module_name).register(subparsers)
    return parser


def named_command(argv: Sequence[str]) -> str | None:
    """The sub-command a command line names: its first argument, unless that is an option."""
    return argv[0] if argv and not argv[0].startswith("-") else None


def missing_extra_message(
    command: str, exc: ModuleNotFoundError, command_extra: str | None = None
) -> str | None:
    """The one line for a command whose optional dependency is not installed, or None when
    the missing module is not one that an extra provides (a real bug: let it raise). A
    command that declares its extra (`set_defaults(extra=...)`) names that one."""
    top_level = (exc.name or "").partition(".")[0]
    if top_level not in EXTRA_OF_MODULE:
        return None
    extra = command_extra or EXTRA_OF_MODULE[top_level]
    return (
        f"lagscope {command}: needs {top_level}, which is not installed; "
        f"install the '{extra}' extra: pip install 'lagscope[{extra}]'"
    )


def main(argv: Sequence[str] | None = None, *, exit_without_teardown: bool = False) -> int:
    """Run one command line; returns its exit code.

    With `exit_without_teardown` (the console script), a command that declares it leaves
    nothing behind (`set_defaults(one_shot=True)`: every output written and closed, no
    thread, child or connection left) ends the process itself, without the interpreter's
    teardown: freeing numpy's and pyarrow's modules and arrays one by one, memory the
    system takes back at once, costs some 17 ms, a tenth of `lagscope analyze` on a
    reference trace. Every other command returns as usual.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    # pydantic looks for plugins among the entry points of every installed distribution at
    # its first model; in a training environment that scan costs more than the rest of a
    # command's start. A command line needs no pydantic plugin; a user can still set it.
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    parser = build_parser(named_command(argv))
    args = parser.parse_args(argv)
    code = _handled(args)
    if exit_without_teardown and getattr(args, "one_shot", False):
        os._exit(_flushed(code))
    return code


def entry() -> NoReturn:
    """The `lagscope` console script."""
    sys.exit(main(exit_without_teardown=True))


def _flushed(code: int) -> int:
    """Flush what the teardown would have flushed; a reader gone is exit code 141."""
    if "logging" in sys.modules:
        sys.modules["logging"].shutdown()
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        code = 141
    with contextlib.suppress(BrokenPipeError, ValueError):
        sys.stderr.flush()
    return code


def _handled(args: argparse.Namespace) -> int:
    try:
        return int(args.handler(args) or 0)
    except ModuleNotFoundError as exc:
        message = missing_extra_message(args.command, exc, getattr(args, "extra", None))
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"lagscope {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`lagscope ... | head`): nothing left to say, and Python's
        # own flush at exit must not complain either.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except Exception as exc:
        if not isinstance(exc, user_error_types()):
            raise
        # These errors name the file, setting or store at fault in one line (a store is
        # named by its DSN without the password: `ParsedDsn.shown`).
        print(f"lagscope {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_DATA if isinstance(exc, TraceError) else EXIT_USAGE


#: A well-formed command line whose input data cannot be used (see conventions.py).
EXIT_BAD_DATA = 1
#: A wrong command line or wrong settings; argparse's own code for usage errors.
EXIT_USAGE = 2


#: Errors that mean the user's input or settings are wrong, by module and class name: the
#: modules are not imported here, since `--help` must stay cheap.
_USER_ERRORS = (
    ("lagscope.producers.config", "ConfigError"),
    ("lagscope.store.errors", "StoreError"),
)


def user_error_types() -> tuple[type[BaseException], ...]:
    """The user-error classes that can have been raised: those of the modules imported so far
    (an error class whose module was never imported cannot have been raised)."""
    found: list[type[BaseException]] = [TraceError, UsageError]
    for module_name, class_name in _USER_ERRORS:
        module = sys.modules.get(module_name)
        if module is not None:
            found.append(getattr(module, class_name))
    return tuple(found)


if __name__ == "__main__":
    entry()
