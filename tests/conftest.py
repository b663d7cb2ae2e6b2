"""Shared fixtures. The reference traces live in ../shared/reference-traces beside the
checkout (never copied into the project); a run without them fails rather than skips."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
REFERENCE_TRACES = Path(
    os.environ.get("LAGSCOPE_REFERENCE_TRACES", REPO_ROOT.parent / "shared" / "reference-traces")
)
REFERENCE_NAMES = ("AR", "SE", "ST")


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
    from producers.reference_format import load_meta, load_trace

    return (
        load_trace(REFERENCE_TRACES / f"trace-{name}.parquet"),
        load_meta(REFERENCE_TRACES / f"meta-{name}.yaml"),
    )


@cache
def analyzed_reference(name: str):
    from simulator.prepare import prepare
    from simulator.whatif import analyze

    trace, meta = load_reference(name)
    prepared = prepare(trace, meta)
    return prepared, analyze(prepared)


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
