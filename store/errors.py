"""What goes wrong with a store, as errors whose message names what and where (a store is
named by its DSN without the password)."""

from __future__ import annotations


class StoreError(Exception):
    """A problem with the store: a bad DSN, an unreachable server, a failed statement, or
    a batch that does not fit the schema. The message names what and where."""


class BatchError(StoreError):
    """A batch that does not fit the schema: writing it again cannot succeed."""
