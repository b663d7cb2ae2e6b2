"""The README's "Monitor your training job" example runs as written: torchrun with two
ranks, then `lagscope run --log-dir` on what they wrote."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

#: The README's torch job, run for real with torchrun: slow.
pytestmark = pytest.mark.slow

pytest.importorskip("torch")

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(tmp_path: Path) -> None:
    text = README.read_text()
    section = text.split("## Monitor your training job", 1)[1].split("\n## ", 1)[0]
    script = re.search(r"```python\n(.*?)```", section, re.S)
    assert script is not None
    (tmp_path / "train.py").write_text(script.group(1))
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    train = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--standalone", "train.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-3000:]
    assert "torchrun --standalone --nproc-per-node 2 train.py" in section
    assert "lagscope run --log-dir lagscope-logs" in section
    run = subprocess.run(
        [str(bin_dir / "lagscope"), "run", "--log-dir", "lagscope-logs"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"job my-job attempt 0: \d+ steps closed", run.stdout), run.stdout
    steps = int(re.search(r"(\d+) steps closed", run.stdout).group(1))
    assert steps == 31  # 32 batches per epoch, DDP's first (re-bucketing) step not recorded
