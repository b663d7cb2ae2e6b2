"""Live is the answer: what an on-call engineer sees *while* a real job runs.

The real 4-process DP 2 x PP 2 1F1B job (gloo, recorded through `lagscope.torch` only)
runs, and both hosts analyse its logs while it writes them, into one shared store (the
ClickHouse HTTP interface over chDB, `tests.chdb_http_server`): `lagscope run --follow`,
and `lagscope stream` -> the real broker -> two `lagscope worker`s of one group. The
test polls the store as Grafana would, every quarter second:

- a straggler (its forward 2x slower, or its host stalling between its ops, for steps
  15-44): the `episodes` table names the worker, its machine and what it is slow in while
  it is still slow, within a few steps of its onset; the alert rule on open episodes
  fires for it then; the job's final verdict says the same;
- a healthy job: no episode, no alert, no cause, at any time.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from lagscope.dashboards.alerts import RULES
from lagscope.stream_app.sink import ClickHouseSink
from tests.worker_util import (
    WorkerProcess,
    create_topics,
    start_store_server,
    start_streamer,
    start_worker,
)

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

#: The straggler's steps (the job runs 60).
SLOW_START, SLOW_END, STEPS = 15, 45, 60
#: The worker of rank 2 in DP 2 x PP 2 (rank = dp * pp + stage).
WORKER = (1, 0)
#: On-call targets: seen within this many steps of the onset.
SEEN_WITHIN = 10
EPISODE_RULE = next(rule for rule in RULES if rule.uid == "lagscope-episode-open")


@dataclass
class Seen:
    """What one host's store showed over the run."""

    #: (last closed step, episodes rows) at each poll.
    polls: list[tuple[int, list[dict[str, Any]]]] = field(default_factory=list)
    #: Last closed step at each poll where the episode alert fired, and its rows.
    fired: list[tuple[int, list[dict[str, Any]]]] = field(default_factory=list)
    #: The job's verdict at the end: cause and summary.
    verdict: tuple[str, str] = ("", "")
    #: At the end, the uids of the alert rules that fire for the job.
    rules_firing: list[str] = field(default_factory=list)


def _poll(sink: ClickHouseSink, job: str, seen: Seen) -> None:
    try:
        _, rows = sink.query(
            "SELECT max(step) FROM steps WHERE job_id = {job:String}", {"job": job}
        )
        last = int(rows[0][0]) if rows and rows[0][0] is not None else -1
        names, rows = sink.query(
            "SELECT episode_id, state, dp_rank, pp_rank, cause, optype, node, onset_step, "
            "recovery_step, first_seen_step FROM episodes FINAL WHERE job_id = {job:String}",
            {"job": job},
        )
        episodes = [dict(zip(names, row, strict=True)) for row in rows]
        names, rows = sink.query(EPISODE_RULE.sql)
        alerts = [dict(zip(names, row, strict=True)) for row in rows]
    except Exception:  # the tables appear when a host first writes
        return
    seen.polls.append((last, episodes))
    firing = [a for a in EPISODE_RULE.firing(alerts) if a["job_id"] == job]
    if firing:
        seen.fired.append((last, firing))


