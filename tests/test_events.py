"""Encoding round-trip, determinism of batch ids, and clear errors on bad data."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lagscope.producers.events import (
    BATCH_VERSION,
    OP_FIELDS,
    JobInfo,
    RankStepBatch,
    SchemaError,
    StepEncoder,
    batch_from_records,
    batch_id_of,
    decode_batch,
    encode_batch,
)
from lagscope.simulator.optypes import KNOWN_OPTYPES
from lagscope.simulator.trace import JobMeta

i64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@st.composite
def batches(draw: st.DrawFn) -> RankStepBatch:
    n = draw(st.integers(min_value=0, max_value=40))
    names = draw(st.lists(st.sampled_from((*KNOWN_OPTYPES, "custom-op")), min_size=n, max_size=n))
    return RankStepBatch.build(
        job_id=draw(st.text(min_size=1, max_size=20)),
        attempt=draw(st.integers(0, 2**31)),
        rank=draw(st.integers(0, 2**31 - 1)),
        dp_rank=draw(st.integers(0, 1000)),
        pp_rank=draw(st.integers(0, 100)),
        tp_rank=draw(st.integers(0, 8)),
        cp_rank=draw(st.integers(0, 8)),
        step=draw(st.integers(0, 2**63 - 1)),
        optype=names,
        microbatch=draw(st.lists(st.integers(-1, 2**31 - 1), min_size=n, max_size=n)),
        chunk=draw(st.lists(st.integers(-1, 100), min_size=n, max_size=n)),
        seq=draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)),
        start_ns=draw(st.lists(i64, min_size=n, max_size=n)),
        duration_ns=draw(st.lists(st.integers(0, 2**63 - 1), min_size=n, max_size=n)),
    )


@settings(max_examples=200, deadline=None)
@given(batches())
def test_encoding_round_trips_every_field(batch: RankStepBatch) -> None:
    encoded = encode_batch(batch)
    decoded = decode_batch(encoded)
    assert decoded.to_records() == batch.to_records()
    assert encode_batch(decoded) == encoded
    assert decoded.batch_id == batch_id_of(encoded)


@settings(max_examples=200, deadline=None)
@given(batches(), st.permutations((*KNOWN_OPTYPES, "custom-op")))
def test_the_timers_step_encoder_writes_the_bytes_encode_batch_does(
    batch: RankStepBatch, timer_names: list[str]
) -> None:
    # The timer's dictionary is its own (any order, every name); the wire's is the names
    # used, sorted: the two paths must agree byte for byte, or batch ids would differ.
    fields = ("job_id", "attempt", "rank", "dp_rank", "pp_rank", "tp_rank", "cp_rank")
    identity = {k: getattr(batch, k) for k in fields}
    encoder = StepEncoder(**identity, optype_names=timer_names)
    used = [batch.optype_names[c] for c in batch.optype.tolist()]
    codes = [timer_names.index(name) for name in used]
    encoded = encoder.encode(
        batch.step, codes, batch.microbatch.tolist(), batch.chunk.tolist(), batch.seq.tolist(),
        batch.start_ns.tolist(), batch.duration_ns.tolist(),
    )  # fmt: skip
    assert encoded == encode_batch(batch)


def _sample(**overrides: object) -> RankStepBatch:
    args: dict[str, object] = dict(
        job_id="job-1",
        attempt=0,
        rank=3,
        dp_rank=1,
        pp_rank=2,
        step=7,
        optype=["forward-compute", "backward-compute", "forward-compute"],
        microbatch=[0, 0, 1],
        chunk=[0, 0, 0],
        seq=[0, 0, 1],
        start_ns=[1_000, 2_000, 3_000],
        duration_ns=[10, 20, 30],
    )
    args.update(overrides)
    return RankStepBatch.build(**args)


def test_batch_id_depends_on_content_only_not_on_dictionary_layout() -> None:
    a = _sample()
    b = RankStepBatch.build(
        job_id="job-1",
        attempt=0,
        rank=3,
        dp_rank=1,
        pp_rank=2,
        step=7,
        optype=[2, 0, 2],
        optype_names=("backward-compute", "gc", "forward-compute"),
        microbatch=[0, 0, 1],
        chunk=[0, 0, 0],
        seq=[0, 0, 1],
        start_ns=[1_000, 2_000, 3_000],
        duration_ns=[10, 20, 30],
    )
    assert a.batch_id == b.batch_id
    assert _sample(duration_ns=[10, 20, 31]).batch_id != a.batch_id
    assert _sample(step=8).batch_id != a.batch_id
    assert _sample(attempt=1).batch_id != a.batch_id


def test_records_round_trip_through_batch_from_records() -> None:
    records = _sample().to_records()
    assert set(records[0]) == set(OP_FIELDS)
    assert batch_from_records(records).to_records() == records
    records[1]["step"] = 99
    with pytest.raises(SchemaError, match="record 1 has step=99"):
        batch_from_records(records)


def test_decode_rejects_unknown_version_with_clear_message() -> None:
    encoded = bytearray(encode_batch(_sample()))
    struct.pack_into("<H", encoded, 4, BATCH_VERSION + 6)
    body = bytes(encoded[:-4])
    encoded[-4:] = struct.pack("<I", zlib.crc32(body))
    with pytest.raises(SchemaError, match=f"unknown batch encoding version {BATCH_VERSION + 6}"):
        decode_batch(bytes(encoded), where="msg@42")


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda b: b[:10], "too short"),
        (lambda b: b"XXXX" + b[4:], "bad magic"),
        (lambda b: b[:-9] + bytes([b[-9] ^ 0xFF]) + b[-8:], "checksum mismatch"),
        (lambda b: b[:-1], "checksum mismatch"),
    ],
)
def test_decode_rejects_corrupt_data(mutate, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        decode_batch(mutate(encode_batch(_sample())), where="source.log@0")


def test_build_rejects_out_of_range_and_negative_values() -> None:
    with pytest.raises(SchemaError, match="'chunk' holds values"):
        _sample(chunk=[0, 0, 70_000])
    with pytest.raises(SchemaError, match="negative duration_ns"):
        _sample(duration_ns=[10, -1, 30])
    with pytest.raises(SchemaError, match="job_id is empty"):
        _sample(job_id="")


def test_binary_is_much_smaller_than_json() -> None:
    n = 200
    batch = _sample(
        optype=["forward-compute"] * n,
        microbatch=np.arange(n),
        chunk=np.zeros(n, int),
        seq=np.arange(n),
        start_ns=1_700_000_000_000_000_000 + np.arange(n) * 1000,
        duration_ns=np.full(n, 123_456),
    )
    as_json = json.dumps(batch.to_records()).encode()
    assert len(encode_batch(batch)) * 5 < len(as_json)


def test_job_info_extends_job_meta() -> None:
    meta = JobMeta(dp_size=4, pp_size=4, tp_size=4, world_size=64)
    info = JobInfo.from_meta(meta, job_id="AR-0", attempt=2)
    assert info.key == "AR-0/2"
    assert info.cp_size == 1
    assert info.to_meta() == meta
    assert JobInfo.model_validate_json(info.model_dump_json()) == info
    with pytest.raises(ValueError, match="world_size"):
        JobInfo(job_id="x", dp_size=2, pp_size=1, world_size=3)
