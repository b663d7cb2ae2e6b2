"""How small a straggler the hosts name, and how soon, as jobs grow: generated jobs (pp 8 x
tp 8, 16 micro-batches, 40 steps of ~4.4 s, ops jittering by 2 %, a heavier last stage)
with one worker slower by a factor in its compute for steps 16-31, read step by step as a
host reads them (`tell_trace`, what `lagscope analyze` prints and `lagscope run` stores).

A row per (GPUs, factor): the steps from the onset to the step its episode was named, or
"none" when no episode was; the JSON keeps the episode's bounds and the run's verdict.
Below 1.5x the detector needs a quiet job (`OnlineEpisodeSettings.quiet_jump_rate`); a
straggler whose extra time hides behind the heavier last stage costs the job too little
to be named at all.
"""

from __future__ import annotations

#: (GPUs, DP ranks): pp 8 x tp 8.
SIZES = ((1024, 16), (12288, 192))
FACTORS = (1.2, 1.3, 1.45, 2.0)
ONSET, RECOVERY, STEPS = 16, 32, 40


def _named(dp: int, factor: float) -> dict:
    from lagscope.simulator.generate import JobSpec, SlowWorker, generate_job
    from lagscope.simulator.job_story import tell_trace
    from lagscope.simulator.prepare import prepare
    from lagscope.simulator.whatif import DEFAULT_DECOMPOSE_THRESHOLD

    slow = SlowWorker(dp=2 * dp // 3, stage=4, factor=factor, start_step=ONSET,
                      end_step=RECOVERY)  # fmt: skip
    job = generate_job(JobSpec(dp=dp, pp=8, tp=8, microbatches=16, steps=STEPS, seed=0,
                               stragglers=(slow,)))  # fmt: skip
    told = tell_trace(
        prepare(job.trace, job.meta), job.meta, decompose_threshold=DEFAULT_DECOMPOSE_THRESHOLD
    )
    episodes = told.episodes
    found = [e for e in episodes if (e.episode.dp, e.episode.stage) == (slow.dp, slow.stage)]
    return {
        "named_after_steps": found[0].episode.first_seen - ONSET if found else None,
        "bounds": [found[0].episode.onset, found[0].episode.recovery] if found else None,
        "other_episodes": len(episodes) - len(found),
        "verdict": str(told.verdict.cause),
    }


def run() -> list[dict]:
    rows = []
    for gpus, dp in SIZES:
        for factor in FACTORS:
            seen = _named(dp, factor)
            steps = seen["named_after_steps"]
            rows.append(
                {
                    "benchmark": f"straggler named, {gpus:,} GPUs, one worker {factor}x slower "
                    f"in steps {ONSET}-{RECOVERY - 1} of {STEPS}: steps after its onset",
                    "value": "none" if steps is None else steps,
                    "unit": "steps",
                    "target": "named within 10 steps from 1.3x on; no other episode",
                    **seen,
                }
            )
    return rows
