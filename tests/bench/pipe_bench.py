"""Frames through an analysis process' pipe while the host's main thread is busy in Python:
the pipe at the system's default size (64 KB) and widened as `_Child` widens it.

The host reads its child's frames on a thread, which takes the interpreter lock back
after every pipe's worth of bytes, behind the main thread (decoding, the live half), up
to a switch interval each time. A 12,288-GPU job sends its child ~4 MB a step and gets
~2.4 MB back. Interleaved pairs, each run a child writing 64 MB in 4 MB frames with the
host's own `_write_frame`, read with `_read_frame`.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time

from lagscope.stream_app.analysis_process import _read_frame, _widen

FRAME_BYTES = 4 << 20
FRAMES = 16
PAIRS = 3
_CHILD = (
    "import sys\n"
    "from lagscope.stream_app.analysis_process import _write_frame\n"
    f"frame = bytes({FRAME_BYTES})\n"
    f"for _ in range({FRAMES}): _write_frame(sys.stdout.buffer, frame)\n"
)


def _megabytes_per_s(widen: bool) -> float:
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE)
    assert child.stdout is not None
    if widen:
        _widen(child.stdout)
    received = [0]
    done = threading.Event()

    def read() -> None:
        while (frame := _read_frame(child.stdout)) is not None:
            received[0] += len(frame)
        done.set()

    began = time.perf_counter()
    threading.Thread(target=read, daemon=True).start()
    busy = 0
    while not done.is_set():  # the host's main thread, in Python
        for i in range(10_000):
            busy += i
    seconds = time.perf_counter() - began
    child.wait()
    if received[0] != FRAME_BYTES * FRAMES:
        raise RuntimeError(f"read {received[0]} of {FRAME_BYTES * FRAMES} bytes")
    return received[0] / 1e6 / seconds


def run() -> list[dict]:
    runs: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(PAIRS):
        for widen in (False, True):
            runs[widen].append(_megabytes_per_s(widen))
    return [
        {
            "benchmark": f"analysis process frames to a busy host, pipe {name}",
            "value": statistics.median(runs[widen]),
            "unit": "MB/s",
            "target": "> 50 (a 12,288-GPU step: 6.4 MB)" if widen else "",
            "spread": [min(runs[widen]), max(runs[widen])],
            "runs": PAIRS,
        }
        for widen, name in ((False, "of 64 KB (the default)"), (True, "widened (_widen)"))
    ]
