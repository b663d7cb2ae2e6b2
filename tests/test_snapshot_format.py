"""Snapshots are data, never code: a crafted snapshot in the store cannot run anything in
the worker, a damaged one is passed over, and a good one restores the exact state."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lagscope.store.schema import WORKER_STATE_TABLE
from lagscope.store.sink import ClickHouseSink
from lagscope.store.snapshot_format import SnapshotError, decode_state, encode_state
from lagscope.stream_app.worker_config import WorkerConfig
from lagscope.stream_app.worker_core import SNAPSHOT_VERSION, WorkerCore


class _Exploit:
    """What an attacker who can write the store would plant: unpickling runs os.system."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_state_round_trips_exactly():
    tree = {
        ("job", 0): {"ids": (1, 2, 3), "seen": {4, 5}, "frozen": frozenset({"a"})},
        "arrays": [np.arange(5, dtype=np.int64), np.array([0.1, np.nan, -np.inf])],
        "scalar": np.float32(1 / 3),
        "nan": float("nan"),
        "bytes": b"\x00\xff",
        "none": None,
    }
    back = decode_state(encode_state(tree))
    assert back[("job", 0)] == {"ids": (1, 2, 3), "seen": {4, 5}, "frozen": frozenset({"a"})}
    np.testing.assert_array_equal(back["arrays"][0], tree["arrays"][0])
    assert back["arrays"][1].tobytes() == tree["arrays"][1].tobytes()  # bit for bit
    assert back["scalar"].dtype == np.float32 and back["scalar"] == tree["scalar"]
    assert np.isnan(back["nan"]) and back["bytes"] == b"\x00\xff" and back["none"] is None


def test_a_model_written_before_a_field_was_added_reads_with_its_default():
    """A snapshot of an older version lacks `DependencyModel.host_predecessor`: the job
    resumes with its default (launch delays as its host time); an unknown field is
    refused."""
    import json
    import zipfile

    from lagscope.simulator.generate import JobSpec, generate_job
    from lagscope.simulator.prepare import prepare

    job = generate_job(JobSpec(dp=2, pp=2, microbatches=2, steps=1))
    model = prepare(job.trace, job.meta).model
    assert model.host_predecessor is not None

    def rewritten(change) -> bytes:
        with zipfile.ZipFile(io.BytesIO(encode_state({"model": model}))) as old:
            members = {name: old.read(name) for name in old.namelist()}
        tree = np.load(io.BytesIO(members["__tree__.npy"]))
        document = json.loads(tree.tobytes())
        change(document["tree"]["$dict"][0][1]["fields"])
        buffer = io.BytesIO()
        np.save(buffer, np.frombuffer(json.dumps(document).encode(), dtype=np.uint8))
        members["__tree__.npy"] = buffer.getvalue()
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w") as new:
            for name, data in members.items():
                new.writestr(name, data)
        return out.getvalue()

    older = decode_state(rewritten(lambda fields: fields.pop("host_predecessor")))
    assert older["model"].host_predecessor is None and older["model"].deps == model.deps
    with pytest.raises(SnapshotError, match="fields"):
        decode_state(rewritten(lambda fields: fields.update(unknown=1)))


def test_what_the_format_cannot_hold_is_refused_when_writing(tmp_path):
    with pytest.raises(TypeError, match="cannot be stored"):
        encode_state({"x": _Exploit(tmp_path / "never")})
    with pytest.raises(TypeError, match="object arrays"):
        encode_state(np.array([object()], dtype=object))


def test_a_pickle_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    crafted = pickle.dumps({"version": SNAPSHOT_VERSION, "x": _Exploit(marker)})
    with pytest.raises(SnapshotError, match="not a lagscope state payload"):
        decode_state(crafted, "crafted")
    # an .npz whose member is a pickled object array: numpy refuses it, nothing runs
    import io

    buffer = io.BytesIO()
    np.savez(buffer, __tree__=np.array([_Exploit(marker)], dtype=object))
    with pytest.raises(SnapshotError):
        decode_state(buffer.getvalue(), "crafted npz")
    assert not marker.exists()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_damaged_payload_is_a_snapshot_error_or_a_value_never_a_crash(data):
    payload = bytearray(
        encode_state({("j", 0): {"a": np.arange(4.0), "t": (1, "x")}, "dataclass": None})
    )
    for _ in range(data.draw(st.integers(1, 8))):
        position = data.draw(st.integers(0, len(payload) - 1))
        payload[position] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(payload)))
    try:
        decode_state(bytes(payload[:cut]), "damaged")
    except SnapshotError as exc:
        assert "damaged" in str(exc)


def test_the_worker_passes_over_a_crafted_snapshot_without_running_it(chdb_dsn, tmp_path):
    marker = tmp_path / "pwned"
    sink = ClickHouseSink(chdb_dsn)
    sink.ensure_schema()
    core = WorkerCore(WorkerConfig(), sink, publish=lambda key, value: None)
    core.partition(0)  # a fresh partition, snapshotted at its start
    core.partitions[0].next_offset = 7
    assert core.checkpoint(0) == 7

    # Whoever can write the store plants a newer "snapshot" that is a pickle.
    crafted = pickle.dumps({"version": SNAPSHOT_VERSION, "x": _Exploit(marker)})
    sink.client.insert(
        WORKER_STATE_TABLE,
        [[core.group, core.topic, 0, 99, 0, crafted]],
        column_names=["group_id", "topic", "partition", "next_offset", "written_at", "state"],
    )
    restarted = WorkerCore(WorkerConfig(), sink, publish=lambda key, value: None)
    part = restarted.partition(0)
    assert not marker.exists()
    # the older, readable snapshot is used, and the consumer is sent back to its offset
    assert part.next_offset == 7
    assert restarted.take_seeks() == {0: 7}
    sink.close()
