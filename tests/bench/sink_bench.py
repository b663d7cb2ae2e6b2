"""ClickHouse sink on embedded chDB: insert throughput (raw ops, per-step result batches)
and the latency of typical dashboard queries.

Runs in a fresh subprocess: chDB opens one data directory per process, and the store
lives in a temporary directory that is removed afterwards.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]

OPS_BATCH_ROWS = 100_000
OPS_BATCHES = 10
#: A 1,024-GPU job (dp 128 x pp 8): one batch per step with its attribution and heatmap.
DP, PP, N_OPTYPES = 128, 8, 12
RESULT_BATCHES = 200
QUERY_REPEATS = 15


def run() -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.bench.sink_bench"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"sink bench failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ops_batch(index: int, t0_ns: int):
    from lagscope.store.sink import SinkBatch

    n = OPS_BATCH_ROWS
    rng = np.random.default_rng(index)
    rank = np.arange(n) % (DP * PP)
    batch = SinkBatch(f"bench-ops/{index}")
    batch.add(
        "ops",
        {
            "job_id": np.full(n, "bench", dtype=object),
            "attempt": np.zeros(n, np.uint32),
            "step": np.full(n, index, np.uint64),
            "rank": rank.astype(np.uint32),
            "dp_rank": (rank % DP).astype(np.uint32),
            "pp_rank": (rank // DP).astype(np.uint32),
            "tp_rank": np.zeros(n, np.uint32),
            "cp_rank": np.zeros(n, np.uint32),
            "optype": np.array(["forward-compute", "backward-compute"] * (n // 2), dtype=object),
            "seq": (np.arange(n) // (DP * PP)).astype(np.uint32),
            "microbatch": np.zeros(n, np.uint32),
            "chunk": np.zeros(n, np.uint32),
            "start": (t0_ns + index * 10**9 + np.arange(n) * 1000).astype("datetime64[ns]"),
            "duration_ns": rng.integers(10_000, 1_000_000, n).astype(np.uint64),
            "batch_id": np.full(n, f"b{index}", dtype=object),
        },
    )
    return batch


def result_batch(step: int, t0: float):
    """What `rows_from_result` builds for one step of the 1,024-GPU job."""
    from lagscope.store.sink import SinkBatch

    rng = np.random.default_rng(step)
    slowdown = 1 + rng.exponential(0.05)
    batch = SinkBatch(f"bench/0/{step}-{step}/0")
    ts = t0 + step * 2.0
    batch.add(
        "steps",
        {
            "job_id": ["bench"],
            "attempt": [0],
            "step": [step],
            "ts": [ts],
            "complete": [True],
            "missing_ranks": [[]],
            "actual_s": [2.0 * slowdown],
            "simulated_s": [2.0 * slowdown],
            "ideal_s": [2.0],
            "slowdown": [slowdown],
            "launch_slowdown": [1.0],
            "waste": [1 - 1 / slowdown],
            "mfu_actual": [0.4 / slowdown],
            "mfu_ideal": [0.4],
            "n_gpus": [DP * PP],
            "gpu_seconds": [2.0 * slowdown * DP * PP],
            "gpu_seconds_wasted": [2.0 * (slowdown - 1) * DP * PP],
            "processed_at": [ts + 5],
            "version": [0],
        },
    )
    names = [f"op{i}" for i in range(N_OPTYPES)] + [str(d) for d in range(DP)]
    names += [str(s) for s in range(PP)]
    kinds = ["optype"] * N_OPTYPES + ["dp_rank"] * DP + ["stage"] * PP
    n = len(names)
    batch.add(
        "attribution",
        {
            "job_id": ["bench"] * n,
            "attempt": np.zeros(n, np.uint32),
            "step": np.full(n, step, np.uint64),
            "ts": np.full(n, ts),
            "kind": kinds,
            "name": names,
            "slowdown": 1 + rng.exponential(0.02, n),
            "version": np.zeros(n, np.uint64),
        },
    )
    n = DP * PP
    batch.add(
        "worker_slowdown",
        {
            "job_id": ["bench"] * n,
            "attempt": np.zeros(n, np.uint32),
            "step": np.full(n, step, np.uint64),
            "ts": np.full(n, ts),
            "dp_rank": (np.arange(n) % DP).astype(np.uint32),
            "pp_rank": (np.arange(n) // DP).astype(np.uint32),
            "slowdown": 1 + rng.exponential(0.02, n),
            "version": np.zeros(n, np.uint64),
        },
    )
    return batch


DASHBOARD_QUERIES = {
    "slowdown per minute (rollup)": (
        "SELECT minute, sum(slowdown_sum) / sum(slowdown_count) AS slowdown, "
        "sum(gpu_seconds_wasted) FROM steps_1m WHERE job_id = {job:String} "
        "AND attempt = {attempt:UInt32} GROUP BY minute ORDER BY minute"
    ),
    "steps of a job (FINAL)": (
        "SELECT step, ts, slowdown, mfu_actual FROM steps FINAL WHERE job_id = {job:String} "
        "AND attempt = {attempt:UInt32} ORDER BY step"
    ),
    "worker heatmap, 100 steps (FINAL)": (
        "SELECT pp_rank, dp_rank, avg(slowdown) FROM worker_slowdown FINAL "
        "WHERE job_id = {job:String} AND attempt = {attempt:UInt32} "
        "AND step BETWEEN {lo:UInt64} AND {hi:UInt64} GROUP BY pp_rank, dp_rank"
    ),
}


def _measure() -> list[dict]:
    from lagscope.store.sink import ClickHouseSink

    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="lagscope-sink-bench-") as tmp:
        store = ClickHouseSink(f"chdb://{tmp}")
        store.ensure_schema()
        t0_ns = time.time_ns() - 3600 * 10**9  # recent: inside the ops TTL
        batches = [ops_batch(i, t0_ns) for i in range(OPS_BATCHES)]
        started = time.perf_counter()
        for batch in batches:
            store.write(batch)
        elapsed = time.perf_counter() - started
        rows.append(
            {
                "benchmark": f"sink: ops insert, batches of {OPS_BATCH_ROWS:,} rows",
                "value": OPS_BATCHES * OPS_BATCH_ROWS / elapsed,
                "unit": "rows/s",
                "target": ">= 500k rows/s",
            }
        )
        t0 = time.time() - 86400
        batches = [result_batch(step, t0) for step in range(RESULT_BATCHES)]
        n_rows = sum(sum(b.row_count(t) for t in b.tables) for b in batches)
        started = time.perf_counter()
        for batch in batches:
            store.write(batch)
        elapsed = time.perf_counter() - started
        rows.append(
            {
                "benchmark": f"sink: per-step result batches (dp {DP} x pp {PP})",
                "value": RESULT_BATCHES / elapsed,
                "unit": "batches/s",
                "target": ">= 20 batches/s",
                "rows_per_s": n_rows / elapsed,
            }
        )
        params = {"job": "bench", "attempt": 0, "lo": 50, "hi": 149}
        for name, sql in DASHBOARD_QUERIES.items():
            store.query(sql, params)  # warm the caches, as a refreshing dashboard does
            latencies = []
            for _ in range(QUERY_REPEATS):
                started = time.perf_counter()
                store.query(sql, params)
                latencies.append(time.perf_counter() - started)
            rows.append(
                {
                    "benchmark": f"sink: query {name}",
                    "value": statistics.median(latencies) * 1000,
                    "unit": "ms",
                    "target": "<= 100 ms (median)",
                }
            )
        store.close()
    return rows


if __name__ == "__main__":
    print(json.dumps(_measure()))
