"""Which machine each rank runs on: stored per (job, attempt, rank) in `rank_identity`, and
named in a diagnosis next to the workers it names.

Every rank writes its own job record carrying its `RankIdentity` (host, GPU index, PCI
bus id, scheduler node, pod); both hosts (the faust worker and the embedded runner) turn
each record into one `rank_identity` row and remember the representative rank (tp 0,
cp 0) of every (dp, pp) worker, so that "(dp 3, pp 1)" in a summary or an advice reads
"(dp 3, pp 1) on node-7 GPU 5".
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from lagscope.producers.events import JobInfo, RankIdentity
from lagscope.simulator.diagnose import Diagnosis

_WORKER = re.compile(r"\(dp (\d+), pp (\d+)\)")


def machine_label(who: RankIdentity) -> str:
    """ "node-7 GPU 5 (0000:3b:00.0)": the scheduler's node name, else the host name."""
    label = who.node or who.host or "an unnamed host"
    if who.pod:
        label += f" (pod {who.pod})"
    if who.gpu is not None:
        label += f" GPU {who.gpu}"
        if who.pci_bus_id:
            label += f" ({who.pci_bus_id})"
    return label


class MachineBook:
    """The machine of every (dp, pp) worker of every job attempt seen so far."""

    def __init__(self) -> None:
        self._by_job: dict[tuple[str, int], dict[tuple[int, int], str]] = {}
        self._identity: dict[tuple[str, int], dict[tuple[int, int], RankIdentity]] = {}
        #: (job, attempt) -> rank -> the hash of its identity as last given to be stored: a
        #: rank's end record repeats its start's, and a row again for each of them was a
        #: second 100,000 rows at the end of a 100,000-GPU job (its worker's core thread,
        #: ~16 us a record).
        self._stored: dict[tuple[str, int], dict[int, int]] = {}

    def add(self, info: JobInfo) -> bool:
        """Remember `info`'s rank; True when it named its machine other than its rank last
        did (a row to store). A record naming no machine (a replayed trace's rank saying it
        ended) names none, not "an unnamed host".

        >>> book = MachineBook()
        >>> who = RankIdentity(rank=0, host="node-1", gpu=0)
        >>> record = JobInfo(job_id="j", dp_size=1, pp_size=1, world_size=1, rank_identity=who)
        >>> book.add(record), book.add(record.model_copy(update={"ended_ns": 7}))
        (True, False)
        >>> book.add(record.model_copy(update={"rank_identity": who.model_copy(update={"gpu": 1})}))
        True
        """
        who = info.rank_identity
        if who is None or not (who.node or who.host):
            return False
        key = (info.job_id, info.attempt)
        if who.tp_rank == 0 and who.cp_rank == 0:
            self._by_job.setdefault(key, {})[who.dp_rank, who.pp_rank] = machine_label(who)
            self._identity.setdefault(key, {})[who.dp_rank, who.pp_rank] = who
        stored = self._stored.setdefault(key, {})
        # Its fields' values (a pydantic model's repr took 15 us); a newer writer's extra
        # fields by their text.
        extra = who.model_extra
        fingerprint = hash((tuple(who.__dict__.values()), repr(extra) if extra else ""))
        if stored.get(who.rank) == fingerprint:
            return False
        stored[who.rank] = fingerprint
        return True

    def machines(self, job_id: str, attempt: int) -> Mapping[tuple[int, int], str]:
        return self._by_job.get((job_id, attempt), {})

    def identity(self, job_id: str, attempt: int, worker: tuple[int, int]) -> RankIdentity | None:
        """The representative rank of `worker` (dp, pp), when its record said."""
        return self._identity.get((job_id, attempt), {}).get(worker)


def name_machines(diagnosis: Diagnosis, machines: Mapping[tuple[int, int], str]) -> Diagnosis:
    """`diagnosis` with every "(dp d, pp s)" it names followed by "on <machine>" when known."""
    if not machines:
        return diagnosis

    def named(match: re.Match[str]) -> str:
        machine = machines.get((int(match.group(1)), int(match.group(2))))
        return f"{match.group(0)} on {machine}" if machine else match.group(0)

    advice = tuple(
        dataclasses.replace(a, detail=_WORKER.sub(named, a.detail)) for a in diagnosis.advice
    )
    return dataclasses.replace(diagnosis, summary=_WORKER.sub(named, diagnosis.summary),
                               advice=advice)  # fmt: skip
