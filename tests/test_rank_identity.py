"""Rank identity: stored rows, and a diagnosis naming the machine of the workers it names."""

from __future__ import annotations

from lagscope.producers.events import JobInfo, RankIdentity
from lagscope.simulator.diagnose import Advice, Diagnosis
from lagscope.stream_app.identity import MachineBook, name_machines, rank_identity_rows


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
        "slow_workers",
        "worker(s) (dp 1, pp 0), (dp 0, pp 0) explain 80% of the slowdown",
        {},
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
