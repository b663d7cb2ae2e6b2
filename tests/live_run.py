"""Following a real torch job live with both hosts, as an on-call engineer meets it: the job
runs, `lagscope run --follow` and `lagscope stream` -> the real broker -> two `lagscope
worker`s analyse its logs while it writes them, into one shared store (the ClickHouse HTTP
interface over chDB, `tests.chdb_http_server`), and the store is polled as Grafana would,
every quarter second. Used by tests/test_live.py and the episode bench."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lagscope.dashboards.alerts import RULES
from lagscope.producers.events import decode_batch
from lagscope.producers.log import KIND_BATCH, RankLogReader, Record, list_rank_dirs
from lagscope.store.errors import StoreError
from lagscope.store.rows import episode_version
from lagscope.store.sink import ClickHouseSink
from tests.worker_util import (
    WorkerProcess,
    create_topics,
    start_store_server,
    start_streamer,
    start_worker,
)

EPISODE_RULE = next(rule for rule in RULES if rule.uid == "lagscope-episode-open")
#: The hosts start before the job and exit this long after its last record, a fallback:
#: they are stopped once the job is concluded. A job's processes take several seconds to
#: start, over 20 on a machine whose cores are all busy (the streamer and the workers
#: exited before the first record of a 4-rank job beside two CPU burners).
_HOSTS_IDLE_EXIT_S = 60.0


@dataclass
class Seen:
    """What one host's store showed over the run."""

    #: (last closed step, episodes rows) at each poll.
    polls: list[tuple[int, list[dict[str, Any]]]] = field(default_factory=list)
    #: Last closed step at each poll where the episode alert fired, and its rows.
    fired: list[tuple[int, list[dict[str, Any]]]] = field(default_factory=list)
    #: Wall-clock time of each poll (epoch seconds), in the order of `polls`.
    poll_times: list[float] = field(default_factory=list)
    #: When each step began (epoch seconds), read from the store at the end.
    step_starts: dict[int, float] = field(default_factory=dict)
    #: The job's verdict at the end: cause and summary.
    verdict: tuple[str, str] = ("", "")
    #: At the end, the uids of the alert rules that fire for the job.
    rules_firing: list[str] = field(default_factory=list)
    #: At the end, the job's row: how many of its ranks said they ended, and whether the
    #: job did (all of them).
    ended: tuple[int, bool] = (0, False)
    #: Whether the job's final diagnosis was in the store while the hosts still ran.
    concluded: bool = False
    #: step -> when the host had its last batch and when it made its rows (epoch s).
    received: dict[int, float] = field(default_factory=dict)
    processed: dict[int, float] = field(default_factory=dict)
    #: step -> when the store first held it (with `arrivals`: watched every 50 ms), and
    #: when it first held an episode, with that episode's first_seen step.
    stored: dict[int, float] = field(default_factory=dict)
    first_episode: tuple[float, int] | None = None


@dataclass
class LogArrivals:
    """When each rank's steps reached its log (epoch seconds, read every `period_s`): how
    long the timer held them, apart from how long the hosts took."""

    #: rank -> step -> when it was first readable.
    at: dict[int, dict[int, float]] = field(default_factory=dict)
    #: rank -> step -> when it ended on the rank (its last op's end, epoch seconds).
    ended: dict[int, dict[int, float]] = field(default_factory=dict)
    period_s: float = 0.1

    def step_in_log(self, step: int) -> float | None:
        """When the last rank's batch of `step` reached its log; None if one never did."""
        times = [steps.get(step) for steps in self.at.values()]
        return max(times) if times and None not in times else None  # type: ignore[type-var]


def start_training(
    module: str, logs: Path, job: str, steps: int, knobs: Sequence[str], log_path: Path
) -> subprocess.Popen:
    """The test's torch job (`module`, tests/torch_jobs) writing its rank logs to `logs`,
    its output to `log_path`."""
    with open(log_path, "wb") as job_log:
        return subprocess.Popen(
            [sys.executable, "-m", module, "--log-dir", str(logs), "--job-id", job,
             "--steps", str(steps), "--block-ms", "2", *knobs],
            stdout=job_log, stderr=subprocess.STDOUT,
        )  # fmt: skip


def _watch_logs(logs: Path, arrivals: LogArrivals, stop: threading.Event) -> None:
    readers: dict[Path, RankLogReader] = {}
    while not stop.wait(arrivals.period_s):
        for directory in list_rank_dirs(logs):
            readers.setdefault(directory, RankLogReader(directory, torn_grace_s=60.0))
        now = time.time()
        for reader in readers.values():
            for item in reader.read(1 << 30):
                if isinstance(item, Record) and item.kind == KIND_BATCH:
                    batch = decode_batch(item.payload)
                    arrivals.at.setdefault(batch.rank, {}).setdefault(batch.step, now)
                    end = int((batch.start_ns + batch.duration_ns).max()) / 1e9
                    arrivals.ended.setdefault(batch.rank, {})[batch.step] = end


