"""Rank identity: stored rows, and a diagnosis naming the machine of the workers it names."""

from __future__ import annotations

import re
import time
from pathlib import Path

from lagscope.producers.events import JobInfo, RankIdentity
from lagscope.simulator.advice import Advice
from lagscope.simulator.causes import Cause
from lagscope.simulator.diagnose import Diagnosis
from lagscope.simulator.evidence import Evidence
from lagscope.store.rows import rank_identity_rows
from lagscope.stream_app.identity import MachineBook, name_machines


def _record(rank: int, dp: int, pp: int, tp: int = 0, **machine: object) -> JobInfo:
    who = RankIdentity(rank=rank, dp_rank=dp, pp_rank=pp, tp_rank=tp, **machine)  # type: ignore[arg-type]
    return JobInfo(job_id="j", dp_size=2, pp_size=2, tp_size=2, world_size=8, rank_identity=who)


def test_a_named_worker_reads_with_its_node_and_gpu() -> None:
    book = MachineBook()
    assert book.add(
        _record(2, 1, 0, host="h2", node="node-3", gpu=5, pci_bus_id="00000000:3B:00.0")
    )
    assert book.add(_record(3, 1, 0, tp=1, host="h2", node="node-3", gpu=6))  # not the one read
    assert book.add(_record(0, 0, 0, host="h0"))
    assert not book.add(JobInfo(job_id="j", dp_size=2, pp_size=2, tp_size=2, world_size=8))
    diagnosis = Diagnosis(
        Cause.SLOW_WORKERS,
        "worker(s) (dp 1, pp 0), (dp 0, pp 0) explain 80% of the slowdown",
        Evidence(),
        (Advice("remove the straggler", "restart without (dp 1, pp 0), (dp 1, pp 1)", 1.2),),
    )
    named = name_machines(diagnosis, book.machines("j", 0))
    assert named.summary == (
        "worker(s) (dp 1, pp 0) on node-3 GPU 5 (00000000:3B:00.0), (dp 0, pp 0) on h0 "
        "explain 80% of the slowdown"
    )
    # A worker whose machine is unknown keeps its plain name.
    assert named.advice[0].detail == (
        "restart without (dp 1, pp 0) on node-3 GPU 5 (00000000:3B:00.0), (dp 1, pp 1)"
    )
    assert name_machines(diagnosis, book.machines("other", 0)) == diagnosis


def test_rows_carry_every_coordinate_and_the_machine() -> None:
    rows = rank_identity_rows(_record(7, 1, 1, tp=1, local_rank=3, host="h", pod="p", gpu=3))
    assert {k: v[0] for k, v in rows.items()} == {
        "job_id": "j", "attempt": 0, "rank": 7, "local_rank": 3, "dp_rank": 1, "pp_rank": 1,
        "tp_rank": 1, "cp_rank": 0, "host": "h", "node": "", "pod": "p", "gpu": 3,
        "pci_bus_id": "", "version": 0,
    }  # fmt: skip


def test_the_faust_worker_stores_every_rank_and_names_its_machine(
    kafka_bootstrap, kafka_topics, tmp_path: Path
) -> None:
    """Every rank's job record (its own key on the compacted jobs topic) becomes a row;
    the stored diagnosis names the machine of the worker it names."""
    from confluent_kafka import Producer

    from lagscope.producers.replay import iter_step_batches
    from tests.conftest import load_reference
    from tests.worker_util import create_topics, query_store, start_worker

    create_topics(kafka_bootstrap, kafka_topics)
    trace, meta = load_reference("AR")
    producer = Producer({"bootstrap.servers": kafka_bootstrap})
    world = meta.world_size
    per_worker = meta.tp_size * meta.dsp_size
    for rank in range(world):
        worker, inner = divmod(rank, per_worker)
        pp, dp = divmod(worker, meta.dp_size)
        who = RankIdentity(rank=rank, local_rank=rank % 8, dp_rank=dp, pp_rank=pp,
                           tp_rank=inner, host=f"host-{rank // 8}", gpu=rank % 8)  # fmt: skip
        info = JobInfo.from_meta(meta, job_id="ID").model_copy(update={"rank_identity": who})
        producer.produce(kafka_topics["topic_jobs"], key=info.record_key.encode(),
                         value=info.model_dump_json().encode())  # fmt: skip
    for _, _, batches in iter_step_batches(trace, meta, job_id="ID", start_wall_ns=time.time_ns()):
        for batch in batches:
            producer.produce(kafka_topics["topic_ops"], key=b"ID", value=batch.encode())
    producer.flush(30)
    worker = start_worker(kafka_bootstrap, kafka_topics, tmp_path / "w", group="identity")
    assert worker.wait(180) == 0, worker.log()[-4000:]
    rows = query_store(
        tmp_path / "w", "SELECT rank, local_rank, host, gpu FROM rank_identity FINAL ORDER BY rank"
    )
    assert [(r["rank"], r["local_rank"], r["host"], r["gpu"]) for r in rows] == [
        (rank, rank % 8, f"host-{rank // 8}", rank % 8) for rank in range(world)
    ]
    (diagnosis,) = query_store(
        tmp_path / "w",
        "SELECT cause, JSONExtractString(evidence, 'summary') AS summary, advice "
        "FROM diagnoses FINAL ORDER BY step DESC LIMIT 1",
    )
    named = re.findall(r"\(dp (\d+), pp (\d+)\)( on host-\d+ GPU \d+)?", diagnosis["summary"])
    assert named and all(machine for *_, machine in named), diagnosis
