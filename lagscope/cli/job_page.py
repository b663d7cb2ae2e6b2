"""The HTML page of a job the embedded host followed, as `lagscope run --report` and
`lagscope demo` write it: the host hands over the job as it stands (`JobReport`) and the
steps it retains, the dashboards' report renders the page. This is the one place that
joins the two, so neither the hosts nor the dashboards import the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from lagscope.simulator.job_story import in_step_order
from lagscope.simulator.prepare import PreparedTrace
from lagscope.simulator.whatif import analyze

if TYPE_CHECKING:
    from lagscope.dashboards.report import ReportData
    from lagscope.simulator.episodes import Episode
    from lagscope.stream_app.host_core import JobReport


def render_job_page(
    job: JobReport, retained: Sequence[PreparedTrace] = (), refresh_s: float | None = None
) -> str:
    """The HTML page of one job (`retained`: the steps kept for its roll-up, for the
    episodes' own worker scores; `refresh_s`: a live page that refreshes itself). The
    embedded host's renderer (`stream_app.embedded.PageRenderer`)."""
    from lagscope.dashboards.report import render_report

    return render_report(report_data(job, refresh_s=refresh_s, retained=retained))


def report_data(
    job: JobReport,
    *,
    refresh_s: float | None = None,
    retained: Sequence[PreparedTrace] = (),
) -> ReportData:
    """What the HTML report shows of one job (`refresh_s`: a live page; `retained`: the
    steps kept for the roll-up, for the episodes' own worker scores)."""
    from lagscope.dashboards.report import ReportData

    assert job.rollup is not None
    info = job.info
    totals = job.totals
    episode_scores: list[np.ndarray | None] = [None] * len(job.episodes)
    if retained:
        prepared = in_step_order(retained)
        episode_scores = [
            _episode_worker_slowdown(prepared, e, job.rollup.ideal_cost) for e in job.episodes
        ]
    return ReportData(
        title=f"lagscope: {info.job_id} (attempt {info.attempt})",
        subtitle=f"{info.world_size} GPUs: dp {info.dp_size} x pp {info.pp_size} x tp "
        f"{info.tp_size} x cp {info.dsp_size}, vpp {info.vpp_size}",
        result=job.rollup,
        diagnosis=job.diagnosis,
        step_ids=list(totals.step_ids),
        step_slowdown=list(totals.step_slowdown),
        changes=[
            {
                "step": c.step,
                "kind": c.kind,
                "series": c.series,
                "before_mean": c.before_mean,
                "after_mean": c.after_mean,
            }
            for c in job.changes
        ],
        gpu_hours=totals.gpu_seconds / 3600,
        gpu_hours_wasted=totals.gpu_seconds_above_ideal / 3600,
        mfu_actual=totals.mfu_actual,
        mfu_ideal=totals.mfu_ideal,
        incomplete_steps=totals.incomplete_steps,
        episodes=[(e.onset, e.recovery, e.diagnosis) for e in job.episodes],
        episode_worker_slowdown=episode_scores,
        refresh_s=refresh_s,
        last_step=job.last_step,
        last_step_closed_at=job.last_step_closed_at,
        last_step_started_at=totals.last_step_start_ns / 1e9 if totals.last_step_start_ns else None,
        worker_machines=job.machines,
    )


def _episode_worker_slowdown(
    prepared: PreparedTrace, episode: Episode, ideal: dict[str, float]
) -> np.ndarray | None:
    """S_w of every worker over an episode's own steps, with the whole run's ideal (as the
    episode was diagnosed); None when it has no retained step."""
    end = episode.recovery if episode.recovery is not None else np.inf
    inside = (prepared.steps >= episode.onset) & (prepared.steps < end)
    if not inside.any():
        return None
    # S_w needs the attributions only: no explanation passes, no launch decomposition.
    part = prepared.select_steps(inside)
    return analyze(part, ideal=ideal, decompose_threshold=np.inf, explain=False).worker_slowdown
