"""The worker's Prometheus metric families: what one scrape reads of a worker core's
counters (copies of what the core and the event loop keep in plain Python)."""

from __future__ import annotations

from typing import Any

from lagscope.stream_app.worker_core import WorkerCore


def worker_metric_families(
    core: WorkerCore, topic: str, lag_by_partition: dict[int, int]
) -> list[Any]:
    """The families of one scrape of a worker over `core`, consuming `topic`, with each
    assigned partition's consumer lag (records in Kafka past the last one processed)."""
    from lagscope.producers.metrics import (
        counter,
        gauge,
        histogram,
        labelled_counter,
        labelled_gauge,
    )

    counters = dict(core.counters)
    lag = {(topic, str(number)): value for number, value in lag_by_partition.items()}
    stored = dict(core.steps_stored)
    return [
        counter("lagscope_worker_records_total",
                "Records of the ops topic processed (re-deliveries below a snapshot not "
                "counted).", counters["messages"]),
        counter("lagscope_worker_replayed_records_total",
                "Re-delivered records skipped because a snapshot already covers them.",
                counters["replayed_skipped"]),
        counter("lagscope_worker_records_read_again_total",
                "Records handed over past the analysis (the consumer ahead of a restored "
                "state), held and read again after the worker moved the consumer back.",
                counters["held_for_seek"]),
        counter("lagscope_worker_records_never_read_total",
                "Records of the ops topic never read: the offsets a partition skipped "
                "(deleted by retention before the worker came to them).",
                counters["records_never_read"]),
        counter("lagscope_worker_ops_total", "Ops in the processed batches.",
                counters["ops"]),
        labelled_counter("lagscope_worker_steps_total",
                         "Closed steps stored, each once (complete: every rank reported).",
                         ["complete"],
                         {("true",): stored[True], ("false",): stored[False]}),
        counter("lagscope_worker_steps_already_stored_total",
                "Re-closed steps (after a crash or rebalance) found already stored.",
                counters["steps_already_stored"]),
        counter("lagscope_worker_steps_closed_again_total",
                "Steps closed without a rank whose late batches closed them again (their "
                "rows replaced).", counters["steps_closed_again"]),
        labelled_counter("lagscope_worker_dead_letters_total",
                         "Records set aside in the store's dead_letters table, by kind.",
                         ["reason"],
                         {(kind,): n for kind, n in dict(core.dead_letters_by_kind).items()}),
        counter("lagscope_worker_snapshots_total", "Processor snapshots written.",
                counters["snapshots"]),
        counter("lagscope_worker_rollups_total", "Job roll-ups diagnosed.",
                counters["rollups"]),
        counter("lagscope_worker_failed_writes_total",
                "Store writes that failed after their retries.", counters["failed_writes"]),
        gauge("lagscope_worker_store_failing",
              "1 while the store refuses writes (the worker then takes no messages).",
              1 if core.store_failing else 0),
        labelled_gauge("lagscope_worker_consumer_lag_records",
                       "Records in Kafka past the last one processed, per assigned "
                       "partition.", ["topic", "partition"], lag),
        histogram("lagscope_worker_step_processing_seconds",
                  "Analysis time per closed step (a processor pass over the steps it "
                  "closed).", core.step_seconds),
        gauge("lagscope_worker_last_step_timestamp_seconds",
              "Unix time of the last write of closed steps to the store (0: none yet).",
              core.last_write_at or 0.0),
    ]  # fmt: skip
