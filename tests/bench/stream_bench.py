"""The distributed host: Kafka -> `lagscope worker` (faust) -> ClickHouse (chDB).

- sustained op events/s on this 2-core machine: a backlog of rank-step batches is put on
  Kafka first, then worker processes drain it, one job per partition and one worker per
  partition (started together, so the group gets one assignment); ops over the time from
  the first message consumed to the last steps write, everything included (model
  inference, writes, checkpoints, results to Kafka). Shapes: two 1,024-GPU jobs (dp16 x
  pp8 x tp8, 32 micro-batches: 128 batches of 182 ops per step, 200 steps each) on two
  workers; the AR reference trace x20 (16 batches of 166 ops per step) on two, and on
  one pinned to one core (three runs: the target is 2 M ops/s there);
- one job of 1,024, 12,288 and 100,000 GPUs (pp 8 x tp 8, 16 micro-batches) through one
  worker pinned to one core and to two: seconds of the whole process per step, against
  a 5 s step, with the worker's peak memory; and whether every run of a job, on one core
  or on two, stored the same rows (`tests/bench/stored_rows.py`);
- how fast one worker catches up with each of those jobs after it was down: a 5 s-step
  job's backlog drained at N x real time, the backlog of the job's steps with everything
  included (the same runs' seconds per step), and each step of a backlog twice as long
  beyond them (the job replayed twice over, minus the run of it once);
- latency from a step's last batch (delivered to Kafka) to its `steps` row (processed_at,
  taken just before the insert), AR replayed at 200x real time into a running worker,
  default worker settings (writes every 0.5 s);
- StepProcessor time per step (the second step of a job: model inference is done) for
  1,024-, 4,096- and 12,288-GPU shaped jobs (pp=8, tp=8, 32 microbatches).

Uses `LAGSCOPE_KAFKA_BOOTSTRAP` when set, else starts the local KRaft broker.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
REFERENCE = Path(
    os.environ.get("LAGSCOPE_REFERENCE_TRACES", REPO / "tests" / "data" / "reference-traces")
)


def _processor_rows() -> list[dict]:
    from lagscope.producers.events import JobInfo
    from lagscope.producers.replay import iter_step_batches
    from lagscope.simulator.generate import JobSpec, generate_job
    from lagscope.stream_app.processor import StepProcessor

    rows = []
    for gpus in (1024, 4096, 12288):
        job = generate_job(JobSpec(dp=gpus // 64, pp=8, tp=8, microbatches=32, steps=2))
        processor = StepProcessor()
        processor.on_job(JobInfo.from_meta(job.meta, job_id=f"bench-{gpus}"))
        seconds = []
        for _, _, batches in iter_step_batches(
            job.trace, job.meta, job_id=f"bench-{gpus}", start_wall_ns=0
        ):
            started = time.perf_counter()
            closed = [out for batch in batches for out in processor.on_batch(batch)]
            seconds.append(time.perf_counter() - started)
            assert len(closed) == 1
        rows.append(
            {
                "benchmark": f"processor step, {gpus} GPUs ({len(batches)} batches/step)",
                "value": seconds[-1],
                "unit": "s/step",
                "target": "< step time",
                "first_step_s": seconds[0],
            }
        )
        ops = sum(batch.n_ops for batch in batches)
        rows.append(
            {
                "benchmark": f"processor op events/s, {gpus} GPUs ({ops} ops/step)",
                "value": ops / seconds[-1],
                "unit": "ops/s",
                "target": ">= 1e6",
            }
        )
    return rows


def _throughput_row(
    bootstrap: str,
    work: Path,
    shape: str,
    jobs: list,
    workers: int,
    cores: set[int] | None = None,
    env: dict[str, str] | None = None,
    start_wall_ns: int | None = None,
) -> dict:
    """Drain a backlog of `jobs` (trace, meta) with `workers` worker processes.

    One partition per job (the ops topic is keyed by job id), one worker per partition,
    each with its own chDB store (chDB is one process's embedded engine; a deployment
    shares a ClickHouse server). Rate = all ops / (last steps write - first message).
    `cores`: the CPUs each worker (and its analysis processes) may run on (all when None);
    `env`: more of the workers' settings; `start_wall_ns`: when the jobs' first steps
    began (now by default). The row's `stored_digests` are each worker's store's.
    """
    from confluent_kafka import Consumer, TopicPartition

    from lagscope.producers.replay import replay
    from tests.worker_util import create_topics, kafka_config, start_worker

    topics = _topics()
    create_topics(bootstrap, topics, ops_partitions=len(jobs))
    job_ids = _job_ids_on_distinct_partitions(len(jobs))
    ops = batches = 0
    for job_id, (trace, meta, repeat) in zip(job_ids, jobs, strict=True):
        stats = replay(trace, meta, kafka=kafka_config(bootstrap, topics), job_id=job_id,
                       repeat=repeat, progress=None, start_wall_ns=start_wall_ns)  # fmt: skip
        ops, batches = ops + stats.ops, batches + stats.batches
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-watermarks"})
    filled = [
        consumer.get_watermark_offsets(TopicPartition(topics["topic_ops"], p), timeout=10)[1]
        for p in range(len(jobs))
    ]
    consumer.close()
    if min(filled) == 0:
        raise RuntimeError(f"the jobs did not land on distinct partitions: {filled}")
    procs = [
        start_worker(
            bootstrap,
            topics,
            work / topics["topic_ops"] / str(i),
            group=topics["topic_ops"],
            exit_when_idle_s=3.0,
            # The deployed idle time (the tests' 1 s concludes a large job between two
            # fetches); the worker concludes every job at its idle exit anyway.
            env={"LAGSCOPE_WORKER__ROLLUP_IDLE_S": "10", **(env or {})},
        )
        for i in range(workers)
    ]
    if cores is not None:
        for proc in procs:  # before it starts its threads: they inherit the set
            os.sched_setaffinity(proc.process.pid, cores)
    summaries = []
    for proc in procs:
        proc.wait(900)
        summaries.append(json.loads(re.findall(r"(\{\"worker_counters\".*\})", proc.log())[-1]))
    first = min(s["first_message_at"] for s in summaries if s["first_message_at"])
    last = max(s["last_write_at"] for s in summaries if s["last_write_at"])
    steps = sum(s["worker_counters"]["steps_written"] for s in summaries)
    consumed = sum(s["worker_counters"]["ops"] for s in summaries)
    if consumed != ops:
        counters = [s["worker_counters"] for s in summaries]
        raise RuntimeError(
            f"the workers consumed {consumed} ops of the {ops} produced (more: a rebalance "
            f"re-delivered; fewer: lost): {counters}; logs under {work / topics['topic_ops']}"
        )
    return {
        "benchmark": f"worker sustained op events/s, {shape}, {workers} worker(s)",
        "value": ops / (last - first),
        "unit": "ops/s",
        "target": ">= 1e6 on 2 cores",
        "ops": ops,
        "batches_per_s": batches / (last - first),
        "steps_per_s": steps / (last - first),
        "seconds": last - first,
        # A worker's own peak and its analysis processes' (summed: an upper bound).
        "worker_peak_rss_mb": max(
            s.get("peak_rss_mb", 0.0) + s.get("analysis_processes_peak_rss_mb", 0.0)
            for s in summaries
        ),
        "stored_digests": [
            _stored_digest(f"chdb://{work / topics['topic_ops'] / str(i) / 'chdb'}")
            for i in range(workers)
        ],
    }


def _stored_digest(dsn: str) -> str:
    """The digest of what an exited worker stored (in a process of its own: one process
    opens a chDB directory at a time)."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.bench.stored_rows", dsn],
        capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    return done.stdout.strip().splitlines()[-1]


