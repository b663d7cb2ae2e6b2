"""The error every reader and command raises for input that cannot be analysed.

Kept apart from the trace model so that the command line can catch it without importing
numpy or pydantic first (`lagscope --help` should cost little more than the interpreter).
"""

from __future__ import annotations

from typing import Any


class TraceError(ValueError):
    """Input that cannot be analysed; the message names the source and what is at fault."""


def describe_validation_error(exc: Any, what: str) -> str:
    """'field.sub: message; ...' of a pydantic ValidationError, for one-line messages."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or what}: {e['msg']}" for e in exc.errors())
