"""Producer benchmarks: timer overhead, encoded size, streamer throughput into a real broker."""

from __future__ import annotations

import json
import os
import tempfile
import time
import zlib
from pathlib import Path

from lagscope.deploy.kafka_local import KafkaBroker
from lagscope.producers.config import KafkaSettings, LagscopeConfig, StreamerSettings
from lagscope.producers.reference_format import load_meta, load_trace
from lagscope.producers.replay import default_job_id, iter_step_batches, replay
from lagscope.producers.streamer import Streamer
from lagscope.producers.timer import OpTimer

REFERENCE_TRACES = Path(__file__).resolve().parents[2] / "tests" / "data" / "reference-traces"


def _timer_overhead_ns(log_dir: Path, n: int = 200_000) -> float:
    timer = OpTimer(job_id="bench", rank=0, dp_rank=0, pp_rank=0, log_dir=log_dir,
                    mode="host", gc_probe=False)  # fmt: skip
    op = timer.op
    best = float("inf")
    for step in range(5):
        timer.step(step)
        begin = time.perf_counter_ns()
        for _ in range(n):
            with op("forward-compute", microbatch=1, chunk=0):
                pass
        elapsed = time.perf_counter_ns() - begin
        begin = time.perf_counter_ns()
        for _ in range(n):
            pass
        loop = time.perf_counter_ns() - begin
        best = min(best, (elapsed - loop) / n)
    timer.close()
    return best


class _NullScope:
    __slots__ = ()

    def __enter__(self) -> _NullScope:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _null_with_ns(n: int = 200_000) -> float:
    """What an empty `with` block costs on this machine: the floor for any Python timer."""
    scope = _NullScope()
    best = float("inf")
    for _ in range(5):
        begin = time.perf_counter_ns()
        for _ in range(n):
            with scope:
                pass
        best = min(best, (time.perf_counter_ns() - begin) / n)
    return best


def _bytes_per_op() -> dict[str, float]:
    trace = load_trace(REFERENCE_TRACES / "trace-AR.parquet")
    meta = load_meta(REFERENCE_TRACES / "meta-AR.yaml")
    binary = json_bytes = binary_z = json_z = ops = 0
    for _, _, batches in iter_step_batches(trace, meta, job_id=default_job_id(meta),
                                           start_wall_ns=time.time_ns()):  # fmt: skip
        for batch in batches:
            encoded = batch.encode()
            as_json = json.dumps(batch.to_records()).encode()
            binary += len(encoded)
            json_bytes += len(as_json)
            binary_z += len(zlib.compress(encoded, 1))
            json_z += len(zlib.compress(as_json, 1))
            ops += batch.n_ops
    return {
        "binary": binary / ops,
        "json": json_bytes / ops,
        "binary_zlib1": binary_z / ops,
        "json_zlib1": json_z / ops,
    }


def _streamer_throughput(bootstrap: str, work: Path, repeat: int = 20) -> tuple[float, int]:
    trace = load_trace(REFERENCE_TRACES / "trace-AR.parquet")
    meta = load_meta(REFERENCE_TRACES / "meta-AR.yaml")
    log_dir = work / "logs"
    replay(trace, meta, log_dir=log_dir, repeat=repeat, progress=None)
    topic = f"bench-{os.getpid()}-{time.time_ns()}"
    config = LagscopeConfig(
        kafka=KafkaSettings(bootstrap_servers=bootstrap, topic_ops=f"{topic}.ops",
                            topic_deadletter=f"{topic}.dl", topic_jobs=f"{topic}.jobs"),
        streamer=StreamerSettings(log_dir=log_dir, idle_exit_s=0.0),
    )  # fmt: skip
    streamer = Streamer(config)
    streamer.ensure_topics()
    begin = time.perf_counter()
    # Ship until every record is read and confirmed by the broker (close() waits).
    while streamer.step():
        pass
    streamer.close()
    elapsed = time.perf_counter() - begin
    return streamer.stats.ops / elapsed, streamer.stats.ops


def run() -> list[dict]:
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        rows.append({
            "benchmark": "producers: timer overhead per op (host mode, with op(...))",
            "value": _timer_overhead_ns(work / "timer"), "unit": "ns/op", "target": "< 1000",
        })  # fmt: skip
        rows.append({
            "benchmark": "producers: reference, an empty with-block on this machine",
            "value": _null_with_ns(), "unit": "ns/op", "target": "(context)",
        })  # fmt: skip
        sizes = _bytes_per_op()
        for name, value in sizes.items():
            rows.append({
                "benchmark": f"producers: encoded bytes per op, {name} (AR trace)",
                "value": value, "unit": "bytes/op", "target": "binary << json",
            })  # fmt: skip
        bootstrap = os.environ.get("LAGSCOPE_KAFKA_BOOTSTRAP")
        broker = None
        if not bootstrap:
            broker = KafkaBroker(work / "kafka").start()
            bootstrap = broker.bootstrap
        try:
            rate, ops = _streamer_throughput(bootstrap, work)
        finally:
            if broker is not None:
                broker.stop()
        rows.append({
            "benchmark": f"producers: streamer logs→Kafka throughput ({ops:,} ops, acks=all)",
            "value": rate, "unit": "ops/s", "target": ">= 1,000,000",
        })  # fmt: skip
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
