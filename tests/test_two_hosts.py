"""One pipeline, two hosts: the same rank logs through `lagscope run` (embedded) and through
`lagscope stream` -> Kafka -> `lagscope worker` give the same rows in every table, row for
row, timestamps of processing aside. The worker computes its steps in a child process
(`processor.analysis_processes`), the embedded host in its own: the same rows too.

Everything is real and runs as a user runs it: each command a process of its own, the
local broker, a chDB store per host read back through `lagscope query`.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.cluster_run import TABLES as CLUSTER_TABLES
from tests.straggler_logs import write_straggler_logs
from tests.worker_util import create_topics, query_dsn, start_streamer, start_worker

pytestmark = pytest.mark.slow

#: Every table a host writes, the columns that order its rows, and the columns that say
#: when a host did something (they differ by design).
TABLES: dict[str, tuple[str, tuple[str, ...]]] = {
    **CLUSTER_TABLES,
    "ops": ("job_id, attempt, step, rank, start, optype, seq", ()),
}


def _rows(dsn: str, table: str) -> list[dict[str, Any]]:
    order, skip = TABLES[table]
    rows = query_dsn(dsn, f"SELECT * FROM {table} FINAL ORDER BY {order}")
    return [{k: v for k, v in row.items() if k not in skip} for row in rows]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return a == b


def test_the_same_logs_give_the_same_rows_through_either_host(
    kafka_bootstrap: str, kafka_topics: dict[str, str], tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    write_straggler_logs(logs, "two-hosts", gpus_per_node=4)
    embedded_dsn = f"chdb://{tmp_path / 'embedded'}"
    ran = subprocess.run(
        [sys.executable, "-m", "lagscope.cli", "run", "--log-dir", str(logs),
         "--dsn", embedded_dsn],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr

    create_topics(kafka_bootstrap, kafka_topics)
    streamer = start_streamer(kafka_bootstrap, kafka_topics, logs, tmp_path / "stream")
    assert streamer.wait(180) == 0, streamer.log()[-3000:]
    worker = start_worker(
        kafka_bootstrap, kafka_topics, tmp_path / "worker", group="two-hosts",
        env={"LAGSCOPE_STORE__RAW_OPS": "true", "LAGSCOPE_PROCESSOR__ANALYSIS_PROCESSES": "1",
             "LAGSCOPE_PROCESSOR__ANALYSIS_PROCESS_MIN_OPS": "0"},
    )  # fmt: skip
    assert worker.wait(300) == 0, worker.log()[-4000:]
    # The worker's steps were computed in a child process, the embedded host's in its own.
    assert "analysis process(es) started" in worker.log()
    worker_dsn = f"chdb://{tmp_path / 'worker' / 'chdb'}"

    episodes = _rows(embedded_dsn, "episodes")
    assert [(e["dp_rank"], e["pp_rank"], e["state"]) for e in episodes] == [(2, 1, "closed")]
    for table in TABLES:
        embedded, distributed = _rows(embedded_dsn, table), _rows(worker_dsn, table)
        assert len(embedded) == len(distributed), (table, len(embedded), len(distributed))
        if table != "dead_letters":
            assert embedded, f"{table}: no rows"
        for mine, theirs in zip(embedded, distributed, strict=True):
            differing = [k for k in mine if not _same(mine[k], theirs[k])]
            assert not differing, (table, {k: (mine[k], theirs[k]) for k in differing})
