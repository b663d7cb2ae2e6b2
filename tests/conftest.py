"""Shared fixtures.

- The reference traces are vendored in tests/data/reference-traces (see its README and the
  NOTICE); `LAGSCOPE_REFERENCE_TRACES` points the suite at another copy.
- A real Kafka broker for the whole session: `LAGSCOPE_KAFKA_BOOTSTRAP=host:port` uses an
  existing broker; otherwise a local KRaft broker is fetched (deploy/kafka_local.py, cached
  in ~/.cache/lagscope/kafka/) and started. If it cannot start, the tests that need it fail with the
  broker's log: they never skip. Under pytest-xdist (`make test`) each test process starts
  a broker of its own (free ports): the tests' topics are their own, but not their consumer
  groups' names, so an existing broker serves one pytest process only.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from lagscope.deploy.kafka_local import KafkaBroker
from lagscope.producers.config import KafkaSettings, LagscopeConfig, StreamerSettings

REPO_ROOT = Path(__file__).resolve().parent.parent
REFERENCE_TRACES = Path(
    os.environ.get("LAGSCOPE_REFERENCE_TRACES", REPO_ROOT / "tests" / "data" / "reference-traces")
)
REFERENCE_NAMES = ("AR", "SE", "ST")


#: Fixtures whose tests are slow by nature, marked `slow` here rather than one by one: a
#: real Kafka broker (its start, and the end-to-end runs through it); torch.profiler traces
#: of a real torch job (tests/test_profiler_trace.py).
SLOW_FIXTURES = frozenset({"kafka_bootstrap", "own_broker", "profiled_torch_job"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`make test-fast` leaves out the tests marked `slow`: those marked in their module
    (real torch jobs, live runs, browsers, ...) and every test that needs a broker."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    if not (REFERENCE_TRACES / "trace-AR.parquet").exists():
        pytest.fail(
            f"reference traces not found in {REFERENCE_TRACES}; set LAGSCOPE_REFERENCE_TRACES"
        )
    return REFERENCE_TRACES


@cache
def load_reference(name: str):
    """(trace, meta) of a reference trace, cached for the session."""
    from lagscope.producers.reference_format import load_meta, load_trace

    return (
        load_trace(REFERENCE_TRACES / f"trace-{name}.parquet"),
        load_meta(REFERENCE_TRACES / f"meta-{name}.yaml"),
    )


@cache
def analyzed_reference(name: str):
    from lagscope.simulator.prepare import prepare
    from lagscope.simulator.whatif import analyze

    trace, meta = load_reference(name)
    prepared = prepare(trace, meta)
    return prepared, analyze(prepared)


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    existing = os.environ.get("LAGSCOPE_KAFKA_BOOTSTRAP")
    if existing and os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.fail(
            "LAGSCOPE_KAFKA_BOOTSTRAP serves one pytest process: tests running side by side "
            "would share consumer groups there; unset it (each process starts its own broker)"
        )
    if existing:
        yield existing
        return
    broker = KafkaBroker(tmp_path_factory.mktemp("kafka"))
    broker.start()  # raises KafkaLocalError with the broker's log: the test errors out
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture
def own_broker(tmp_path: Path) -> Iterator[KafkaBroker]:
    """A broker of the test's own, to stop and start again (the session's is shared)."""
    broker = KafkaBroker(tmp_path / "kafka-own")
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def kafka_topics() -> dict[str, str]:
    """Topic names unique to one test, so tests sharing a broker do not see each other."""
    prefix = f"test-{uuid.uuid4().hex[:10]}"
    return {
        "topic_ops": f"{prefix}.ops",
        "topic_deadletter": f"{prefix}.deadletter",
        "topic_jobs": f"{prefix}.jobs",
    }


@pytest.fixture
def streamer_config(kafka_bootstrap: str, kafka_topics: dict[str, str], tmp_path: Path):
    def make(log_dir: Path, **streamer: object) -> LagscopeConfig:
        return LagscopeConfig(
            kafka=KafkaSettings(bootstrap_servers=kafka_bootstrap, **kafka_topics),
            streamer=StreamerSettings(log_dir=log_dir, **{"idle_exit_s": 0.5, **streamer}),
        )

    return make


@pytest.fixture(scope="session")
def chdb_dir(tmp_path_factory) -> Path:
    """The one chDB data directory of the test session: chDB opens a single directory per
    process, so every test that needs a store shares it (each with its own database)."""
    return tmp_path_factory.mktemp("chdb")


@pytest.fixture
def chdb_dsn(chdb_dir: Path, request) -> str:
    """DSN of a fresh database (named after the test) in the session's chDB directory."""
    import re

    name = re.sub(r"\W", "_", request.node.name)[:60]
    return f"chdb://{chdb_dir}?database=t_{name}"


def assert_same_result(got, want, what: str) -> None:
    """Two what-if results hold the same numbers, bit for bit."""
    for name in ("steps", "t_actual", "t_nodelay", "t_ideal", "worker_slowdown"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name), f"{what}: {name}")
    np.testing.assert_array_equal(np.isnan(got.t_simulated), np.isnan(want.t_simulated))
    assert got.slowdown == want.slowdown, what
    assert got.launch_slowdown == want.launch_slowdown, what
    assert got.ideal_cost == want.ideal_cost, what
    for kind in ("by_optype", "by_dp_rank", "by_stage", "launch_by_optype", "launch_by_stage"):
        a, b = getattr(got, kind), getattr(want, kind)
        assert (a is None) == (b is None), f"{what}: {kind}"
        if a is not None:
            assert a.overall == b.overall, f"{what}: {kind}"
            assert a.per_step.keys() == b.per_step.keys()
            for key in a.per_step:
                np.testing.assert_array_equal(a.per_step[key], b.per_step[key], f"{kind} {key}")


def straight_and_resumed(
    info, steps: list, settings, cut: int
) -> tuple[list, list, object, object]:
    """A job's steps ((end, step, batches) each) through one processor straight, and
    through another snapshotted after `cut` steps and resumed from the snapshot: the step
    outputs of each, and the two processors."""
    from lagscope.store.snapshot_format import decode_state, encode_state
    from lagscope.stream_app.processor import StepProcessor

    def feed(processor, part) -> list:
        return [out for _, _, batches in part for b in batches for out in processor.on_batch(b)]

    straight = StepProcessor(settings)
    straight.on_job(info)
    want = feed(straight, steps)
    resumed = StepProcessor(settings)
    resumed.keep_diagnosed = True  # as a worker, which snapshots
    resumed.on_job(info)
    got = feed(resumed, steps[:cut])
    resumed = StepProcessor.from_state(decode_state(encode_state(resumed.state_dict())))
    got += feed(resumed, steps[cut:])
    return want, got, straight, resumed
