"""Straggler episodes found while the job runs: one closed step at a time, per worker.

An on-call engineer needs to see a straggler while it is still slow, within a few steps of
its onset, and a healthy job must stay quiet on its own noise. The detector reads, for
every worker (dp, pp) and every step, the seconds of each kind of the worker's *own* time:
each op type that is its own work (forward, backward, input wait, optimizer: nobody else
makes it wait there) and `host`, the time its host spent between its ops (the host gaps
of its ops, `prepare.host_gaps`: slow Python, a slow or busy CPU, data prepared outside
the loader; on a GPU a late kernel launch leaves every CUDA-event duration unchanged, so
this is how a slow host looks in production).

A worker's episode opens when, over its last `onset_steps` steps, one kind of its own
time

- rose by `min_rise` (half) in its median over the worker's own baseline (its steps before,
  at most `baseline_steps`, none of an earlier episode), and in its least step over the
  baseline's quick level (its 10 % quantile): contention only ever adds time, so a rank
  that merely loses its core now and then is still quick now and then, and a straggler's
  every step is slow;
- is slower than its peers' (the other DP ranks of its stage, else the other stages) in
  every one of those steps by `min_peer_ratio`, and by more than it was before;
- rose by more than its peers' own time rose over theirs (a stretch in which the whole
  machine is slow is the machine's);
- costs the worker at least `min_cost` of a median step, clear of its noise by `onset_z`
  standard errors (a noisy series needs a larger rise); its noise is its baseline's,
  pooled with its peers' as `peer_noise_steps` steps of its own (a few steps of its own can
  read as still by chance).

A weaker rise, clear of the noise by `confirm_z` only, opens the episode once it has
lasted `confirm_steps`; a job whose workers jump that much in more than `quiet_spike_rate`
of their steps before the evidence (ranks that lose shared cores in runs of up to 10 steps
look like stragglers for that long) opens none before `confirm_steps`, and above
`busy_spike_rate` none before `noisy_steps`, unless the jumps that reach the middle
of the worker's two levels are that rare (after `own_rise_baseline_steps`): a host
stalled 100 ms between ops of a few ms, far beyond what sharing cores does, opens at
`onset_steps`. In a quiet job (its workers jump by
`quiet_min_rise` in at most `quiet_jump_rate` of their steps: long, steady kernels), a
smaller rise, by `quiet_min_rise` and `quiet_min_peer_ratio` over its peers, opens one at
`confirm_steps`, clear of the noise by `onset_z`: a GPU throttled to 1.3x is a straggler
there, while on shared CPU cores every rank rises so now and then. The evidence begins
where the worker rose (its first step is past the middle of its two levels), and the
baselines leave out every episode's steps (a straggler changes what its peers do too). Of
the kinds that rose at once, the episode is the one that cost most (a rank starved of
input also starts its next forward late: one episode); a worker in an episode opens
another only in another kind that costs it `second_episode_ratio` times more (a small
episode must not hide a straggler that follows it, and the host time a straggler drags up
with it stays part of its episode). An episode stays open while the worker is slow and
closes once `recovery_steps` of its last `recovery_steps` + 1 steps, the latest among
them, are back below the middle of its two levels (one noisy step does not hold a
recovered worker's episode open); the recovery step is the first of those.

The settings (`OnlineEpisodeSettings`) are measured on real 4-rank torch jobs on a shared
2-core machine, healthy and with one rank 2x slower in one kind for a stretch of steps;
`tests/data/recorded` keeps the hardest of them, read step by step by
`tests/test_recorded_jobs.py`, and `tests/bench/NOTES.md` ("Live episodes on real jobs")
has the measurements.

A worker slow from the job's first step has no rise to see. The job's diagnosis finds it
(slower than its peers in the median step, `diagnose.py`), and the host then adopts it
(`OnlineEpisodes.adopt`): an episode from where its stretch above its peers begins, at its
peers' level before, followed from then on like any other.

State (`state_dict` / `from_state`) is plain arrays and numbers: a host snapshots it with
the rest of its step processor.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, TypeVar

import numpy as np

from lagscope.simulator.episodes import StretchFit
from lagscope.simulator.fields import Bound, FieldErrors, check_fields
from lagscope.simulator.noise import own_work_mask
from lagscope.simulator.peers import peer_median
from lagscope.simulator.prepare import PreparedTrace, host_gaps, own_durations

#: The kind of a worker's time spent between its ops (the host gaps of its ops).
HOST = "host"

#: Up to this many DP ranks a worker is compared with the median of its peers exactly;
#: beyond, with that of its whole stage, itself included (`peers.peer_median`).
_EXACT_PEERS_UP_TO = 16

#: MAD of a normal sample times this factor estimates its standard deviation.
_MAD_TO_SIGMA = 1.4826
_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True)
class OnlineEpisodeSettings:
    """When an episode opens and closes. Every value was measured on the real runs of
    tests/bench/NOTES.md ("Live episodes on real jobs"); a change must be measured there
    again (`make bench`, episode module, and `tests/test_recorded_jobs.py`)."""

    #: Steps of evidence that open a clear episode: 4 opened an episode on 4 of the first
    #: 26 healthy runs, 5 on none.
    onset_steps: int = 5
    #: ... and a weaker one (clear of the noise by `confirm_z` only): a 2x slower compute
    #: beside busy peers reads 1.5x; 8 steps keep the healthy runs quiet.
    confirm_steps: int = 8
    #: Rise of the worker's median, and of its least step over its quick level: a rank
    #: that lost its core for a while rose by a third, a 2x straggler by close to 2x.
    min_rise: float = 0.5
    #: In every step of the evidence, at least this much slower than its peers' median.
    min_peer_ratio: float = 1.25
    #: The rise over the baseline's noise (standard errors) that opens at `onset_steps`.
    onset_z: float = 8.0
    #: ... and that opens at `confirm_steps` (5: as the finished-run fit, `episodes.py`).
    confirm_z: float = 5.0
    #: The rise costs the worker this share of a median step at least (a sub-millisecond
    #: op that tripled is no straggler).
    min_cost: float = 0.05
    #: The weight of the peers' noise in a worker's (as this many of its own baseline
    #: steps): 3 of 4 equal host delays after the warm-up read as no noise at all, and a
    #: few ms of contention then as 50 standard errors (a healthy DDP run opened a host
    #: episode at step 9 that way, and it hid an input straggler's episode at step 15).
    peer_noise_steps: int = 4
    #: A worker in an episode opens another, in another kind, only when that kind costs
    #: it this many times more: time a straggler drags along in another kind must not name
    #: it twice (a 2x forward straggler of a real 1F1B job raised its launch delays by
    #: 1.07x the forward's extra, when they were its host time); an input straggler hidden
    #: behind a host episode of noise cost 9x that episode.
    second_episode_ratio: float = 2.0
    #: Fewest baseline steps before an onset: a job's first steps are its warm-up.
    min_baseline_steps: int = 4
    #: ... and before a rise the job's workers seldom reach opens on `onset_steps` in a
    #: job whose workers jump often: fewer do not tell how seldom.
    own_rise_baseline_steps: int = 10
    #: Most baseline steps compared against (the recent past, not the whole run).
    baseline_steps: int = 40
    #: Steps back below the middle of the two levels (of one more) that end an episode.
    recovery_steps: int = 3
    #: A job whose workers jump by `min_rise` and `min_cost` in more than this share of
    #: their baseline steps (ranks sharing loaded cores lose them in runs of up to 10
    #: steps) opens an episode at `confirm_steps` at the earliest ...
    quiet_spike_rate: float = 0.1
    #: ... and above this share at `noisy_steps` only, past the longest such run.
    busy_spike_rate: float = 0.2
    noisy_steps: int = 11
    #: The quantile of a worker's baseline steps that stands for its quick level: its
    #: least step is one lucky step, its median includes the steps it lost its core.
    quick_quantile: float = 0.1
    #: Against its peers, one step in this many of the evidence may be quick (a peer lost
    #: its core there): windows of 5 steps allow none, of 8 one, of 11 two.
    steps_per_quick_peer_step: int = 5
    #: In a quiet job a smaller rise opens an episode too, on `confirm_steps` of evidence
    #: clear of the noise by `onset_z`: a worker 1.3-1.45x slower (a throttled GPU) for 16
    #: of a generated 1,024-GPU job's 40 steps cost those steps 15-23 % and was never an
    #: episode; nor, by a hair, a 1.5x one at 12,288 GPUs (its median rose 1.494x).
    quiet_min_rise: float = 0.15
    #: ... slower than its peers by this much in its every step ...
    quiet_min_peer_ratio: float = 1.1
    #: ... where the job's workers jump by `quiet_min_rise` (and `min_cost`) in at most this
    #: share of their baseline steps (of that kind): in the recorded CPU jobs, whose ranks
    #: lose their cores, their compute and host time jump so in 14-39 % of the steps
    #: (median over a run; input waits and optimizer 0-7 %), on the emulated accelerator
    #: 0-3 %; in the recorded GPU jobs (a 200 M model on one H100, 37 ms steps, its short
    #: kernels waiting on the host) 16-37 %: the lane stays closed there. Generated jobs
    #: whose ops jitter by 2 % never jump so.
    quiet_jump_rate: float = 0.05
    #: How far (steps) the end of the job's refit may move an onset from the live one: the
    #: evidence (up to `noisy_steps` long) may begin on a noisy step before the rise; with
    #: 3 a forward straggler of steps 15-29 kept a live onset of 11 (real 1F1B job).
    refine_onset_slack_steps: int = 8
    #: ... and a recovery (the detector closes after `recovery_steps` back).
    refine_recovery_slack_steps: int = 4
    #: The end-of-job refit of an episode's bounds (`episodes.square_wave`).
    refit: StretchFit = field(default_factory=StretchFit)

    def __post_init__(self) -> None:
        problems = check_fields(self, _SETTINGS_BOUNDS)
        if self.confirm_steps < self.onset_steps:
            problems.append(("confirm_steps", "must be at least onset_steps"))
        if self.noisy_steps < self.confirm_steps:
            problems.append(("noisy_steps", "must be at least confirm_steps"))
        if self.quiet_min_rise > self.min_rise:
            problems.append(("quiet_min_rise", "must be at most min_rise"))
        if self.quiet_min_peer_ratio > self.min_peer_ratio:
            problems.append(("quiet_min_peer_ratio", "must be at most min_peer_ratio"))
        if problems:
            raise FieldErrors(problems)

    @property
    def history_steps(self) -> int:
        """Steps of history the detector keeps per worker and kind."""
        return self.baseline_steps + self.noisy_steps


_SETTINGS_BOUNDS = {
    "onset_steps": Bound(integer=True, ge=2),
    "confirm_steps": Bound(integer=True, ge=2),
    "min_rise": Bound(gt=0),
    "min_peer_ratio": Bound(ge=1),
    "quiet_min_rise": Bound(gt=0),
    "quiet_min_peer_ratio": Bound(ge=1),
    "quiet_jump_rate": Bound(ge=0, le=1),
    "onset_z": Bound(ge=0),
    "confirm_z": Bound(ge=0),
    "min_cost": Bound(ge=0),
    "peer_noise_steps": Bound(integer=True, ge=0),
    "second_episode_ratio": Bound(ge=1),
    "min_baseline_steps": Bound(integer=True, ge=2),
    "baseline_steps": Bound(integer=True, ge=2),
    "recovery_steps": Bound(integer=True, ge=1),
    "quiet_spike_rate": Bound(ge=0, le=1),
    "busy_spike_rate": Bound(ge=0, le=1),
    "noisy_steps": Bound(integer=True, ge=2),
    "own_rise_baseline_steps": Bound(integer=True, ge=1),
    "quick_quantile": Bound(ge=0, le=1),
    "steps_per_quick_peer_step": Bound(integer=True, ge=1),
    "refine_onset_slack_steps": Bound(integer=True, ge=0),
    "refine_recovery_slack_steps": Bound(integer=True, ge=0),
}


def signal_kinds(prepared: PreparedTrace) -> tuple[str, ...]:
    """The kinds of own time of a job's workers: its own-work op types, then `host`."""
    own = own_work_mask(prepared)
    return (*sorted({t for t, mine in zip(prepared.node_optype, own, strict=True) if mine}), HOST)