def _run_live(tmp_path: Path, bootstrap: str, topics: dict[str, str], job: str,
              knobs: list[str]) -> dict[str, Seen]:  # fmt: skip
    """Run the job, both hosts following it, polling the store; returns what each host's
    database showed."""
    server = start_store_server(tmp_path / "store")
    processes: list[WorkerProcess] = []
    try:
        databases = {"embedded": server.dsn("live_embedded"), "kafka": server.dsn("live_kafka")}
        sinks = {name: ClickHouseSink(dsn) for name, dsn in databases.items()}
        for sink in sinks.values():
            sink.ensure_schema()
        logs = tmp_path / "logs"
        logs.mkdir()
        create_topics(bootstrap, topics)
        with open(tmp_path / "job.log", "wb") as job_log:
            training = subprocess.Popen(
                [sys.executable, "-m", "tests.torch_jobs.pipeline_1f1b", "--log-dir",
                 str(logs), "--job-id", job, "--steps", str(STEPS), "--block-ms", "2", *knobs],
                stdout=job_log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + 120
        while not any(logs.glob("rank-*")):
            assert training.poll() is None, (tmp_path / "job.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the job wrote no log in 120 s"
            time.sleep(0.1)
        with open(tmp_path / "run.log", "wb") as run_log:
            following = subprocess.Popen(
                [sys.executable, "-m", "lagscope.stream_app.cli", "run", "--log-dir",
                 str(logs), "--follow", "--idle-exit-s", "6", "--dsn", databases["embedded"]],
                stdout=run_log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        processes.append(WorkerProcess(following, tmp_path / "run.log"))
        processes.append(
            start_streamer(bootstrap, topics, logs, tmp_path / "stream", idle_exit_s=6.0)
        )
        for index in range(2):
            processes.append(
                start_worker(
                    bootstrap,
                    topics,
                    tmp_path / f"worker-{index}",
                    group=job,
                    exit_when_idle_s=8.0,
                    dsn=databases["kafka"],
                )
            )
        seen = {name: Seen() for name in databases}
        while training.poll() is None or any(p.process.poll() is None for p in processes):
            for name, sink in sinks.items():
                _poll(sink, job, seen[name])
            assert time.monotonic() < deadline + 300, "the live run did not end"
            time.sleep(0.25)
        assert training.returncode == 0, (tmp_path / "job.log").read_text()[-3000:]
        for process in processes:
            assert process.wait(30) == 0, process.log()[-3000:]
        for name, sink in sinks.items():
            _poll(sink, job, seen[name])
            seen[name].verdict = _verdict(sink, job)
            seen[name].rules_firing = _rules_firing(sink, job)
        return seen
    finally:
        for process in processes:
            if process.process.poll() is None:
                process.process.kill()
        server.stop()


def _verdict(sink: ClickHouseSink, job: str) -> tuple[str, str]:
    _, rows = sink.query(
        "SELECT cause, JSONExtractString(evidence, 'summary') FROM diagnoses FINAL "
        "WHERE job_id = {job:String} ORDER BY step DESC, version DESC LIMIT 1",
        {"job": job},
    )
    return rows[0]


def _rules_firing(sink: ClickHouseSink, job: str) -> list[str]:
    firing = []
    for rule in RULES:
        names, rows = sink.query(rule.sql)
        found = [dict(zip(names, row, strict=True)) for row in rows]
        if any(r.get("job_id") == job for r in rule.firing(found)):
            firing.append(rule.uid)
    return firing


@pytest.mark.parametrize(
    ("phase", "cause", "op"),
    [("forward", "slow_workers", "forward-compute"), ("host", "slow_host", "host")],
)
def test_a_straggler_is_named_while_it_is_still_slow(
    kafka_bootstrap: str, kafka_topics: dict[str, str], tmp_path: Path, phase: str, cause: str,
    op: str,
) -> None:  # fmt: skip
    job = f"live-{phase}"
    seen = _run_live(
        tmp_path, kafka_bootstrap, kafka_topics, job,
        ["--slow-rank", "2", "--slow-phase", phase,
         "--slow-steps", f"{SLOW_START}-{SLOW_END - 1}"],
    )  # fmt: skip
    for host, found in seen.items():
        # While the worker was still slow (the job had closed no step past its window),
        # the store named it, with what it is slow in, as an open episode ...
        open_while_slow = [
            (last, e)
            for last, episodes in found.polls
            for e in episodes
            if last < SLOW_END and e["state"] == "open"
        ]
        first_polls = [p for p in found.polls if p[1]][:3]
        assert open_while_slow, (host, first_polls, found.polls[-2:])
        _, episode = open_while_slow[0]
        assert (episode["dp_rank"], episode["pp_rank"]) == WORKER, (host, episode)
        assert (episode["cause"], episode["optype"]) == (cause, op), (host, episode)
        assert abs(episode["onset_step"] - SLOW_START) <= 3, (host, episode)
        assert episode["first_seen_step"] - SLOW_START <= SEEN_WITHIN, (host, episode)
        # ... the on-call alert fired for it then ...
        assert any(last < SLOW_END for last, _ in found.fired), (host, found.fired[:3])
        alert = found.fired[0][1][0]
        assert alert["worker"] == "(dp 1, pp 0)" and alert["op"] == op, (host, alert)
        # ... and it was the only episode, closed at its recovery by the end.
        final = found.polls[-1][1]
        assert len(final) == 1 and final[0]["state"] == "closed", (host, final)
        assert abs(final[0]["recovery_step"] - SLOW_END) <= 3, (host, final)
        # The job's verdict tells the same story.
        verdict_cause, summary = found.verdict
        assert verdict_cause == cause and "(dp 1, pp 0)" in summary, (host, summary)
        assert summary.count("(dp ") == 1, (host, summary)


def test_a_healthy_job_stays_quiet_while_it_runs(
    kafka_bootstrap: str, kafka_topics: dict[str, str], tmp_path: Path
) -> None:
    job = "live-healthy"
    seen = _run_live(tmp_path, kafka_bootstrap, kafka_topics, job, [])
    for host, found in seen.items():
        assert found.polls and found.polls[-1][0] >= STEPS - 2, (host, found.polls[-1:])
        episodes = [e for _, polled in found.polls for e in polled]
        assert episodes == [], (host, episodes[:3])
        assert found.fired == [], (host, found.fired[:3])
        assert found.verdict[0] == "none", (host, found.verdict)
        assert found.rules_firing == [], (host, found.rules_firing)