def _same_rows_row(where: str, gpus: int, runs: list[dict], length: str = "") -> dict:
    """Whether every run of one job (of `length`), on one core or on two, stored the same
    rows."""
    digests = {d for r in runs for d in r.get("stored_digests", [r.get("stored_digest")])}
    if None in digests or not digests:
        raise RuntimeError(f"a run of the {gpus:,}-GPU job through {where} has no digest")
    job = f"one {gpus:,}-GPU job" + (f" of {length}" if length else "")
    return {
        "benchmark": f"{job} through {where}: the runs on 1 and 2 cores stored the same rows",
        "value": "yes" if len(digests) == 1 else f"NO ({len(digests)} different)",
        "unit": "",
        "target": "yes (the two-process path computes what one process does)",
        "runs": len(runs),
    }


def _job_ids_on_distinct_partitions(n: int) -> list[str]:
    """Job ids that librdkafka's default partitioner (crc32 of the key) spreads 1:1."""
    import zlib

    ids: dict[int, str] = {}
    candidate = 0
    while len(ids) < n:
        job_id = f"bench-{candidate}"
        ids.setdefault(zlib.crc32(job_id.encode()) % n, job_id)
        candidate += 1
    return [ids[p] for p in range(n)]


def _worker_rows(bootstrap: str, work: Path) -> list[dict]:

    from lagscope.producers.reference_format import load_meta, load_trace
    from lagscope.simulator.generate import JobSpec, generate_job

    trace, meta = load_trace(REFERENCE / "trace-AR.parquet"), load_meta(REFERENCE / "meta-AR.yaml")
    big = generate_job(JobSpec(dp=16, pp=8, tp=8, microbatches=32, steps=200, seed=7))
    rows = [
        _throughput_row(
            bootstrap,
            work,
            "1,024-GPU jobs (128 batches/step)",
            [(big.trace, big.meta, 1)] * 2,
            workers=2,
        ),
        _throughput_row(
            bootstrap, work, "AR trace x20 (16 batches/step)", [(trace, meta, 20)] * 2, workers=2
        ),
        _one_core_row(bootstrap, work, trace, meta),
    ]
    return rows + _scale_rows(bootstrap, work) + _latency_rows(bootstrap, work, trace, meta)


