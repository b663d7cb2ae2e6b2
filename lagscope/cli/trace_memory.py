"""Whether a recorded trace's analysis fits in this machine's memory, and the window of
it that does: `analyze` holds the whole trace (about 100 bytes an op), so a trace larger
than the memory available is refused at once, in one line, unless `--steps` names a
window of it, read alone from the row groups that hold it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from lagscope.simulator.errors import TraceError

if TYPE_CHECKING:
    import numpy as np

    from lagscope.simulator.trace import JobMeta, Trace


def replay_it(path: Path, meta_path: str) -> str:
    """How to follow a trace too large for `analyze`: a window of steps at a time."""
    return (
        f"replay the trace into rank logs and follow them a window of steps at a time "
        f"(lagscope replay --trace {path} --meta {meta_path} --log-dir DIR, then lagscope run "
        f"--log-dir DIR)"
    )


#: What `analyze` holds per op of a trace at its peak: 105-111 bytes measured on generated
#: jobs of 2.4-9.5 M ops (128 to 12,544 workers), ~70 MB besides; a little less here, so
#: that only a trace that cannot fit is refused.
ANALYZE_BYTES_PER_OP = 100
#: Trace files smaller than this are not weighed against the memory (~10 bytes an op on
#: disk: at most ~1 GB to analyse).
_WEIGHED_FROM_BYTES = 8 << 20


class TraceWeight(NamedTuple):
    """A trace's ops, the memory its analysis needs and the memory available (bytes)."""

    rows: int
    needed: int
    available: int

    def too_large(self, path: Path) -> str:
        return (
            f"{path}: {self.rows:,} ops; analysing them at once takes about "
            f"{self.needed / 2**30:.1f} GiB of memory and {self.available / 2**30:.1f} GiB "
            f"is available"
        )


def weight_beyond_memory(path: Path) -> TraceWeight | None:
    """The trace's weight where its analysis needs more memory than is available (read
    whole, a 12,288-GPU job's 2,000 steps, 290 M ops, need ~27 GiB, and the kernel would
    kill the command minutes later without a word); None where it fits, or where its
    rows or the machine's memory cannot be read (`load_trace` names a broken file)."""
    from lagscope.producers.parquet_columns import ParquetError, parquet_rows

    try:
        if path.stat().st_size < _WEIGHED_FROM_BYTES:
            return None
        rows = parquet_rows(path)
    except (OSError, ParquetError):
        return None
    needed, available = rows * ANALYZE_BYTES_PER_OP, memory_available_bytes()
    if available is None or needed <= available:
        return None
    return TraceWeight(rows, needed, available)


def read_window(
    path: Path,
    meta: JobMeta,
    meta_path: str,
    weight: TraceWeight,
    chosen: Callable[[np.ndarray], np.ndarray],
    say: Callable[..., None],
) -> Trace:
    """The steps `chosen` picks (a mask of the file's step ids, `--steps`) alone, of a
    trace too large to read whole: the row groups that hold them, where the file's steps
    come in order (lagscope's own files)."""
    import numpy as np

    from lagscope.producers.reference_format import index_steps

    index = index_steps(path)
    if index is None:
        raise TraceError(
            f"{weight.too_large(path)}, and its row groups do not hold its steps in order, so "
            f"no window of them can be read alone: {replay_it(path, meta_path)}"
        )
    step_ids = np.asarray(index.step_ids)
    steps = step_ids[chosen(step_ids)]
    rows = index.rows * steps.size // step_ids.size
    if rows * ANALYZE_BYTES_PER_OP > weight.available:
        raise TraceError(
            f"{path}: the {steps.size:,} step(s) of --steps hold about {rows:,} ops, "
            f"{rows * ANALYZE_BYTES_PER_OP / 2**30:.1f} GiB to analyse, and "
            f"{weight.available / 2**30:.1f} GiB is available: choose fewer, or "
            f"{replay_it(path, meta_path)}"
        )
    trace = index.read(steps.tolist(), meta=meta, meta_path=meta_path)
    say(
        f"lagscope analyze: {path} holds {weight.rows:,} ops, more than fit in memory: read "
        f"the {steps.size:,} step(s) of --steps alone ({trace.step.size:,} ops), their "
        f"clock offsets and dependency model from them"
    )
    return trace


def memory_available_bytes() -> int | None:
    """What this process can still allocate without the kernel reclaiming more than its
    caches: the kernel's estimate (`MemAvailable`), or the room under its cgroup's
    memory limit where that is less (a container's); None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError):
        pass
    room = _cgroup_room_bytes()
    if room is not None:
        found.append(room)
    return min(found) if found else None


#: A cgroup's memory files: (limit, usage, its page cache's entry in memory.stat), v2 then v1.
_CGROUP_MEMORY = (
    ("", "memory.max", "memory.current", "file"),
    ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache"),
)


def _cgroup_room_bytes(
    own: Path = Path("/proc/self/cgroup"), mounts: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """Bytes under this process' cgroup memory limit (v2 or v1; `own` says its groups,
    `mounts` is where they are mounted), its page cache counted as room (it is given back
    under pressure); None without a limit."""
    try:
        paths = {
            controller: path.lstrip("/")
            for _, controller, path in (line.split(":", 2) for line in own.read_text().splitlines())
        }
    except (OSError, ValueError):
        return None
    for mount, limit_file, usage_file, cache in _CGROUP_MEMORY:
        controller = "memory" if mount else ""
        if controller not in paths:
            continue
        root = mounts / mount
        # A container sees its own cgroup at the mount's root, a host at its path.
        for group in (root / paths[controller], root):
            try:
                limit = (group / limit_file).read_text().strip()
                if limit == "max" or int(limit) >= 1 << 62:
                    return None
                used = int((group / usage_file).read_text())
                stat = (group / "memory.stat").read_text().splitlines()
                stat = dict(line.split() for line in stat)
                return max(0, int(limit) - used + int(stat.get(cache, 0)))
            except (OSError, ValueError):
                continue
    return None
