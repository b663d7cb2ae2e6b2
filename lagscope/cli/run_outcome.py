"""What `lagscope run` says when its logs give it nothing to analyse.

A run over no rank logs, or over logs without a single op, must not end like a healthy
job's ("0 ops", exit 0): these build the one line that names the folder and what was found
there, with the likely fix (the directory one level down, the monitor attached too late).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from lagscope.producers.log import RANK_DIR_PREFIX, list_rank_dirs, rank_logs_nearby

if TYPE_CHECKING:
    from lagscope.stream_app.embedded import RunReport

#: How many directories a hint names before it says "and N more".
_NAMED = 3

#: What a job that wrote its job records and no op most likely did wrong.
RECORDED_NOTHING_HINT = (
    "the job's monitor recorded nothing (lagscope.megatron: call "
    "get_forward_backward_func() after lagscope.megatron.monitor(...); lagscope.torch: "
    "monitor the model the loop trains, before its first step)"
)


def no_rank_logs_message(log_dir: Path) -> str:
    """`--log-dir DIR` holds no `rank-NNNNNN/` directory: where they are, if nearby."""
    head = f"--log-dir {log_dir}: no rank logs in it (rank-NNNNNN/ directories)"
    if log_dir.name.startswith(RANK_DIR_PREFIX) and log_dir.parent != log_dir:
        return f"{head}; it is one rank's log: pass the directory that holds it, {log_dir.parent}"
    nearby = rank_logs_nearby(log_dir)
    if not nearby:
        return f"{head}; nothing to analyse"
    named = ", ".join(str(p) for p in nearby[:_NAMED])
    more = f" and {len(nearby) - _NAMED} more" if len(nearby) > _NAMED else ""
    where = "one level down" if all(p.parent == log_dir for p in nearby) else "further down"
    return f"{head}; found some {where}, in {named}{more}: pass one of those as --log-dir"


def no_ops_message(log_dir: Path, report: RunReport) -> str:
    """The logs were read and gave nothing to analyse: no op, or ops without the job
    record that says the job's layout. What they held, and the likely cause."""
    ranks = len(list_rank_dirs(log_dir))
    if not ranks:
        return no_rank_logs_message(log_dir)
    if report.ops and not report.jobs:
        return (
            f"--log-dir {log_dir}: {report.ops:,} ops in {ranks} rank log(s) but no job "
            "record (the job's dp/pp/tp sizes), so no step could be analysed; the timers "
            "must be given job_info= (lagscope.torch and lagscope.megatron write it)"
        )
    found = f"--log-dir {log_dir}: {ranks} rank log(s) without a single op"
    if report.dead_letters:
        found += f" ({report.dead_letters} unreadable record(s), kept as dead letters)"
    if report.jobs:
        jobs = ", ".join(f"{job} attempt {attempt}" for job, attempt in sorted(report.jobs))
        return f"{found}; only the job record of {jobs}: {RECORDED_NOTHING_HINT}"
    return f"{found}; nothing to analyse"


def nothing_analysed(log_dir: Path, report: RunReport) -> str | None:
    """Why a run analysed nothing (no op, no job record, or no step of any job that could
    be analysed), or None when some job was analysed."""
    if not report.ops or not report.jobs:
        return no_ops_message(log_dir, report)
    if any(job.rollup is not None for job in report.jobs.values()):
        return None
    jobs = []
    for (job_id, attempt), job in sorted(report.jobs.items()):
        missing = sorted({coord for _, coords in job.incomplete_steps for coord in coords})
        shown = ", ".join(f"(dp {dp}, pp {pp})" for dp, pp in missing[:_NAMED])
        more = f" and {len(missing) - _NAMED} more" if len(missing) > _NAMED else ""
        lacking = f", missing {shown}{more}" if missing else ""
        why = ""
        if job.first_failure is not None:
            step, reason = job.first_failure
            why = f"; step {step}: {reason.removeprefix(f'{job_id}/{attempt} step {step}: ')}"
        jobs.append(
            f"job {job_id} attempt {attempt}: {job.steps} steps, "
            f"{job.totals.incomplete_steps} incomplete{lacking}{why}"
        )
    return (
        f"--log-dir {log_dir}: no step of any job could be analysed ({'; '.join(jobs)}); "
        "a step needs the logs of every (dp, pp) worker, and the steps table says why each "
        "failed"
    )
