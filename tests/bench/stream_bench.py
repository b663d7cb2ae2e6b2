"""The distributed host: Kafka -> `lagscope worker` (faust) -> ClickHouse (chDB).

- sustained op events/s: the AR reference trace replayed 5 times (220 steps, 586k ops in
  rank-step batches) is put on Kafka first, then one worker drains it; ops over the time
  from its first message to its last steps write;
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
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
REFERENCE = Path(
    os.environ.get("LAGSCOPE_REFERENCE_TRACES", REPO.parent / "shared" / "reference-traces")
)


def _processor_rows() -> list[dict]:
    from producers.events import JobInfo
    from producers.replay import iter_step_batches
    from simulator.generate import JobSpec, generate_job
    from stream_app.processor import StepProcessor

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


def _worker_rows(bootstrap: str, work: Path) -> list[dict]:
    from confluent_kafka import Producer

    from producers.events import JobInfo
    from producers.reference_format import load_meta, load_trace
    from producers.replay import iter_step_batches, replay
    from tests.worker_util import create_topics, kafka_config, query_store, start_worker

    trace, meta = load_trace(REFERENCE / "trace-AR.parquet"), load_meta(REFERENCE / "meta-AR.yaml")
    rows = []

    # Throughput: a backlog drained by one worker.
    topics = _topics()
    create_topics(bootstrap, topics)
    stats = replay(trace, meta, kafka=kafka_config(bootstrap, topics), job_id="AR", repeat=5,
                   progress=None)  # fmt: skip
    worker = start_worker(bootstrap, topics, work / "throughput", group="bench")
    worker.wait(900)
    summary = json.loads(re.findall(r"(\{\"worker_counters\".*\})", worker.log())[-1])
    busy = summary["last_write_at"] - summary["first_message_at"]
    rows.append(
        {
            "benchmark": "worker sustained op events/s (AR x5 backlog, 1 worker)",
            "value": stats.ops / busy,
            "unit": "ops/s",
            "target": ">= 1e6 on 2 cores",
            "batches_per_s": stats.batches / busy,
            "steps_per_s": summary["worker_counters"]["steps_written"] / busy,
        }
    )

    # Latency: a live replay at 200x into a running worker.
    topics = _topics()
    create_topics(bootstrap, topics)
    worker = start_worker(bootstrap, topics, work / "latency", group="bench")
    deadline = time.monotonic() + 60
    while "partition" not in worker.log() and "Worker ready" not in worker.log():
        if time.monotonic() > deadline:
            raise RuntimeError(f"worker did not start:\n{worker.log()[-3000:]}")
        time.sleep(0.1)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    info = JobInfo.from_meta(meta, job_id="AR")
    producer.produce(topics["topic_jobs"], key=info.key.encode(),
                     value=info.model_dump_json().encode())  # fmt: skip
    producer.flush(10)
    delivered: dict[int, float] = {}
    begin = time.monotonic()
    for end_ns, step, batches in iter_step_batches(trace, meta, job_id="AR",
                                                   start_wall_ns=time.time_ns()):  # fmt: skip
        delay = begin + end_ns / 1e9 / 200 - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        for batch in batches[:-1]:
            producer.produce(topics["topic_ops"], key=b"AR", value=batch.encode())

        def on_delivery(err, _msg, step=step):
            delivered[step] = time.time()

        producer.produce(topics["topic_ops"], key=b"AR", value=batches[-1].encode(),
                         on_delivery=on_delivery)  # fmt: skip
        producer.poll(0)
    producer.flush(30)
    worker.wait(300)
    stored = query_store(
        work / "latency", "SELECT step, toFloat64(processed_at) AS at FROM steps ORDER BY step"
    )
    latency = np.array([row["at"] - delivered[row["step"]] for row in stored])
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
    from deploy.kafka_local import KafkaBroker

    rows = _processor_rows()
    with tempfile.TemporaryDirectory(prefix="lagscope-stream-bench-") as tmp:
        work = Path(tmp)
        bootstrap = os.environ.get("LAGSCOPE_KAFKA_BOOTSTRAP")
        if bootstrap:
            rows += _worker_rows(bootstrap, work)
        else:
            with KafkaBroker(work / "kafka") as broker:
                rows += _worker_rows(broker.bootstrap, work)
    return rows