def worker_signals(prepared: PreparedTrace, kinds: Sequence[str]) -> np.ndarray:
    """[step, kind, stage, dp] seconds of each worker's own time of each kind: the summed
    durations of its own-work ops of that op type (less the parameter all-gathers they
    waited for inside them, `prepare.own_durations`), and for `host` the summed host gaps of
    all its ops (time its host took to start an op once the op could start and the worker
    had done the work before it, `prepare.host_gaps`)."""
    out = np.zeros((prepared.n_steps, len(kinds), prepared.n_stages, prepared.n_dp))
    own = own_durations(prepared) if any(kind != HOST for kind in kinds) else None
    for index, kind in enumerate(kinds):
        if kind == HOST:
            out[:, index] = prepared.stage_sums(host_gaps(prepared))
        else:
            out[:, index] = prepared.stage_sums(own, kind)
    return out


@dataclass
class WorkerEpisode:
    """One worker's episode as the detector keeps it: open while it is slow, closed at its
    recovery. The hosts name and price it (`EpisodeState`) before any output shows it
    (`episodes.py` has the three types)."""

    episode_id: int
    dp: int
    stage: int
    #: The kind of own time that rose: an op type, or `host`.
    kind: str
    #: Step ids: the first slow step, the step of the update that opened it, and the
    #: first step back at the old level (None while open).
    onset: int
    first_seen: int
    recovery: int | None
    #: The worker's median seconds of that kind before the onset and over the evidence.
    level_before: float
    level_inside: float
    #: The worker over its peers' median (median step), inside and before.
    ratio_inside: float
    ratio_before: float
    #: The last step this episode covered (its latest update).
    last_step: int
    #: Found by the job's diagnosis, slow as far back as it saw (`OnlineEpisodes.adopt`):
    #: its `level_before` is its peers' and `ratio_before` 1.
    standing: bool = False

    @property
    def open(self) -> bool:
        return self.recovery is None

    @property
    def extra_s(self) -> float:
        """Seconds more per step than the worker's own level before."""
        return self.level_inside - self.level_before