def _watch_store(dsn: str, job: str, seen: Seen, stop: threading.Event) -> None:
    """Note when each step is first in the store: one cheap query every 50 ms, apart
    from the polls' (whose three queries on two stores take a second on a busy machine)."""
    sink = ClickHouseSink(dsn)
    try:
        while not stop.wait(0.05):
            try:
                _, rows = sink.query(
                    "SELECT (SELECT max(step) FROM steps WHERE job_id = {job:String}), "
                    "(SELECT count() FROM steps WHERE job_id = {job:String}), "
                    "(SELECT min(first_seen_step) FROM episodes WHERE job_id = {job:String}), "
                    "(SELECT count() FROM episodes WHERE job_id = {job:String})",
                    {"job": job},
                )
            except Exception:  # the tables appear when a host first writes
                continue
            now = time.time()
            last, count, first_seen, episodes = rows[0]
            if count:
                for step in range(max(seen.stored, default=-1) + 1, int(last) + 1):
                    seen.stored[step] = now
            if episodes and seen.first_episode is None:
                seen.first_episode = (now, int(first_seen))
    finally:
        sink.close()


def _poll(sink: ClickHouseSink, job: str, seen: Seen) -> None:
    try:
        # The alert rule first: what it reads is at most the steps read after it, so a
        # write landing between two reads never dates an alert before its episode's step
        # (read last, it dated one alert at step 1, the write before its episode's).
        names, rows = sink.query(EPISODE_RULE.sql)
        alerts = [dict(zip(names, row, strict=True)) for row in rows]
        names, rows = sink.query(
            "SELECT episode_id, state, dp_rank, pp_rank, cause, optype, node, onset_step, "
            "recovery_step, first_seen_step FROM episodes FINAL WHERE job_id = {job:String}",
            {"job": job},
        )
        episodes = [dict(zip(names, row, strict=True)) for row in rows]
        # The last step after the episodes, and at least the step an episode was seen
        # at: the sink inserts a write's `steps` last (the exactly-once marker), so a
        # poll between its inserts reads the episode beside the previous write's steps
        # (an episode first seen at step 19 read beside step 1 that way).
        _, rows = sink.query(
            "SELECT max(step) FROM steps WHERE job_id = {job:String}", {"job": job}
        )
        last = int(rows[0][0]) if rows and rows[0][0] is not None else -1
        last = max([last, *(int(e["first_seen_step"]) for e in episodes)])
    except Exception:  # the tables appear when a host first writes
        return
    seen.polls.append((last, episodes))
    seen.poll_times.append(time.time())
    firing = [a for a in EPISODE_RULE.firing(alerts) if a["job_id"] == job]
    if firing:
        seen.fired.append((last, firing))


