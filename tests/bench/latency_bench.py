"""Where a step's latency goes, hop by hop, on live real jobs followed by both hosts; and how
fast a worker started behind a job catches up.

Real 4-rank torch jobs (the 1F1B job and the DDP job, each with a straggler 2x slower in
its forward for steps 15-44 of 60) are followed live by `lagscope run --follow` and by
`lagscope stream` -> the real broker -> two `lagscope worker`s (tests/live_run.py), the
logs watched every 20 ms, the stored steps every 50 ms (the store's polls, the alert
rule's, every second: each query holds the shared test store's one engine lock, which
the hosts' writes wait for). Per host, median and p95 over the
jobs' steps, each hop measured to the step's last rank:

- seal + log: from the step's end on its rank (its last op's end) to its batch readable
  in the rank's log: the timer's hand-over, the sealer's encoding and write;
- streamer (Kafka host): to the batch produced to Kafka (the record's CreateTime);
- to the host: to the host's having the step's last batch (`steps.received_at`): Kafka,
  the worker's fetch and hand-over to its core; or `lagscope run`'s reading of the logs;
- host: its windows, analysis and write cadence, to the step's rows made
  (`steps.processed_at`);
- store: to the step in the store (its stored steps watched every 50 ms);
- end to end: the step's end to the step in the store;
- the episode: the end of its detecting step (`first_seen_step`) to the episode in the
  store.

Catch-up: the 1F1B job runs 300 steps with only the streamer up; then one worker starts:
its steps per second from its first message to its last write, and how many times the
job's own pace that is. `LAGSCOPE_BENCH_LIVE_REPEAT` (default 1) runs the live jobs that
many times.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from lagscope.producers.events import peek_header
from tests.kafka_util import consume_all, measure_with_broker
from tests.live_run import LogArrivals, Seen, first_named, follow_live
from tests.worker_util import create_topics, start_streamer, start_worker

SLOW_START, SLOW_END = 15, 45
#: (job module, the straggler's rank, its (dp, pp) worker, job knobs).
JOBS = (
    ("tests.torch_jobs.pipeline_1f1b", 2, (1, 0), []),
    ("tests.torch_jobs.ddp", 1, (1, 0),
     ["--layers", "6", "--hidden", "256", "--batch", "32", "--bucket-mb", "0.3"]),
)  # fmt: skip
#: The live runs' polls (the alert rule, the episodes, the last step: their queries hold
#: the shared test store's one engine lock, and every 0.2 s they made the writes they
#: measure wait) only check which episode the store named: the steps' times come from a
#: watcher of one light query every 50 ms.
POLL_S = 1.0
HOPS = ("seal + log", "streamer", "to the host", "host", "store", "end to end")
CATCH_UP_STEPS = 300


def _topics() -> dict[str, str]:
    prefix = f"latency-{uuid.uuid4().hex[:8]}"
    return {name: f"{prefix}.{name.removeprefix('topic_')}"
            for name in ("topic_ops", "topic_jobs", "topic_deadletter")}  # fmt: skip


def _last(times: dict[int, dict[int, float]], step: int) -> float | None:
    """The latest of each rank's time for `step`; None unless every rank has one."""
    values = [by_step.get(step) for by_step in times.values()]
    if not values or None in values:
        return None
    return max(v for v in values if v is not None)


def _hops(host: str, seen: Seen, arrivals: LogArrivals,
          produced: dict[int, dict[int, float]]) -> dict[str, list[float]]:  # fmt: skip
    """Each hop's seconds over the steps every part of which was seen."""
    out: dict[str, list[float]] = {hop: [] for hop in HOPS}
    visible = seen.stored
    for step, made in seen.processed.items():
        ended = _last(arrivals.ended, step)
        logged = _last(arrivals.at, step)
        shown = visible.get(step)
        if ended is None or logged is None or shown is None:
            continue
        before_host = logged
        if host == "kafka":
            sent = _last(produced, step)
            if sent is None:
                continue
            out["streamer"].append(sent - logged)
            before_host = sent
        out["seal + log"].append(logged - ended)
        received = seen.received.get(step)  # a store before `received_at` has none
        if received is not None:
            out["to the host"].append(received - before_host)
            out["host"].append(made - received)
        out["store"].append(shown - made)
        out["end to end"].append(shown - ended)
    return out


def _episode_delay(seen: Seen, arrivals: LogArrivals, worker: tuple[int, int]) -> float | None:
    """From the end of the episode's detecting step to the episode in the store (the
    job's only episode: the straggler's, `first_named` checks)."""
    if seen.first_episode is None or first_named(seen, worker) is None:
        return None
    at, first_seen = seen.first_episode
    ended = _last(arrivals.ended, first_seen)
    return None if ended is None else at - ended


