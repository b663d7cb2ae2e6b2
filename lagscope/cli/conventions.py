"""What every `lagscope` command shares on its command line: the help layout, renamed
options, output paths where `-` means stdout, and the error that means "the command line
is wrong".

Exit codes, the same for every command:

- 0: done.
- 1: the command line is fine but what it points at is not: an input file that is missing,
  unreadable or malformed (a parquet file given as `--meta`, a trace with a missing
  column, a trace and the meta of another job), data the analysis cannot use
  (`TraceError`), logs with nothing `run` could analyse, or data Kafka did not confirm
  (`stream`, `replay --to-kafka`: the count is printed, the logs keep what `stream` did not
  ship).
- 2: the command line itself is wrong: an unknown option or a bad value (argparse), an
  output path the command cannot write in that form (`--heatmap out.txt`), two outputs
  sent to stdout, a log directory that does not exist or holds no rank logs (`UsageError`;
  `lagscope stream`, a sidecar that may start before the job, waits for it instead), an
  output folder holding files the command did not write (`claim_output_dir`), and
  settings that are wrong wherever they came from (config file, environment, DSN:
  `ConfigError`, `StoreError`).
- 130: interrupted (Ctrl-C); 141: the reader of stdout went away (`| head`).

Light on purpose: imported while the parser is built, so `lagscope --help` stays cheap.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Callable
from fnmatch import fnmatch
from pathlib import Path

#: The path that means "write to stdout" for every output option.
STDOUT = "-"
#: The first line of every command's examples in `--help`.
EXAMPLES_HEADING = "examples:"


class UsageError(Exception):
    """The command line is wrong (exit 2); the message names the option and the problem."""


class HelpFormatter(argparse.HelpFormatter):
    """Descriptions wrap paragraph by paragraph, examples keep their lines; every option
    with a real default shows it (argparse's own ArgumentDefaultsHelpFormatter also prints
    "default: None" and "default: False", which tell a reader nothing)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for paragraph in text.split("\n\n"):
            if paragraph.startswith(EXAMPLES_HEADING):
                paragraphs.append(textwrap.indent(paragraph, indent))
            else:
                paragraphs.append(
                    textwrap.fill(
                        " ".join(paragraph.split()),
                        width,
                        initial_indent=indent,
                        subsequent_indent=indent,
                    )
                )
        return "\n\n".join(paragraphs)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        # `is`, not `in`: 0 == False, and a default of 0 is one to show.
        if (
            "%(default)" in text
            or "default" in text
            or action.default is None
            or action.default is False
            or action.default is argparse.SUPPRESS
            or action.default == []
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


#: The levels `--log-level` offers, on every command that runs for long.
LOG_LEVELS = ("debug", "info", "warning", "error")


def add_log_level(parser: argparse.ArgumentParser, *, service: bool = True) -> None:
    """`--log-level`, the same on every long-running command: the services (worker,
    stream) log at info by default, timestamped; the commands a person runs (run, replay,
    demo) show warnings only, as plain lines, unless a level is asked for."""
    parser.add_argument(
        "--log-level",
        default="info" if service else None,
        choices=LOG_LEVELS,
        help="how much the command logs on stderr"
        + ("" if service else " (default: warning, as plain lines)"),
    )


def configure_logging(args: argparse.Namespace) -> None:
    """Log lines on stderr at the level `--log-level` chose, in one format for every
    command (nothing to do where no level was chosen and none is the default)."""
    import logging

    if args.log_level is None:
        return
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def examples(*lines: str) -> str:
    """An epilog of example command lines, one per line."""
    return EXAMPLES_HEADING + "\n" + "\n".join(f"  {line}" for line in lines)


class _DeprecatedName(argparse.Action):
    """An old option name, still accepted for one release: stores into the new option's
    destination and says once, on stderr, which name to use."""

    def __init__(self, option_strings, dest, *, new_name: str, **kwargs) -> None:
        self.new_name = new_name
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(
            f"{parser.prog}: {option_string} is deprecated and will be removed in the next "
            f"release; use {self.new_name}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def add_old_name(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    old_name: str,
    new_action: argparse.Action,
) -> None:
    """Accept `old_name` as a hidden alias of the option `new_action` (same destination,
    same type, not shown in --help)."""
    kwargs = {"type": new_action.type} if new_action.type is not None else {}
    parser.add_argument(
        old_name,
        dest=new_action.dest,
        action=_DeprecatedName,
        new_name=new_action.option_strings[0],
        help=argparse.SUPPRESS,
        **kwargs,
    )


def check_one_stdout(args: argparse.Namespace, *options: str) -> list[str]:
    """The output options (argparse destinations) of `args` given as `-`; two of them would
    interleave on stdout, which is a usage error."""
    given = [name for name in options if getattr(args, name, None) == STDOUT]
    if len(given) > 1:
        names = ", ".join("--" + name.replace("_", "-") for name in given)
        raise UsageError(f"{names}: only one output can go to stdout ('-')")
    return given


def write_output(path: str | Path, content: str | bytes, *, option: str) -> str:
    """Write `content` to `path`, or to stdout when `path` is `-`; returns where it went.
    A path that cannot be written is one line naming the option, the path and why."""
    if str(path) == STDOUT:
        if isinstance(content, bytes):
            sys.stdout.flush()
            sys.stdout.buffer.write(content)
            sys.stdout.buffer.flush()
        else:
            sys.stdout.write(content if content.endswith("\n") else content + "\n")
            sys.stdout.flush()
        return "stdout"
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content, encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"{option} {target}: cannot write ({exc.strerror or exc})") from None
    return str(target)


