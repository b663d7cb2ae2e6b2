"""Live is the answer: what an on-call engineer sees *while* a real job runs.

The real 4-process DP 2 x PP 2 1F1B job (gloo, recorded through `lagscope.torch` only)
runs, and both hosts analyse its logs while it writes them, into one shared store (the
ClickHouse HTTP interface over chDB, `tests.chdb_http_server`): `lagscope run --follow`,
and `lagscope stream` -> the real broker -> two `lagscope worker`s of one group. The
test polls the store as Grafana would, every quarter second:

- a straggler (its forward 2x slower, its host stalling between its ops, or its own
  garbage collections pausing its forward as long again, or its host between its ops as
  on a GPU, for steps 15-44): the `episodes`
  table names the worker, its machine, what it is slow in and why while it is still slow,
  within a few steps of its onset; the alert rule on open episodes fires for it then; the
  job's final verdict says the same;
- a healthy job: no episode, no alert, no cause, at any time;
- a straggler still slow when the job ends: its episode stays open, its alert stops with
  the job (every rank said it ended);
- a worker slow from the job's first step (a bad node from the start, no rise to detect):
  its episode, open since the first step, from the job's first diagnosis on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.live_run import follow_live

pytest.importorskip("torch")
#: `alone`: they assert how soon the store shows what a job does, which another test
#: sharing the two cores would delay (`make test` runs them after the rest).
pytestmark = [pytest.mark.slow, pytest.mark.alone]

#: The straggler's steps (the job runs 60).
SLOW_START, SLOW_END, STEPS = 15, 45, 60
#: The worker of rank 2 in DP 2 x PP 2 (rank = dp * pp + stage).
WORKER = (1, 0)
#: On-call targets: seen within this many steps of the onset.
SEEN_WITHIN = 10
#: A planted delay spins the CPU, as a slow accelerator stays busy: a rank sleeping
#: through it hands its core to the others on a loaded 2-core machine, the job's own step
#: times then lose nothing, and "within the job's jitter, no episode" is the right answer
#: (a CI run on a busy machine measured exactly that).
SPUN = ["--busy", "true"]


def _open_before(found: Any, step: int) -> list[tuple[int, dict[str, Any]]]:
    """(the job's last closed step, episode) of every open episode the store showed while
    the job had closed no step past `step`."""
    return [
        (last, e)
        for last, episodes in found.polls
        for e in episodes
        if last < step and e["state"] == "open"
    ]


@pytest.mark.parametrize(
    ("phase", "cause", "op"),
    [
        ("forward", "slow_workers", "forward-compute"),
        ("host", "slow_host", "host"),
        ("gc", "gc_pauses", "forward-compute"),
        ("host_gc", "gc_pauses", "host"),
    ],
)
def test_a_straggler_is_named_while_it_is_still_slow(
    kafka_bootstrap: str, kafka_topics: dict[str, str], tmp_path: Path, phase: str, cause: str,
    op: str,
) -> None:  # fmt: skip
    job = f"live-{phase}"
    seen = follow_live(
        tmp_path, kafka_bootstrap, kafka_topics, job,
        ["--slow-rank", "2", "--slow-phase", phase,
         "--slow-steps", f"{SLOW_START}-{SLOW_END - 1}", *SPUN],
    )  # fmt: skip
    for host, found in seen.items():
        # While the worker was still slow (the job had closed no step past its window),
        # the store named it, with what it is slow in, as an open episode ...
        open_while_slow = _open_before(found, SLOW_END)
        first_polls = [p for p in found.polls if p[1]][:3]
        assert open_while_slow, (host, first_polls, found.polls[-2:])
        _, episode = open_while_slow[0]
        assert (episode["dp_rank"], episode["pp_rank"]) == WORKER, (host, episode)
        assert (episode["cause"], episode["optype"]) == (cause, op), (host, episode)
        assert abs(episode["onset_step"] - SLOW_START) <= 3, (host, episode)
        assert episode["first_seen_step"] - SLOW_START <= SEEN_WITHIN, (host, episode)
        # ... the on-call alert fired for it then ...
        assert any(last < SLOW_END for last, _ in found.fired), (host, found.fired[:3])
        alert = found.fired[0][1][0]
        assert alert["worker"] == "(dp 1, pp 0)" and alert["op"] == op, (host, alert)
        # ... and it was the only episode, closed at its recovery by the end.
        final = found.polls[-1][1]
        assert len(final) == 1 and final[0]["state"] == "closed", (host, final)
        assert abs(final[0]["recovery_step"] - SLOW_END) <= 3, (host, final)
        # The job's verdict tells the same story.
        verdict_cause, summary = found.verdict
        assert verdict_cause == cause and "(dp 1, pp 0)" in summary, (host, summary)
        assert summary.count("(dp ") == 1, (host, summary)
        # Its ranks said they ended: the verdict was in the store as the job ended.
        assert found.concluded, host


def test_a_healthy_job_stays_quiet_while_it_runs(
    kafka_bootstrap: str, kafka_topics: dict[str, str], tmp_path: Path
) -> None:
    job = "live-healthy"
    seen = follow_live(tmp_path, kafka_bootstrap, kafka_topics, job, [])
    for host, found in seen.items():
        assert found.polls and found.polls[-1][0] >= STEPS - 2, (host, found.polls[-1:])
        episodes = [e for _, polled in found.polls for e in polled]
        assert episodes == [], (host, episodes[:3])
        assert found.fired == [], (host, found.fired[:3])
        assert found.verdict[0] == "none", (host, found.verdict)
        assert found.rules_firing == [], (host, found.rules_firing)
        # Its 4 ranks said they ended: finished, so not "silent" once its steps stop.
        assert found.ended == (4, True), (host, found.ended)
        assert found.concluded, host


def test_a_straggler_still_slow_when_the_job_ends_stops_alerting_with_it(
    kafka_bootstrap: str, kafka_topics: dict[str, str], tmp_path: Path
) -> None:
    """The worker is slow from step 20 to the job's last: its episode is open (and its
    alert fires) while the job runs, still open when the job ends; the job's ranks said
    they ended, so the alert stops with the job, not 15 minutes later."""
    job = "live-slow-to-the-end"
    # Twice the other tests' steps: the alert can fire only between the host's first
    # write of the episode and the job's end, about 2.5 s of a 60-step job on a quiet
    # machine, and a loaded CI machine's host once lagged the job by more than that.
    steps = 2 * STEPS
    seen = follow_live(
        tmp_path, kafka_bootstrap, kafka_topics, job,
        ["--slow-rank", "2", "--slow-phase", "forward", "--slow-steps", f"20-{steps - 1}",
         *SPUN],
        steps=steps,
    )  # fmt: skip
    for host, found in seen.items():
        assert any(
            e["state"] == "open" and (e["dp_rank"], e["pp_rank"]) == WORKER
            for _, episodes in found.polls
            for e in episodes
        ), (host, found.polls[-2:])
        assert found.fired, host
        final = found.polls[-1][1]
        assert [(e["state"], e["recovery_step"]) for e in final] == [("open", None)], final
        assert found.ended == (4, True), (host, found.ended)
        assert found.rules_firing == [], (host, found.rules_firing)
        assert found.verdict[0] == "slow_workers" and "(ongoing)" in found.verdict[1], host


def test_a_worker_slow_from_the_first_step_is_named_while_the_job_runs(
    kafka_bootstrap: str, kafka_topics: dict[str, str], tmp_path: Path
) -> None:
    """Its forward 2x slower from step 0 to the end: the episode detector sees no rise, the
    job's first diagnosis (its 10th step) verifies it; from then on the store holds its
    episode, open since the job's first step, and the alert fires for it while the job
    runs; the verdict tells the same."""
    job = "live-from-the-first-step"
    seen = follow_live(
        tmp_path, kafka_bootstrap, kafka_topics, job,
        ["--slow-rank", "2", "--slow-phase", "forward", *SPUN],
    )  # fmt: skip
    for host, found in seen.items():
        running = _open_before(found, STEPS - 10)
        assert running, (host, [p for p in found.polls if p[1]][:3], found.polls[-2:])
        _, episode = running[0]
        assert (episode["dp_rank"], episode["pp_rank"]) == WORKER, (host, episode)
        assert (episode["cause"], episode["optype"]) == ("slow_workers", "forward-compute")
        assert episode["onset_step"] <= 1, (host, episode)
        assert episode["first_seen_step"] <= 12, (host, episode)
        assert any(last < STEPS - 10 for last, _ in found.fired), (host, found.fired[:3])
        final = found.polls[-1][1]
        assert len(final) == 1 and final[0]["state"] == "open", (host, final)
        verdict_cause, summary = found.verdict
        assert verdict_cause == "slow_workers" and "(dp 1, pp 0)" in summary, (host, summary)
        assert summary.count("(dp ") == 1, (host, summary)
