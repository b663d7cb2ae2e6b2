"""The one record of input set aside: what it was, where it came from, and why.

Every stage that rejects input keeps it this way instead of dropping it: a host storing it
in the `dead_letters` table (`store/rows.py`), whatever the input's origin, a
rank's log file (`rank-000003/000000.lglog@4096`) or a Kafka record
(`lagscope.ops[2]@1789`).

A streamer sets aside what it cannot ship (a torn or garbled stretch of a rank's log, a
record it cannot read) on the dead-letter topic, in the JSON of `streamer_dead_letter`;
the workers store those too (`from_streamer`), so the store holds what every stage set
aside, as `lagscope run` does reading the logs itself.
"""

from __future__ import annotations

import json
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


#: The schema header of a streamer's dead letter on the dead-letter topic.
STREAMER_DEAD_LETTER_SCHEMA = b"deadletter-1"


def streamer_dead_letter(
    *, host: str, source: str, offset: int, length: int, reason: str, sample: bytes
) -> bytes:
    """The dead-letter topic's record of `length` bytes a streamer on `host` set aside at
    `offset` of the log file `source` (`sample`: their first bytes).

    >>> value = streamer_dead_letter(host="node-7", source="/logs/rank-000001/000000.lglog",
    ...     offset=4096, length=300, reason="bad record header", sample=b"\\x00\\xff")
    >>> letter = from_streamer(value, "lagscope.deadletter[0]@12", 1.5)
    >>> letter.source
    'node-7:/logs/rank-000001/000000.lglog@4096'
    >>> letter.reason
    'bad record header (300 bytes set aside by the streamer)'
    >>> from_streamer(b"{", "lagscope.deadletter[0]@13", 1.5).reason
    "a streamer's dead letter that cannot be read: not JSON with a source, an offset and a reason"
    """
    return json.dumps(
        {"host": host, "source": source, "offset": offset, "length": length,
         "reason": reason, "sample_hex": bytes(sample).hex()}
    ).encode()  # fmt: skip


def from_streamer(value: bytes | None, where: str, at_s: float) -> DeadLetter:
    """The dead letter a streamer sent (`where`: its Kafka origin, `at_s`: its time); a
    record that is not one is a dead letter itself, at `where`, with its bytes."""
    try:
        sent = json.loads(value or b"")
        source = f"{sent['source']}@{int(sent['offset'])}"
        if sent.get("host"):
            source = f"{sent['host']}:{source}"
        reason = f"{sent['reason']} ({int(sent['length']):,} bytes set aside by the streamer)"
        sample = bytes.fromhex(sent.get("sample_hex", ""))
    except (ValueError, KeyError, TypeError):
        return DeadLetter(
            where,
            "a streamer's dead letter that cannot be read: not JSON with a source, an "
            "offset and a reason",
            value or b"",
            "",
            at_s,
        )
    return DeadLetter(source, reason, sample, "", at_s)