#: The file that marks a folder as a command's own output (`claim_output_dir`).
OUTPUT_MARK = ".lagscope-output.json"


def claim_output_dir(
    path: Path,
    *,
    command: str,
    own: tuple[str, ...],
    option: str = "--out",
    looks_own: Callable[[Path], bool] | None = None,
) -> list[Path]:
    """Make `path` the output folder of `command`, whose outputs are the names `own`
    (fnmatch patterns), or refuse with one UsageError line: nothing that the command did
    not write is ever deleted or overwritten.

    A folder that does not exist or is empty is taken (and marked); one marked by an
    earlier run of the same command is taken again if it holds nothing but the command's
    own names. Any other folder is refused, naming what in it is not the command's
    (`looks_own`: recognises an unmarked folder an older version of the command wrote).
    Returns the command's earlier outputs in it, for the caller to replace.
    """
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option} {path}: is not a directory")
    entries = sorted(path.iterdir()) if path.is_dir() else []
    marked = _marked_by(path / OUTPUT_MARK)
    if (
        entries
        and marked != command
        and not (marked is None and looks_own is not None and looks_own(path))
    ):
        whose = f"lagscope {marked}'s" if marked else "files lagscope " + command + " did not write"
        raise UsageError(
            f"{option} {path}: holds {whose} ({_names(entries)}); give a new or empty folder "
            f"(lagscope {command} deletes and overwrites only its own outputs)"
        )
    foreign = [
        e for e in entries if e.name != OUTPUT_MARK and not any(fnmatch(e.name, o) for o in own)
    ]
    if foreign:
        raise UsageError(
            f"{option} {path}: holds files lagscope {command} did not write ({_names(foreign)}); "
            f"move them away or give a new or empty folder"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
        (path / OUTPUT_MARK).write_text(json.dumps({"written_by": f"lagscope {command}"}) + "\n")
    except OSError as exc:
        raise UsageError(f"{option} {path}: cannot write ({exc.strerror or exc})") from None
    return [e for e in entries if e.name != OUTPUT_MARK]


def _marked_by(mark: Path) -> str | None:
    """The command whose mark `mark` is, or None (no mark, or not one of ours)."""
    try:
        written_by = json.loads(mark.read_text(encoding="utf-8")).get("written_by", "")
    except (OSError, ValueError, AttributeError):
        return None
    return written_by.removeprefix("lagscope ") if isinstance(written_by, str) else None


def _names(entries: list[Path], shown: int = 3) -> str:
    names = ", ".join(e.name for e in entries[:shown])
    return names + (f" and {len(entries) - shown} more" if len(entries) > shown else "")
