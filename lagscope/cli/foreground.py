"""Run a command as the terminal's foreground job, as a shell would, so that wrapping it
changes nothing a user sees: what `lagscope launch` does with the training command.

The command gets a process group of its own, and the terminal (when this process has
it) is handed to that group: Ctrl-C and Ctrl-\\ reach every process of the command at
once (torchrun and each of its ranks), as they would without the wrapper, and not the
wrapper, which keeps going to conclude. Ctrl-Z stops the command and then the wrapper,
which hands the terminal back and forth across `fg`. A signal sent to the wrapper
(`kill`, a scheduler's SIGTERM, SIGINT without a terminal) is passed on to the command's
first process, as sending it to the command itself would. The exit status is the
command's: `exit_like()` ends the wrapper the same way, by the same signal if it was
killed by one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import NoReturn

#: Signals passed on to the command when the wrapper gets them.
FORWARDED = (
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)


class Foreground:
    """The command, running; `wait()` for its status (a negative one: killed by that
    signal, as `subprocess` says it)."""

    def __init__(self, command: Sequence[str], env: Mapping[str, str]) -> None:
        self._terminal = _terminal_we_hold()
        self._previous: dict[int, object] = {}
        self.process = subprocess.Popen(list(command), env=dict(env), process_group=0)
        self._give_terminal(self.process.pid)
        for sig in FORWARDED:
            self._previous[sig] = signal.signal(sig, self._forward)

    def _forward(self, sig: int, _: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, sig)

    def wait(self) -> int:
        """Wait for the command to end, following it through Ctrl-Z and `fg`."""
        pid = self.process.pid
        try:
            while True:
                try:
                    _, status = os.waitpid(pid, os.WUNTRACED)
                except ChildProcessError:  # reaped elsewhere
                    return self.process.returncode or 0
                except InterruptedError:
                    continue
                if os.WIFSTOPPED(status):
                    self._stopped(pid)
                    continue
                code = os.waitstatus_to_exitcode(status)
                self.process.returncode = code
                return code
        finally:
            self._give_terminal(os.getpgrp())
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)  # type: ignore[arg-type]

    def _stopped(self, pid: int) -> None:
        """The command stopped (Ctrl-Z): stop here too, so the shell sees its job stop;
        once continued (`fg`), give the terminal back and continue the command."""
        self._give_terminal(os.getpgrp())
        os.kill(os.getpid(), signal.SIGSTOP)
        self._give_terminal(pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGCONT)

    def _give_terminal(self, group: int) -> None:
        if self._terminal is None:
            return
        with _ignoring(signal.SIGTTOU), contextlib.suppress(OSError):
            os.tcsetpgrp(self._terminal, group)


def _terminal_we_hold() -> int | None:
    """The file descriptor of the terminal whose foreground this process group is."""
    for stream in (sys.stdin, sys.stdout, sys.stderr):
        try:
            fd = stream.fileno()
            if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
                return fd
        except (AttributeError, OSError, ValueError):
            continue
    return None


@contextlib.contextmanager
def _ignoring(sig: int) -> Iterator[None]:
    previous = signal.signal(sig, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(sig, previous)


def exit_like(code: int) -> NoReturn:
    """End this process as the command ended: its exit code, or the signal that killed
    it (so that a shell's loop stops at a Ctrl-C as it would have)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        sig = -code
        with contextlib.suppress(OSError, ValueError):
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        code = 128 + sig
    os._exit(code)
