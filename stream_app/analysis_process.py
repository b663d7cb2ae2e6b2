"""Where the compute half of a job's steps runs: in the host's process, or in child
processes beside it (`processor.analysis_processes`).

A step's analysis is two halves. The compute half (stream_app/step_compute.py: prepare,
running ideals, engine pass) is most of a large job's analysis after decoding, and needs
only what it carries itself; the live half (detectors, episodes, diagnoses) reads and
writes the job's live state. With child processes the host sends each closed step's
batches, packed in a few columns, to the child that computes that job, and goes on
decoding the next step while the child works: two cores on one job. The child returns the
prepared step and its result; the host runs the live half on them in closing order, and
adds the step to its own copy of the running ideals, so its snapshots hold what the
child holds. A job's steps always go to one child, which keeps its running ideals.

Both executors have one interface: `submit` a job's closed steps, `poll` for the outcome.
`InProcess` computes at `submit`; `ChildProcesses` computes in the child.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence
from itertools import count
from typing import IO, Any

from lagscope.producers.events import pack_batches, unpack_batches
from lagscope.stream_app.step_compute import (
    ClosedStep,
    JobCompute,
    StepComputed,
    StepToCompute,
    compute_steps,
    with_model,
    without_model,
)

log = logging.getLogger("lagscope.analysis")

#: A job's computed steps, or why the computation failed (every step of the call fails).
Outcome = list[StepComputed] | str


class AnalysisProcessError(RuntimeError):
    """A child analysis process exited: the host cannot go on without what it held."""


class InProcess:
    """The compute half run at `submit`, in this process."""

    #: The job's `JobCompute` is the host's own: nothing to mirror.
    mirrors = False

    def __init__(self) -> None:
        self._tickets = count()
        self._done: dict[int, Outcome] = {}

    def submit(self, owner: int, job: JobCompute, steps: Sequence[ClosedStep]) -> int:
        ticket = next(self._tickets)
        self._done[ticket] = _compute(job, steps)
        return ticket

    def poll(self, ticket: int, wait: bool) -> Outcome | None:
        return self._done.pop(ticket)

    def forget(self, owner: int) -> None:
        pass


def _compute(job: JobCompute, steps: Sequence[ClosedStep]) -> Outcome:
    try:
        return compute_steps(job, steps)
    except Exception as exc:
        # A bug must not take the job's steps (or the host) down: they are stored
        # unanalysed, with the error as the reason.
        log.exception("analysing %d step(s) of %s failed", len(steps), job.info.key)
        return f"analysis failed: {exc!r}"


class ChildProcesses:
    """The compute half run in `count` child processes; a job's steps go to one child.

    Each child is `python -m lagscope.stream_app.analysis_process`, fed over its stdin and
    answering on its stdout, one length-prefixed pickle per message: a child of its own
    command re-imports no host script (multiprocessing's spawn runs a script without a
    main guard again), and exits when its host's end of the pipe closes. Requests are
    pickled when submitted (the host goes on changing its state) and written by a thread
    (a busy child must not block the host); results are read by a thread into a queue. A
    child that exits raises `AnalysisProcessError` at the next poll that waits for it.
    """

    #: The host keeps its own copy of each job's running ideals (for its snapshots).
    mirrors = True

    def __init__(self, count_: int) -> None:
        self._results: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._children = [_Child(index, self._results) for index in range(count_)]
        log.info(
            "%d analysis process(es) started (pid %s)",
            count_,
            ", ".join(str(c.process.pid) for c in self._children),
        )
        self._tickets = count()
        #: Ticket -> the host's JobCompute it updates (the model, once).
        self._waiting: dict[int, JobCompute] = {}
        self._done: dict[int, Outcome] = {}
        #: (owner, job) -> index of its child; present once the child holds its state.
        self._child_of: dict[tuple[int, tuple[str, int]], int] = {}
        self._next_child = 0

    def submit(self, owner: int, job: JobCompute, steps: Sequence[ClosedStep]) -> int:
        ticket = next(self._tickets)
        key = (owner, job.info.key)
        sync = None
        if key not in self._child_of:
            # The child starts from the host's state: nothing of this job is in flight.
            self._child_of[key] = self._next_child
            self._next_child = (self._next_child + 1) % len(self._children)
            sync = job
        steps_sent = [
            (c.step, c.complete, list(c.dp_ranks), pack_batches(c.batches)) for c in steps
        ]
        self._children[self._child_of[key]].send(("compute", ticket, key, sync, steps_sent))
        self._waiting[ticket] = job
        return ticket

    def poll(self, ticket: int, wait: bool) -> Outcome | None:
        while ticket not in self._done:
            try:
                message = self._results.get(block=wait)
            except queue.Empty:
                return None
            if message[0] == "exited":
                raise AnalysisProcessError(message[1])
            self._take(message)
        return self._done.pop(ticket)

    def _take(self, message: tuple[Any, ...]) -> None:
        _, ticket, outcome, model = message
        job = self._waiting.pop(ticket)
        if job.model is None and model is not None:
            job.model = model
            job.compiled = model.compiled
        if isinstance(outcome, str):
            self._done[ticket] = outcome
        else:
            self._done[ticket] = with_model(outcome, job.model)  # type: ignore[arg-type]

    def forget(self, owner: int) -> None:
        """Drop an owner's jobs in the children (its processor is gone)."""
        for key in [k for k in self._child_of if k[0] == owner]:
            self._children[self._child_of.pop(key)].send(("forget", key))


