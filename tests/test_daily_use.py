"""Trust in daily use (issue 27), each case run as a user would, the CLI as a process: no
command deletes or overwrites what it did not write, and none reports success on nothing
or turns a reader that left early into a failure."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lagscope.cli.conventions import OUTPUT_MARK
from lagscope.producers.config import KafkaSettings, LagscopeConfig, StreamerSettings
from lagscope.producers.events import JobInfo
from lagscope.producers.streamer import Streamer
from lagscope.producers.timer import OpTimer

REFERENCE = Path(__file__).resolve().parent / "data" / "reference-traces"
ST_TRACE, ST_META = REFERENCE / "trace-ST.parquet", REFERENCE / "meta-ST.yaml"


def lagscope(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lagscope", *args],
        capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False,
    )  # fmt: skip


def one_error_line(done: subprocess.CompletedProcess, command: str) -> str:
    lines = done.stderr.strip().splitlines()
    assert lines and lines[-1].startswith(f"lagscope {command}: error: "), done.stderr
    assert "Traceback" not in done.stderr
    return lines[-1]


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


# -- files ---------------------------------------------------------------------------------


@pytest.mark.parametrize("out", ["precious", "."])
def test_demo_refuses_a_folder_of_someone_elses_files(tmp_path: Path, out: str) -> None:
    folder = tmp_path / out
    folder.mkdir(exist_ok=True)
    (folder / "thesis.txt").write_text("four years of work")
    (folder / "logs").mkdir()  # even a name the demo would use is not the demo's here
    (folder / "logs" / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    done = lagscope("demo", "--out", out, "--steps", "20", cwd=tmp_path)
    assert done.returncode == 2
    line = one_error_line(done, "demo")
    assert f"--out {out}: holds files lagscope demo did not write" in line
    assert "logs, thesis.txt" in line
    assert tree(tmp_path) == before and not (folder / OUTPUT_MARK).exists()


@pytest.mark.slow  # the demo run twice (~7 s)
def test_demo_reruns_replace_only_its_own_outputs(tmp_path: Path) -> None:
    first = lagscope("demo", "--out", "demo", "--steps", "20", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    out = tmp_path / "demo"
    assert json.loads((out / OUTPUT_MARK).read_text()) == {"written_by": "lagscope demo"}
    report = (out / "report.html").stat().st_mtime_ns
    time.sleep(0.01)
    again = lagscope("demo", "--out", "demo", "--steps", "20", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert (out / "report.html").stat().st_mtime_ns > report
    assert {p.name for p in out.iterdir()} == {OUTPUT_MARK, "logs", "chdb", "report.html"}
    # a file of the user's among the demo's outputs: the next run touches nothing
    (out / "notes.md").write_text("what I saw")
    before = tree(out)
    refused = lagscope("demo", "--out", "demo", "--steps", "20", cwd=tmp_path)
    assert refused.returncode == 2
    assert "(notes.md)" in one_error_line(refused, "demo")
    assert tree(out) == before


@pytest.mark.slow  # the demo run (~4 s)
def test_demo_takes_over_a_demo_folder_of_an_older_version(tmp_path: Path) -> None:
    """out/demo of a version that wrote no mark: recognised by its layout, not refused."""
    out = tmp_path / "out" / "demo"
    (out / "logs" / "rank-000000").mkdir(parents=True)
    (out / "logs" / "rank-000000" / "00-0000.lglog").write_bytes(b"old")
    (out / "chdb").mkdir()
    (out / "report.html").write_text("<html>old</html>")
    done = lagscope("demo", "--steps", "20", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert not (out / "logs" / "rank-000000" / "00-0000.lglog").exists()
    assert "old" not in (out / "report.html").read_text()


@pytest.mark.slow  # the demo run (~5 s)
def test_the_demo_job_reads_ended_once_the_demo_is_done(tmp_path: Path) -> None:
    """Every rank of the demo's 128-GPU job says it ended, the 96 TP ranks the analysis
    does not read too (as a real job's do): a demo left behind in a store is a finished
    job, not a silent one that pages."""
    assert lagscope("demo", "--out", "demo", "--steps", "20", cwd=tmp_path).returncode == 0
    assert len(list((tmp_path / "demo" / "logs").iterdir())) == 128
    done = lagscope(
        "query", "--dsn", f"chdb://{tmp_path / 'demo' / 'chdb'}", "--format", "json",
        "SELECT world_size, ranks_ended, ended_at IS NOT NULL AS ended FROM jobs FINAL",
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [{"world_size": 128, "ranks_ended": 128, "ended": 1}]


@pytest.mark.parametrize("output", ["--json", "--report", "--timeline"])
def test_analyze_never_writes_over_its_own_input(tmp_path: Path, output: str) -> None:
    (tmp_path / "meta.yaml").write_bytes(ST_META.read_bytes())
    (tmp_path / "trace.parquet").write_bytes(ST_TRACE.read_bytes())
    before = tree(tmp_path)
    target = "meta.yaml" if output == "--json" else "./trace.parquet"
    done = lagscope("analyze", "--trace", "trace.parquet", "--meta", "meta.yaml",
                    output, target, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2
    source = "--meta" if output == "--json" else "--trace"
    assert f"{output} {target}: is the command's input ({source})" in one_error_line(
        done, "analyze"
    )
    assert tree(tmp_path) == before


def test_generate_never_overwrites_a_trace_it_did_not_write(tmp_path: Path) -> None:
    recorded = tmp_path / "recorded"
    recorded.mkdir()
    (recorded / "trace.parquet").write_bytes(b"a real recording")
    args = ("--dp", "2", "--pp", "2", "--steps", "4", "--microbatches", "2")
    done = lagscope("generate", "--out", "recorded", *args, cwd=tmp_path)
    assert done.returncode == 2
    assert "holds files lagscope generate did not write (trace.parquet)" in one_error_line(
        done, "generate"
    )
    assert (recorded / "trace.parquet").read_bytes() == b"a real recording"
    for _ in range(2):  # a new folder, then a rerun into its own
        done = lagscope("generate", "--out", "jobs/clean", *args, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    names = {p.name for p in (tmp_path / "jobs" / "clean").iterdir()}
    assert names == {OUTPUT_MARK, "trace.parquet", "meta.yaml", "truth.json", "spec.json"}


def test_dashboards_build_never_overwrites_another_dashboard(tmp_path: Path) -> None:
    theirs = tmp_path / "job-overview.json"
    theirs.write_text(json.dumps({"uid": "team-dashboard", "title": "ours"}))
    done = lagscope("dashboards", "build", "--out", ".", "--alerts-out", "a.yaml", cwd=tmp_path)
    assert done.returncode == 2
    assert "job-overview.json: not lagscope's dashboards" in one_error_line(
        done, "dashboards build"
    )
    assert json.loads(theirs.read_text())["uid"] == "team-dashboard"
    assert not (tmp_path / "a.yaml").exists()
    theirs.unlink()
    for _ in range(2):  # its own files are replaced on a rerun
        done = lagscope("dashboards", "build", "--out", ".", "--alerts-out", "a.yaml", cwd=tmp_path)
        assert done.returncode == 0, done.stderr


def test_a_checkpoint_path_holding_another_file_is_moved_aside_not_overwritten(
    tmp_path: Path,
) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a checkpoint")
    config = LagscopeConfig(
        kafka=KafkaSettings(bootstrap_servers="127.0.0.1:9"),
        streamer=StreamerSettings(log_dir=tmp_path / "logs", checkpoint_path=notes),
    )
    streamer = Streamer(config, producer=object())
    streamer.write_checkpoint()
    (kept,) = tmp_path.glob("notes.txt.unreadable-*")
    assert kept.read_text() == "not a checkpoint"
    assert json.loads(notes.read_text())["version"] >= 1


# -- honest outcomes ---------------------------------------------------------------------


def test_run_on_a_folder_without_rank_logs_says_where_they_are(tmp_path: Path) -> None:
    replayed = lagscope("replay", "--trace", str(ST_TRACE), "--meta", str(ST_META), "--log-dir",
                        "jobs/st", "--no-progress", cwd=tmp_path)  # fmt: skip
    assert replayed.returncode == 0, replayed.stderr
    too_high = lagscope("run", "--log-dir", "jobs", cwd=tmp_path)
    assert too_high.returncode == 2
    assert one_error_line(too_high, "run") == (
        "lagscope run: error: --log-dir jobs: no rank logs in it (rank-NNNNNN/ directories); "
        "found some one level down, in jobs/st: pass one of those as --log-dir"
    )
    too_low = lagscope("run", "--log-dir", "jobs/st/rank-000000", cwd=tmp_path)
    assert too_low.returncode == 2
    assert "it is one rank's log: pass the directory that holds it, jobs/st" in one_error_line(
        too_low, "run"
    )
    (tmp_path / "empty").mkdir()
    empty = lagscope("run", "--log-dir", "empty", cwd=tmp_path)
    assert empty.returncode == 2
    assert "--log-dir empty: no rank logs in it" in one_error_line(empty, "run")
    assert "0 ops" not in too_high.stderr + too_low.stderr + empty.stderr
    # refused before the store opens: no empty store is left behind
    assert not (tmp_path / "lagscope-data").exists()


def test_run_on_logs_without_ops_fails_and_names_what_it_found(tmp_path: Path) -> None:
    """A job whose monitor recorded nothing (the Megatron order trap) leaves only job
    records behind: that is no analysis, whatever the store says."""
    info = JobInfo(job_id="silent", dp_size=1, pp_size=2, world_size=2)
    for rank in range(2):
        timer = OpTimer(job_id="silent", rank=rank, dp_rank=0, pp_rank=rank,
                        log_dir=tmp_path / "logs", mode="host", gc_probe=False,
                        job_info=info)  # fmt: skip
        timer.close()
    done = lagscope("run", "--log-dir", "logs", cwd=tmp_path)
    assert done.returncode == 1
    line = one_error_line(done, "run")
    assert line.startswith("lagscope run: error: --log-dir logs: 2 rank log(s) without a single op")
    assert "only the job record of silent attempt 0" in line
    assert "get_forward_backward_func() after lagscope.megatron.monitor" in line


def test_run_that_could_analyse_nothing_fails_and_says_why(tmp_path: Path) -> None:
    # ops without the job record that gives the job's layout
    timer = OpTimer(job_id="bare", rank=0, dp_rank=0, pp_rank=0, log_dir=tmp_path / "bare",
                    mode="host", gc_probe=False)  # fmt: skip
    for step in range(3):
        timer.step(step)
        with timer.op("forward-compute", microbatch=0):
            pass
    timer.close()
    done = lagscope("run", "--log-dir", "bare", cwd=tmp_path)
    assert done.returncode == 1
    assert "3 ops in 1 rank log(s) but no job record" in one_error_line(done, "run")
    # one rank's log of a two-rank job: every step lacks the other rank
    replayed = lagscope("replay", "--trace", str(ST_TRACE), "--meta", str(ST_META), "--log-dir",
                        "st", "--no-progress", cwd=tmp_path)  # fmt: skip
    assert replayed.returncode == 0, replayed.stderr
    (tmp_path / "half").mkdir()
    (tmp_path / "st" / "rank-000000").rename(tmp_path / "half" / "rank-000000")
    done = lagscope("run", "--log-dir", "half", cwd=tmp_path)
    assert done.returncode == 1
    line = one_error_line(done, "run")
    assert "--log-dir half: no step of any job could be analysed (job ST-0 attempt 0: 32 " in line
    assert "32 incomplete, missing (dp 0, pp 1)" in line


def test_a_second_replay_of_a_job_into_its_logs_is_refused(tmp_path: Path) -> None:
    """Each step would be recorded twice, which no step survives: the run that follows
    analysed nothing. Refused, with the fix; the logs are left as they were."""
    replay = ("replay", "--trace", str(ST_TRACE), "--meta", str(ST_META), "--log-dir", "st",
              "--no-progress")  # fmt: skip
    assert lagscope(*replay, cwd=tmp_path).returncode == 0
    before = tree(tmp_path / "st")
    again = lagscope(*replay, cwd=tmp_path)
    assert again.returncode == 2
    line = one_error_line(again, "replay")
    assert "--log-dir st: rank-000000 already holds job ST-0 attempt 0" in line
    assert "replay into an empty directory, or as another attempt (--attempt 1)" in line
    assert tree(tmp_path / "st") == before
    assert lagscope(*replay, "--attempt", "1", cwd=tmp_path).returncode == 0


def test_a_run_over_steps_recorded_twice_names_why_in_its_line(tmp_path: Path) -> None:
    """Two recordings of one job attempt in one rank log (a replay into logs that held it
    before this version refused, a streamer's logs copied twice): the line says what the
    steps table says of the first failed step."""
    for name in ("a", "b"):
        done = lagscope("replay", "--trace", str(ST_TRACE), "--meta", str(ST_META),
                        "--log-dir", name, "--no-progress", cwd=tmp_path)  # fmt: skip
        assert done.returncode == 0, done.stderr
    for rank in (tmp_path / "b").iterdir():
        for log in rank.iterdir():  # after a's files, in the readers' order
            log.rename(tmp_path / "a" / rank.name / f"9{log.name}")
    done = lagscope("run", "--log-dir", "a", cwd=tmp_path)
    assert done.returncode == 1
    line = one_error_line(done, "run")
    assert "(job ST-0 attempt 0: 32 steps, 0 incomplete; step " in line
    assert "is recorded more than once)" in line


def test_query_into_a_reader_that_leaves_early_is_quiet(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "lagscope", "query", "--dsn", "chdb://memory", "--format", "csv",
         "SELECT number FROM system.numbers LIMIT 2000000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
    )  # fmt: skip
    assert process.stdout is not None and process.stderr is not None
    assert process.stdout.readline() == b"number\n"  # `| head -1`
    process.stdout.close()
    assert process.wait(120) in (0, 141)
    assert process.stderr.read() == b""


def test_python_dash_m_lagscope_is_the_command(tmp_path: Path) -> None:
    done = lagscope("--version", cwd=tmp_path)
    assert done.returncode == 0
    from lagscope import __version__

    assert done.stdout.strip() == f"lagscope {__version__}"
    assert done.stderr == ""


@pytest.mark.parametrize(
    "args,problem",
    [
        (["run", "--log-dir", "logs", "--dsn", "chdb://./afile/store"], "cannot create"),
        (["query", "SELECT 1", "--dsn", "chdb://./no-store"], "no chDB store"),
        (["stream", "--log-dir", "logs", "--checkpoint", "afile/cp.json", "--idle-exit-s", "1",
          "--bootstrap-servers", "127.0.0.1:9"], "checkpoint afile/cp.json: cannot be read"),
        (["stream", "--log-dir", "logs", "--metrics-port", "70000"], "streamer.metrics_port"),
        (["dashboards", "push", "--url", "http://127.0.0.1:port"], "Grafana URL"),
        (["run", "--log-dir", "logs", "--report", "logs"], "--report logs: is a directory"),
    ],
)  # fmt: skip
def test_settings_that_cannot_work_end_in_one_line(
    tmp_path: Path, args: list[str], problem: str
) -> None:
    (tmp_path / "afile").write_text("a file, not a folder")
    (tmp_path / "logs" / "rank-000000").mkdir(parents=True)
    done = lagscope(*args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert problem in one_error_line(
        done, " ".join(args[:2] if args[0] == "dashboards" else args[:1])
    )


@pytest.mark.slow  # waits out the clients' broker timeouts (~7 s)
def test_a_client_that_needs_a_broker_is_told_in_one_line_when_none_answers(
    kafka_bootstrap: str,
) -> None:
    """check_kafka_reachable: the one line a worker needs instead of aiokafka's traceback
    (the streamer waits for Kafka instead)."""
    from lagscope.producers.config import ConfigError
    from lagscope.producers.kafka_login import check_kafka_reachable

    check_kafka_reachable(KafkaSettings(bootstrap_servers=kafka_bootstrap), timeout_s=20)
    unreachable = KafkaSettings(
        bootstrap_servers="127.0.0.1:9",
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="lagscope",
        sasl_password="s3cr3t-Pa55word",
    )
    began = time.monotonic()
    with pytest.raises(ConfigError, match=r"no Kafka broker answers at 127\.0\.0\.1:9") as error:
        check_kafka_reachable(unreachable, timeout_s=2)
    assert time.monotonic() - began < 10
    assert "s3cr3t" not in str(error.value) and "\n" not in str(error.value)
