"""The job dashboards lagscope ships, by file name stem, each with `job` and `attempt`
variables filled from the `jobs` table:

- Job overview (uid `lagscope-job`, `job_overview.py`): the on-call view of one job attempt.
- Pipeline health (uid `lagscope-pipeline`, `pipeline_health.py`): is the pipeline keeping
  up and losing nothing.

What they are built from: `panels.py`. The fleet-wide dashboards, which have no job
variable: `fleet.py`.
"""

from __future__ import annotations

from collections.abc import Callable

from lagscope.dashboards.job_overview import job_overview
from lagscope.dashboards.panels import BuiltDashboard
from lagscope.dashboards.pipeline_health import pipeline_health

#: Every job dashboard lagscope ships, by file name stem.
DASHBOARDS: dict[str, Callable[[], BuiltDashboard]] = {
    "job-overview": job_overview,
    "pipeline-health": pipeline_health,
}


def build_all() -> dict[str, BuiltDashboard]:
    return {name: make() for name, make in DASHBOARDS.items()}
