"""What a diagnosis rests on, as typed records: who, in which op, how much, against which
noise floor, and the figures measured to decide it.

Every reader (the verdict, the run's story, the summary, the report, the store's rows)
reads attributes of these records. `Evidence.as_dict()` writes the JSON the store, the
`--json` output and the dashboards' SQL read: the keys and their order are the ones they
have always had, so stored diagnoses and the queries over them keep their shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lagscope.simulator.causes import Cause


@dataclass(frozen=True)
class Worker:
    """A (dp, pp) worker of the job's grid."""

    dp: int
    stage: int

    def label(self) -> str:
        """How every output names a worker (a machine may follow it).

        >>> Worker(1, 0).label()
        '(dp 1, pp 0)'
        """
        return f"(dp {self.dp}, pp {self.stage})"

    def as_dict(self) -> dict[str, int]:
        return {"dp": self.dp, "stage": self.stage}


def in_one_unit(*seconds: float) -> tuple[list[str], str]:
    """Durations as a summary writes them side by side: in ms, or in s where the largest
    is 10 s or more (a 46-s step's forward reads "27.9 s", not "27873.9 ms").

    >>> in_one_unit(0.05, 0.2)
    (['50.0', '200.0'], 'ms')
    >>> in_one_unit(12.1, 27.8739)
    (['12.1', '27.9'], 's')
    """
    scale, unit = (1.0, "s") if max(seconds, default=0.0) >= 10 else (1e3, "ms")
    return [f"{value * scale:.1f}" for value in seconds], unit


@dataclass(frozen=True)
class VerifiedWorker:
    """A worker verified slow on its own: the share of the slowdown it explains alone,
    and where its own time exceeds its peers' (extra seconds per step by op type)."""

    worker: Worker
    share: float | None
    slow_in: Mapping[str, float] = field(default_factory=dict)

    @property
    def first_op(self) -> str | None:
        """The op type it is slowest in."""
        return next(iter(self.slow_in), None)

    def as_dict(self) -> dict[str, Any]:
        return {**self.worker.as_dict(), "share": self.share, "slow_in": dict(self.slow_in)}


@dataclass(frozen=True)
class SlowGroup:
    """A communication group whose transfers are slower than those moving the same data."""

    ops: tuple[str, ...]
    dp: int | None
    transfer_s: float
    optype_median_s: float
    ratio: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "ops": list(self.ops),
            "dp": self.dp,
            "transfer_s": self.transfer_s,
            "optype_median_s": self.optype_median_s,
            "ratio": self.ratio,
        }


@dataclass(frozen=True)
class GcFacts:
    """What the GC probe recorded: pauses per step, the share of the slowdown taking them
    out removes, and the share of the slow computes' excess they account for."""

    recorded: bool
    pause_per_step_s: float | None = None
    explained: float | None = None
    coincidence: float | None = None

    def as_dict(self) -> dict[str, Any]:
        if not self.recorded:
            return {"gc_recorded": False}
        return {
            "gc_recorded": True,
            "gc_pause_per_step_s": self.pause_per_step_s,
            "gc_explained": self.explained,
            "gc_coincidence": self.coincidence,
        }


@dataclass(frozen=True)
class HostFacts:
    """A worker whose host stalls between its ops: its host gaps over its peers'."""

    worker: Worker
    launch_ratio: float
    extra_s: float
    share_of_launch_delays: float
    launch_slowdown: float

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.worker.as_dict(),
            "launch_ratio": self.launch_ratio,
            "extra_s": self.extra_s,
            "share_of_launch_delays": self.share_of_launch_delays,
            "launch_slowdown": self.launch_slowdown,
        }


@dataclass(frozen=True)
class EpisodeFacts:
    """A worker's episode as its detector measured it, and what it cost."""

    id: int
    kind: str
    onset: int
    recovery: int | None
    first_seen: int
    level_before_s: float
    level_inside_s: float
    ratio_inside: float
    ratio_before: float
    lost_s: float
    share: float
    steps: int
    #: Found by the job's diagnosis, slow as far back as it saw: its level before is its
    #: peers' (`WorkerEpisode.standing`).
    standing: bool = False
    #: The model's price (`lost_s` is the job's own measure where that contradicts it),
    #: the job's own measure (None: no steps before the episode to compare with), and the
    #: share of it the model explains (None: the job measured no loss beyond its noise).
    model_lost_s: float | None = None
    job_lost_s: float | None = None
    model_explains: float | None = None
    #: Share of its steps' time the job would have saved without it.
    step_share: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass(frozen=True)