Change = Literal["opened", "updated", "closed"]


@dataclass(frozen=True)
class EpisodeChange:
    """What an update did to an episode."""

    change: Change
    episode: WorkerEpisode


@dataclass
class _History:
    """The last `length` steps of every series, oldest first ([slot, kind, stage, dp]),
    and of their peers' medians (each step's own: kept with it, not redone per window)."""

    length: int
    values: np.ndarray
    peers: np.ndarray
    steps: np.ndarray
    count: int = 0

    def push(self, step: int, values: np.ndarray) -> None:
        peers = peer_median(values[np.newaxis], include_self_above=_EXACT_PEERS_UP_TO)[0]
        if self.count < self.length:
            self.values[self.count] = values
            self.peers[self.count] = peers
            self.steps[self.count] = step
            self.count += 1
            return
        self.values[:-1] = self.values[1:]
        self.peers[:-1] = self.peers[1:]
        self.steps[:-1] = self.steps[1:]
        self.values[-1] = values
        self.peers[-1] = peers
        self.steps[-1] = step

    def recent(self, n: int) -> np.ndarray:
        return self.values[self.count - n : self.count]

    def recent_peers(self, n: int) -> np.ndarray:
        return self.peers[self.count - n : self.count]


@dataclass(frozen=True)
class _Lane:
    """One way an episode opens: `window` steps of evidence clear of the noise by `z`,
    risen by `rise` and slower than the peers by `peer_ratio`, in a job whose workers jump
    by `rise` in at most `most_jumps` of their baseline steps (None: any)."""

    window: int
    z: float
    rise: float
    peer_ratio: float
    most_jumps: float | None
    #: Whether the job's jumps are counted at the worker's own rise (its least step of
    #: the window over its median before) rather than at `rise`.
    at_own_rise: bool = False


@dataclass
class _Evidence:
    """What the gates found for every worker over one window ([kind, stage, dp])."""

    raised: np.ndarray
    extra_s: np.ndarray
    level_before: np.ndarray
    level_inside: np.ndarray
    ratio_before: np.ndarray
    ratio_inside: np.ndarray
    #: The worker's least step of the window over its median before, less one.
    least_rise: np.ndarray


