"""The summary `lagscope run` and `lagscope demo` print of a job: the same story the store,
the alerts and the report tell (the run's verdict built from its episodes), its cost
split into stragglers and the job's own jitter, and every episode with the step it was
first seen at.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lagscope.stream_app.host_core import JobReport
    from lagscope.stream_app.processor import DetectedChange

#: Change points listed in the per-series line at most (the rest are counted).
_SERIES_CHANGES_SHOWN = 8


def print_job_summary(job: JobReport, say: Callable[..., None] = print) -> None:
    """Print what the run found for one job."""
    from lagscope.simulator.run_story import gpu_time, noise_headline
    from lagscope.simulator.verdict import MEANINGS

    info = job.info
    say(
        f"  job {info.job_id} attempt {info.attempt}: {job.steps} steps closed"
        + (f", {job.totals.incomplete_steps} incomplete" if job.totals.incomplete_steps else "")
    )
    if job.rollup is None:
        say("    nothing could be analysed")
        return
    r = job.rollup
    floor = job.run_diagnosis.evidence.noise_floor if job.run_diagnosis else None
    say(
        f"    {noise_headline(r.slowdown, floor, job.straggler_gpu_seconds, job.gpu_seconds)}"
        f" - S: {MEANINGS['S']}"
    )
    say(
        f"    GPU time {gpu_time(job.gpu_seconds)} in all; "
        f"{gpu_time(job.straggler_gpu_seconds)} lost to stragglers' episodes"
    )
    totals = job.totals
    if totals.mfu_actual is not None and totals.mfu_ideal is not None:
        say(f"    MFU actual {totals.mfu_actual:.1%} vs straggler-free {totals.mfu_ideal:.1%}")
    _print_workers(job, say)
    for state, episode in zip(job.episode_states, job.episodes, strict=True):
        print_episode(state, episode, say)
    _print_changes(job, say)
    if job.diagnosis is not None:
        _print_verdict(job, say)


def _print_workers(job: JobReport, say: Callable[..., None]) -> None:
    from lagscope.dashboards.stragglers import others_than, ranked_workers, verified_in_run
    from lagscope.simulator.verdict import MEANINGS

    assert job.rollup is not None
    evidence = job.diagnosis.evidence if job.diagnosis is not None else None
    verified = verified_in_run(evidence, [e.diagnosis.evidence for e in job.episodes])
    top = ranked_workers(job.rollup.worker_slowdown, verified)
    others = others_than(job.rollup.worker_slowdown, top)
    say(
        "    top stragglers "
        + ", ".join(w.describe() for w in top)
        + (f" ({others.text('workers', 'S_w')})" if others else "")
        + f" - S_w: {MEANINGS['S_w']}"
    )


def print_episode(
    state: object, episode: object, say: Callable[..., None], indent: str = "    "
) -> None:
    """One episode (`state`: its live state; `episode`: its bounds and diagnosis) with the
    step it was first seen at, its action and its advice."""
    from lagscope.simulator.verdict import verdict_of

    live = state.episode  # type: ignore[attr-defined]
    end = f"to step {episode.recovery}" if episode.recovery is not None else "ongoing"  # type: ignore[attr-defined]
    told = verdict_of(episode.diagnosis, recovered_at=episode.recovery)  # type: ignore[attr-defined]
    seen = live.first_seen - live.onset
    say(
        f"{indent}episode {live.episode_id} from step {episode.onset} {end} "  # type: ignore[attr-defined]
        f"(seen at step {live.first_seen}, {seen} step(s) after its onset): {told.line()}"
    )
    say(f"{indent}  action: {told.action_line()}")
    for a in episode.diagnosis.advice:  # type: ignore[attr-defined]
        say(
            f"{indent}  advice: {a.action} (predicted speed-up {a.predicted_speedup:.3f}x): "
            f"{a.detail}"
        )


def _print_changes(job: JobReport, say: Callable[..., None]) -> None:
    for c in (c for c in job.changes if c.series == "step_time" and c.kind != "shift"):
        say(
            f"    change point: {c.kind} at step {c.step} on {c.series} "
            f"({c.before_mean:.3f} -> {c.after_mean:.3f})"
        )
    culprits = {f"worker/{s.episode.dp}.{s.episode.stage}" for s in job.episode_states}
    culprits |= {f"stage/{s.episode.stage}" for s in job.episode_states}
    culprits |= {f"dp/{s.episode.dp}" for s in job.episode_states}
    changes = ordered_series_changes(job.changes, culprits)
    if changes:
        shown = ", ".join(f"{c.series} {c.kind}@{c.step}" for c in changes[:_SERIES_CHANGES_SHOWN])
        more = len(changes) - _SERIES_CHANGES_SHOWN
        say(
            f"    per-series changes: {shown}" + (f" and {more} more" if more > 0 else "")
            + " (raw change points; the episodes above are the verified story)"
        )  # fmt: skip


def ordered_series_changes(
    changes: Sequence[DetectedChange], culprits: set[str]
) -> list[DetectedChange]:
    """The onsets and recoveries of the per-worker, stage and DP series (not the step
    time, not shifts of a series that only moved against its peers), the episodes' own
    series first, then in step order: a cut list never drops the culprit."""
    found = {
        (c.series, c.kind, c.step): c
        for c in changes
        if c.series != "step_time" and c.kind != "shift"
    }
    return sorted(found.values(), key=lambda c: (c.series not in culprits, c.step, c.series))


def _print_verdict(job: JobReport, say: Callable[..., None]) -> None:
    from lagscope.simulator.verdict import escalation_text, verdict_of

    # One verdict per analysis (the run, each episode), as `lagscope analyze` prints it.
    d = job.diagnosis
    story = verdict_of(d)
    say(f"    verdict: {story.line()}")
    say(f"    action: {story.action_line()}")
    for a in d.advice:
        say(f"    advice: {a.action} (predicted speed-up {a.predicted_speedup:.3f}x): {a.detail}")
    if d.escalation:
        say(f"    escalation: {escalation_text(d.escalation)}")
