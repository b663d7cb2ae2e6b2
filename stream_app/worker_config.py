"""The distributed worker's settings (`lagscope worker`): one `WorkerConfig`, layered by
`producers/config.py` (flags < environment `LAGSCOPE_<SECTION>__<FIELD>` < secrets
directory < config file < defaults)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from lagscope.producers.config import KafkaSettings, LagscopeConfig
from lagscope.store.dsn import DEFAULT_DSN, DSN_ENV
from lagscope.store.sink import RetryPolicy
from lagscope.stream_app.host_core import WRITE_EVERY_STEPS, WRITE_INTERVAL_S
from lagscope.stream_app.processor import ProcessorSettings


class WorkerKafkaSettings(KafkaSettings):
    topic_results: str = "lagscope.results"


class StoreSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: ClickHouse DSN (chdb:///dir or http(s)://...); default $LAGSCOPE_CLICKHOUSE_DSN or
    #: the embedded store under the working directory.
    dsn: str | None = None
    #: Days raw ops are kept, set on the store when the host starts. Unset, a new store
    #: keeps them 7 days and an existing one keeps the TTL it has: a host started without
    #: this setting must not cut what the store keeps (ClickHouse deletes past a TTL).
    ops_ttl_days: int | None = Field(default=None, ge=1)
    #: A failed write is tried this many times in all, with exponential back-off of at most
    #: `write_retry_max_wait_s` between tries; after that the closed steps stay pending
    #: (and the offsets uncommitted) until a later write succeeds.
    write_attempts: int = Field(default=5, ge=1)
    write_retry_max_wait_s: float = Field(default=2.0, gt=0)
    #: Keep every raw op in `ops` for the timeline drill-down (as `lagscope run` does): a
    #: large job writes ~27 bytes per op before compression, so it is off by default.
    raw_ops: bool = False

    def resolved_dsn(self) -> str:
        return self.dsn or os.environ.get(DSN_ENV) or DEFAULT_DSN

    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(
            attempts=self.write_attempts,
            first_wait_s=min(0.1, self.write_retry_max_wait_s),
            max_wait_s=self.write_retry_max_wait_s,
        )


class WorkerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: Consumer group (and faust app id): workers of one group share the partitions.
    group_id: str = "lagscope-worker"
    #: Write closed steps at least this often (seconds; a slow store's writes are spaced
    #: further, to a tenth of the worker's time: `host_core.WRITE_MAX_SHARE`) ...
    write_interval_s: float = Field(default=WRITE_INTERVAL_S, gt=0)
    #: ... or as soon as this many are waiting. A step that opens or closes an episode is
    #: written at once, once the partition is caught up.
    write_every_steps: int = Field(default=WRITE_EVERY_STEPS, ge=1)
    #: Snapshot the processors (and commit offsets) this often ...
    checkpoint_interval_s: float = Field(default=5.0, gt=0)
    #: ... or less often, so that snapshots take at most this share of the worker's time:
    #: a 100,000-GPU job's snapshot is 84 MB and takes ~0.9 s to encode and write, so it
    #: comes every ~18 s (a restart re-reads a little more of Kafka).
    checkpoint_max_share: float = Field(default=0.05, gt=0, le=1)
    #: Fetched runs (one partition's records from one fetch) handed to the processor at once
    #: ...
    take_max_runs: int = Field(default=4, ge=1)
    #: ... or those that came within this long of the first (a backlog fills them at once;
    #: a job followed live has one, which waited 0.2 s, a fifth of the latency budget).
    take_within_s: float = Field(default=0.05, gt=0)
    #: Most bytes fetched per partition at once (the size of a run): larger runs amortise the
    #: per-run cost; a run is at most this much memory per partition.
    fetch_max_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    #: How long a batch of a job without metadata waits for `lagscope.jobs`.
    job_wait_s: float = Field(default=5.0, ge=0)
    #: How often lateness timeouts, writes and snapshots are checked: a live job's steps
    #: not yet due at the end of their pass (writes are spaced by their own cost) wait
    #: for the next tick, 0.25 s at most, a quarter of a step's 1 s budget to the store.
    tick_interval_s: float = Field(default=0.25, gt=0)
    #: Conclude a job (episodes refined, final diagnosis) once it has received no batch
    #: and closed no step for this long (a job every rank of which said it ended is
    #: concluded at once; an idle job may only have paused, so its open episodes keep
    #: their live bounds); while it runs its diagnosis is kept current anyway
    #: (`processor.diagnose_every_steps`).
    rollup_idle_s: float = Field(default=10.0, gt=0)
    #: Exit after this long with no message and everything written (tests, backfills).
    exit_when_idle_s: float | None = Field(default=None, gt=0)
    #: Kafka group session timeout; a killed worker's partitions move after this long.
    session_timeout_s: float = Field(default=30.0, ge=6)
    #: The worker's state directory (faust keeps little there: no tables are used). Made
    #: when missing; None: a fresh temporary directory, removed at exit, so the worker
    #: starts in any working directory.
    data_dir: Path | None = None
    #: Serve Prometheus metrics on this port (0 = any free port, logged); None = off.
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    #: Address the metrics endpoint listens on.
    metrics_addr: str = "0.0.0.0"
    #: Seconds between two tries to reach a Kafka broker that does not answer at start-up.
    broker_retry_s: float = Field(default=5.0, gt=0)
    #: The metrics endpoint's /healthz fails once the worker's loop has not gone round for
    #: this long, or its consumer has had records waiting and taken none (seconds).
    stall_s: float = Field(default=120.0, gt=0)


class WorkerConfig(LagscopeConfig):
    kafka: WorkerKafkaSettings = Field(default_factory=WorkerKafkaSettings)
    processor: ProcessorSettings = Field(default_factory=ProcessorSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    worker: WorkerSettings = Field(default_factory=WorkerSettings)
