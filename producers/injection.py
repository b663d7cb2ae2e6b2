"""How `lagscope launch` reaches the processes of a training command it runs unchanged.

The command's environment gets three things, and nothing of the user's files changes:

- `PYTHONPATH` starts with `launch_site/`, a folder holding only a `sitecustomize.py`,
  which Python imports at the start of every interpreter whose path holds it (torchrun's
  agent, each rank, a spawning script's children, data loader workers): it installs the
  automatic monitor (`producers.auto_monitor`) and then runs the `sitecustomize` it hides,
  if the environment had one;
- `LAGSCOPE_LAUNCH=1` turns that on (the folder alone does nothing);
- `LAGSCOPE_JOB_ID` and `LAGSCOPE_LOG_DIR`, which every monitor reads when the job does not
  pass them, so a job that starts its own `lagscope.torch.monitor()` writes to the same
  logs.

Imports nothing but the standard library: the command line reads this before it starts
the job.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: The variable that turns the injected `sitecustomize` on.
LAUNCH_VARIABLE = "LAGSCOPE_LAUNCH"
#: The folder put first on the job's `PYTHONPATH`.
SITE_DIR = Path(__file__).resolve().parent / "launch_site"


def child_environment(
    environment: Mapping[str, str], *, job_id: str, log_dir: str | Path
) -> dict[str, str]:
    """The training command's environment: `environment` with the injection turned on."""
    child = dict(environment)
    path = [str(SITE_DIR)]
    path += [p for p in child.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SITE_DIR)]
    child["PYTHONPATH"] = os.pathsep.join(path)
    child[LAUNCH_VARIABLE] = "1"
    child["LAGSCOPE_JOB_ID"] = job_id
    child["LAGSCOPE_LOG_DIR"] = str(Path(log_dir).resolve())
    return child


def injected(environment: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs under `lagscope launch`."""
    return (environment if environment is not None else os.environ).get(LAUNCH_VARIABLE) == "1"
