"""What the step processor keeps per job attempt, and the steps it windows and closes.

- `Window`: a step's batches gathered per (dp, pp) coordinate until it closes.
- `Closed`: a closed step waiting for its analysis.
- `Held`: a step closed without some coordinates, its batches held for their late ones.
- `JobState`: one job attempt's state in the processor: its compute half's running
  ideals, its retained steps, its change-point detectors, its story (`LiveJob`), its
  arrivals and the steps it holds for late batches; saved and resumed with its
  processor's state (`state_dict` / `from_state`), its retained steps' inputs apart
  (`encode_step_inputs`: a host persists each once).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lagscope.producers.events import JobInfo, RankStepBatch
from lagscope.simulator.bocd import BocdBank
from lagscope.simulator.job_story import LiveJob
from lagscope.simulator.prepare import PreparedTrace
from lagscope.store.snapshot_format import SnapshotError, decode_state, encode_state
from lagscope.stream_app.analysis_process import ChildProcesses, InProcess
from lagscope.stream_app.held_bytes import held_bytes
from lagscope.stream_app.lateness import JobArrivals
from lagscope.stream_app.step_compute import JobCompute

if TYPE_CHECKING:
    from lagscope.stream_app.processor import ProcessorSettings

log = logging.getLogger("lagscope.processor")

#: `retained_inputs(job, steps)`: the encoded inputs of a job's retained steps by step
#: id (a host's checkpoint store), for a state that holds their ids only.
RetainedInputs = Callable[[tuple[str, int], list[int]], dict[int, bytes]]

#: Steps closed without some coordinates whose batches a job holds for late ones, and the
#: ops they may hold in all (~30 bytes each: 60 MB; a 100,000-GPU job's step alone is
#: more, and is not held).
_HELD_STEPS = 64
_HELD_OPS = 2_000_000
#: Steps closed without some coordinates remembered per job with those coordinates.
_CLOSED_WITHOUT_KEPT = 4096


#: Fields of a retained step that are its own (the model and meta are the job's).
_STEP_INPUTS = (
    "steps", "n_dp", "start", "duration", "cost", "launch_delay", "actual_step_time",
    "worker_rank", "source", "gc_pause", "gc_gap_pause", "entry",
)  # fmt: skip
#: ... less those a snapshot of an earlier version lacks (none recorded, or not known,
#: as then).
_STEP_INPUTS_ADDED = ("gc_gap_pause", "entry")
_ADDED_NONE = dict.fromkeys(_STEP_INPUTS_ADDED)


def encode_step_inputs(prepared: PreparedTrace) -> bytes:
    """A retained step's inputs, without the job's model (hosts persist these once), in the
    safe state format (`store.snapshot_format`: no pickle)."""
    return encode_state(_step_inputs(prepared))


def _step_inputs(prepared: PreparedTrace) -> dict[str, Any]:
    return {name: getattr(prepared, name) for name in _STEP_INPUTS}


def decode_step_inputs(payload: bytes, where: str = "retained step") -> dict[str, Any]:
    """The fields `encode_step_inputs` wrote; a payload of another shape is a
    SnapshotError."""
    inputs = decode_state(payload, where)
    if not isinstance(inputs, dict) or not (
        set(_STEP_INPUTS) - set(_STEP_INPUTS_ADDED) <= set(inputs) <= set(_STEP_INPUTS)
    ):
        raise SnapshotError(f"{where}: not the inputs of a retained step")
    return {name: None for name in _STEP_INPUTS_ADDED} | inputs


@dataclass
class Window:
    first_seen: float
    #: When its latest batch came (wall-clock time: the steps' `received_at`).
    received_at: float = 0.0
    #: Batches per (dp, pp) coordinate: a rank-step may arrive in several parts (a huge
    #: step, or ops recorded after the step was sealed).
    batches: dict[tuple[int, int], list[RankStepBatch]] = field(default_factory=dict)
    fingerprints: set[tuple[int, int, bytes]] = field(default_factory=set)

    def all_batches(self) -> list[RankStepBatch]:
        return [b for parts in self.batches.values() for b in parts]


@dataclass
class Closed:
    """A closed step waiting for its analysis."""

    job: JobState
    step: int
    start_ns: int
    missing: tuple[tuple[int, int], ...]
    #: DP ranks whose every stage reported (the ones analysed).
    dp_ranks: list[int]
    batches: list[RankStepBatch]
    #: Why the step cannot be analysed ("": it can).
    reason: str = ""
    #: Why its missing coordinates were missing.
    missing_reason: str = ""
    #: > 0: the step closed again, with late batches, and what it held.
    version: int = 0
    held: Held | None = None
    #: When the host had its last batch (wall clock).
    received_at: float = 0.0

    @property
    def complete(self) -> bool:
        return not self.missing


@dataclass
class Held:
    """A step closed without some coordinates, its batches held for theirs: a late batch
    closes it again (`StepProcessor._reclose`), its rows replacing the stored ones."""

    step: int
    start_ns: int
    batches: dict[tuple[int, int], list[RankStepBatch]]
    missing: set[tuple[int, int]]
    ops: int
    version: int = 0
    #: The stored result's (actual, ideal, slowdown), taken back from the job's totals
    #: when it closes again (None: it had none).
    figures: tuple[float, float, float] | None = None
    #: Late batches came since it last closed.
    fresh: bool = False


def fingerprint(batch: RankStepBatch) -> tuple[int, int, bytes]:
    """Identity of a batch's content: a re-sent batch has the same ops at the same times."""
    return (batch.dp_rank, batch.pp_rank, batch.start_ns.tobytes() + batch.seq.tobytes())