def follow_live(tmp_path: Path, bootstrap: str, topics: dict[str, str], job: str,
                knobs: list[str], *, module: str = "tests.torch_jobs.pipeline_1f1b",
                steps: int = 60, arrivals: LogArrivals | None = None,
                poll_s: float = 0.25, watch_stored: bool = False) -> dict[str, Seen]:  # fmt: skip
    """Run the job, both hosts following it, polling the store every `poll_s`; returns
    what each host's database showed. With `arrivals`, the logs are read as well, to note
    when each step reached them; with `watch_stored`, each store's stored steps and first
    episode every 50 ms (`Seen.stored`, `Seen.first_episode`)."""
    server = start_store_server(tmp_path / "store")
    processes: list[WorkerProcess] = []
    stop = threading.Event()
    try:
        databases = {"embedded": server.dsn("live_embedded"), "kafka": server.dsn("live_kafka")}
        sinks = {name: ClickHouseSink(dsn) for name, dsn in databases.items()}
        for sink in sinks.values():
            sink.ensure_schema()
        logs = tmp_path / "logs"
        logs.mkdir()
        if arrivals is not None:
            watching = threading.Thread(target=_watch_logs, args=(logs, arrivals, stop),
                                        daemon=True)  # fmt: skip
            watching.start()
        create_topics(bootstrap, topics)
        # The hosts first, as on a cluster where they run before any job: the workers
        # joined their group and the followers wait for the job's logs.
        for index in range(2):
            processes.append(
                start_worker(
                    bootstrap,
                    topics,
                    tmp_path / f"worker-{index}",
                    group=job,
                    exit_when_idle_s=_HOSTS_IDLE_EXIT_S,
                    dsn=databases["kafka"],
                )
            )
        deadline = time.monotonic() + 120
        while not all("newly assigned partitions" in p.log() for p in processes):
            assert all(p.process.poll() is None for p in processes), processes[0].log()[-3000:]
            assert time.monotonic() < deadline, "the workers joined no group in 120 s"
            time.sleep(0.2)
        streaming = start_streamer(
            bootstrap, topics, logs, tmp_path / "stream", idle_exit_s=_HOSTS_IDLE_EXIT_S
        )
        processes.append(streaming)
        with open(tmp_path / "run.log", "wb") as run_log:
            following = subprocess.Popen(
                [sys.executable, "-m", "lagscope.cli", "run", "--log-dir",
                 str(logs), "--follow", "--idle-exit-s", str(_HOSTS_IDLE_EXIT_S), "--dsn",
                 databases["embedded"]],
                stdout=run_log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        processes.append(WorkerProcess(following, tmp_path / "run.log"))
        training = start_training(module, logs, job, steps, knobs, tmp_path / "job.log")
        seen = {name: Seen() for name in databases}
        if watch_stored:
            for name, dsn in databases.items():
                threading.Thread(target=_watch_store, args=(dsn, job, seen[name], stop),
                                 daemon=True).start()  # fmt: skip
        stopping = False
        while training.poll() is None or any(p.process.poll() is None for p in processes):
            for name, sink in sinks.items():
                _poll(sink, job, seen[name])
            if training.poll() is not None and not stopping:
                # A host concludes a job once all its ranks said they ended: when both
                # stores hold that final answer, the hosts have nothing left to do, and are
                # stopped as an operator would rather than left to fall idle.
                for name, sink in sinks.items():
                    seen[name].concluded = seen[name].concluded or _concluded(sink, job, steps)
                if all(found.concluded for found in seen.values()):
                    # Not the follower: it ends by itself once every rank said it ended,
                    # its final answer the last thing it stores (stopped while it prints
                    # its summary, it died of the signal).
                    for process in processes:
                        if process.process is not following:
                            process.process.terminate()
                    stopping = True
            assert time.monotonic() < deadline + 300, "the live run did not end"
            time.sleep(poll_s)
        assert training.returncode == 0, (tmp_path / "job.log").read_text()[-3000:]
        for process in processes:
            assert process.wait(30) == 0, process.log()[-3000:]
        for name, sink in sinks.items():
            _poll(sink, job, seen[name])
            seen[name].verdict = _verdict(sink, job)
            _, rows = sink.query(
                "SELECT step, toUnixTimestamp64Milli(ts) / 1000 FROM steps FINAL "
                "WHERE job_id = {job:String}",
                {"job": job},
            )
            seen[name].step_starts = {int(step): float(at) for step, at in rows}
            _, rows = sink.query(
                "SELECT step, toUnixTimestamp64Milli(processed_at) / 1000 FROM steps FINAL "
                "WHERE job_id = {job:String}",
                {"job": job},
            )
            seen[name].processed = {int(step): float(at) for step, at in rows}
            try:
                _, rows = sink.query(
                    "SELECT step, toUnixTimestamp64Milli(received_at) / 1000 FROM steps FINAL "
                    "WHERE job_id = {job:String} AND received_at IS NOT NULL",
                    {"job": job},
                )
            except StoreError:  # a build before the column: the bench's "before"
                rows = []
            seen[name].received = {int(step): float(at) for step, at in rows}
            seen[name].rules_firing = _rules_firing(sink, job)
            _, rows = sink.query(
                "SELECT ranks_ended, ended_at IS NOT NULL FROM jobs FINAL "
                "WHERE job_id = {job:String}",
                {"job": job},
            )
            seen[name].ended = (int(rows[0][0]), bool(rows[0][1])) if rows else (0, False)
        return seen
    finally:
        stop.set()
        for process in processes:
            if process.process.poll() is None:
                process.process.kill()
        server.stop()


def _concluded(sink: ClickHouseSink, job: str, steps: int) -> bool:
    """Whether the store holds the job's final diagnosis, made at its last step."""
    _, rows = sink.query(
        "SELECT max(version) FROM diagnoses WHERE job_id = {job:String}", {"job": job}
    )
    return (
        bool(rows)
        and rows[0][0] is not None
        and int(rows[0][0]) == episode_version(steps - 1, final=True)
    )


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


def first_named(seen: Seen, worker: tuple[int, int]) -> tuple[int, float, dict] | None:
    """The first poll at which an episode named `worker`: the job's last closed step then,
    the poll's wall-clock time, and the episode's row; None if it never was."""
    for (last, episodes), at in zip(seen.polls, seen.poll_times, strict=True):
        for episode in episodes:
            if (episode["dp_rank"], episode["pp_rank"]) == worker:
                return last, at, episode
    return None
