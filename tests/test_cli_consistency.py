"""One name for one thing on every command, every default in `--help`, and the README's
install table true: a command run with only the extra the table names for it works (the
other installed distributions hidden from its imports)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lagscope.cli import build_parser

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
ST_TRACE = REPO / "tests/data/reference-traces/trace-ST.parquet"
ST_META = REPO / "tests/data/reference-traces/meta-ST.yaml"

#: Options that have no default by nature: inputs, outputs and filters the user names (a
#: new option with a default must show it instead of joining this list).
NO_DEFAULT = {
    "analyze": {"--trace", "--profiler-trace", "--meta", "--json", "--heatmap", "--timeline",
                "--report", "--steps", "--config"},
    "generate": {"--out", "--spec"},
    "changepoints": {"--input", "--json"},
    "run": {"--log-dir", "--config", "--report"},
    "launch": {"--config", "--report"},
    "stream": {"--log-dir"},
    "replay": {"--trace", "--profiler-trace", "--meta", "--log-dir"},
}  # fmt: skip


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    found = {}
    for name, sub in subparsers.choices.items():
        nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
        if nested:
            found.update({f"{name} {n}": p for n, p in nested[0].choices.items()})
        else:
            found[name] = sub
    return found


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        a
        for a in parser._actions
        if a.option_strings
        and a.help != argparse.SUPPRESS
        and not isinstance(a, argparse._HelpAction | argparse._VersionAction)
    ]


def test_every_default_is_in_help() -> None:
    for name, parser in _commands().items():
        formatter = parser._get_formatter()
        for action in _options(parser):
            if isinstance(action, argparse._StoreTrueAction | argparse._StoreConstAction):
                continue
            shown = formatter._expand_help(action) if action.help else ""
            option = action.option_strings[0]
            if option in NO_DEFAULT.get(name, set()):
                continue
            assert "default" in shown, f"lagscope {name} {option}: no default in --help"
            if action.default not in (None, [], False):
                # the formatter's own: a default of 0 shows too (0 == False)
                assert str(action.default) in shown, f"lagscope {name} {option}: {shown!r}"


def test_one_name_for_one_thing_on_every_long_running_command() -> None:
    commands = _commands()
    for name in ("worker", "stream", "run", "replay", "demo"):
        options = {o for a in _options(commands[name]) for o in a.option_strings}
        assert "--log-level" in options, f"lagscope {name} has no --log-level"
    kafka = {"--bootstrap-servers", "--topic-ops", "--topic-deadletter", "--topic-jobs",
             "--kafka-option", "--config"}  # fmt: skip
    for name in ("worker", "stream", "replay"):
        options = {o for a in _options(commands[name]) for o in a.option_strings}
        assert kafka <= options, f"lagscope {name} lacks {sorted(kafka - options)}"
    # the same option means the same on each: one choice of levels
    levels = {
        tuple(a.choices)
        for name in ("worker", "stream", "run", "replay", "demo")
        for a in _options(commands[name])
        if a.option_strings == ["--log-level"]
    }
    assert len(levels) == 1


def test_worker_topics_and_kafka_options_reach_its_settings(tmp_path: Path) -> None:
    from lagscope.cli.kafka_options import kafka_overrides

    args = build_parser().parse_args(
        ["worker", "--topic-ops", "o", "--topic-jobs", "j", "--kafka-option", "acks=all"]
    )
    overrides = kafka_overrides(args)
    assert overrides["topic_ops"] == "o" and overrides["topic_jobs"] == "j"
    assert overrides["client_options"] == {"acks": "all"}


def _readme_extras() -> dict[str, str]:
    """Each command the README's install table names, and the extra its row installs."""
    section = README.split("## Installing", 1)[1].splitlines()
    start = next(i for i, line in enumerate(section) if line.startswith("|"))
    rows = []
    for line in section[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line)
    found = {}
    for row in rows:
        install, what = row.strip("|").split("|", 1)
        extra = re.search(r"lagscope\[(\w+)\]", install)
        for group in re.findall(r"`lagscope ([a-z /]+)`", what.split("(`replay")[0]):
            # `analyze / generate / replay` are three commands, `dashboards build / push` one
            known = {name.split()[0] for name in _commands()}
            for piece in group.split(" / "):
                command = piece.split()[0]
                if command in known:
                    found[command] = extra.group(1) if extra else ""
    return found


def test_the_install_table_names_each_commands_own_extra() -> None:
    table = _readme_extras()
    commands = _commands()
    for name, parser in commands.items():
        top = name.split()[0]
        assert top in table, f"the README's install table does not say what `{top}` needs"
        declared = parser.get_default("extra") or ""
        assert table[top] == declared, f"`lagscope {name}`: README {table[top]!r}, CLI {declared!r}"


_BLOCKED_RUN = """
import sys, importlib.abc, importlib.metadata as md
from lagscope.deploy.constraints import closure
allowed = set(closure("lagscope", tuple(e for e in sys.argv[1].split(",") if e)))
allowed.add("lagscope")
from packaging.utils import canonicalize_name
blocked = {
    module for module, dists in md.packages_distributions().items()
    if not any(str(canonicalize_name(d)) in allowed for d in dists)
    and module not in ("lagscope", "_distutils_hack", "pip", "setuptools", "pkg_resources")
}
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the extra)", name=name)
        return None
for module in list(sys.modules):
    if module.partition(".")[0] in blocked:
        del sys.modules[module]
sys.meta_path.insert(0, Blocker())
from lagscope.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _with_only(extra: str, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _BLOCKED_RUN, extra, *argv],
        cwd=cwd, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@pytest.mark.slow  # three commands in fresh processes, one of them the embedded pipeline
def test_commands_work_with_only_the_extra_the_readme_names(tmp_path: Path) -> None:
    table = _readme_extras()
    logs = tmp_path / "logs"
    done = _with_only(
        table["replay"], "replay", "--trace", str(ST_TRACE), "--meta", str(ST_META),
        "--log-dir", str(logs), "--job-id", "st", "--no-progress", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = tmp_path / "report.html"
    done = _with_only(table["run"], "run", "--log-dir", str(logs), "--report", str(report),
                      cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "<html" in report.read_text()[:500].lower()
    done = _with_only(table["query"], "query", "SELECT count() AS n FROM steps", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # and the blocker blocks: a command that needs more says which extra, in one line
    done = _with_only("store", "run", "--log-dir", str(logs), "--report", str(report),
                      cwd=tmp_path)  # fmt: skip
    assert done.returncode == 1
    assert "install the 'demo' extra" in done.stderr
