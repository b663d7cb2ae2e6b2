"""Every example a user copies runs as written (issue 27): the Python examples in the
package's docstrings, the README's commands, and every `lagscope` command line that the
READMEs and `--help` show.

- A docstring example runs as a script in an empty folder; a line `print(...)  # X` says
  what it prints. One whose first line says how to launch it (`# train.py: torchrun ...`)
  is launched that way. What an example says analyses its logs (`lagscope run --log-dir
  lagscope-logs`) is run on them too.
- The Megatron example needs megatron-core on GPUs, which no test machine has: it is
  checked as far as can be without them (it compiles, its calls fit the real signatures,
  and it calls them in the order of the real Megatron job that tests/test_megatron_job.py
  runs on CPU).
- `lagscope analyze` of the README runs on the reference trace it names and prints the
  summary the README shows; the README's torch job runs as written (into a temporary
  folder); every other `lagscope ...` line of the READMEs and of every command's examples
  is accepted by the command's real parser.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lagscope.cli import build_parser
from lagscope.cli.conventions import EXAMPLES_HEADING

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
REFERENCE = REPO / "tests" / "data" / "reference-traces"
#: The source folders installed under `lagscope` (their modules' docstrings are scanned).
SOURCE_FOLDERS = (
    "lagscope",
    "producers",
    "simulator",
    "stream_app",
    "store",
    "dashboards",
    "deploy",
)
#: A code block's first line that makes it a Python example (not a table or a layout).
_PYTHON_START = re.compile(r"^(import |from \S+ import |# \S+\.py: )")


@dataclass(frozen=True)
class Example:
    where: str
    code: str

    @property
    def launch(self) -> list[str] | None:
        """The command line its first line gives (`# train.py: torchrun ...`), if any."""
        first = self.code.splitlines()[0]
        match = re.match(r"# (\S+\.py): (.+)$", first)
        return shlex.split(match.group(2)) if match else None


def docstring_examples() -> list[Example]:
    found = []
    for folder in SOURCE_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef):
                    continue
                doc = ast.get_docstring(node, clean=True) or ""
                for block in re.findall(r"(?:^|\n)\n((?:(?:    .*)?\n)+)", doc + "\n"):
                    code = textwrap.dedent(block).strip("\n") + "\n"
                    if _PYTHON_START.match(code) and ">>>" not in code:
                        name = getattr(node, "name", "module")
                        found.append(Example(f"{path.relative_to(REPO)}:{name}", code))
    return found


EXAMPLES = docstring_examples()
MEGATRON = [e for e in EXAMPLES if "megatron.core" in e.code]
RUNNABLE = [e for e in EXAMPLES if e not in MEGATRON]


def test_the_known_examples_are_found() -> None:
    places = {e.where.split(":")[0] for e in EXAMPLES}
    assert places >= {
        "lagscope/timer.py",
        "lagscope/torch.py",
        "lagscope/megatron.py",
        "producers/timer.py",
        "producers/config.py",
    }, places


def _run(command: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def _launcher(argv: list[str]) -> list[str]:
    """The example's command line with this environment's interpreter and scripts."""
    if argv[0] == "torchrun":
        pytest.importorskip("torch")
        return [sys.executable, "-m", "torch.distributed.run", *argv[1:]]
    if argv[0] == "lagscope":
        return [sys.executable, "-m", "lagscope", *argv[1:]]
    return argv


def _runnable(example: Example) -> Any:
    """An example as a test case: one that imports torch runs a real torch job, slow."""
    marks = [pytest.mark.slow] if "import torch" in example.code else []
    return pytest.param(example, marks=marks, id=example.where)


@pytest.mark.parametrize("example", [_runnable(e) for e in RUNNABLE])
def test_docstring_example_runs_as_written(example: Example, tmp_path: Path) -> None:
    if "import torch" in example.code:
        pytest.importorskip("torch")
    launch = example.launch
    if launch is not None:
        script = launch[-1]
        (tmp_path / script).write_text(example.code)
        done = _run(_launcher(launch), tmp_path)
    else:
        (tmp_path / "example.py").write_text(example.code)
        done = _run([sys.executable, "example.py"], tmp_path)
    assert done.returncode == 0, f"{example.where}:\n{done.stderr[-3000:]}"
    expected = re.findall(r"^\s*print\(.*\)\s+# (.+)$", example.code, flags=re.M)
    if expected:
        assert done.stdout.splitlines() == expected, example.where
    # what the example's own text says analyses what it wrote
    module = importlib.import_module(_module_of(example.where))
    log_dir = re.search(r'log_dir="([^"/]+)"', example.code)
    if log_dir and f"lagscope run --log-dir {log_dir.group(1)}" in (module.__doc__ or ""):
        analysed = _run(_launcher(["lagscope", "run", "--log-dir", log_dir.group(1)]), tmp_path)
        assert analysed.returncode == 0, f"{example.where}:\n{analysed.stderr[-3000:]}"
        assert re.search(r"job \S+ attempt 0: \d+ steps closed", analysed.stdout)


def _module_of(where: str) -> str:
    """`producers/timer.py:module` -> `lagscope.producers.timer` (the installed name)."""
    dotted = where.split(":")[0].removesuffix(".py").replace("/", ".")
    return dotted if dotted.startswith("lagscope.") else f"lagscope.{dotted}"


@pytest.mark.parametrize("example", MEGATRON, ids=lambda e: e.where)
def test_megatron_example_fits_megatron_and_the_real_job(example: Example) -> None:
    if sys.version_info < (3, 12):
        pytest.skip("megatron-core 0.19 is published for Python >= 3.12 only")
    import megatron.core.parallel_state as parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import lagscope.megatron

    tree = ast.parse(example.code)  # it compiles
    compile(tree, example.where, "exec")
    calls = _calls(tree)
    signatures = {
        "parallel_state.initialize_model_parallel": parallel_state.initialize_model_parallel,
        "lagscope.megatron.monitor": lagscope.megatron.monitor,
        "get_forward_backward_func": get_forward_backward_func,
    }
    for name, function in signatures.items():
        (call,) = [c for c in calls if c[0] == name]
        inspect.signature(function).bind(*call[1], **dict.fromkeys(call[2]))
    # the schedule's own keywords are those megatron's schedules take
    (schedule_call,) = [c for c in calls if c[0] == "forward_backward"]
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining

    inspect.signature(forward_backward_no_pipelining).bind(**dict.fromkeys(schedule_call[2]))
    order = [
        "parallel_state.initialize_model_parallel",
        "lagscope.megatron.monitor",
        "get_forward_backward_func",
        "forward_backward",
        "monitor.close",
    ]
    assert [c[0] for c in calls if c[0] in order] == order
    # ... the order of the Megatron job the tests run
    job = ast.parse((REPO / "tests" / "megatron_jobs" / "tiny_gpt.py").read_text())
    (train,) = [n for n in ast.walk(job) if isinstance(n, ast.FunctionDef) and n.name == "_train"]
    job_order = [c[0] for c in _calls(train) if c[0] in order]
    assert job_order == order, job_order


def _calls(tree: ast.AST) -> list[tuple[str, list[ast.expr], list[str]]]:
    """Every call in source order (as a reader reads it): dotted name, positional
    arguments, keyword names."""
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    calls.sort(key=lambda n: (n.lineno, n.col_offset))
    return [(ast.unparse(n.func), n.args, [k.arg for k in n.keywords if k.arg]) for n in calls]


# -- the README ----------------------------------------------------------------------------


def _section(text: str, heading: str) -> str:
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def test_readme_analyze_example_prints_what_the_readme_shows(tmp_path: Path) -> None:
    section = _section(README.read_text(), "## Analysing a recorded trace")
    blocks = fenced_blocks(section)
    command = " ".join(blocks[0][1].replace("\\\n", " ").split())
    shown = blocks[1][1]
    for name in ("trace-AR.parquet", "meta-AR.yaml"):
        shutil.copy(REFERENCE / name, tmp_path / name)
    argv = shlex.split(command)
    assert argv[0] == ".venv/bin/lagscope"
    done = _run([sys.executable, "-m", "lagscope", *argv[1:]], tmp_path)
    assert done.returncode == 0, done.stderr
    for name in ("out.json", "heatmap.png", "timeline.json"):
        assert (tmp_path / name).stat().st_size > 0
    for line in shown.strip().splitlines():
        # a line the README cuts short ("...") must start the printed one
        expected = (line.split("...")[0] if "..." in line else line).strip()
        assert any(out.strip().startswith(expected) for out in done.stdout.splitlines()), line
    keys = re.findall(r"`(\w+)`", section.split("`--json` writes", 1)[1].split("\n- ", 1)[0])
    import json

    written = json.loads((tmp_path / "out.json").read_text())
    assert set(keys) - {"steps"} <= set(written), set(keys) - set(written)


@pytest.mark.slow  # the README's torch job, run for real (~13 s)
def test_readme_torch_job_example_runs(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    text = README.read_text()
    line = re.search(
        r"`(\.venv/bin/python -m tests\.torch_jobs\.ddp [^`]+)`", text.replace("\n", " ")
    )
    assert line is not None
    argv = shlex.split(line.group(1))
    assert argv[argv.index("--log-dir") + 1] == "/tmp/ddp/logs"
    argv[argv.index("--log-dir") + 1] = str(tmp_path / "logs")  # a private copy of /tmp/ddp
    done = _run([sys.executable, *argv[1:]], REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert list((tmp_path / "logs").glob("rank-*"))


# -- every command line shown anywhere is one the CLI takes ---------------------------------


def fenced_blocks(markdown: str) -> list[tuple[str, str]]:
    """The fenced code blocks of a markdown text: (language, content), in order."""
    blocks: list[tuple[str, str]] = []
    language: str | None = None
    lines: list[str] = []
    for line in markdown.splitlines():
        if line.startswith("```"):
            if language is None:
                language, lines = line[3:].strip(), []
            else:
                blocks.append((language, "\n".join(lines) + "\n"))
                language = None
        elif language is not None:
            lines.append(line)
    return blocks


def _documented_lines() -> list[tuple[str, str]]:
    """(where, line) of every shell block of the READMEs and every `--help` example."""
    found: list[tuple[str, str]] = []
    for doc in (README, REPO / "deploy" / "README.md"):
        for language, block in fenced_blocks(doc.read_text()):
            if language in ("sh", "bash", "shell"):
                for line in block.replace("\\\n", " ").splitlines():
                    found.append((str(doc.relative_to(REPO)), line))
    parser = build_parser()
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    for name, sub in commands.choices.items():
        parsers = [sub]
        for action in sub._actions:
            if action.dest == "dashboards_command":
                parsers += list(action.choices.values())
        for each in parsers:
            epilog = each.epilog or ""
            if EXAMPLES_HEADING in epilog:
                for line in epilog.split(EXAMPLES_HEADING, 1)[1].splitlines():
                    found.append((f"lagscope {name} --help", line))
    return found


def _lagscope_arguments(line: str) -> list[str] | None:
    """The arguments of a documented `lagscope ...` line, or None for another line."""
    if not re.match(r"\s*([A-Z_]+=\S*\s+)*(\S*/)?lagscope\s", line):
        return None  # output, or another program
    words = shlex.split(line.split(" # ")[0].split("   #")[0], comments=False)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]  # VAR=value before the command
    if not words or not words[0].endswith("lagscope") or words[0] == "lagscope-logs":
        return None
    for stop in ("|", ">", "2>", "&&"):
        if stop in words:
            words = words[: words.index(stop)]
    return words[1:]


def _command_lines() -> list[tuple[str, str]]:
    return [
        (where, shlex.join(arguments))
        for where, line in _documented_lines()
        if (arguments := _lagscope_arguments(line)) is not None
    ]


COMMAND_LINES = _command_lines()


def test_command_lines_are_found() -> None:
    wheres = {where for where, _ in COMMAND_LINES}
    assert {
        "README.md",
        "deploy/README.md",
        "lagscope run --help",
        "lagscope stream --help",
    } <= wheres
    assert len(COMMAND_LINES) >= 30


@pytest.mark.parametrize("where,line", COMMAND_LINES, ids=[f"{w}: {c}" for w, c in COMMAND_LINES])
def test_every_command_line_shown_is_accepted(where: str, line: str) -> None:
    parser = build_parser()
    try:
        args = parser.parse_args(shlex.split(line))
    except SystemExit:
        pytest.fail(f"{where}: `lagscope {line}` is refused by the CLI")
    assert args.handler is not None