class JobState:
    """One job attempt's state in the step processor."""

    def __init__(self, info: JobInfo, settings: ProcessorSettings) -> None:
        self.info = info
        self.settings = settings
        #: The dependency model and running ideals: the compute half's own state (a child
        #: process holds its copy; this one is kept equal to it for snapshots).
        self.compute = JobCompute(info, settings)
        #: Where its compute half runs: chosen at its first analysable step (by its size).
        self.executor: InProcess | ChildProcesses | None = None
        self.retained: deque[PreparedTrace] = deque(maxlen=settings.rollup_window_steps)
        self.detector: BocdBank | None = None
        self.series_names: list[str] = []
        #: (update index, step id) of recent detector updates, to name change steps.
        self.fed_steps: deque[tuple[int, int]] = deque(maxlen=4096)
        #: Per series, the mean of its first regime: a change is an onset only when it
        #: rises above it (a stage that got relatively faster because another one slowed
        #: and came back is no onset).
        self.series_baseline: dict[str, float] = {}
        #: Totals, episodes and diagnosis, kept current step by step.
        self.live = LiveJob(
            info, settings.diagnose_every_steps, settings.episodes, settings.diagnosis
        )
        #: The steps of its last diagnosis, held while a snapshot may need them
        #: (`StepProcessor.keep_diagnosed`).
        self.diagnosed: tuple[PreparedTrace, ...] = ()
        #: What its coordinates delivered and when: how long its steps wait for one.
        self.arrivals = JobArrivals(settings.lateness_s)
        #: Its open windows' steps.
        self.open_steps: set[int] = set()
        #: Its (dp, pp) coordinates, and per step how many of them delivered it last (the
        #: lowest such step, once each delivered one, is the one all have reached).
        self.coordinates = info.dp_size * info.pp_size
        self._reached: dict[int, int] = {}
        self.passed_by_all: int | None = None
        #: Its latest steps closed without some coordinates, their batches held (at most
        #: `_HELD_STEPS`, `_HELD_OPS` ops in all), and the coordinates each closed without
        #: (more of them: a late batch beyond those held is a dead letter saying so).
        self.held: dict[int, Held] = {}
        self.held_ops = 0
        self.closed_without: dict[int, frozenset[tuple[int, int]]] = {}

    def _fit_window(self) -> None:
        """The retained window as long as the compute half's (sized by the byte budget
        from the job's first complete step)."""
        capacity = self.compute.capacity
        if self.retained.maxlen == capacity:
            return
        self.retained = deque(self.retained, maxlen=capacity)
        if capacity < self.settings.rollup_window_steps:
            log.warning(
                "job %s/%d: a step holds %.1f MB, so its roll-up and comm medians cover the "
                "last %d complete steps (rollup_budget_bytes %d MB), not %d",
                self.info.job_id,
                self.info.attempt,
                self.compute.step_bytes / 1e6,
                capacity,
                self.settings.rollup_budget_bytes >> 20,
                self.settings.rollup_window_steps,
            )

    def retain(self, prepared: PreparedTrace, *, mirror: bool) -> None:
        """Keep a complete step for the roll-up; `mirror`: add it to this side's running
        ideals too (the compute half ran elsewhere)."""
        if mirror:
            self.compute.add_complete_step(prepared)
        self._fit_window()
        self.retained.append(prepared)

    def retain_at(self, prepared: PreparedTrace, *, mirror: bool) -> None:
        """Keep a step that became complete late among the retained ones, in step order
        (not when it is older than all of a full window)."""
        if mirror:
            self.compute.add_complete_step(prepared)
        self._fit_window()
        step = int(prepared.steps[0])
        kept = sorted([*self.retained, prepared], key=lambda p: int(p.steps[0]))
        if len(kept) > (self.retained.maxlen or len(kept)) and int(kept[0].steps[0]) == step:
            return
        self.retained = deque(kept, maxlen=self.retained.maxlen)

    def restore_retained(self, ideal_state: dict[str, Any], retained: list[PreparedTrace]) -> None:
        if retained:
            self.compute.size_window(retained[0])
            self._fit_window()
            # A snapshot taken under a larger budget keeps only what this one allows.
            retained = retained[-self.compute.capacity :]
        self.retained.extend(retained)
        self.compute.ideal.restore(ideal_state, retained)

    def delivered(self, coordinate: tuple[int, int], step: int, at: float, delay_s: float) -> bool:
        """Note a batch of `coordinate` for `step`; True when it moved the step that every
        coordinate has reached (the steps before it will get no more batches)."""
        arrivals = self.arrivals
        before = arrivals.latest_step.get(coordinate)
        arrivals.on_batch(coordinate, step, at, delay_s)
        after = arrivals.latest_step[coordinate]
        if before == after:
            return False
        reached = self._reached
        if before is not None:
            reached[before] -= 1
            if not reached[before]:
                del reached[before]
        reached[after] = reached.get(after, 0) + 1
        if len(arrivals.latest_step) < self.coordinates:
            return False
        lowest = self.passed_by_all
        if lowest is None or lowest not in reached:
            lowest = min(reached)
        if lowest != self.passed_by_all:
            self.passed_by_all = lowest
            return True
        return False

    def hold(self, held: Held) -> None:
        """Hold a step closed without some coordinates, letting go of the oldest held."""
        self.closed_without[held.step] = frozenset(held.missing)
        while len(self.closed_without) > _CLOSED_WITHOUT_KEPT:
            del self.closed_without[next(iter(self.closed_without))]
        self.held[held.step] = held
        self.held_ops += held.ops
        while self.held and (len(self.held) > _HELD_STEPS or self.held_ops > _HELD_OPS):
            self.release(next(iter(self.held)))

    def release(self, step: int) -> None:
        held = self.held.pop(step, None)
        if held is not None:
            self.held_ops -= held.ops

    def restore_reached(self) -> None:
        """The steps reached, counted again from the arrivals (after a restore)."""
        self._reached = {}
        for step in self.arrivals.latest_step.values():
            self._reached[step] = self._reached.get(step, 0) + 1
        if len(self.arrivals.latest_step) >= self.coordinates and self._reached:
            self.passed_by_all = min(self._reached)

    def diagnosed_beyond_window(self) -> list[PreparedTrace]:
        """The held steps of the last diagnosis that the retained window no longer holds."""
        retained = {int(p.steps[0]) for p in self.retained}
        return [p for p in self.diagnosed if int(p.steps[0]) not in retained]

    @property
    def retained_capacity(self) -> int:
        """How many complete steps the roll-up covers at most (the budget's cap)."""
        return self.retained.maxlen or 0

    def held_bytes(self, seen: set[int] | None = None) -> dict[str, int]:
        """Bytes each structure the job keeps between its steps holds, each object counted
        once, where it is first met in this order (`held_bytes`). Each has its bound,
        whatever the job's length: the running ideals (with the dependency model) and the
        detectors the job's shape, the retained steps the roll-up budget
        (`rollup_budget_bytes`, on their arrays' bytes; a worker's twice, while the steps
        of its last diagnosis the window moved past wait for a snapshot to store them), its
        episodes `CLOSED_EPISODES_KEPT` closed ones and the detector's history, its
        arrivals `lateness._KEPT` observations, the steps held for late batches
        `_HELD_STEPS` and `_HELD_OPS`."""
        seen = set() if seen is None else seen
        parts = {
            # First: the dependency model its retained steps share is the compute's.
            "running_ideals": self.compute,
            "retained_steps": (self.retained, self.diagnosed),
            "change_points": (self.detector, self.fed_steps, self.series_baseline),
            "episodes_and_diagnosis": self.live,
            "arrivals": (self.arrivals, self._reached),
            "held_steps": (self.held, self.closed_without),
        }
        return {name: held_bytes(part, seen) for name, part in parts.items()}

    def state_dict(
        self, *, now: float, with_retained_inputs: bool, held: dict[str, int]
    ) -> dict[str, Any]:
        """The job's part of its processor's state (`StepProcessor.state_dict`): `now` on
        the processor's clock, `held` what it holds (`StepProcessor.held_bytes`)."""
        return {
            "info": self.info.model_dump(),
            "model": self.compute.model,
            "ideal": self.compute.ideal.state(),
            "retained": [_step_inputs(p) for p in self.retained]
            if with_retained_inputs
            else [int(p.steps[0]) for p in self.retained],
            # Its last diagnosis' steps the window no longer holds (ids: in its
            # live state; the host persists them as it does the retained ones).
            "diagnosed": [_step_inputs(p) for p in self.diagnosed_beyond_window()]
            if with_retained_inputs
            else [],
            "detector": self.detector.state_dict() if self.detector else None,
            "series_names": self.series_names,
            "fed_steps": list(self.fed_steps),
            "series_baseline": dict(self.series_baseline),
            "live": self.live.state_dict(),
            "arrivals": self.arrivals.state_dict(now),
            # What it held when the snapshot was taken (not restored: counted again).
            "held_bytes": held,
            "held": [
                {
                    "step": h.step,
                    "start_ns": h.start_ns,
                    "batches": [b for parts in h.batches.values() for b in parts],
                    "missing": [list(c) for c in sorted(h.missing)],
                    "version": h.version,
                    "figures": list(h.figures) if h.figures else None,
                    "fresh": h.fresh,
                }
                for h in self.held.values()
            ],
            "closed_without": [
                [step, [list(c) for c in sorted(without)]]
                for step, without in self.closed_without.items()
            ],
        }

    @classmethod
    def from_state(
        cls,
        saved: dict[str, Any],
        settings: ProcessorSettings,
        now: float,
        open_steps: set[int],
        retained_inputs: RetainedInputs | None,
    ) -> JobState:
        """A job resumed from its `state_dict()` (`now` on the processor's clock; its open
        windows' steps); `retained_inputs` as `StepProcessor.from_state` has it."""
        job = cls(JobInfo.model_validate(saved["info"]), settings)
        key = (job.info.job_id, job.info.attempt)
        job.compute.model = saved["model"]
        retained = list(saved["retained"])
        if retained and isinstance(retained[0], dict):
            meta = job.info.to_meta()
            retained = [PreparedTrace(model=job.compute.model, meta=meta, **r) for r in retained]
        elif retained:
            retained = _load_retained(job, key, retained, retained_inputs)
        job.restore_retained(saved["ideal"], retained)
        if saved["detector"] is not None:
            job.detector = BocdBank.from_state(saved["detector"])
        job.series_names = list(saved["series_names"])
        job.fed_steps.extend(tuple(x) for x in saved["fed_steps"])
        job.series_baseline = dict(saved["series_baseline"])
        if "arrivals" in saved:
            job.arrivals = JobArrivals.from_state(saved["arrivals"], settings.lateness_s, now)
            job.restore_reached()
        job.open_steps = set(open_steps)
        for step, without in saved.get("closed_without", []):
            job.closed_without[int(step)] = frozenset((int(d), int(p)) for d, p in without)
        for h in saved.get("held", []):
            batches: dict[tuple[int, int], list[RankStepBatch]] = {}
            for batch in h["batches"]:
                batches.setdefault((batch.dp_rank, batch.pp_rank), []).append(batch)
            held = Held(
                int(h["step"]), int(h["start_ns"]), batches,
                {(int(d), int(p)) for d, p in h["missing"]},
                sum(b.n_ops for b in h["batches"]), int(h["version"]),
                tuple(h["figures"]) if h["figures"] else None, bool(h["fresh"]),
            )  # fmt: skip
            job.held[held.step] = held
            job.held_ops += held.ops
        missing = job.live.restore(
            saved["live"], list(job.retained),
            _diagnosed_steps(job, key, saved, retained_inputs),
        )  # fmt: skip
        if missing:
            log.warning(
                "job %s/%d: %d step(s) of its last diagnosis are not in the checkpoint "
                "store (%s...); its story is told again from its next diagnosis on",
                *key, len(missing), missing[:5],
            )  # fmt: skip
        return job


