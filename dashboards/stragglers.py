"""Which workers a picture or a summary names as stragglers, and how sure it is.

The worker score S_w = min(S_dp, S_stage) lights up the crossings of a slow DP replica
and a slow stage: with a straggler at (dp 5, pp 2) and a heavier stage 3, (dp 5, pp 3)
can score highest without being slow itself. The diagnosis re-simulates the top
candidates one by one (`verified_slow_workers` in simulator/diagnose.py) and lists those
slow on their own in its evidence; every output names those first, marks the crossings as
such, and leaves the rest unverified.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from lagscope.simulator.summary import Others

if TYPE_CHECKING:
    from lagscope.simulator.evidence import Evidence

Kind = Literal["verified", "crossing", "unverified"]


@dataclass(frozen=True)
class RankedWorker:
    dp: int
    stage: int
    worker_slowdown: float
    kind: Kind

    def describe(self) -> str:
        text = f"(dp {self.dp}, pp {self.stage}) S_w={self.worker_slowdown:.3f}"
        if self.kind == "verified":
            return text + " verified"
        if self.kind == "crossing":
            return text + " S_w crossing (its DP replica or stage holds a verified straggler)"
        return text


def verified_workers(evidence: Evidence | None) -> list[tuple[int, int]]:
    """(dp, stage) of the workers the diagnosis verified, best first."""
    if evidence is None:
        return []
    return [(w.dp, w.stage) for w in evidence.verified_workers]


def verified_in_run(
    evidence: Evidence | None, episode_evidence: Sequence[Evidence]
) -> list[tuple[int, int]]:
    """The workers verified over the whole run, then those verified in its episodes: a
    straggler that came and went is verified on its episode's steps, and the whole run's
    scores still light up its crossings.

    >>> from lagscope.simulator.evidence import Evidence, Finding, VerifiedWorker, Worker
    >>> episode = Evidence(finding=Finding(verified=(VerifiedWorker(Worker(5, 2), 0.9),)))
    >>> verified_in_run(Evidence(), [episode])
    [(5, 2)]
    """
    found = verified_workers(evidence)
    for episode in episode_evidence:
        found += [w for w in verified_workers(episode) if w not in found]
    return found


def ranked_workers(
    worker_slowdown: np.ndarray, verified: list[tuple[int, int]], top: int = 3
) -> list[RankedWorker]:
    """The verified workers first (in the diagnosis' order), then the highest S_w cells,
    each marked verified, crossing or unverified; `top` in all.

    >>> s_w = np.array([[1.0, 1.0], [1.0, 1.3], [1.0, 1.4]])  # [stage, dp]
    >>> [w.describe() for w in ranked_workers(s_w, [(1, 1)], top=2)]
    ['(dp 1, pp 1) S_w=1.300 verified', '(dp 1, pp 2) S_w=1.400 S_w crossing (its DP replica or stage holds a verified straggler)']
    """  # noqa: E501
    ranked = [
        RankedWorker(dp, stage, float(worker_slowdown[stage, dp]), "verified")
        for dp, stage in verified
    ]
    order = np.argsort(-worker_slowdown, axis=None, kind="stable")
    n_dp = worker_slowdown.shape[1]
    for index in order.tolist():
        if len(ranked) >= top:
            break
        stage, dp = divmod(int(index), n_dp)
        if (dp, stage) in verified:
            continue
        crossing = any(v_dp == dp or v_stage == stage for v_dp, v_stage in verified)
        ranked.append(
            RankedWorker(
                dp,
                stage,
                float(worker_slowdown[stage, dp]),
                "crossing" if crossing else "unverified",
            )
        )
    return ranked[:top]


def others_than(worker_slowdown: np.ndarray, shown: Sequence[RankedWorker]) -> Others | None:
    """Where the S_w of the workers a list of `shown` leaves out lie (None: it shows all).

    >>> s_w = np.array([[1.0, 1.1], [1.2, 1.4]])  # [stage, dp]
    >>> others_than(s_w, ranked_workers(s_w, [], top=1)).text("workers", "S_w")
    'the other 3 workers: S_w 1.000-1.200, median 1.100'
    """
    left_out = np.ones(worker_slowdown.shape, dtype=bool)
    for w in shown:
        left_out[w.stage, w.dp] = False
    return Others.of(worker_slowdown[left_out])
