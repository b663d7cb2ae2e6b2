"""What a host sets aside: every dead letter, whichever stage of the host set it aside (a
job record, a batch that cannot be decoded or admitted, one late for its step, what a
streamer sent on the dead-letter topic), waiting for the store, and how many of each
kind there have been (the metrics' `dead_letters` by kind, `lagscope run`'s count).

Each input a host commits on its own keeps its letters apart, so that they are stored
with what it commits: the job records (and a worker's dead-letter topic) in
`JobRecords`, each partition's batches in its `HostCore`. They share one count by kind.
"""

from __future__ import annotations

import logging

from lagscope.producers.dead_letters import DeadLetter

log = logging.getLogger("lagscope.processor")

#: Kinds of dead letters, as the metrics count them: a record that cannot be decoded, a
#: batch the admission rejects (or set aside after windowing), one a windowing
#: bug dropped, a job record that is invalid or conflicts with a known one, what a
#: streamer set aside on a training node (the dead-letter topic, read by the workers),
#: and a batch that came after its step closed without it, too late to close it again.
DEAD_LETTER_KINDS = ("undecodable", "rejected", "windowing", "job_metadata", "streamer", "late")


class DeadLetters:
    """Dead letters waiting for the store, and a count of every one by kind.

    >>> letters = DeadLetters()
    >>> letters.add(DeadLetter("ops[0]@7", "not a batch"), "undecodable", logged=False)
    >>> len(letters), letters.by_kind["undecodable"]
    (1, 1)
    >>> [d.source for d in letters.take()], len(letters), letters.by_kind["undecodable"]
    (['ops[0]@7'], 0, 1)
    >>> partition = DeadLetters(counted_with=letters)
    >>> partition.add(DeadLetter("ops[1]@3", "late"), "late", logged=False)
    >>> len(partition), len(letters), letters.total
    (1, 0, 2)
    """

    def __init__(self, counted_with: DeadLetters | None = None) -> None:
        """`counted_with`: another collector whose count by kind this one adds to."""
        self._waiting: list[DeadLetter] = []
        self.by_kind: dict[str, int] = (
            counted_with.by_kind
            if counted_with is not None
            else dict.fromkeys(DEAD_LETTER_KINDS, 0)
        )

    def add(self, letter: DeadLetter, kind: str, *, logged: bool = True) -> None:
        """Set `letter` aside as `kind` (one of `DEAD_LETTER_KINDS`): logged (not what a
        streamer logged on its node already), counted, stored with the next write."""
        if logged:
            log.warning("dead letter %s: %s", letter.source, letter.reason)
        self.by_kind[kind] += 1
        self._waiting.append(letter)

    @property
    def waiting(self) -> list[DeadLetter]:
        """The letters not stored yet, oldest first."""
        return list(self._waiting)

    def take(self, count: int | None = None) -> list[DeadLetter]:
        """The oldest `count` letters waiting (all by default), no longer waiting: the
        writer has stored them."""
        count = len(self._waiting) if count is None else count
        taken, self._waiting = self._waiting[:count], self._waiting[count:]
        return taken

    @property
    def total(self) -> int:
        """Every letter set aside so far, stored or not (with those it is counted with)."""
        return sum(self.by_kind.values())

    def __len__(self) -> int:
        return len(self._waiting)
