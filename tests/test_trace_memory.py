"""What `analyze` weighs a trace against: the memory this machine (or its cgroup) has
left. `analyze`'s refusals and its window of a large trace: tests/test_cli_analyze.py."""

from __future__ import annotations

import sys
from pathlib import Path

from lagscope.cli.trace_memory import _cgroup_room_bytes, memory_available_bytes

GIB = 1 << 30


def test_the_memory_available_is_read_from_the_machine() -> None:
    available = memory_available_bytes()
    if sys.platform != "linux":
        assert available is None
        return
    with open("/proc/meminfo") as meminfo:
        total_kb = int(next(line for line in meminfo if line.startswith("MemTotal:")).split()[1])
    assert 0 < available <= total_kb * 1024


def _group(folder: Path, files: dict[str, str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


def test_a_cgroup_v2_limit_leaves_its_room_page_cache_counted_as_room(tmp_path: Path) -> None:
    own = tmp_path / "cgroup"
    own.write_text("0::/job.slice/analyze.scope\n")
    _group(tmp_path / "sys" / "job.slice" / "analyze.scope", {
        "memory.max": f"{8 * GIB}\n",
        "memory.current": f"{6 * GIB}\n",
        "memory.stat": f"anon {4 * GIB}\nfile {2 * GIB}\n",
    })  # fmt: skip
    assert _cgroup_room_bytes(own, tmp_path / "sys") == 4 * GIB
    (tmp_path / "sys" / "job.slice" / "analyze.scope" / "memory.max").write_text("max\n")
    assert _cgroup_room_bytes(own, tmp_path / "sys") is None


def test_a_cgroup_v1_limit_is_read_at_its_path_or_at_a_container_s_root(tmp_path: Path) -> None:
    own = tmp_path / "cgroup"
    own.write_text("12:pids:/\n4:memory:/docker/abc\n0::/\n")
    limits = {
        "memory.limit_in_bytes": f"{16 * GIB}\n",
        "memory.usage_in_bytes": f"{10 * GIB}\n",
        "memory.stat": f"cache {GIB}\ntotal_cache {3 * GIB}\n",
    }
    _group(tmp_path / "host" / "memory" / "docker" / "abc", limits)
    assert _cgroup_room_bytes(own, tmp_path / "host") == 9 * GIB
    _group(tmp_path / "container" / "memory", limits)  # its own group at the mount's root
    assert _cgroup_room_bytes(own, tmp_path / "container") == 9 * GIB
    unlimited = {**limits, "memory.limit_in_bytes": "9223372036854771712\n"}
    _group(tmp_path / "free" / "memory", unlimited)
    assert _cgroup_room_bytes(own, tmp_path / "free") is None
    assert _cgroup_room_bytes(tmp_path / "absent", tmp_path / "host") is None
