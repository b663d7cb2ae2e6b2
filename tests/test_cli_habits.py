"""The command-line habits a new user expects, one test per defect of issue 15: examples and
defaults in --help, one name per concept, `-` for stdout, one-line errors with the exit
code of their kind (2 for the command line, 1 for the data), no store from a mistyped
directory, one default store, plain progress off a terminal, Ctrl-C that keeps the work."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lagscope.cli import build_parser, main
from lagscope.cli.conventions import EXAMPLES_HEADING
from lagscope.simulator.defaults import BOCD_WARMUP
from tests.conftest import REFERENCE_TRACES

LAGSCOPE = [sys.executable, "-m", "lagscope.cli"]
ST_TRACE = str(REFERENCE_TRACES / "trace-ST.parquet")
ST_META = str(REFERENCE_TRACES / "meta-ST.yaml")


def all_command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser by its command line ("dashboards build", ...)."""
    found: dict[str, argparse.ArgumentParser] = {}

    def walk(prefix: str, parser: argparse.ArgumentParser) -> None:
        subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subcommands:
            found[prefix] = parser
            return
        for name, child in subcommands[0].choices.items():
            walk(f"{prefix} {name}".strip(), child)

    walk("", build_parser())
    return found


def visible_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        action
        for action in parser._actions
        if action.option_strings and action.help != argparse.SUPPRESS
    ]


COMMANDS = sorted(all_command_parsers())


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_help_has_examples_and_help_on_every_option(command: str) -> None:
    parser = all_command_parsers()[command]
    text = parser.format_help()
    examples = text[text.index(EXAMPLES_HEADING) :].splitlines()[1:]
    assert examples and all(
        line.strip().startswith("lagscope ") or "=" in line for line in examples
    )
    assert any(f"lagscope {command}" in line for line in examples), examples
    undocumented = [a.option_strings[0] for a in visible_options(parser) if not a.help]
    assert not undocumented, f"lagscope {command}: no help text on {undocumented}"


def test_defaults_are_shown_and_empty_defaults_are_not() -> None:
    parsers = all_command_parsers()
    run_help = " ".join(parsers["run"].format_help().split())
    assert "is waited for) (default: 30.0)" in run_help  # --idle-exit-s
    analyze_help = " ".join(parsers["analyze"].format_help().split())
    # --decompose-threshold: the default, and where a setting overrides it
    assert "reaches this (default: 1.03, or the settings' processor" in analyze_help
    changepoints_help = " ".join(parsers["changepoints"].format_help().split())
    assert f"before detection (default: {BOCD_WARMUP})" in changepoints_help  # --warmup
    for command, parser in parsers.items():
        text = parser.format_help()
        assert "default: None" not in text and "default: False" not in text, command


def test_one_name_per_concept_across_commands() -> None:
    """The same thing has the same option everywhere; the old names are not shown."""
    names = {
        command: {s for a in visible_options(parser) for s in a.option_strings}
        for command, parser in all_command_parsers().items()
    }
    for old in ("--logs", "--bootstrap", "--exit-when-idle-s"):
        assert not [c for c, shown in names.items() if old in shown], old
    assert {"run", "stream", "replay"} <= {c for c, n in names.items() if "--log-dir" in n}
    assert {"worker", "stream", "replay"} <= {
        c for c, n in names.items() if "--bootstrap-servers" in n
    }
    assert {"run", "stream", "worker"} <= {c for c, n in names.items() if "--idle-exit-s" in n}


def test_old_option_names_still_work_for_one_release(capsys: pytest.CaptureFixture) -> None:
    parser = build_parser("worker")
    args = parser.parse_args(["worker", "--bootstrap", "k:9092", "--exit-when-idle-s", "3"])
    assert (args.bootstrap_servers, args.idle_exit_s) == ("k:9092", 3.0)
    args = build_parser("run").parse_args(["run", "--logs", "some/dir"])
    assert args.log_dir == Path("some/dir")
    err = capsys.readouterr().err
    assert "--logs is deprecated and will be removed in the next release; use --log-dir" in err
    assert "--bootstrap is deprecated" in err and "use --bootstrap-servers" in err
    assert "--exit-when-idle-s is deprecated" in err and "use --idle-exit-s" in err


