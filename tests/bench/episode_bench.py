"""How soon an on-call engineer sees a straggler: real torch jobs followed live by both
hosts (`lagscope run --follow`, and `lagscope stream` -> Kafka -> two `lagscope worker`s),
the shared store polled every quarter second (tests/live_run.py).

Per host, over the straggler runs (1F1B: forward, backward, input, host, GC, host GC; DDP:
forward, host, GC, host GC; each worker 2x slower for steps 15-44 of 60; GC: its own
collections pause its forward as long again; host GC: they run between its ops, as on a
GPU):

- detection latency in steps: the job's last closed step when the store first showed the
  episode, minus the true onset (what the on-call sees, the pipeline's lag included), and
  first_seen_step minus the onset (the detector's own evidence);
- detection latency in seconds: from the start of the onset step to the poll that first
  showed it, and where that time goes: from the end of the episode's first_seen step
  until every rank's batch of it was in its log (the timer's sealing pace), and from then
  until the store showed the episode (the host: reading, windows, analysis, its write,
  and the poll's own quarter second);
- stragglers named with the right worker and cause, and episodes on the healthy runs.

`LAGSCOPE_BENCH_LIVE_REPEAT` (default 1) runs each job that many times. Before these hosts
found episodes live, an episode existed only at the end of `lagscope run` (45 steps after
this onset at best) and the worker found none.
"""

from __future__ import annotations

import statistics
import uuid
from pathlib import Path

from tests.kafka_util import measure_with_broker
from tests.live_run import LogArrivals, first_named, follow_live

SLOW_START, SLOW_END = 15, 45
#: (job module, slow rank, worker of it, phase, cause expected).
CASES = (
    ("tests.torch_jobs.pipeline_1f1b", 2, (1, 0), "forward", "slow_workers"),
    ("tests.torch_jobs.pipeline_1f1b", 2, (1, 0), "backward", "slow_workers"),
    ("tests.torch_jobs.pipeline_1f1b", 2, (1, 0), "input", "slow_input"),
    ("tests.torch_jobs.pipeline_1f1b", 2, (1, 0), "host", "slow_host"),
    ("tests.torch_jobs.pipeline_1f1b", 2, (1, 0), "gc", "gc_pauses"),
    ("tests.torch_jobs.pipeline_1f1b", 2, (1, 0), "host_gc", "gc_pauses"),
    ("tests.torch_jobs.ddp", 1, (1, 0), "forward", "slow_workers"),
    ("tests.torch_jobs.ddp", 1, (1, 0), "host", "slow_host"),
    ("tests.torch_jobs.ddp", 1, (1, 0), "gc", "gc_pauses"),
    ("tests.torch_jobs.ddp", 1, (1, 0), "host_gc", "gc_pauses"),
)
HEALTHY = ("tests.torch_jobs.pipeline_1f1b", "tests.torch_jobs.ddp")
#: The DDP job's sizes in the verdict tests (tests/test_torch_verdicts.py), without their
#: emulated device (`block_ms`): on real CPU compute, four ranks on two cores, a sleeping
#: straggler frees a core for its peers and the job's step time moves less than a GPU
#: job's would, so its ranks' prompt seals (`producers/step_change.py`) may not fire.
DDP_KNOBS = ["--layers", "6", "--hidden", "256", "--batch", "32", "--bucket-mb", "0.3"]


def _topics() -> dict[str, str]:
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    return {name: f"{prefix}.{name.removeprefix('topic_')}"
            for name in ("topic_ops", "topic_jobs", "topic_deadletter")}  # fmt: skip


def _knobs(module: str) -> list[str]:
    return DDP_KNOBS if module.endswith("ddp") else []