#: Runs of the one-worker, one-core drain: single runs on this shared machine mislead.
ONE_CORE_RUNS = 3


def _one_core_row(bootstrap: str, work: Path, trace: Any, meta: Any) -> dict:
    """One worker pinned to one core draining AR x 20 (the broker on either core): the
    median of `ONE_CORE_RUNS` runs, against the target of 2 M ops/s on one core."""
    shape = "AR trace x20 (16 batches/step)"
    start_wall_ns = (int(time.time()) - 3600) * 10**9  # every run the same job
    job = [(trace, meta, 20)]
    runs = [
        _throughput_row(bootstrap, work, shape, job, 1, cores={0}, start_wall_ns=start_wall_ns)
        for _ in range(ONE_CORE_RUNS)
    ]
    values = sorted(r["value"] for r in runs)
    median = next(r for r in runs if r["value"] == values[len(values) // 2])
    digests = {d for r in runs for d in r["stored_digests"]}
    if len(digests) != 1:
        raise RuntimeError(f"{len(runs)} runs of one job stored {len(digests)} different sets")
    return {
        **median,
        "benchmark": f"worker sustained op events/s, {shape}, 1 worker pinned to 1 core",
        "target": ">= 2e6 on 1 core",
        "spread": [values[0], values[-1]],
        "runs": len(runs),
    }


#: (GPUs, dp, steps) of the one-job scaling curve: pp 8, tp 8, 16 micro-batches; the
#: largest is 100,000 GPUs to within a DP rank (1,560 x 8 x 8 = 99,840).
SCALE_JOBS = ((1024, 16, 60), (12288, 192, 20), (99840, 1560, 10))
#: Runs of each setup (interleaved): this machine is shared, single runs mislead.
SCALE_RUNS = 3
#: The step time a backlog's catch-up speed is counted against (issue 69 item 3), and the
#: speed wanted on two cores per job size (GPUs up to the key).
JOB_STEP_S = 5.0
CATCH_UP_TARGETS = ((4096, 20.0), (12288, 20.0), (10**6, 5.0))


def _catch_up_row(gpus: int, cores: int, processes: str, per_step: list[float], via: str,
                  backlog: str = "") -> dict:  # fmt: skip
    """How fast one worker drains a backlog of a job of `JOB_STEP_S` steps after it was
    down: the job's step time over the worker's seconds per step of the backlog (the
    backlog runs above were all in Kafka, or in memory, before the worker started)."""
    speeds = [JOB_STEP_S / seconds for seconds in per_step]
    wanted = next(x for limit, x in CATCH_UP_TARGETS if gpus <= limit)
    return {
        "benchmark": f"catch-up of a {gpus:,}-GPU job's backlog{backlog} ({JOB_STEP_S:g} s "
        f"steps) by one worker {via} on {cores} core(s), {processes} analysis process(es)",
        "value": statistics.median(speeds),
        "spread": [min(speeds), max(speeds)],
        "unit": "x real",
        "target": f">= {wanted:g} on 2 cores" if cores == 2 else "2 cores faster",
        "runs": len(speeds),
    }


#: The one-job runs: on one core, the analysis in the worker's process; on two, its
#: compute half in one analysis process beside it (`processor.analysis_processes`).
SCALE_SETUPS = (({0}, "0"), ({0, 1}, "1"))
#: Each job's backlog is drained once as generated and once replayed twice over (its steps
#: again, numbered on): the difference is what each step of a backlog costs once the
#: worker runs, without what a backlog pays once whatever its length (every rank's job
#: record, the first step's model inference, the job's conclusion at its end).
BACKLOG_REPEATS = (1, 2)


def _scale_rows(bootstrap: str, work: Path) -> list[dict]:
    """One job through one worker, on one core and on two: seconds of the whole worker
    process per step (the first step's model inference and the job's final conclusion
    included), against a 5 s step; its ops/s and peak memory (the worker's and its
    analysis process'); the catch-up speed of that backlog, and of each step more of a
    longer one. The setups alternate, three runs each."""
    from lagscope.simulator.generate import JobSpec, generate_job

    rows = []
    for gpus, dp, steps in SCALE_JOBS:
        job = generate_job(JobSpec(dp=dp, pp=8, tp=8, microbatches=16, steps=steps, seed=11))
        runs: dict[tuple[int, str, int], list[dict]] = {}
        start_wall_ns = (int(time.time()) - 3600) * 10**9  # every run the same job
        for cores, processes in SCALE_SETUPS * SCALE_RUNS:
            for repeat in BACKLOG_REPEATS:
                jobs = [(job.trace, job.meta, repeat)]
                env = {"LAGSCOPE_PROCESSOR__ANALYSIS_PROCESSES": processes}
                row = _throughput_row(
                    bootstrap, work, f"{gpus} GPUs", jobs, workers=1, cores=cores, env=env,
                    start_wall_ns=start_wall_ns,
                )  # fmt: skip
                runs.setdefault((len(cores), processes, repeat), []).append(row)
        for cores, processes in ((len(c), p) for c, p in SCALE_SETUPS):
            setup = runs[(cores, processes, 1)]
            longer = runs[(cores, processes, BACKLOG_REPEATS[-1])]
            per_step = [r["seconds"] / steps for r in setup]
            rows.append(
                {
                    "benchmark": f"one {gpus:,}-GPU job through one worker on {cores} "
                    f"core(s), {processes} analysis process(es): seconds per step",
                    "value": statistics.median(per_step),
                    "spread": [min(per_step), max(per_step)],
                    "unit": "s/step",
                    "target": "< 5 s (keeps up with a 5 s step)",
                    "ops_per_s": statistics.median(r["value"] for r in setup),
                    "worker_peak_rss_mb": max(r["worker_peak_rss_mb"] for r in setup),
                    "worker_peak_rss_mb_longer_backlog": max(
                        r["worker_peak_rss_mb"] for r in longer
                    ),
                    "steps": steps,
                    "runs": len(setup),
                }
            )
            whole = f" of {steps} steps, everything included"
            rows.append(_catch_up_row(gpus, cores, processes, per_step, "through Kafka", whole))
            # Interleaved pairs: each run of the longer backlog against the run just
            # before it.
            extra = (BACKLOG_REPEATS[-1] - 1) * steps
            per_extra_step = [
                (long["seconds"] - short["seconds"]) / extra
                for short, long in zip(setup, longer, strict=True)
            ]
            beyond = f", each step beyond the first {steps}"
            rows.append(
                _catch_up_row(gpus, cores, processes, per_extra_step, "through Kafka", beyond)
            )
        for repeat in BACKLOG_REPEATS:
            same = [r for (_, _, n), s in runs.items() if n == repeat for r in s]
            rows.append(_same_rows_row("one worker", gpus, same, f"{steps * repeat} steps"))
        del job
    return rows


def _core_scale_rows() -> list[dict]:
    """The jobs of SCALE_JOBS through a worker's core alone (tests/bench/core_scale.py: no
    Kafka, so no broker sharing the cores), each run a process of its own, pinned to one
    core without an analysis process and to two with one; interleaved, three runs each.
    Seconds from the first message to the job's conclusion and snapshot, per step."""
    rows = []
    for gpus, dp, steps in SCALE_JOBS:
        runs: dict[tuple[int, str], list[dict]] = {}
        start_s = str(int(time.time()) - 3600)  # every run the same job
        for cores, processes in SCALE_SETUPS * SCALE_RUNS:
            done = subprocess.run(
                [sys.executable, "-m", "tests.bench.core_scale", str(dp), str(steps), processes,
                 start_s],
                capture_output=True, text=True, check=True, timeout=1800,
                preexec_fn=lambda cores=cores: os.sched_setaffinity(0, cores),
            )  # fmt: skip
            runs.setdefault((len(cores), processes), []).append(
                json.loads(done.stdout.strip().splitlines()[-1])
            )
        for (cores, processes), setup in runs.items():
            per_step = [r["seconds"] / steps for r in setup]
            rows.append(
                {
                    "benchmark": f"one {gpus:,}-GPU job through a worker's core (no Kafka) on "
                    f"{cores} core(s), {processes} analysis process(es): seconds per step",
                    "value": statistics.median(per_step),
                    "spread": [min(per_step), max(per_step)],
                    "unit": "s/step",
                    "target": "< 5 s; 2 cores faster than 1",
                    "peak_rss_mb": max(r["peak_rss_mb"] for r in setup),
                    "worker_cpu_s_per_step": statistics.median(
                        r["worker_cpu_s"] / steps for r in setup
                    ),
                    "analysis_cpu_s_per_step": statistics.median(
                        r["analysis_cpu_s"] / steps for r in setup
                    ),
                    "steps": steps,
                    "runs": len(setup),
                }
            )
            rows.append(_catch_up_row(gpus, cores, processes, per_step, "(its core, no Kafka)"))
        rows.append(_same_rows_row("a worker's core", gpus, [r for s in runs.values() for r in s]))
    return rows


def _latency_rows(bootstrap: str, work: Path, trace, meta) -> list[dict]:
    """A live replay of `trace` at 200x real time into a running worker."""
    from confluent_kafka import Producer

    from lagscope.producers.events import JobInfo
    from lagscope.producers.replay import iter_step_batches
    from tests.worker_util import create_topics, query_store, start_worker

    rows = []
    topics = _topics()
    create_topics(bootstrap, topics)
    worker = start_worker(bootstrap, topics, work / "latency", group="bench")
    deadline = time.monotonic() + 60
    # Ready = its partition is assigned and restored (the broker may delay a new group's
    # first assignment by a few seconds).
    while "starting fresh" not in worker.log():
        if time.monotonic() > deadline or worker.process.poll() is not None:
            raise RuntimeError(f"worker did not start:\n{worker.log()[-3000:]}")
        time.sleep(0.1)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    info = JobInfo.from_meta(meta, job_id="AR")
    producer.produce(topics["topic_jobs"], key=info.key.encode(),
                     value=info.model_dump_json().encode())  # fmt: skip
    producer.flush(10)
    # From the moment the step's last batch is handed to the producer (its linger and the
    # broker round trip count), to the steps row's processed_at.
    sent: dict[int, float] = {}
    begin = time.monotonic()
    for end_ns, step, batches in iter_step_batches(trace, meta, job_id="AR",
                                                   start_wall_ns=time.time_ns()):  # fmt: skip
        delay = begin + end_ns / 1e9 / 200 - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        for batch in batches:
            payload = batch.encode()
            sent[step] = time.time()
            producer.produce(topics["topic_ops"], key=b"AR", value=payload)
        producer.poll(0)
    producer.flush(30)
    worker.wait(300)
    stored = query_store(
        work / "latency", "SELECT step, toFloat64(processed_at) AS at FROM steps ORDER BY step"
    )
    latency = np.array([row["at"] - sent[row["step"]] for row in stored])
    if os.environ.get("LAGSCOPE_BENCH_VERBOSE"):
        print("latency per step (s):", np.round(latency, 3).tolist())
    for q in (50, 99):
        rows.append(
            {
                "benchmark": f"latency last batch -> steps row, p{q} (AR at 200x)",
                "value": float(np.percentile(latency, q)),
                "unit": "s",
                "target": "< 1 s",
            }
        )
    return rows


def _topics() -> dict[str, str]:
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    return {
        "topic_ops": f"{prefix}.ops",
        "topic_jobs": f"{prefix}.jobs",
        "topic_deadletter": f"{prefix}.deadletter",
    }


def run() -> list[dict]:
    from lagscope.deploy.kafka_local import KafkaBroker

    rows = _processor_rows() + _core_scale_rows()
    with tempfile.TemporaryDirectory(prefix="lagscope-stream-bench-") as tmp:
        work = Path(tmp)
        bootstrap = os.environ.get("LAGSCOPE_KAFKA_BOOTSTRAP")
        if bootstrap:
            rows += _worker_rows(bootstrap, work)
        else:
            # Workers started together get one assignment (Kafka's default wait), so the
            # throughput run measures steady state, not a rebalance.
            with KafkaBroker(work / "kafka", initial_rebalance_delay_ms=3000) as broker:
                rows += _worker_rows(broker.bootstrap, work)
    return rows