class EpisodeBrief:
    """What a run's verdict lists of one of its episodes."""

    id: int | None
    cause: str
    kind: str | None
    onset: int | None
    recovery: int | None
    workers: tuple[Worker, ...]
    lost_s: float
    summary: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "cause": self.cause,
            "kind": self.kind,
            "onset": self.onset,
            "recovery": self.recovery,
            "workers": [w.as_dict() for w in self.workers],
            "lost_s": self.lost_s,
            "summary": self.summary,
        }


@dataclass(frozen=True)
class RunBrief:
    """The run's own diagnosis, kept beside the episode that speaks for the run."""

    cause: str
    summary: str
    slowdown: float | None
    noise_floor: float | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause,
            "summary": self.summary,
            "slowdown": self.slowdown,
            "noise_floor": self.noise_floor,
        }


@dataclass(frozen=True)
class RunFigures:
    """The figures of the steps diagnosed: S, M_W, M_S and the checks of each cause. A
    check that did not run (the diagnosis stopped before it) is None."""

    slowdown: float
    mw: float
    mw_workers: tuple[Worker, ...]
    ms: float
    fwd_bwd_correlation: float
    forward_outlier_share: float
    backward_outlier_share: float
    top_optype: tuple[str, float] | None
    #: The slowdown the job's op-to-op fluctuations alone give (its noise floor).
    noise_floor: float | None = None
    gc: GcFacts | None = None
    stage_excess: tuple[float, ...] | None = None
    mw_speedup: float | None = None
    ms_speedup: float | None = None
    slow_groups: tuple[SlowGroup, ...] | None = None

    def _head(self) -> dict[str, Any]:
        head: dict[str, Any] = {
            "slowdown": self.slowdown,
            "mw": self.mw,
            "mw_workers": [w.as_dict() for w in self.mw_workers],
            "ms": self.ms,
            "fwd_bwd_correlation": self.fwd_bwd_correlation,
            "forward_outlier_share": self.forward_outlier_share,
            "backward_outlier_share": self.backward_outlier_share,
            "top_optype": list(self.top_optype) if self.top_optype else None,
        }
        if self.noise_floor is not None:
            head["noise_floor"] = self.noise_floor
        return head

    def _tail(self) -> dict[str, Any]:
        tail: dict[str, Any] = {}
        if self.gc is not None:
            tail.update(self.gc.as_dict())
        if self.stage_excess is not None:
            tail["stage_excess"] = list(self.stage_excess)
        if self.mw_speedup is not None:
            tail["mw_speedup"] = self.mw_speedup
        if self.ms_speedup is not None:
            tail["ms_speedup"] = self.ms_speedup
        if self.slow_groups is not None:
            tail["slow_groups"] = [g.as_dict() for g in self.slow_groups]
        return tail


@dataclass(frozen=True)
class Finding:
    """What a diagnosis names: who (the workers, best first, with what each is slow in),
    the stage where the cause is one, and what its own check measured. Empty for a
    diagnosis that names nothing."""

    named: tuple[Worker, ...] = ()
    verified: tuple[VerifiedWorker, ...] = ()
    #: The share of the slowdown the verified workers explain together.
    verified_share: float | None = None
    stage: int | None = None
    host: HostFacts | None = None
    episode: EpisodeFacts | None = None
    #: Actions the what-if predicts would not speed the job up (left off the ladder).
    refuted_actions: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        verified = [v.as_dict() for v in self.verified]
        named = [w.as_dict() for w in self.named]
        if self.host is not None:
            out.update(slow_host=self.host.as_dict(), named_workers=named,
                       verified_workers=verified)  # fmt: skip
        elif self.episode is not None:
            out.update(named_workers=named, verified_workers=verified,
                       episode=self.episode.as_dict())  # fmt: skip
        elif self.verified or self.named:
            out["verified_workers"] = verified
            out["verified_workers_share"] = self.verified_share
            out["named_workers"] = named
        if self.refuted_actions:
            out["refuted_actions"] = list(self.refuted_actions)
        return out