class _Child:
    """One child process, the thread that writes to it and the one that reads from it."""

    def __init__(self, index: int, results: queue.Queue[tuple[Any, ...]]) -> None:
        self.name = f"lagscope-analysis-{index}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lagscope.stream_app.analysis_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        for pipe in (self.process.stdin, self.process.stdout):
            _widen(pipe)
        self._outbox: queue.Queue[bytes] = queue.Queue()
        self._results = results
        threading.Thread(target=self._write, name=f"{self.name}-in", daemon=True).start()
        threading.Thread(target=self._read, name=f"{self.name}-out", daemon=True).start()

    def send(self, message: tuple[Any, ...]) -> None:
        self._outbox.put(pickle.dumps(message, protocol=5))

    def _write(self) -> None:
        pipe = self.process.stdin
        assert pipe is not None
        try:
            while True:
                _write_frame(pipe, self._outbox.get())
        except OSError:
            pass  # the child is gone: the reader says so

    def _read(self) -> None:
        pipe = self.process.stdout
        assert pipe is not None
        while (frame := _read_frame(pipe)) is not None:
            self._results.put(pickle.loads(frame))
        code = self.process.wait()
        self._results.put(
            ("exited", f"analysis process {self.name} exited with code {code}; the host "
             "stops (it resumes from its last snapshot)")
        )  # fmt: skip


def _widen(pipe: IO[bytes] | None) -> None:
    """Give `pipe` the largest buffer the system allows (Linux; 64 KB by default).

    A thread copying a frame through a pipe takes the interpreter lock back after every
    buffer's worth, behind the host's main thread, up to a switch interval (5 ms) each
    time. With the main thread busy in Python, frames of 4 MB crossed a 64 KB pipe at
    13 MB/s and a 1 MB one at 90 MB/s (`make bench`: tests/bench/pipe_bench.py); a
    12,288-GPU job sends its child 4 MB a step and gets 2.4 MB back, and with the narrow
    pipe its child waited on its own writes a quarter of the time.
    """
    if pipe is None or not hasattr(fcntl, "F_SETPIPE_SZ"):
        return
    try:
        with open("/proc/sys/fs/pipe-max-size") as limit:
            size = int(limit.read())
        fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, size)
    except (OSError, ValueError):
        pass  # the default buffer works, only slower


def _write_frame(pipe: IO[bytes], payload: bytes) -> None:
    pipe.write(len(payload).to_bytes(8, "little"))
    pipe.write(payload)
    pipe.flush()


def _read_frame(pipe: IO[bytes]) -> bytes | None:
    head = pipe.read(8)
    if len(head) < 8:
        return None
    size = int.from_bytes(head, "little")
    payload = pipe.read(size)
    return payload if len(payload) == size else None


def serve() -> None:
    """A child's loop: compute what the host sends, in order, until its pipe closes."""
    # Ctrl-C reaches the whole process group: the host decides when this child ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    requests = sys.stdin.buffer
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    # Whatever else writes to stdout here must not break the frames.
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    jobs: dict[tuple[int, tuple[str, int]], JobCompute] = {}
    while (frame := _read_frame(requests)) is not None:
        message = pickle.loads(frame)
        if message[0] == "forget":
            jobs.pop(message[1], None)
            continue
        _, ticket, key, sync, steps_sent = message
        if sync is not None:
            jobs[key] = sync
        job = jobs[key]
        had_model = job.model is not None
        try:
            steps = [
                StepToCompute(step, complete, dp_ranks, unpack_batches(packed))
                for step, complete, dp_ranks, packed in steps_sent
            ]
            outcome: Outcome = without_model(compute_steps(job, steps))
        except Exception as exc:
            # Its traceback goes to this child's stderr (the host's); the host logs a line.
            traceback.print_exc()
            outcome = f"analysis failed: {exc!r}"
        model = job.model if not had_model else None
        _write_frame(answers, pickle.dumps(("computed", ticket, outcome, model), protocol=5))


def peak_rss_mb(pid: int | str) -> float:
    """The most memory a process held (MB): Linux's VmHWM (0 when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def cpu_seconds(pid: int | str) -> float:
    """CPU seconds (user and system) a process used so far: Linux's /proc (0 when it
    cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # After the command's name, in parentheses, utime and stime are fields 12-13.
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def analysis_cpu_seconds() -> float:
    """The CPU seconds of this process' analysis children, summed (0 without children)."""
    return sum(
        cpu_seconds(child.process.pid)
        for children in _shared.values()
        for child in children._children
    )


def analysis_peak_rss_mb() -> float:
    """The peaks of this process' analysis children, summed (0 without children)."""
    return sum(
        peak_rss_mb(child.process.pid)
        for children in _shared.values()
        for child in children._children
    )


_shared: dict[int, ChildProcesses] = {}


def shared_children(processes: int) -> ChildProcesses:
    """`processes` child processes, shared by every processor of this process that asks
    for the same number."""
    if processes not in _shared:
        _shared[processes] = ChildProcesses(processes)
    return _shared[processes]


if __name__ == "__main__":
    serve()
