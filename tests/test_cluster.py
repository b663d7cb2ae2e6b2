"""The cluster gives the embedded answer, however the operator started it: a real 4-process
DP 2 x PP 2 1F1B job (gloo, recorded through `lagscope.torch`, rank 2 2x slower in its
forward for steps 15-44 of 80) is followed live by `lagscope stream` -> the real broker ->
`lagscope worker`s of one group, and their tables equal, row for row, those of `lagscope
run` on the same logs: the steps with their `complete` flag, the workers' and the
attributions' rows, the change points, the episodes with their bounds, the diagnoses.

- A fresh cluster: the workers start before the job's topics exist (they make them),
  the partition's owner is killed (-9) mid-job and its successor resumes from the
  snapshot, and a third worker joins the group later still (a rebalance).
- A late worker: the job runs before any worker; one starts behind it and catches up
  while the job still writes, and another joins while it does.

Before, the fresh cluster's workers were assigned nothing and stored nothing, and a
worker that caught up or was handed the partition closed steps incomplete whose batches
were next in Kafka (the episode's bounds then moved with them).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster_run import Plan, run_cluster

pytest.importorskip("torch")
# Alone (`make test`): a real job with a planted straggler, two workers and a broker.
pytestmark = [pytest.mark.slow, pytest.mark.alone]

STRAGGLER = ["--slow-rank", "2", "--slow-phase", "forward", "--slow-steps", "15-44"]


def _assert_same_rows(cluster) -> None:
    assert cluster.differences() == {}
    steps = cluster.rows["embedded"]["steps"]
    assert len(steps) == 80 and all(row["complete"] for row in steps), steps[-1]
    episodes = cluster.rows["embedded"]["episodes"]
    assert [(e["dp_rank"], e["pp_rank"]) for e in episodes] == [(1, 0)], episodes


def test_a_fresh_cluster_through_a_kill_and_a_join_stores_what_lagscope_run_does(
    kafka_bootstrap: str, kafka_topics: dict[str, str], tmp_path: Path
) -> None:
    plan = Plan(topics_first=False, workers_before=2, kill_owner_at_step=30,
                start_at_steps=(50,))  # fmt: skip
    cluster = run_cluster(tmp_path, kafka_bootstrap, kafka_topics, "fresh", STRAGGLER, plan)
    logs = [worker.log() for worker in cluster.workers]
    # One line says what a worker did about the missing topics.
    assert any("were missing: created them" in log for log in logs), logs[0][-2000:]
    # The killed owner's successor resumed from its snapshot.
    assert cluster.killed is not None
    assert any("restored snapshot" in log for log in logs), logs[0][-2000:]
    _assert_same_rows(cluster)


def test_a_worker_started_behind_a_running_job_stores_what_lagscope_run_does(
    kafka_bootstrap: str, kafka_topics: dict[str, str], tmp_path: Path
) -> None:
    plan = Plan(topics_first=True, workers_before=0, start_at_steps=(20, 35))
    cluster = run_cluster(tmp_path, kafka_bootstrap, kafka_topics, "late", STRAGGLER, plan)
    _assert_same_rows(cluster)
