"""Whether a rank's step time just changed, so that the timer hands its steps over at once.

The timer hands short steps to its sealer ~40 at a time (a wake and a write per seal are
much of the monitor's CPU), so the log lags a job of 100 ms steps by up to 3 s: 30 steps.
While a job runs steadily nobody needs those steps sooner. When a straggler appears, the
on-call engineer does: an episode needs 5 slow steps of evidence and is due in the store
within 5 steps of its onset. In synchronous training a straggler slows every rank's step
(its peers wait for it in their collectives), and its recovery speeds them all up again,
so each rank can tell, from its own step times alone, when the analysis needs its steps
now.

The test is a two-sided CUSUM over the rank's step times, each standardised by the median
and the MAD of the rank's previous `window` steps: it sums how far steps sit beyond
`slack` standard deviations (each step counting at most `clip`) and fires when the sum
passes `threshold`. A step time that rose by 30 % fires on its third step (median over
simulated 100 ms steps with 10 % noise), by 15 % on its fifth; a lone slow step (a lost
core, a collection) never fires; on steady steps with 10 % noise it fires once in ~180
steps, on steps that lose their core one time in ten once in ~120. On the real 4-rank jobs
of tests/data/recorded (2 shared cores, steps of ~50 ms), the ranks of the clean runs fire
in 0.4 % of their steps, and every rank of a job whose rank starves of input 3 steps after
its onset. It tests from its `window // 4`-th step on. The scale never drops under `floor`
of the median, 5 %: a rank whose steps repeat to the microsecond would otherwise fire on
any jitter, and a smaller change costs less than the least an episode opens on
(`OnlineEpisodeSettings.min_cost`, 5 % of a step), so nobody needs its steps sooner. A
floor of 2 % fired 1-4 times in 120 steps of the real 1F1B job of `make bench` (2 shared
cores, steps of ~103 ms that drift by 3-5 % for a while), each spell a few extra wakes of
the sealer; 5 % fired once in three runs, on two steps of 150 ms. On a quiet rank a step
time 10 % slower fires on its fourth step, 15 % and more on its third.

Pure Python on a handful of floats, a few microseconds per step on the training thread:
the median and MAD are taken every `refresh_steps` steps, not every step.
"""

from __future__ import annotations

from collections import deque

#: MAD of a normal sample times this factor estimates its standard deviation.
_MAD_TO_SIGMA = 1.4826


class StepChange:
    """Feed it each step's seconds (`observe`); True when the step time has changed.

    >>> change = StepChange()
    >>> [change.observe(0.100 + 0.002 * (i % 3)) for i in range(20)].count(True)
    0
    >>> [change.observe(0.140) for _ in range(4)]
    [False, False, True, False]
    """

    def __init__(
        self,
        window: int = 32,
        slack: float = 0.5,
        threshold: float = 5.0,
        floor: float = 0.05,
        refresh_steps: int = 4,
        clip: float = 2.5,
    ) -> None:
        self.slack, self.threshold, self.floor, self.clip = slack, threshold, floor, clip
        self.refresh_steps = refresh_steps
        self._recent: deque[float] = deque(maxlen=window)
        self._min_steps = window // 4
        self._center = 0.0
        self._scale = 0.0
        self._since_refresh = refresh_steps
        self._up = 0.0
        self._down = 0.0

    def observe(self, seconds: float) -> bool:
        """Take one step's seconds; whether the step time changed (the sums restart)."""
        changed = False
        if len(self._recent) >= self._min_steps:
            if self._since_refresh >= self.refresh_steps:
                self._refresh()
            # A step counts at most `clip` deviations: one very slow step (a lost core,
            # a collection) never fires alone, three in a row of any size do.
            z = min(self.clip, max(-self.clip, (seconds - self._center) / self._scale))
            self._up = max(0.0, self._up + z - self.slack)
            self._down = max(0.0, self._down - z - self.slack)
            if self._up >= self.threshold or self._down >= self.threshold:
                changed = True
                self._up = self._down = 0.0
        self._recent.append(seconds)
        self._since_refresh += 1
        return changed

    def _refresh(self) -> None:
        ordered = sorted(self._recent)
        middle = len(ordered) // 2
        center = ordered[middle]
        spread = sorted([abs(x - center) for x in ordered])[middle]  # no generator frames
        self._center = center
        self._scale = max(_MAD_TO_SIGMA * spread, self.floor * center, 1e-9)
        self._since_refresh = 0