def test_dash_means_stdout_for_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["analyze", "--trace", ST_TRACE, "--meta", ST_META, "--json", "-"]) == 0
    out, err = capsys.readouterr()
    document = json.loads(out)  # stdout holds the JSON and nothing else
    assert document["slowdown"] > 1.0
    assert "lagscope analyze:" in err and "result written to stdout" in err
    assert not (tmp_path / "-").exists()


def test_dash_means_stdout_for_changepoints_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    rows = [f"a,{i},{1.0 if i < 30 else 1.5}" for i in range(60)]
    (tmp_path / "series.csv").write_text("series,index,value\n" + "\n".join(rows) + "\n")
    assert main(["changepoints", "--input", "series.csv", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    changes = json.loads(out)
    assert [(c["series"], c["kind"], c["index"]) for c in changes] == [("a", "onset", 30)]
    assert "onset" in err  # the table moved to stderr
    assert not (tmp_path / "-").exists()


def test_two_outputs_on_stdout_is_a_usage_error(capsys: pytest.CaptureFixture) -> None:
    code = main(["analyze", "--trace", ST_TRACE, "--meta", ST_META, "--json", "-", "--report", "-"])
    assert code == 2
    assert capsys.readouterr().err == (
        "lagscope analyze: error: --json, --report: only one output can go to stdout ('-')\n"
    )


def test_a_parquet_file_given_as_meta_is_one_line_exit_1(capsys: pytest.CaptureFixture) -> None:
    assert main(["analyze", "--trace", ST_TRACE, "--meta", ST_TRACE]) == 1
    assert capsys.readouterr().err == (
        f"lagscope analyze: error: {ST_TRACE}: not a yaml text file (not UTF-8 text)\n"
    )


def test_heatmap_in_a_format_it_cannot_draw_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out.txt"
    code = main(["analyze", "--trace", ST_TRACE, "--meta", ST_META, "--heatmap", str(out)])
    assert code == 2
    err = capsys.readouterr().err
    assert err == (
        f"lagscope analyze: error: --heatmap {out}: cannot draw a .txt file; use one of "
        ".png, .svg, .pdf, or '-' for PNG on stdout\n"
    )
    assert not out.exists()


def test_an_unreadable_input_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["analyze", "--trace", ST_TRACE, "--meta", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (
        f"lagscope analyze: error: {tmp_path}: cannot read (Is a directory)\n"
    )


def test_an_unwritable_output_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    target = blocker / "result.json"
    code = main(["analyze", "--trace", ST_TRACE, "--meta", ST_META, "--json", str(target)])
    assert code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"lagscope analyze: error: --json {target}: cannot write (File exists)"]


def lagscope(*args: str, cwd: Path, **kwargs) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "LAGSCOPE_CLICKHOUSE_DSN"}
    return subprocess.run(
        [*LAGSCOPE, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
        **kwargs,
    )  # fmt: skip


def test_run_on_a_missing_log_dir_creates_no_store(tmp_path: Path) -> None:
    done = lagscope("run", "--log-dir", "no/such/dir", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == "lagscope run: error: --log-dir no/such/dir: does not exist\n"
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def st_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    logs = tmp_path_factory.mktemp("st-logs")
    done = subprocess.run(
        [*LAGSCOPE, "replay", "--trace", ST_TRACE, "--meta", ST_META, "--log-dir", str(logs),
         "--job-id", "st", "--no-progress"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return logs


def test_run_and_query_share_the_default_store_and_progress_is_plain_lines(
    tmp_path: Path, st_logs: Path
) -> None:
    ran = lagscope("run", "--log-dir", str(st_logs), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "store: chdb://./lagscope-data/chdb" in ran.stdout
    # stderr is a pipe: one plain progress line at the end, no carriage-return redraws.
    assert "\r" not in ran.stderr
    assert ran.stderr.splitlines()[-1].startswith("pipeline: ")
    queried = lagscope(
        "query", "--format", "csv", "SELECT job_id, count() FROM steps FINAL GROUP BY job_id",
        cwd=tmp_path,
    )  # fmt: skip
    assert queried.returncode == 0, queried.stderr
    assert queried.stdout.splitlines()[1] == "st,32"


@pytest.mark.slow  # a followed run interrupted (~5 s)
@pytest.mark.parametrize(
    ("stop", "said"), [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated")]
)
def test_ctrl_c_or_sigterm_while_following_keeps_the_work_and_says_so(
    tmp_path: Path, st_logs: Path, stop: signal.Signals, said: str
) -> None:
    """Ctrl-C (a user) or SIGTERM (a scheduler, an orchestrator) stops `--follow`: what was
    read is analysed, stored and summed up, and the exit status is the signal's."""
    import shutil

    from lagscope.producers.events import JobInfo
    from lagscope.producers.log import KIND_JOB, LogWriter

    # ST's replay ended its job; a second job still running keeps the command following.
    logs = tmp_path / "logs"
    shutil.copytree(st_logs, logs)
    running = JobInfo(job_id="running", dp_size=1, pp_size=1, world_size=1)
    with LogWriter(logs, 999) as writer:
        writer.append(KIND_JOB, running.model_dump_json().encode())
    env = {k: v for k, v in os.environ.items() if k != "LAGSCOPE_CLICKHOUSE_DSN"}
    command = [*LAGSCOPE, "run", "--log-dir", str(logs), "--follow", "--idle-exit-s", "120"]
    # A suite started in the background (`cmd &`, nohup) hands its children SIGINT ignored,
    # and Python then installs no handler: give the command the default a terminal gives.
    with subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    ) as process:  # fmt: skip
        # The schema's last migration is the sign the command is following the logs.
        deadline = time.monotonic() + 120
        store = tmp_path / "lagscope-data" / "chdb"
        while not store.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(4.0)
        process.send_signal(stop)
        out, err = process.communicate(timeout=120)
    assert process.returncode == 128 + stop, err
    assert err.splitlines()[-1] == f"lagscope run: {said}"
    assert "job st attempt 0: 32 steps closed" in out
    assert "Traceback" not in err


@pytest.mark.slow  # a job that starts after the idle exit (~10 s)
def test_following_waits_for_a_job_that_starts_later_than_the_idle_exit(
    tmp_path: Path, st_logs: Path
) -> None:
    """`lagscope run --follow` started before the job (as a user starts it, then launches
    the job, which loads its data first): the idle exit counts from the job's first
    record, not from the command's start, so a late job is analysed, not missed."""
    import shutil

    logs = tmp_path / "logs"
    logs.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "LAGSCOPE_CLICKHOUSE_DSN"}
    command = [*LAGSCOPE, "run", "--log-dir", str(logs), "--follow", "--idle-exit-s", "2"]
    with subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    ) as process:  # fmt: skip
        time.sleep(5.0)  # more than twice the idle exit
        assert process.poll() is None, process.communicate()
        # Each rank's directory appears whole (a rename), as a job's first seal would.
        for rank_dir in sorted(st_logs.iterdir()):
            staged = tmp_path / f"staged-{rank_dir.name}"
            shutil.copytree(rank_dir, staged)
            staged.rename(logs / rank_dir.name)
        out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    assert f"waiting for the job's rank logs under {logs}" in err.splitlines()[0]
    assert "job st attempt 0: 32 steps closed" in out


@pytest.mark.slow  # waits out the idle exit (~12 s)
def test_stream_without_kafka_says_so_once_and_honours_idle_exit(
    tmp_path: Path, st_logs: Path
) -> None:
    """Port 9 (discard) has no listener: librdkafka fails every connection attempt."""
    checkpoint = tmp_path / "checkpoint.json"
    began = time.monotonic()
    done = lagscope(
        "stream", "--log-dir", str(st_logs), "--bootstrap-servers", "127.0.0.1:9",
        "--checkpoint", str(checkpoint), "--idle-exit-s", "2",
        cwd=tmp_path,
    )  # fmt: skip
    took = time.monotonic() - began
    # Nothing was delivered: not a success, or an orchestrator would clean up the logs.
    assert done.returncode == 1, done.stderr
    # ensure_topics waits 10 s for a broker, then idleness counts through the outage.
    assert took < 40, took
    lines = done.stderr.splitlines()
    assert len(lines) == 3, done.stderr
    assert "Kafka at 127.0.0.1:9 does not answer" in lines[0]
    assert "Kafka at 127.0.0.1:9 did not answer for" in lines[1]
    assert "stay in the logs and are sent on the next run" in lines[1]
    stats = json.loads(done.stdout)
    assert stats["kafka_connect_failures"] > 0 and stats["kafka_unreachable_s"] > 2
    assert json.loads(checkpoint.read_text())["positions"] == {}  # nothing confirmed
    log_bytes = sum(f.stat().st_size for f in st_logs.rglob("*.lglog"))
    assert stats["unshipped_bytes"] == log_bytes > 0
    assert lines[2] == (
        f"lagscope stream: error: {log_bytes:,} bytes of the logs under {st_logs} were not "
        "delivered to Kafka at 127.0.0.1:9; they stay in the logs and the next run sends them "
        f"(checkpoint {checkpoint})"
    )


def _stream_topics(kafka_topics: dict[str, str]) -> list[str]:
    return [f"--{name.replace('_', '-')}={topic}" for name, topic in kafka_topics.items()]


def test_stream_whose_log_dir_never_appears_fails_saying_so(
    tmp_path: Path, kafka_bootstrap: str, kafka_topics: dict[str, str]
) -> None:
    """A wrong --log-dir is waited for (the job may create it later), and at the idle exit
    it is a failure, not a sidecar that shipped everything; the path is not created."""
    done = lagscope(
        "stream", "--log-dir", "typo/logs", "--bootstrap-servers", kafka_bootstrap,
        *_stream_topics(kafka_topics), "--idle-exit-s", "1", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-1] == (
        "lagscope stream: error: --log-dir typo/logs never appeared; nothing was shipped"
    )
    assert not (tmp_path / "typo").exists()


def test_stream_of_an_empty_log_dir_with_kafka_up_is_done(
    tmp_path: Path, kafka_bootstrap: str, kafka_topics: dict[str, str]
) -> None:
    """The control: a job that has not written yet, a Kafka that answered, nothing owed."""
    (tmp_path / "logs").mkdir()
    done = lagscope(
        "stream", "--log-dir", "logs", "--bootstrap-servers", kafka_bootstrap,
        *_stream_topics(kafka_topics), "--idle-exit-s", "1", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "error" not in done.stderr


@pytest.mark.slow  # ensure_topics waits 10 s for a broker
def test_stream_whose_kafka_never_answers_fails_even_with_nothing_to_ship(
    tmp_path: Path,
) -> None:
    (tmp_path / "logs").mkdir()
    done = lagscope(
        "stream", "--log-dir", "logs", "--bootstrap-servers", "127.0.0.1:9",
        "--idle-exit-s", "1", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-1] == (
        "lagscope stream: error: Kafka at 127.0.0.1:9 never answered; nothing was shipped"
    )


def test_stream_on_a_file_for_its_log_dir_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "logs").write_text("not a directory")
    done = lagscope("stream", "--log-dir", "logs", "--idle-exit-s", "1", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == "lagscope stream: error: --log-dir logs: is not a directory\n"
