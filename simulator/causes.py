"""The causes a diagnosis can name: one enum, so that no output spells a cause its own way.

The values are the strings every stored diagnosis, alert and dashboard already carries
(`Cause` is a `str`: it compares equal to them and is written as them in JSON).
"""

from __future__ import annotations

from enum import StrEnum


class Cause(StrEnum):
    """Why a job (or one of its episodes) was slower than it could have been."""

    #: Nothing beyond the job's own noise.
    NONE = "none"
    #: Slower, spread over many workers: no single cause stands out.
    UNATTRIBUTED = "unattributed"
    #: A few workers compute slower than their peers (their accelerator, or their CPU).
    SLOW_WORKERS = "slow_workers"
    #: A worker waits for its next batch (its data loader, its storage).
    SLOW_INPUT = "slow_input"
    #: A worker's host is slow between its ops (launch delays); its ops take their time.
    SLOW_HOST = "slow_host"
    #: The last pipeline stage computes more than the others (its output head, its loss).
    LAST_STAGE_IMBALANCE = "last_stage_imbalance"
    #: Micro-batches of unequal cost (unbalanced sequence lengths).
    SEQUENCE_IMBALANCE = "sequence_imbalance"
    #: Python garbage collection stalls the computes (the GC probe's recorded pauses).
    GC_PAUSES = "gc_pauses"
    #: Some links transfer slower than the others moving the same data.
    SLOW_COMMUNICATION = "slow_communication"

    @property
    def names_workers(self) -> bool:
        """Whether this cause names workers (who to act on).

        >>> Cause.SLOW_HOST.names_workers, Cause.LAST_STAGE_IMBALANCE.names_workers
        (True, False)
        """
        return self in WORKER_CAUSES


#: Causes that name workers: slow in their compute, starved of input, or on a slow host.
WORKER_CAUSES = frozenset({Cause.SLOW_WORKERS, Cause.SLOW_INPUT, Cause.SLOW_HOST})
