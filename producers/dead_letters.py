"""The one record of input set aside: what it was, where it came from, and why.

Every stage that rejects input keeps it this way instead of dropping it: a host storing it
in the `dead_letters` table (`store/rows.py`), whatever the input's origin, a
rank's log file (`rank-000003/000000.lglog@4096`) or a Kafka record
(`lagscope.ops[2]@1789`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeadLetter:
    """Input set aside, with its origin and the reason, never silently dropped."""

    #: Where it came from: `file@offset` of a log, `topic[partition]@offset` of Kafka.
    source: str
    #: Why it was set aside, in one line.
    reason: str
    #: Its bytes (a sample of them for garbage in a log).
    payload: bytes = b""
    #: The job it belongs to, when that could be read ("" otherwise).
    job_id: str = ""
    #: When it was produced (epoch seconds), so a replay stores the same row; 0 unknown.
    at_s: float = 0.0
