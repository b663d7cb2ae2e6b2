"""The worker's run-fetching faust consumer, against the real broker."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

from confluent_kafka import Consumer, Producer, TopicPartition

from tests.worker_util import create_topics

REPO = Path(__file__).resolve().parents[1]


def test_runs_deliver_every_record_once_in_order_and_commit_where_told(
    kafka_bootstrap: str, kafka_topics: dict[str, str], tmp_path: Path
) -> None:
    topic = kafka_topics["topic_ops"]
    create_topics(kafka_bootstrap, kafka_topics, ops_partitions=2)
    # Small producer batches: a fetch returns whole batches, so these make small runs.
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "linger.ms": 0, "batch.size": 4096})
    n = 3000
    for i in range(n):
        # ~1 KiB values, so a 16 KiB fetch returns runs of about a dozen records.
        producer.produce(topic, value=f"{i}".encode().ljust(1000), partition=i % 2)
    assert producer.flush(30) == 0

    group = f"runs-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "runs.json"
    app = subprocess.run(
        [sys.executable, "-m", "tests.fetch_runs_app", kafka_bootstrap, topic, group,
         str(tmp_path / "faust"), str(out), str(n)],
        cwd=REPO, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert out.exists(), app.stdout[-3000:] + app.stderr[-3000:]
    got = json.loads(out.read_text())
    runs = got["runs"]

    by_partition: dict[int, list[int]] = {}
    values = []
    for run in runs:
        offsets = run["offsets"]
        assert run["run_offset"] == offsets[-1]  # a run is committed past its last record
        assert offsets == list(range(offsets[0], offsets[-1] + 1))  # contiguous
        by_partition.setdefault(run["partition"], []).extend(offsets)
        values += [int(v) for v in run["values"]]
    assert sorted(values) == list(range(n))  # every record once
    assert set(by_partition) == {0, 1}
    for offsets in by_partition.values():
        assert offsets == list(range(len(offsets)))  # in order, from the start
    assert len(runs) >= 20  # the fetch size bounds a run ...
    assert max(len(r["offsets"]) for r in runs) > 1  # ... which still holds many records

    assert got["committed"] is True
    consumer = Consumer({"bootstrap.servers": kafka_bootstrap, "group.id": group})
    try:
        committed = consumer.committed([TopicPartition(topic, p) for p in (0, 1)], timeout=10)
    finally:
        consumer.close()
    assert {tp.partition: tp.offset for tp in committed} == {
        p: len(offsets) for p, offsets in by_partition.items()
    }