def _measure(bootstrap: str, work: Path, repeat: int) -> list[dict]:
    #: Per host: (steps after onset in the store, first_seen - onset, seconds, job).
    found: dict[str, list[tuple[int, int, float, str]]] = {"embedded": [], "kafka": []}
    log_lag: list[float] = []
    host_lag: dict[str, list[float]] = {"embedded": [], "kafka": []}
    right: dict[str, int] = {"embedded": 0, "kafka": 0}
    #: Per host: the runs whose first episode named the worker with another cause.
    wrong: dict[str, list[str]] = {"embedded": [], "kafka": []}
    healthy_episodes: dict[str, int] = {"embedded": 0, "kafka": 0}
    runs = 0
    for index in range(repeat):
        for module, rank, worker, phase, cause in CASES:
            runs += 1
            job = f"bench-{phase}-{module.rsplit('.', 1)[1]}-{index}"
            knobs = [*_knobs(module), "--slow-rank", str(rank), "--slow-phase", phase,
                     "--slow-steps", f"{SLOW_START}-{SLOW_END - 1}"]  # fmt: skip
            arrivals = LogArrivals()
            seen = follow_live(work / job, bootstrap, _topics(), job, knobs, module=module,
                               arrivals=arrivals)  # fmt: skip
            for host, polled in seen.items():
                first = first_named(polled, worker)
                if first is None:
                    continue
                last, at, episode = first
                evidence_step = episode["first_seen_step"]
                in_log = arrivals.step_in_log(evidence_step)
                ended = polled.step_starts.get(evidence_step + 1)
                if in_log is not None:
                    host_lag[host].append(at - in_log)
                    if ended is not None and host == "embedded":  # the same logs for both
                        log_lag.append(in_log - ended)
                right[host] += episode["cause"] == cause
                if episode["cause"] != cause:
                    wrong[host].append(f"{job}: {episode['cause']}")
                onset_at = polled.step_starts.get(SLOW_START)
                seconds = at - onset_at if onset_at is not None else float("nan")
                found[host].append(
                    (last - SLOW_START, episode["first_seen_step"] - SLOW_START, seconds, job)
                )
        for module in HEALTHY:
            job = f"bench-healthy-{module.rsplit('.', 1)[1]}-{index}"
            seen = follow_live(work / job, bootstrap, _topics(), job, _knobs(module),
                               module=module)  # fmt: skip
            for host, polled in seen.items():
                named = {e["episode_id"] for _, episodes in polled.polls for e in episodes}
                healthy_episodes[host] += len(named)
    rows = []
    for host, latencies in found.items():
        if latencies:
            stored = [float(x[0]) for x in latencies]
            evidence = [float(x[1]) for x in latencies]
            seconds = [x[2] for x in latencies]
            target = "<= 5 typical, never > 10"
            worst = max(latencies, key=lambda x: x[0])
            rows += [
                {**_median_row(f"live {host}: in the store, steps after onset", stored,
                               "steps", target),
                 "note": f"the most: {worst[0]} steps ({worst[2]:.2f} s), {worst[3]}"},
                _median_row(f"live {host}: first_seen_step - onset", evidence, "steps",
                            target),
                _median_row(f"live {host}: in the store, seconds after onset", seconds, "s",
                            "a few steps' time"),
            ]  # fmt: skip
            if host_lag[host]:
                rows.append(_median_row(f"live {host}: host lag, evidence in the logs to the "
                                        "store (s)", host_lag[host], "s", "< 0.5"))  # fmt: skip
        rows.append({"benchmark": f"live {host}: stragglers named right (worker and cause)",
                     "value": f"{right[host]}/{runs}", "unit": "runs", "target": "all",
                     "note": "; ".join(wrong[host]) or ""})  # fmt: skip
        rows.append({"benchmark": f"live {host}: episodes on healthy runs",
                     "value": healthy_episodes[host], "unit": "episodes", "target": "0",
                     "runs": repeat * len(HEALTHY)})  # fmt: skip
    if log_lag:
        rows.append(_median_row("live: timer lag, evidence step's end to every rank's log (s)",
                                log_lag, "s", "<= 3 (the seal pace)"))  # fmt: skip
    return rows


def _median_row(name: str, values: list[float], unit: str, target: str) -> dict:
    return {
        "benchmark": name,
        "value": statistics.median(values),
        "unit": unit,
        "target": target,
        "spread": [min(values), max(values)],
        "runs": len(values),
    }


def run() -> list[dict]:
    return measure_with_broker("lagscope-episode-bench-", _measure)