@dataclass(frozen=True)
class Evidence:
    """Everything a diagnosis rests on: the figures of its steps (None for an episode's
    own diagnosis), what it names, and for a run's verdict its episodes and, when an
    episode speaks for the run, the run's own diagnosis."""

    figures: RunFigures | None = None
    finding: Finding = field(default_factory=Finding)
    episodes: tuple[EpisodeBrief, ...] | None = None
    run: RunBrief | None = None

    # -- what readers ask -----------------------------------------------------------------
    @property
    def named_workers(self) -> tuple[Worker, ...]:
        """The workers the diagnosis names, best first (its verified ones where it names
        none by themselves)."""
        return self.finding.named or tuple(v.worker for v in self.finding.verified)

    @property
    def verified_workers(self) -> tuple[Worker, ...]:
        """The workers verified slow on their own, best first."""
        return tuple(v.worker for v in self.finding.verified)

    @property
    def slowdown(self) -> float | None:
        """The run's S (an episode speaking for the run carries the run's)."""
        if self.figures is not None:
            return self.figures.slowdown
        return self.run.slowdown if self.run is not None else None

    @property
    def noise_floor(self) -> float | None:
        """The run's noise floor (an episode speaking for the run carries the run's)."""
        if self.figures is not None and self.figures.noise_floor is not None:
            return self.figures.noise_floor
        return self.run.noise_floor if self.run is not None else None

    @property
    def lost_s(self) -> float:
        """Job seconds an episode cost (0 for a run's diagnosis)."""
        return self.finding.episode.lost_s if self.finding.episode is not None else 0.0

    def as_dict(self) -> dict[str, Any]:
        """The JSON document of the store and of `--json` (keys in their historic order)."""
        out: dict[str, Any] = {}
        if self.figures is not None:
            out.update(self.figures._head())
            if self.finding.host is None:
                out.update(self.figures._tail())
        out.update(self.finding.as_dict())
        if self.episodes is not None:
            out["episodes"] = [e.as_dict() for e in self.episodes]
        if self.run is not None:
            out["run"] = self.run.as_dict()
            # An episode speaking for the run: the run's S and floor where readers look.
            for name in ("slowdown", "noise_floor"):
                value = getattr(self.run, name)
                if value is not None:
                    out[name] = value
        return out


@dataclass(frozen=True)
class LadderStep:
    """One rung of an escalation: the action, and the loss at which it is due."""

    action: str
    at_loss_s: float


@dataclass(frozen=True)
class Escalation:
    """Falcon's ski-rental ladder of a cause: the step the loss so far has reached and
    the next one, with the loss at which to take it."""

    cause: Cause | None
    accumulated_loss_s: float
    action: str
    next_action: str | None
    next_action_at_loss_s: float | None
    ladder: tuple[LadderStep, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause,
            "accumulated_loss_s": self.accumulated_loss_s,
            "action": self.action,
            "next_action": self.next_action,
            "next_action_at_loss_s": self.next_action_at_loss_s,
            "ladder": [{"action": s.action, "at_loss_s": s.at_loss_s} for s in self.ladder],
        }

    @classmethod
    def from_dict(cls, document: Mapping[str, Any]) -> Escalation:
        """The escalation a stored (or `--json`) document holds.

        >>> ladder = Escalation(Cause.GC_PAUSES, 5.0, "ignore", "planned garbage collection",
        ...     60.0, (LadderStep("ignore", 0.0), LadderStep("planned garbage collection", 60.0)))
        >>> Escalation.from_dict(ladder.as_dict()) == ladder
        True
        """
        cause = document.get("cause")
        return cls(
            cause=Cause(cause) if cause is not None else None,
            accumulated_loss_s=float(document["accumulated_loss_s"]),
            action=str(document["action"]),
            next_action=document.get("next_action"),
            next_action_at_loss_s=document.get("next_action_at_loss_s"),
            ladder=tuple(
                LadderStep(str(s["action"]), float(s["at_loss_s"]))
                for s in document.get("ladder", ())
            ),
        )