def _produced(bootstrap: str, topic: str) -> dict[int, dict[int, float]]:
    """rank -> step -> when the streamer produced its batch."""
    out: dict[int, dict[int, float]] = {}
    for message in consume_all(bootstrap, topic):
        header = peek_header(message.value)
        out.setdefault(header["rank"], {})[header["step"]] = message.timestamp_s
    return out


def _row(name: str, values: list[float], target: str) -> dict:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {
        "benchmark": name,
        "value": statistics.median(values),
        "unit": "s",
        "target": f"{target}; p95 {p95:.2f} s",
        "spread": [min(values), max(values)],
        "runs": len(values),
        "p95": p95,
    }


def _live(bootstrap: str, work: Path, repeat: int) -> list[dict]:
    hops: dict[tuple[str, str], dict[str, list[float]]] = {}
    episodes: dict[tuple[str, str], list[float]] = {}
    for index in range(repeat):
        for module, rank, worker, knobs in JOBS:
            shape = module.rsplit(".", 1)[1]
            job = f"latency-{shape}-{index}"
            topics = _topics()
            arrivals = LogArrivals(period_s=0.02)
            seen = follow_live(
                work / job, bootstrap, topics, job,
                [*knobs, "--slow-rank", str(rank), "--slow-phase", "forward",
                 "--slow-steps", f"{SLOW_START}-{SLOW_END - 1}"],
                module=module, arrivals=arrivals, poll_s=POLL_S, watch_stored=True,
            )  # fmt: skip
            produced = _produced(bootstrap, topics["topic_ops"])
            for host, found in seen.items():
                for hop, values in _hops(host, found, arrivals, produced).items():
                    hops.setdefault((shape, host), {}).setdefault(hop, []).extend(values)
                delay = _episode_delay(found, arrivals, worker)
                if delay is not None:
                    episodes.setdefault((shape, host), []).append(delay)
    rows = []
    for (shape, host), by_hop in hops.items():
        for hop in HOPS:
            if by_hop.get(hop):
                target = "<= 1 (the budget)" if hop == "end to end" else "a part of it"
                rows.append(_row(f"latency {shape} {host}: {hop} (s)", by_hop[hop], target))
        if episodes.get((shape, host)):
            rows.append(_row(f"latency {shape} {host}: detecting step's end to its episode "
                             "in the store (s)", episodes[shape, host], "<= 1"))  # fmt: skip
    return rows


def _catch_up(bootstrap: str, work: Path) -> list[dict]:
    """The job's backlog in Kafka before any worker; one worker started: its pace."""
    topics = _topics()
    create_topics(bootstrap, topics)
    logs = work / "catch-up" / "logs"
    logs.mkdir(parents=True)
    job = "latency-catch-up"
    began = time.monotonic()
    training = subprocess.run(
        [sys.executable, "-m", "tests.torch_jobs.pipeline_1f1b", "--log-dir", str(logs),
         "--job-id", job, "--steps", str(CATCH_UP_STEPS), "--block-ms", "2"],
        capture_output=True, text=True, timeout=900, check=True,
    )  # fmt: skip
    job_s = time.monotonic() - began
    del training
    streamer = start_streamer(bootstrap, topics, logs, work / "catch-up" / "stream")
    assert streamer.wait(300) == 0, streamer.log()[-2000:]
    worker = start_worker(bootstrap, topics, work / "catch-up" / "worker", group=job,
                          exit_when_idle_s=5.0,
                          env={"LAGSCOPE_WORKER__ROLLUP_IDLE_S": "10"})  # fmt: skip
    assert worker.wait(600) == 0, worker.log()[-3000:]
    summary = next(json.loads(line) for line in worker.log().splitlines()
                   if line.startswith('{"worker_counters"'))  # fmt: skip
    seconds = summary["last_write_at"] - summary["first_message_at"]
    steps = summary["worker_counters"]["steps_written"]
    ops = summary["worker_counters"]["ops"]
    job_pace = CATCH_UP_STEPS / job_s
    return [
        {"benchmark": "catch-up: a worker started behind the 1F1B job's 300 steps (steps/s)",
         "value": steps / seconds, "unit": "steps/s",
         "target": f"{steps / seconds / job_pace:.0f}x the job's own pace "
                   f"({job_pace:.1f} steps/s, process start included)",
         "ops_per_s": ops / seconds},
    ]  # fmt: skip


def _measure(bootstrap: str, work: Path, repeat: int) -> list[dict]:
    return _live(bootstrap, work, repeat) + _catch_up(bootstrap, work)


def run() -> list[dict]:
    return measure_with_broker("lagscope-latency-bench-", _measure)


if __name__ == "__main__":
    for row in run():
        print(json.dumps(row))