def _diagnosed_steps(
    job: JobState,
    key: tuple[str, int],
    saved: dict[str, Any],
    retained_inputs: RetainedInputs | None,
) -> list[PreparedTrace]:
    """The steps of the job's last diagnosis its retained window no longer holds: in the
    state itself, or (a state without inputs) from `retained_inputs`."""
    meta = job.info.to_meta()
    kept = [PreparedTrace(model=job.compute.model, meta=meta, **{**_ADDED_NONE, **inputs})
            for inputs in saved.get("diagnosed", [])]  # fmt: skip
    made = saved["live"].get("last_diagnosis") or {}
    held = {int(p.steps[0]) for p in (*job.retained, *kept)}
    wanted = [int(step) for step in made.get("steps", []) if int(step) not in held]
    if wanted and retained_inputs is not None and job.compute.model is not None:
        kept += _load_retained(job, key, wanted, retained_inputs)
    return kept


def _load_retained(
    job: JobState,
    key: tuple[str, int],
    steps: list[int],
    retained_inputs: RetainedInputs | None,
) -> list[PreparedTrace]:
    if retained_inputs is None or job.compute.model is None:
        raise ValueError(f"state of job {key} holds retained step ids but no inputs were given")
    found = retained_inputs(key, steps)
    lost = [step for step in steps if step not in found]
    if lost:
        log.warning(
            "job %s: %d retained step(s) missing from the checkpoint store (%s...); the "
            "roll-up and comm medians go on without them",
            key,
            len(lost),
            lost[:5],
        )
    meta = job.info.to_meta()
    retained = []
    for step in steps:
        if step not in found:
            continue
        try:
            inputs = decode_step_inputs(found[step], f"retained step {step} of job {key}")
        except SnapshotError as exc:
            log.warning("%s; the roll-up goes on without it", exc)
            continue
        retained.append(PreparedTrace(model=job.compute.model, meta=meta, **inputs))
    return retained
