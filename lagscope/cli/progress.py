"""Progress of a long command, on stderr: a tqdm bar on a terminal, plain lines elsewhere.

A `\\r`-redrawn bar is for eyes on a terminal; in a log file or a CI transcript every redraw
is a line of noise. Off a terminal the same progress is one plain line every
`plain_interval_s` and one at the end.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from lagscope.stream_app.embedded import RunReport


class Progress:
    """`update()` as often as convenient (redraws are rate-limited); `close()` once."""

    def __init__(
        self,
        label: str,
        *,
        unit: str,
        total: int | None = None,
        stream: TextIO | None = None,
        plain_interval_s: float = 10.0,
    ) -> None:
        self.label = label
        self.unit = unit
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.plain_interval_s = plain_interval_s
        self._done = 0
        self._note = ""
        self._last_line = time.monotonic()
        self._bar: Any = None
        if _is_terminal(self.stream):
            # A maintained bar (rate, ETA, terminal width) rather than a hand-drawn one.
            from tqdm import tqdm

            self._bar = tqdm(
                total=total, desc=label, unit=f" {unit}", file=self.stream, mininterval=0.25
            )

    def update(self, done: int, *, total: int | None = None, note: str = "") -> None:
        """`done` units so far (of `total`, when it became known); `note` adds detail."""
        self._done, self._note = done, note
        if total is not None:
            self.total = total
        if self._bar is not None:
            if total is not None and self._bar.total != total:
                self._bar.total = total
            if note:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(done - self._bar.n)
            return
        now = time.monotonic()
        if now - self._last_line >= self.plain_interval_s:
            self._last_line = now
            self._write_line()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        else:
            self._write_line()

    def _write_line(self) -> None:
        of_total = f"/{self.total:,}" if self.total is not None else ""
        note = f", {self._note}" if self._note else ""
        self.stream.write(f"{self.label}: {self._done:,}{of_total} {self.unit}s{note}\n")
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def pipeline_progress(total_ops: int | None) -> tuple[Progress, Callable[[RunReport], None]]:
    """A progress display of the embedded host (`run`, `demo`), and the callback that feeds
    it."""
    display = Progress("pipeline", unit="op", total=total_ops)

    def show(report: RunReport) -> None:
        display.update(report.ops, note=f"{report.steps:,} steps")

    return display, show


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