class OnlineEpisodes:
    """The episodes of one job's workers, updated once per closed, complete step."""

    def __init__(
        self,
        kinds: Sequence[str],
        n_stages: int,
        n_dp: int,
        settings: OnlineEpisodeSettings | None = None,
    ) -> None:
        self.settings = settings or OnlineEpisodeSettings()
        self.kinds = tuple(kinds)
        self.n_stages, self.n_dp = n_stages, n_dp
        shape = (len(self.kinds), n_stages, n_dp)
        length = self.settings.history_steps
        self._history = _History(
            length,
            np.zeros((length, *shape)),
            np.zeros((length, *shape)),
            np.zeros(length, np.int64),
        )
        #: Per worker [stage, dp], the first step its baseline may use (after its last
        #: episode); -1: any.
        self._baseline_from = np.full((n_stages, n_dp), -1, dtype=np.int64)
        self._step_times: list[float] = []
        self.episodes: list[WorkerEpisode] = []
        self._next_id = 1
        #: What lanes of one `_open_new` share (`_once`), emptied when it returns.
        self._shared: dict[tuple[Any, ...], Any] = {}

    # -- the update ---------------------------------------------------------------------
    def update(self, step: int, values: np.ndarray, step_time: float) -> list[EpisodeChange]:
        """Take one closed step (`values`: [kind, stage, dp] seconds, as one step of
        `worker_signals`; `step_time`: its measured time); returns what changed."""
        values = np.asarray(values, dtype=np.float64)
        if values.shape != self._history.values.shape[1:]:
            raise ValueError(
                f"step {step}: signals of shape {values.shape}, this job's are "
                f"{self._history.values.shape[1:]}"
            )
        self._history.push(step, values)
        self._step_times = [*self._step_times, float(step_time)][-self.settings.history_steps :]
        changes = self._follow_open(step)
        try:
            changes += self._open_new(step)
        finally:
            self._shared.clear()
        self._let_go()
        return changes

    def _let_go(self) -> None:
        """Forget the closed episodes that ended before the oldest step kept: nothing
        reads them any more (a baseline masks the kept steps inside an episode), and a
        long job's would pile up. Their state is their host's (`LiveJob`)."""
        history = self._history
        if history.count:
            oldest = int(history.steps[0])
            self.episodes = [e for e in self.episodes if e.recovery is None or e.recovery > oldest]

    def _follow_open(self, step: int) -> list[EpisodeChange]:
        cfg = self.settings
        changes: list[EpisodeChange] = []
        history = self._history
        for episode in self.open_episodes():
            kind = self.kinds.index(episode.kind)
            own = history.recent(history.count)[:, kind, episode.stage, episode.dp]
            steps = history.steps[: history.count]
            since_onset = int((steps >= episode.onset).sum())
            middle = np.sqrt(episode.level_inside * episode.level_before)
            # The last `recovery_steps` + 1 steps, the latest of them and all but one back
            # below the middle: one noisy step (a core lost for a step) does not keep a
            # recovered worker's episode open.
            below = own[-cfg.recovery_steps - 1 :] < middle
            episode.last_step = step
            if (
                since_onset >= cfg.onset_steps + cfg.recovery_steps
                and below[-1]
                and below.sum() >= cfg.recovery_steps
            ):
                episode.recovery = int(steps[-below.size + int(np.argmax(below))])
                self._baseline_from[episode.stage, episode.dp] = episode.recovery
                changes.append(EpisodeChange("closed", episode))
            else:
                changes.append(EpisodeChange("updated", episode))
        return changes

    def _open_new(self, step: int) -> list[EpisodeChange]:
        cfg = self.settings
        # A worker with an open episode opens another only in another kind that costs it
        # `second_episode_ratio` times more: a small episode (a few ms of host noise) must
        # not hide a straggler that follows it, while the host time a straggler drags up
        # with it (a rank starved of input starts its next forward late; a slow forward
        # stage's launches wait) stays part of its one episode.
        open_extra = np.full((self.n_stages, self.n_dp), -np.inf)
        open_kind = np.zeros((len(self.kinds), self.n_stages, self.n_dp), dtype=bool)
        for episode in self.open_episodes():
            at = episode.stage, episode.dp
            open_extra[at] = max(open_extra[at], episode.extra_s)
            open_kind[(self.kinds.index(episode.kind), *at)] = True
        opened_now = np.zeros((self.n_stages, self.n_dp), dtype=bool)
        changes: list[EpisodeChange] = []
        candidates = self._candidates() & ~open_kind
        if not candidates.any():
            return changes  # a healthy job's usual step: no gate to take
        measured = np.flatnonzero(candidates.any(axis=(1, 2)))
        columns = np.nonzero(candidates)
        # Lanes of the same window share its baseline, and lanes of the same gates their
        # evidence, until an episode opens (it leaves the baselines): asked once each.
        for lane in self._lanes():
            window = lane.window
            # The gates first: a series' evidence is its own, and the spike rate (medians
            # over the job's baseline) is only needed where one rose.
            evidence = self._once(
                ("evidence", window, lane.z, lane.rise, lane.peer_ratio),
                lambda lane=lane: self._evidence(lane, columns),
            )
            if evidence is None or not evidence.raised.any():
                continue
            kinds_allowed = np.ones(len(self.kinds), dtype=bool)
            lane_raised = evidence.raised
            if lane.at_own_rise:
                lane_raised = lane_raised & self._rare_at_own_rise(
                    evidence, window, lane.most_jumps
                )
            elif lane.most_jumps is not None:
                kinds_allowed = self._spike_rate(measured, window, lane.rise) <= lane.most_jumps
            raised = (
                lane_raised
                & ~open_kind
                & (
                    np.nan_to_num(evidence.extra_s, nan=-np.inf)
                    > cfg.second_episode_ratio * open_extra[None]
                )
                & ~opened_now[None]
                & kinds_allowed[:, None, None]
            )
            if not raised.any():
                continue
            # Of the kinds a worker rose in at once, the costliest.
            extra = np.where(raised, evidence.extra_s, -np.inf)
            best_kind = np.argmax(extra, axis=0)  # [stage, dp]
            steps = self._history.steps[: self._history.count]
            for stage, dp in zip(*np.nonzero(raised.any(axis=0)), strict=True):
                kind = int(best_kind[stage, dp])
                at = (kind, stage, dp)
                episode = WorkerEpisode(
                    episode_id=self._next_id,
                    dp=int(dp),
                    stage=int(stage),
                    kind=self.kinds[kind],
                    onset=int(steps[-window]),
                    first_seen=step,
                    recovery=None,
                    level_before=float(evidence.level_before[at]),
                    level_inside=float(evidence.level_inside[at]),
                    ratio_inside=float(evidence.ratio_inside[at]),
                    ratio_before=float(evidence.ratio_before[at]),
                    last_step=step,
                )
                self._next_id += 1
                self.episodes.append(episode)
                open_kind[at] = True
                opened_now[stage, dp] = True
                changes.append(EpisodeChange("opened", episode))
        return changes

    def _once(self, key: tuple[Any, ...], make: Callable[[], _T]) -> _T:
        """`make()`, made once per `_open_new` for `key` while the episodes stay as they
        are (an opened one changes every later baseline)."""
        key = (*key, len(self.episodes))
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def _rare_at_own_rise(
        self, evidence: _Evidence, window: int, most_jumps: float | None
    ) -> np.ndarray:
        """[kind, stage, dp]: the raised series whose workers' jumps reach the middle of
        its two levels (its median before and its least step of the window, geometric) in
        at most `most_jumps` of their baseline steps: a rise far beyond the job's own noise
        needs no more evidence than a clear one in a quiet job. The middle, not the least
        step: a job whose noise comes near a straggler's level (input waits that jump by as
        much) is noisy at it."""
        rare = np.zeros_like(evidence.raised)
        if self._history.count - window < self.settings.own_rise_baseline_steps:
            return rare
        for at in zip(*np.nonzero(evidence.raised), strict=True):
            kind = np.array([at[0]])
            rise = float(np.sqrt(1.0 + evidence.least_rise[at]) - 1.0)
            rare[at] = self._spike_rate(kind, window, rise)[at[0]] <= (most_jumps or 0.0)
        return rare

    def _lanes(self) -> tuple[_Lane, ...]:
        """The ways an episode opens, tried in turn: a clear rise on `onset_steps` in a
        job whose workers seldom jump so, or in any job by a rise they seldom reach (its
        own); a weaker one on `confirm_steps`, and in a noisy job on `noisy_steps` only;
        last, in a quiet job, a smaller rise on `confirm_steps`."""
        cfg = self.settings
        return (
            _Lane(cfg.onset_steps, cfg.onset_z, cfg.min_rise, cfg.min_peer_ratio,
                  cfg.quiet_spike_rate),
            _Lane(cfg.onset_steps, cfg.onset_z, cfg.min_rise, cfg.min_peer_ratio,
                  cfg.quiet_spike_rate, at_own_rise=True),
            _Lane(cfg.confirm_steps, cfg.confirm_z, cfg.min_rise, cfg.min_peer_ratio,
                  cfg.busy_spike_rate),
            _Lane(cfg.noisy_steps, cfg.confirm_z, cfg.min_rise, cfg.min_peer_ratio, None),
            _Lane(cfg.confirm_steps, cfg.onset_z, cfg.quiet_min_rise, cfg.quiet_min_peer_ratio,
                  cfg.quiet_jump_rate),
        )  # fmt: skip

    def adopt(
        self,
        worker: tuple[int, int],
        kind: str,
        steps: np.ndarray,
        values: np.ndarray,
        step_times: np.ndarray,
        *,
        seen_at_evidence: bool = False,
    ) -> WorkerEpisode | None:
        """An episode for `worker` (dp, stage), which the job's diagnosis verified slow in
        `kind` while no episode of it is open: slow since before its first step seen (a
        bad node from the job's start has no rise to detect) or risen too weakly to open
        one. `values` are every worker's seconds of `kind` ([step, stage, dp]) and
        `step_times` the measured step times over `steps` (the steps the diagnosis
        covered, in order, the latest last).

        The episode begins where the worker's latest stretch above its peers begins (by
        `min_peer_ratio`, but for one step in `steps_per_quick_peer_step`: a peer that lost
        its core), if that stretch reaches the latest step and is `confirm_steps` long, or
        `noisy_steps` where the other workers jump over their own level in more than
        `busy_spike_rate` of its steps (a rank of a busy machine loses its core for up to
        10 steps); else None. Its level inside is its own median over the stretch; its
        level before, its own median before the stretch where it was quicker there (a rise
        too weak to open an episode), else its peers' over the stretch (the time it would
        take at their pace: a `standing` episode, slow as far back as `steps` go). From
        here on it is followed like any episode, and closes once the worker is back below
        the middle of the two. It
        was first seen at the latest step, or with `seen_at_evidence` (a recorded trace
        read whole) where its stretch had the steps it needed, as a host following the job
        would have seen it.

        >>> detector = OnlineEpisodes(["forward-compute", HOST], n_stages=1, n_dp=3)
        >>> values = np.full((12, 1, 3), 0.010)
        >>> values[:, 0, 1] = 0.020  # dp 1 twice its peers' time from the first step
        >>> found = detector.adopt((1, 0), "forward-compute", np.arange(12), values,
        ...                        np.full(12, 0.1))
        >>> found.onset, found.level_before, found.level_inside, found.standing
        (0, 0.01, 0.02, True)
        >>> detector.adopt((1, 0), "forward-compute", np.arange(12), values,
        ...                np.full(12, 0.1)) is None  # it has one open
        True
        >>> values = np.full((12, 1, 3), 0.010)
        >>> values[:, 0, 2] = [0.012] * 2 + [0.016] * 10  # dp 2 a little slower from step 2
        >>> risen = OnlineEpisodes(["forward-compute", HOST], n_stages=1, n_dp=3).adopt(
        ...     (2, 0), "forward-compute", np.arange(12), values, np.full(12, 0.1))
        >>> risen.onset, risen.level_before, risen.ratio_before, risen.standing
        (2, 0.012, 1.2, False)
        """
        cfg = self.settings
        dp, stage = worker
        if kind not in self.kinds or any(
            (e.dp, e.stage) == (dp, stage) for e in self.open_episodes()
        ):
            return None
        own = values[:, stage, dp]
        peers = peer_median(values[:, np.newaxis], include_self_above=_EXACT_PEERS_UP_TO)[
            :, 0, stage, dp
        ]
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = own / np.where(peers > 0, peers, np.nan)
            slow = ratio >= cfg.min_peer_ratio
        if not slow.size or not slow[-1]:
            return None
        # From the latest step back, as long as the quick steps stay within the allowance
        # of a stretch that long; then from its first slow step.
        quick_from_end = np.cumsum(~slow[::-1])
        allowed = (np.arange(1, slow.size + 1) - 1) // cfg.steps_per_quick_peer_step
        too_many = np.flatnonzero(quick_from_end > allowed)
        start = slow.size - (int(too_many[0]) if too_many.size else slow.size)
        start += int(np.argmax(slow[start:]))
        others = np.ones(values.shape[1:], dtype=bool)
        others[stage, dp] = False
        noisy = (
            _jump_rate(values[start:], others, float(np.median(step_times[start:])), cfg)
            > cfg.busy_spike_rate
        )
        needed = cfg.noisy_steps if noisy else cfg.confirm_steps
        if slow.size - start < needed:
            return None
        level_inside = float(np.median(own[start:]))
        # Its peers' time is positive in every step it is slow in (above them by a ratio).
        ratio_inside = float(np.median(ratio[start:][slow[start:]]))
        # Quicker before its stretch (a rise too weak for the detector): an episode from
        # its own level, as any; else slow as far back as seen, measured by its peers'.
        own_before = float(np.median(own[:start])) if start else np.inf
        rose = own_before < level_inside
        episode = WorkerEpisode(
            episode_id=self._next_id,
            dp=int(dp),
            stage=int(stage),
            kind=kind,
            onset=int(steps[start]),
            first_seen=int(steps[start + needed - 1] if seen_at_evidence else steps[-1]),
            recovery=None,
            level_before=own_before if rose else float(np.median(peers[start:])),
            level_inside=level_inside,
            ratio_inside=ratio_inside,
            ratio_before=float(np.nanmedian(ratio[:start])) if rose else 1.0,
            last_step=int(steps[-1]),
            standing=not rose,
        )
        self._next_id += 1
        self.episodes.append(episode)
        return episode

    def _usable(self, steps: np.ndarray) -> np.ndarray:
        """[slot, stage, dp]: which of these steps a worker's baseline may use: none of its
        own earlier episode, and none inside any episode of the job (a straggler changes
        what its peers do too: they wait, or get the cores it leaves idle)."""
        inside_any = np.zeros(steps.shape, dtype=bool)
        for episode in self.episodes:
            if episode.standing:
                # Slow since before its steps were seen: its peers' steps beside it are
                # all their baselines hold, before its onset as after it.
                continue
            end = episode.recovery if episode.recovery is not None else np.iinfo(np.int64).max
            inside_any |= (steps >= episode.onset) & (steps < end)
        return (steps[:, None, None] >= self._baseline_from[None]) & ~inside_any[:, None, None]

    def _spike_rate(self, kinds: np.ndarray, window: int, rise: float) -> np.ndarray:
        """[kind]: the share of the workers' steps before the last `window` (the evidence:
        a straggler's own first slow steps are no measure of the job's noise; none of an
        episode; only the workers that do that kind of work) in which one jumped by
        `rise` over its own median and by `min_cost` of a step: how often the job's
        own noise makes a worker look like a straggler for a step. Only `kinds` (indices)
        are measured, the others read 1 (they have no candidate)."""
        cfg = self.settings
        history = self._history
        rate = np.ones(len(self.kinds))
        before = history.count - window
        if before < cfg.min_baseline_steps:
            return rate
        values = history.values[:before][-cfg.baseline_steps :, kinds]
        steps = history.steps[:before][-cfg.baseline_steps :]
        usable = self._once(("usable", before), lambda: self._usable(steps))  # [slot, stage, dp]
        # A worker with none of a kind's work (no input wait on a later pipeline stage)
        # has a series of zeros: no series at all. Counted, they halved a 1F1B job's
        # input-wait spike rate and opened an episode on five steps of its noise.
        has_work = (values != 0).any(axis=0, keepdims=True)
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            kept = np.where(usable[:, None] & has_work, values, np.nan)
            median = nanmedian_first_axis(kept)
            step_times = self._step_times[: len(self._step_times) - window]
            step_s = float(np.median(step_times[-cfg.baseline_steps :]))
            jumped = (kept >= (1 + rise) * median) & (kept - median >= cfg.min_cost * step_s)
            counted = np.sum(~np.isnan(kept), axis=(0, 2, 3))
        rate[kinds] = np.where(
            counted > 0, jumped.sum(axis=(0, 2, 3)) / np.maximum(counted, 1), 1.0
        )
        return rate

    def _candidates(self) -> np.ndarray:
        """[kind, stage, dp]: the series that may pass the gates in some window: every
        window asks its k-th least ratio to its peers to reach its lane's peer ratio (at
        least `quiet_min_peer_ratio`), k its allowed quick peer steps, so the last
        `onset_steps` steps (the shortest window's) hold at most the largest k below it.
        Asking this first spares the gates' medians on the series that cannot pass: most
        of them, most of the time."""
        cfg = self.settings
        history = self._history
        last = min(cfg.onset_steps, history.count)
        allowed = (cfg.noisy_steps - 1) // cfg.steps_per_quick_peer_step
        if last - allowed <= 0:
            return np.ones(history.values.shape[1:], dtype=bool)
        peers = history.recent_peers(last)
        with np.errstate(all="ignore"):
            ratio = history.recent(last) / np.where(peers > 0, peers, np.nan)
        least_ratio = min(cfg.min_peer_ratio, cfg.quiet_min_peer_ratio)
        return np.sum(ratio >= least_ratio, axis=0) >= last - allowed

    def _evidence(self, lane: _Lane, columns: tuple[np.ndarray, ...]) -> _Evidence | None:
        """The gates of the module docstring over the `lane`'s window of last steps, with
        its rise and peer ratio, for the series at `columns` ((kind, stage, dp) indices)
        at once; None before enough steps were
        seen or when none of them can pass. Its arrays are [kind, stage, dp], NaN (False)
        off `columns`.

        One function on purpose (about 70 lines): the gates are one conjunction over the
        same arrays, in the docstring's order; split, every part would pass the baseline,
        the window and the peers' levels along."""
        cfg = self.settings
        history = self._history
        window, z, min_rise = lane.window, lane.z, lane.rise
        if history.count < window + cfg.min_baseline_steps:
            return None
        kind, stage, dp = columns
        values = history.recent(history.count)[:, kind, stage, dp]  # [slot, column]
        steps = history.steps[: history.count]
        inside = values[-window:]
        before_slots = np.arange(history.count - window)
        before_slots = before_slots[-cfg.baseline_steps :]
        # A worker's baseline leaves out its last episode's steps: NaN there.
        usable_all = self._once(  # [slot, stage, dp]
            ("usable", history.count - window), lambda: self._usable(steps[before_slots])
        )
        usable = usable_all[:, stage, dp]
        rise = 1.0 + min_rise
        # The least-step gate below, against the baseline's least step (never above its
        # quick level; the slack covers the quantile's rounding): most series fail it,
        # most steps, and skip the medians (a slow-from-the-start worker, on every step).
        least_before = np.where(usable, values[before_slots], np.inf).min(axis=0)
        possible = inside.min(axis=0) >= rise * least_before * (1 - 1e-9)
        if not possible.any():
            return None
        values, inside, usable, kind, stage, dp = _columns_where(
            possible, values, inside, usable, kind, stage, dp
        )
        # The gates against the peers next, before the worker's own levels: a worker
        # steadily slower than its peers (a slow GPU from the start) passes the others.
        peers_all = history.recent_peers(history.count)[:, kind, stage, dp]
        ratio_before, ratio_inside, least_ratio = _ratios_to_peers(
            values, peers_all, usable, before_slots, window, cfg.steps_per_quick_peer_step
        )
        above_peers = (least_ratio >= lane.peer_ratio) & (
            ratio_inside >= (1 + min_rise / 2) * np.fmax(ratio_before, 1.0)
        )
        if not above_peers.any():
            return None
        values, inside, usable, kind, stage, dp, peers_all = _columns_where(
            above_peers, values, inside, usable, kind, stage, dp, peers_all
        )
        ratio_before, ratio_inside = ratio_before[above_peers], ratio_inside[above_peers]
        columns = kind, stage, dp
        before = np.where(usable, values[before_slots], np.nan)
        enough = usable.sum(axis=0) >= cfg.min_baseline_steps
        with np.errstate(all="ignore"), warnings.catch_warnings():
            # Workers without a usable baseline yet are all-NaN slices: `enough` drops them.
            warnings.simplefilter("ignore", RuntimeWarning)
            level_before = nanmedian_first_axis(before)
            quick_before = nanquantile_first_axis(before, cfg.quick_quantile)
            level_inside = np.median(inside, axis=0)
            n_before = np.maximum(np.sum(~np.isnan(before), axis=0), 1)
            # The worker's noise, its own pooled with its peers' (as `peer_noise_steps`
            # steps of its own): a few steps of its own can read as still by chance.
            peers_noise = self._once(
                ("peers noise", history.count - window),
                lambda: self._peers_noise(before_slots, usable_all),
            )[kind, stage, dp]
            own_noise = _mad_sigma(before, level_before)
            noise = np.sqrt(
                (n_before * own_noise**2 + cfg.peer_noise_steps * np.nan_to_num(peers_noise) ** 2)
                / (n_before + cfg.peer_noise_steps)
            )
            stderr = noise * np.sqrt(1.0 / window + 1.0 / n_before)
            peers_inside, peers_before = peers_all[-window:], peers_all[before_slots]
            peers_rise = np.median(peers_inside, axis=0) / np.median(peers_before, axis=0)
            step_s = float(np.median(self._step_times[: len(self._step_times) - window] or [0]))
            extra = level_inside - level_before
            raised = (
                enough
                & (level_before > 0)
                & (level_inside >= rise * level_before)
                & (inside.min(axis=0) >= rise * quick_before)
                # It begins where the worker rose: its first step is already past the
                # middle of the two levels (a stray spike before the rise is no onset).
                & (
                    inside[0]
                    >= np.fmax(
                        (1 + min_rise / 2) * level_before, np.sqrt(level_before * level_inside)
                    )
                )
                & (level_inside / level_before >= (1 + min_rise / 2) * np.fmax(peers_rise, 1.0))
                & (extra >= cfg.min_cost * step_s)
                & (extra >= z * stderr)
            )
        shape = history.values.shape[1:]
        return _Evidence(
            _dense(np.nan_to_num(raised, nan=False).astype(bool), columns, shape, False),
            *(
                _dense(a, columns, shape, np.nan)
                for a in (
                    extra,
                    level_before,
                    level_inside,
                    ratio_before,
                    ratio_inside,
                    inside.min(axis=0) / level_before - 1.0,
                )
            ),
        )

    def _peers_noise(self, before_slots: np.ndarray, usable: np.ndarray) -> np.ndarray:
        """[kind, stage, dp]: the median noise (sigma) of each worker's peers over the
        baseline slots (`usable`: [slot, stage, dp], which of them each worker's baseline
        may use; NaN where none has enough steps). With many DP ranks, the noise of up
        to 64 of them, evenly spread, stands for all."""
        history = self._history
        dp_index = np.arange(self.n_dp)
        if self.n_dp > _EXACT_PEERS_UP_TO:
            dp_index = np.unique(np.linspace(0, self.n_dp - 1, 64).astype(np.intp))
        usable = usable[:, :, dp_index]
        values = history.values[before_slots][..., dp_index]
        before = np.where(usable[:, None], values, np.nan)
        enough = usable.sum(axis=0) >= self.settings.min_baseline_steps
        sigma = np.where(enough[None], _mad_sigma(before), np.nan)  # [kind, stage, dp]
        if self.n_dp > _EXACT_PEERS_UP_TO:
            # The same median as np.nanmedian's, without its masked arrays (a third of
            # the story pass of `lagscope analyze` on a 32-DP trace).
            typical = nanmedian_first_axis(np.moveaxis(sigma, 2, 0))[..., np.newaxis]
            return np.broadcast_to(typical, (*sigma.shape[:2], self.n_dp))
        return peer_median(sigma[np.newaxis])[0]

    # -- reading ------------------------------------------------------------------------
    def open_episodes(self) -> list[WorkerEpisode]:
        return [e for e in self.episodes if e.open]

    def history(self, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The steps it keeps (oldest first), every worker's seconds of `kind` in them
        ([step, stage, dp]) and their measured times: what `adopt` reads, where a job's
        retained window holds fewer steps (a large job keeps a few).

        >>> detector = OnlineEpisodes(["forward-compute", HOST], n_stages=1, n_dp=2)
        >>> for step in (7, 8):
        ...     _ = detector.update(step, np.full((2, 1, 2), 0.01 * step), 0.1)
        >>> steps, values, times = detector.history("forward-compute")
        >>> steps.tolist(), values[:, 0, 1].tolist(), times.tolist()
        ([7, 8], [0.07, 0.08], [0.1, 0.1])
        """
        history = self._history
        return (
            history.steps[: history.count].copy(),
            history.recent(history.count)[:, self.kinds.index(kind)].copy(),
            np.array(self._step_times[-history.count :] if history.count else []),
        )

    def level_of(self, episode: WorkerEpisode, step: int) -> float | None:
        """The worker's seconds of the episode's kind in `step`, while it is kept."""
        history = self._history
        found = np.flatnonzero(history.steps[: history.count] == step)
        if not found.size:
            return None
        kind = self.kinds.index(episode.kind)
        return float(history.values[found[-1], kind, episode.stage, episode.dp])

    # -- state --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        history = self._history
        return {
            "settings": asdict(self.settings),
            "kinds": list(self.kinds),
            "shape": [self.n_stages, self.n_dp],
            "history": history.values[: history.count].copy(),
            "history_steps": history.steps[: history.count].copy(),
            "baseline_from": self._baseline_from.copy(),
            "step_times": list(self._step_times),
            "episodes": [asdict(e) for e in self.episodes],
            "next_id": self._next_id,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> OnlineEpisodes:
        n_stages, n_dp = state["shape"]
        tracker = cls(state["kinds"], n_stages, n_dp, OnlineEpisodeSettings(**state["settings"]))
        for values, step in zip(state["history"], state["history_steps"], strict=True):
            tracker._history.push(int(step), np.asarray(values))
        tracker._baseline_from = np.asarray(state["baseline_from"], dtype=np.int64).copy()
        tracker._step_times = [float(x) for x in state["step_times"]]
        tracker.episodes = [WorkerEpisode(**e) for e in state["episodes"]]
        tracker._next_id = int(state["next_id"])
        return tracker


def _jump_rate(
    values: np.ndarray, workers: np.ndarray, step_s: float, cfg: OnlineEpisodeSettings
) -> float:
    """The share of `workers`' ([stage, dp] mask) steps of `values` ([step, stage, dp]) in
    which one jumped by `min_rise` over its own median there and by `min_cost` of a step
    (`step_s`): as `OnlineEpisodes._spike_rate` counts, over these steps; only the workers
    that do this kind of work count.

    >>> values = np.full((10, 1, 3), 0.010)
    >>> values[::2, 0, 0] = 0.030  # dp 0 jumps every other step
    >>> mask = np.array([[True, True, False]])
    >>> _jump_rate(values, mask, 0.1, OnlineEpisodeSettings())
    0.25
    """
    series = values[:, workers & (values != 0).any(axis=0)]
    if not series.size:
        return 0.0
    median = np.median(series, axis=0)
    jumped = (series >= (1 + cfg.min_rise) * median) & (series - median >= cfg.min_cost * step_s)
    return float(jumped.mean())


def _mad_sigma(values: np.ndarray, level: np.ndarray | None = None) -> np.ndarray:
    """The standard deviation of each column of `values` (NaN: no value) estimated from
    its median absolute deviation (around `level`, its median when not given), robust to
    the few outliers a baseline holds.

    >>> _mad_sigma(np.array([[1.0], [2.0], [3.0], [np.nan], [100.0]])).round(3).tolist()
    [1.483]
    """
    level = nanmedian_first_axis(values) if level is None else level
    return _MAD_TO_SIGMA * nanmedian_first_axis(np.abs(values - level))


def _columns_where(keep: np.ndarray, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """Each of `arrays` ([..., column]) at the columns `keep` marks."""
    if keep.all():
        return arrays
    return tuple(a[..., keep] for a in arrays)


def _ratios_to_peers(
    values: np.ndarray,
    peers: np.ndarray,
    usable: np.ndarray,
    before_slots: np.ndarray,
    window: int,
    steps_per_quick_peer_step: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[column] each: a series' median ratio to its peers over its baseline (the slots of
    `before_slots` that are `usable`) and over the last `window` steps, and its k-th
    least ratio over them: a long window may hold a step or two in which a peer lost its
    core (the ratio dips), so one in `steps_per_quick_peer_step` of them is let pass."""
    with np.errstate(all="ignore"):
        ratio = values / np.where(peers > 0, peers, np.nan)
    inside = ratio[-window:]
    least = np.sort(np.nan_to_num(inside, nan=0.0), axis=0)[
        (window - 1) // steps_per_quick_peer_step
    ]
    before = nanmedian_first_axis(np.where(usable, ratio[before_slots], np.nan))
    return before, nanmedian_first_axis(inside), least


def _dense(
    values: np.ndarray, columns: tuple[np.ndarray, ...], shape: tuple[int, ...], fill: object
) -> np.ndarray:
    """`values` of the series at `columns`, laid back on the [kind, stage, dp] grid."""
    out = np.full(shape, fill, dtype=values.dtype)
    out[columns] = values
    return out


def nanmedian_first_axis(values: np.ndarray) -> np.ndarray:
    """`np.nanmedian(values, axis=0)`, the same numbers (the mean of the two middle values
    as numpy's masked median takes it), without its masked-array overhead: the detector
    takes a dozen medians per step.

    >>> nanmedian_first_axis(np.array([[1.0, np.nan], [4.0, 2.0], [2.0, np.nan]])).tolist()
    [2.0, 2.0]
    """
    ordered = np.sort(values, axis=0)  # NaN last: the first `count` rows are the values
    count = np.sum(~np.isnan(values), axis=0)
    high = count // 2
    low = np.where(count % 2 == 1, high, high - 1)
    top = np.maximum(count - 1, 0)
    a = _row_of_each_column(ordered, np.clip(low, 0, top))
    b = _row_of_each_column(ordered, np.minimum(high, top))
    return np.where(count > 0, (a + b) / 2.0, np.nan)


def _row_of_each_column(values: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """`values[rows[c], c]` for every column c of the axes after the first: one gather
    (`np.take_along_axis` builds an index per axis, most of a detector's median there).

    >>> _row_of_each_column(np.arange(6.0).reshape(3, 2), np.array([2, 0])).tolist()
    [4.0, 1.0]
    """
    flat = values.reshape(values.shape[0], -1)
    picked = flat[rows.ravel(), np.arange(flat.shape[1])]
    return picked.reshape(rows.shape)


def nanquantile_first_axis(values: np.ndarray, q: float) -> np.ndarray:
    """`np.nanquantile(values, q, axis=0)` (linear method), the same numbers, for every
    column at once: numpy's version loops over the columns in Python (`apply_along_axis`),
    33 s per step over the ~100,000 (kind, worker) columns of a 100,000-GPU job.

    >>> values = np.array([[1.0, np.nan], [3.0, 2.0], [2.0, np.nan], [np.nan, np.nan]])
    >>> nanquantile_first_axis(values, 0.25).tolist()
    [1.5, 2.0]
    """
    ordered = np.sort(values, axis=0)  # NaN last: the first `count` rows are the values
    count = np.sum(~np.isnan(values), axis=0)
    # numpy's linear method: the virtual index (n - 1) q, its floor and the next index,
    # both the last value where the virtual index reaches it.
    virtual = (count - 1) * np.float64(q)
    last = virtual >= count - 1
    previous = np.where(last, -1.0, np.floor(virtual))
    following = np.where(last, -1.0, np.floor(virtual) + 1)
    gamma = virtual - previous
    top = np.maximum(count - 1, 0)
    below = np.where(previous < 0, top, previous).astype(np.intp)
    above = np.where(following < 0, top, following).astype(np.intp)
    a = _row_of_each_column(ordered, below)
    b = _row_of_each_column(ordered, above)
    # numpy's _lerp: from a below the middle, from b at or above it.
    difference = b - a
    out = a + difference * gamma
    np.subtract(b, difference * (1 - gamma), out=out, where=gamma >= 0.5)
    return np.where(count > 0, out, np.nan)
