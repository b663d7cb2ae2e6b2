"""The distributed worker's checkpoints in the store: a partition's snapshot with the first
offset it has not consumed (`worker_state`), and the inputs of the steps it retains for
its jobs' roll-ups (`worker_retained`), each step written once, when the first snapshot
that retains it is written, so a snapshot costs what changed, not the whole window.

Snapshots are data, never code (`store/snapshot_format.py`: JSON and numpy arrays
read with `allow_pickle=False`), so whoever can write the store cannot run code in the
worker. Every statement goes through the sink (`ClickHouseSink.insert_rows`, `.query`):
bound parameters, retried writes, deduplicated by a token naming the content.
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Sequence

from lagscope.store.schema import WORKER_RETAINED_TABLE, WORKER_STATE_TABLE
from lagscope.store.sink import ClickHouseSink


class CheckpointStore:
    """One consumer group's checkpoints of one topic's partitions."""

    def __init__(self, sink: ClickHouseSink, group: str, topic: str) -> None:
        self.sink = sink
        self.group = group
        self.topic = topic

    def write_snapshot(self, partition: int, next_offset: int, blob: bytes) -> None:
        """A partition's snapshot, covering everything before `next_offset`."""
        self.write_snapshots([(partition, next_offset, blob)])

    def write_snapshots(self, snapshots: Sequence[tuple[int, int, bytes]]) -> None:
        """Snapshots of several partitions, (partition, next offset, snapshot) each, in
        one insert (a worker checkpoints the partitions that are due together)."""
        if not snapshots:
            return
        now = dt.datetime.now(dt.UTC)
        covered = ",".join(f"{partition}@{offset}" for partition, offset, _ in snapshots)
        self.sink.insert_rows(
            WORKER_STATE_TABLE,
            ["group_id", "topic", "partition", "next_offset", "written_at", "state"],
            [[self.group, self.topic, p, offset, now, blob] for p, offset, blob in snapshots],
            f"state/{self.group}/{self.topic}/{covered}",
        )

    def snapshots(self, partition: int, newest: int) -> list[tuple[int, bytes]]:
        """(next offset, snapshot) of the partition's `newest` snapshots, newest first."""
        _, rows = self.sink.query(
            f"SELECT next_offset, state FROM {WORKER_STATE_TABLE} "
            "WHERE group_id = {group:String} AND topic = {topic:String} "
            "AND partition = {partition:UInt32} ORDER BY next_offset DESC LIMIT {n:UInt32}",
            {"group": self.group, "topic": self.topic, "partition": partition, "n": newest},
            bytes_columns=("state",),
        )
        return [(int(offset), blob) for offset, blob in rows]

    def write_retained(self, steps: Sequence[tuple[str, int, int, bytes]]) -> None:
        """The inputs of retained steps, (job, attempt, step, encoded inputs) each."""
        if not steps:
            return
        now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
        first, last = steps[0], steps[-1]
        keys = "\n".join(f"{job}\t{attempt}\t{step}" for job, attempt, step, _ in steps)
        digest = hashlib.blake2b(keys.encode(), digest_size=12).hexdigest()
        self.sink.insert_rows(
            WORKER_RETAINED_TABLE,
            ["group_id", "job_id", "attempt", "step", "written_at", "inputs"],
            [[self.group, job, attempt, step, now, inputs] for job, attempt, step, inputs in steps],
            f"retained/{self.group}/{first[0]}/{first[1]}/{first[2]}-"
            f"{last[0]}/{last[1]}/{last[2]}/{len(steps)}/{digest}",
        )

    def retained_inputs(self, job: tuple[str, int], steps: list[int]) -> dict[int, bytes]:
        """The encoded inputs of a job's retained steps, by step (those found)."""
        _, rows = self.sink.query(
            f"SELECT step, any(inputs) AS inputs FROM {WORKER_RETAINED_TABLE} "
            "WHERE group_id = {group:String} AND job_id = {job:String} "
            "AND attempt = {attempt:UInt32} AND step IN {steps:Array(UInt64)} GROUP BY step",
            {"group": self.group, "job": job[0], "attempt": job[1], "steps": steps},
            bytes_columns=("inputs",),
        )
        return {int(step): inputs for step, inputs in rows}
