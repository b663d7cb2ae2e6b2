"""Rows of every table of the store, as `SinkBatch`es or columns to add to one: `steps`,
`attribution`, `worker_slowdown` and `changepoints` from the analysis of closed steps,
`jobs`, `diagnoses`, `episodes`, `dead_letters`, `rank_identity` and raw `ops`.

Figures per step (slowdown S = simulated / ideal, the what-if slowdown without launch
delays, as `lagscope analyze` reports it):

- gpu_seconds = actual_s x world_size; gpu_seconds_wasted = gpu_seconds x (1 - 1/S)
- mfu_actual = model_flops_per_step / (actual_s x world_size x gpu_peak_flops), mfu_ideal
  likewise with ideal_s; NULL when the job's FLOPs or the GPU's peak is unknown.
- worker slowdown of (dp, pp) = min(S_dp, S_stage) of that step.
- sim_discrepancy = |simulated - actual| / actual; trusted when it is at most 5 %.
- A step that could not be analysed is stored with `analysed = false`, NaN figures and the
  reason (`complete` still says only whether every rank reported).

The hosts' own records (a closed step, an episode's state, the machines of a job) are
read through the protocols below, which name what a row is made of: the store knows the
tables, the hosts (`stream_app`) know how they found what goes in them.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from lagscope.simulator.diagnose import Diagnosis
from lagscope.simulator.trace import JobMeta
from lagscope.simulator.whatif import Attribution, WhatIfResult
from lagscope.store.schema import RANK_IDENTITY_TABLE
from lagscope.store.sink import SinkBatch

if TYPE_CHECKING:
    from lagscope.producers.dead_letters import DeadLetter
    from lagscope.producers.events import JobInfo, RankIdentity, RankStepBatch
    from lagscope.simulator.episode_cost import EpisodeCost
    from lagscope.simulator.online_episodes import WorkerEpisode


class DetectedChangeRecord(Protocol):
    """A change point found at a step: one `changepoints` row."""

    @property
    def series(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def before_mean(self) -> float: ...
    @property
    def after_mean(self) -> float: ...
    @property
    def probability(self) -> float: ...


class ClosedStepRecord(Protocol):
    """A closed step of the step processor (`stream_app.processor.StepOutput`): one `steps`
    row, with its `attribution`, `worker_slowdown` and `changepoints` rows."""

    @property
    def job_id(self) -> str: ...
    @property
    def attempt(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def start_ns(self) -> int: ...
    @property
    def complete(self) -> bool: ...
    @property
    def missing(self) -> tuple[tuple[int, int], ...]: ...
    @property
    def missing_reason(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def received_at(self) -> float: ...
    @property
    def result(self) -> WhatIfResult | None: ...
    @property
    def info(self) -> JobInfo: ...
    @property
    def changes(self) -> Sequence[DetectedChangeRecord]: ...
    @property
    def analysed_dp_ranks(self) -> tuple[int, ...]: ...
    @property
    def reason(self) -> str: ...


class EpisodeStateRecord(Protocol):
    """An episode as it stands after a step (`simulator.job_story.EpisodeState`): one
    `episodes` row."""

    @property
    def episode(self) -> WorkerEpisode: ...
    @property
    def cost(self) -> EpisodeCost: ...
    @property
    def diagnosis(self) -> Diagnosis: ...
    @property
    def at_step(self) -> int: ...
    @property
    def onset_ns(self) -> int: ...
    @property
    def recovery_ns(self) -> int: ...
    @property
    def last_ns(self) -> int: ...
    @property
    def final(self) -> bool: ...
    @property
    def gpu_seconds_lost(self) -> float: ...


class MachineLookup(Protocol):
    """The machine a worker of a job attempt runs on (`stream_app.identity.MachineBook`)."""

    def identity(
        self, job_id: str, attempt: int, worker: tuple[int, int]
    ) -> RankIdentity | None: ...


#: attribution.kind of each attribution of a result.
ATTRIBUTION_KINDS: tuple[tuple[str, str], ...] = (
    ("optype", "by_optype"),
    ("dp_rank", "by_dp_rank"),
    ("stage", "by_stage"),
    ("launch_optype", "launch_by_optype"),
    ("launch_dp_rank", "launch_by_dp_rank"),
    ("launch_stage", "launch_by_stage"),
)


def json_text(value: Any) -> str:
    """`value` as strict JSON (RFC 8259), non-finite numbers as null: Python writes them as
    `NaN` and `Infinity`, which ClickHouse's JSON functions, Grafana and most parsers
    refuse, so a whole document with one (a DDP job's undefined forward-backward
    correlation) read as empty in the dashboards and the alert rules.

    >>> json_text({"summary": "ok", "correlation": float("nan"), "floor": np.float32(1.5)})
    '{"summary": "ok", "correlation": null, "floor": 1.5}'
    """
    try:
        return json.dumps(value, default=float, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(value), default=float, allow_nan=False)


def _finite(value: Any) -> Any:
    """`value` with every non-finite number (also numpy's) made None."""
    if isinstance(value, Mapping):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if np.isfinite(value) else None
    return value


def rows_from_result(
    job_id: str,
    attempt: int,
    result: WhatIfResult,
    step_start_ts: np.ndarray,
    meta: JobMeta,
    *,
    version: int = 0,
    processed_at: float | None = None,
) -> SinkBatch:
    """The analysed steps of `result` as a batch for `ClickHouseSink.write`.

    step_start_ts: wall-clock start of each of `result.steps` (epoch seconds or numpy
    datetime64). version: higher for a re-processing of the same steps (e.g. the
    changelog offset); the dedup token is derived from it, so it must be deterministic.
    """
    steps = np.asarray(result.steps, dtype=np.int64)
    n_steps = steps.size
    step_start_ts = np.asarray(step_start_ts)
    if step_start_ts.shape != (n_steps,):
        raise ValueError(
            f"rows_from_result({job_id!r}): step_start_ts has shape {step_start_ts.shape}, "
            f"expected ({n_steps},) like result.steps"
        )
    if n_steps == 0:
        raise ValueError(f"rows_from_result({job_id!r}): the result has no steps")
    batch = SinkBatch(f"{job_id}/{attempt}/{steps.min()}-{steps.max()}/{version}")
    batch.add(
        "steps",
        _steps_rows(job_id, attempt, steps, result, step_start_ts, meta, version, processed_at),
    )
    batch.add("attribution", _attribution_rows(job_id, attempt, result, step_start_ts, version))
    batch.add("worker_slowdown", _worker_rows(job_id, attempt, result, step_start_ts, version))
    return batch


def _steps_rows(
    job_id: str,
    attempt: int,
    steps: np.ndarray,
    result: WhatIfResult,
    step_start_ts: np.ndarray,
    meta: JobMeta,
    version: int,
    processed_at: float | None,
) -> dict[str, Any]:
    """The `steps` rows of analysed steps."""
    n_steps = steps.size
    world = meta.world_size
    actual = np.asarray(result.t_actual, dtype=np.float64)
    ideal = np.asarray(result.t_ideal, dtype=np.float64)
    slowdown = np.asarray(result.step_slowdown, dtype=np.float64)
    gpu_seconds = actual * world

    return {
        "job_id": [job_id] * n_steps,
        "attempt": np.full(n_steps, attempt, dtype=np.uint32),
        "step": steps.astype(np.uint64),
        "ts": step_start_ts,
        "complete": np.ones(n_steps, dtype=bool),
        "missing_ranks": [[] for _ in range(n_steps)],
        "missing_reason": [""] * n_steps,
        "actual_s": actual,
        "simulated_s": np.asarray(result.t_nodelay, dtype=np.float64),
        "ideal_s": ideal,
        "slowdown": slowdown,
        "launch_slowdown": np.asarray(result.launch_step_slowdown, dtype=np.float64),
        "waste": 1.0 - 1.0 / slowdown,
        "mfu_actual": _mfu(meta, actual),
        "mfu_ideal": _mfu(meta, ideal),
        "n_gpus": np.full(n_steps, world, dtype=np.uint32),
        "gpu_seconds": gpu_seconds,
        "gpu_seconds_wasted": gpu_seconds * (1.0 - 1.0 / slowdown),
        "analysed": np.ones(n_steps, dtype=bool),
        "reason": [""] * n_steps,
        "sim_discrepancy": np.asarray(result.discrepancy, dtype=np.float64),
        "trusted": np.asarray(result.trusted, dtype=bool),
        "processed_at": np.full(n_steps, time.time() if processed_at is None else processed_at),
        "received_at": [None] * n_steps,
        "version": np.full(n_steps, version, dtype=np.uint64),
    }


def job_rows(
    job_id: str,
    attempt: int,
    meta: JobMeta,
    started: float,
    *,
    version: int = 0,
    record: str | None = None,
    ranks_ended: int = 0,
    ended_at: float | None = None,
) -> dict[str, list]:
    """The `jobs` row of a job attempt (add it to a batch with `batch.add("jobs", ...)`);
    `record`: the job record as it came (JSON), kept whole in `meta` so that the fields of
    a newer writer and its schema version reach the store too. `ranks_ended`: how many of
    its ranks said they ended; `ended_at` (epoch seconds): when the last of all did."""
    return {
        "job_id": [job_id],
        "attempt": [attempt],
        "dp_size": [meta.dp_size],
        "pp_size": [meta.pp_size],
        "tp_size": [meta.tp_size],
        "cp_size": [meta.dsp_size],
        "vpp_size": [meta.vpp_size],
        "world_size": [meta.world_size],
        "model_flops_per_step": [meta.model_flops_per_step],
        "gpu_peak_flops": [meta.gpu_peak_flops],
        "started": [started],
        "meta": [record if record is not None else json_text(meta.as_dict())],
        "ranks_ended": [ranks_ended],
        "ended_at": [ended_at],
        "version": [version],
    }


def _mfu(meta: JobMeta, step_seconds: np.ndarray) -> np.ndarray:
    if meta.model_flops_per_step is None or meta.gpu_peak_flops is None:
        return np.full(step_seconds.shape, np.nan)  # stored as NULL
    return meta.model_flops_per_step / (step_seconds * meta.world_size * meta.gpu_peak_flops)


def _attribution_rows(
    job_id: str, attempt: int, result: WhatIfResult, ts: np.ndarray, version: int
) -> dict[str, object]:
    kinds: list[str] = []
    names: list[str] = []
    values: list[np.ndarray] = []
    for kind, attr in ATTRIBUTION_KINDS:
        attribution: Attribution | None = getattr(result, attr)
        if attribution is None:
            continue
        for name, series in attribution.per_step.items():
            kinds.append(kind)
            names.append(name)
            values.append(np.asarray(series, dtype=np.float64))
    n_steps, n_series = len(result.steps), len(values)
    # Rows are series-major: series k covers rows k*n_steps ... (k+1)*n_steps - 1.
    return {
        "job_id": [job_id] * (n_steps * n_series),
        "attempt": np.full(n_steps * n_series, attempt, dtype=np.uint32),
        "step": np.tile(np.asarray(result.steps, dtype=np.uint64), n_series),
        "ts": np.tile(ts, n_series),
        "kind": np.repeat(np.array(kinds, dtype=object), n_steps),
        "name": np.repeat(np.array(names, dtype=object), n_steps),
        "slowdown": np.concatenate(values) if values else np.zeros(0),
        "version": np.full(n_steps * n_series, version, dtype=np.uint64),
    }


def worker_slowdown_per_step(result: WhatIfResult) -> np.ndarray:
    """[step, stage, dp]: min(S_dp, S_stage) of each step."""
    n_stages, n_dp = result.worker_slowdown.shape
    by_dp = np.stack([result.by_dp_rank.per_step[str(d)] for d in range(n_dp)], axis=1)
    by_stage = np.stack([result.by_stage.per_step[str(s)] for s in range(n_stages)], axis=1)
    return np.minimum(by_dp[:, None, :], by_stage[:, :, None])


def _worker_rows(
    job_id: str, attempt: int, result: WhatIfResult, ts: np.ndarray, version: int
) -> dict[str, object]:
    per_step = worker_slowdown_per_step(result)
    n = per_step.size
    step_index, stage, dp = np.unravel_index(np.arange(n), per_step.shape)
    return {
        "job_id": [job_id] * n,
        "attempt": np.full(n, attempt, dtype=np.uint32),
        "step": np.asarray(result.steps, dtype=np.uint64)[step_index],
        "ts": ts[step_index],
        "dp_rank": dp.astype(np.uint32),
        "pp_rank": stage.astype(np.uint32),
        "slowdown": per_step.ravel().astype(np.float64),
        "version": np.full(n, version, dtype=np.uint64),
    }


def rows_from_outputs(outputs: Sequence[ClosedStepRecord], *, version: int = 0) -> SinkBatch:
    """Closed steps of the step processor (any jobs, complete or not) as one batch.

    Incomplete steps are stored with `complete = false` and the global ranks that never
    reported; their figures cover the DP replicas that were whole (renumbered back to their
    real DP ranks), or are NaN when nothing could be analysed. Change points become
    `changepoints` rows. Each step's rows carry `version`, or its own when higher (a step
    closed again after late batches came: its rows replace the stored ones).
    """
    if not outputs:
        raise ValueError("rows_from_outputs: no outputs")
    tables: dict[str, list[dict[str, Any]]] = {}
    for out in outputs:
        step_version = max(version, getattr(out, "version", 0))
        ts = np.array([out.start_ns / 1e9])
        meta = out.info.to_meta()
        if out.result is not None:
            part = rows_from_result(
                out.job_id, out.attempt, out.result, ts, meta, version=step_version
            )
            if out.analysed_dp_ranks:
                real = np.asarray(out.analysed_dp_ranks, dtype=np.uint32)
                part.tables["worker_slowdown"]["dp_rank"] = real[
                    np.asarray(part.tables["worker_slowdown"]["dp_rank"], dtype=np.int64)
                ]
                dp_rows = np.asarray(part.tables["attribution"]["kind"]) == "dp_rank"
                names = np.asarray(part.tables["attribution"]["name"], dtype=object)
                names[dp_rows] = [str(real[int(n)]) for n in names[dp_rows]]
                part.tables["attribution"]["name"] = names
        else:
            part = SinkBatch("")
            part.add("steps", _unanalysed_step(out, ts, step_version))
        steps = part.tables["steps"]
        steps["complete"] = np.array([out.complete])
        tp_cp = meta.tp_size * meta.dsp_size
        steps["missing_ranks"] = [[(pp * meta.dp_size + dp) * tp_cp for dp, pp in out.missing]]
        steps["missing_reason"] = [out.missing_reason]
        steps["received_at"] = [out.received_at or None]
        if out.changes:
            part.add(
                "changepoints",
                {
                    "job_id": [out.job_id] * len(out.changes),
                    "attempt": [out.attempt] * len(out.changes),
                    "series": [c.series for c in out.changes],
                    "step": [c.step for c in out.changes],
                    "ts": [out.start_ns / 1e9] * len(out.changes),
                    "kind": [c.kind for c in out.changes],
                    "before_mean": [c.before_mean for c in out.changes],
                    "after_mean": [c.after_mean for c in out.changes],
                    "probability": [c.probability for c in out.changes],
                    "version": [step_version] * len(out.changes),
                },
            )
        for table, columns in part.tables.items():
            tables.setdefault(table, []).append(columns)
    batch = SinkBatch(_outputs_token(outputs, version))
    for table, parts in tables.items():
        batch.add(table, concat_columns(parts))
    return batch


def _outputs_token(outputs: Sequence[ClosedStepRecord], version: int) -> str:
    """The dedup token of a batch of closed steps: one job's names its steps; several
    jobs' (a host writing every job it follows at once) adds a digest of every step's
    key, so that two writes of different steps never share a token.

    >>> from types import SimpleNamespace as Out
    >>> _outputs_token([Out(job_id="a", attempt=0, step=s) for s in (3, 4)], 0)
    'a/0/3-4/2/0'
    >>> _outputs_token([Out(job_id=j, attempt=0, step=3) for j in "ab"], 0)[:18]
    'a/0/3-3/2/0/2 jobs'
    """
    first, last = outputs[0], outputs[-1]
    token = f"{first.job_id}/{first.attempt}/{first.step}-{last.step}/{len(outputs)}/{version}"
    again = [f"{out.step}@{out.version}" for out in outputs if getattr(out, "version", 0)]
    if again:  # steps closed again: their rows differ from the first version's
        token += f"/again/{digest_of(again)}"
    jobs = {(out.job_id, out.attempt) for out in outputs}
    if len(jobs) == 1:
        return token
    keys = sorted(f"{out.job_id}\t{out.attempt}\t{out.step}" for out in outputs)
    return f"{token}/{len(jobs)} jobs/{digest_of(keys)}"


def digest_of(names: Iterable[str]) -> str:
    """A short digest of these names, in this order: the part of a dedup token that tells
    two batches of different content apart."""
    return hashlib.blake2b("\n".join(names).encode(), digest_size=12).hexdigest()


def concat_columns(parts: Sequence[Mapping[str, Any]]) -> dict[str, list | np.ndarray]:
    """Column sets of one table (name -> values, the same names in each) as one."""
    return {name: _concat([part[name] for part in parts]) for name in parts[0]}


def _concat(parts: list) -> list | np.ndarray:
    if all(isinstance(p, np.ndarray) and p.dtype != object for p in parts):
        return np.concatenate(parts)
    return [v for p in parts for v in (p.tolist() if isinstance(p, np.ndarray) else p)]


def _unanalysed_step(out: ClosedStepRecord, ts: np.ndarray, version: int) -> dict[str, Any]:
    nan = np.array([np.nan])
    return {
        "job_id": [out.job_id],
        "attempt": [out.attempt],
        "step": [out.step],
        "ts": ts,
        "complete": [False],
        "missing_ranks": [[]],
        "missing_reason": [""],
        "actual_s": nan,
        "simulated_s": nan,
        "ideal_s": nan,
        "slowdown": nan,
        "launch_slowdown": nan,
        "waste": nan,
        "mfu_actual": nan,
        "mfu_ideal": nan,
        "n_gpus": [out.info.world_size],
        "gpu_seconds": nan,
        "gpu_seconds_wasted": nan,
        "analysed": [False],
        "reason": [out.reason or "not analysed"],
        "sim_discrepancy": nan,
        "trusted": [False],
        "processed_at": [time.time()],
        "received_at": [None],
        "version": [version],
    }


def diagnosis_rows(
    job_id: str, attempt: int, step: int, start_ns: int, diagnosis: Diagnosis, *, version: int = 0
) -> dict[str, list]:
    """The `diagnoses` row of a diagnosis made at `step`."""
    best = max((a.predicted_speedup for a in diagnosis.advice), default=None)
    return {
        "job_id": [job_id],
        "attempt": [attempt],
        "step": [step],
        "ts": [start_ns / 1e9],
        "cause": [diagnosis.cause],
        "evidence": [json_text({"summary": diagnosis.summary, **diagnosis.evidence.as_dict()})],
        "advice": [
            json_text(
                {
                    "advice": [a.as_dict() for a in diagnosis.advice],
                    "escalation": _escalation(diagnosis),
                }
            )
        ],
        "predicted_speedup": [best],
        "version": [version],
    }


def _escalation(diagnosis: Diagnosis) -> dict[str, Any]:
    """The escalation as stored ({} when the diagnosis has none)."""
    return diagnosis.escalation.as_dict() if diagnosis.escalation is not None else {}


def episode_version(at_step: int, final: bool) -> int:
    """The version of an episode's (or a job diagnosis') row made at the job's step
    `at_step`: later states replace earlier ones, the job's end replaces the live state of
    the same step, and both hosts write the same number."""
    return 2 * max(at_step, 0) + int(final)


def episode_rows(
    job_id: str,
    attempt: int,
    states: Sequence[EpisodeStateRecord],
    machines: MachineLookup,
) -> dict[str, list]:
    """The `episodes` rows of episode states (at most one per episode: its latest)."""
    latest: dict[int, EpisodeStateRecord] = {}
    for state in states:
        latest[state.episode.episode_id] = state
    rows: dict[str, list] = {name: [] for name in _EPISODE_COLUMNS}
    now = time.time()
    for state in latest.values():
        episode, diagnosis = state.episode, state.diagnosis
        who = machines.identity(job_id, attempt, (episode.dp, episode.stage))
        values = {
            "job_id": job_id,
            "attempt": attempt,
            "episode_id": episode.episode_id,
            "state": "open" if episode.open else "closed",
            "onset_step": episode.onset,
            "recovery_step": episode.recovery,
            "onset_ts": state.onset_ns / 1e9,
            "recovery_ts": state.recovery_ns / 1e9 if episode.recovery is not None else None,
            "last_step": state.at_step,
            "last_ts": state.last_ns / 1e9,
            "cause": diagnosis.cause,
            "optype": episode.kind,
            "dp_rank": episode.dp,
            "pp_rank": episode.stage,
            "workers": [w.label() for w in diagnosis.evidence.named_workers],
            "node": (who.node or who.host) if who is not None else "",
            "host": who.host if who is not None else "",
            "gpu": who.gpu if who is not None else None,
            "share": state.cost.share,
            "lost_s": state.cost.price_s,
            "estimated_lost_s": state.cost.price_estimated_s,
            "estimated_steps": state.cost.estimated_steps if state.cost.price_estimated_s else 0,
            "gpu_seconds_lost": state.gpu_seconds_lost,
            "first_seen_step": episode.first_seen,
            "final": state.final,
            "summary": diagnosis.summary,
            "evidence": json_text(diagnosis.evidence.as_dict()),
            "advice": json_text(
                {"advice": [a.as_dict() for a in diagnosis.advice],
                 "escalation": _escalation(diagnosis)}
            ),
            "updated_at": now,
            "version": episode_version(state.at_step, state.final),
        }  # fmt: skip
        for name in _EPISODE_COLUMNS:
            rows[name].append(values[name])
    return rows


_EPISODE_COLUMNS = (
    "job_id", "attempt", "episode_id", "state", "onset_step", "recovery_step", "onset_ts",
    "recovery_ts", "last_step", "last_ts", "cause", "optype", "dp_rank", "pp_rank", "workers",
    "node", "host", "gpu", "share", "lost_s", "estimated_lost_s", "estimated_steps",
    "gpu_seconds_lost", "first_seen_step", "final",
    "summary", "evidence", "advice", "updated_at", "version",
)  # fmt: skip


def dead_letter_rows(letters: Sequence[DeadLetter]) -> dict[str, list]:
    """The `dead_letters` rows of letters set aside (their own time: a replay writes the
    same rows)."""
    return {
        "ts": [d.at_s for d in letters],
        "job_id": [d.job_id for d in letters],
        "source": [d.source for d in letters],
        "reason": [d.reason for d in letters],
        "payload": [d.payload.hex() for d in letters],
    }


def dead_letter_batch(letters: Sequence[DeadLetter]) -> SinkBatch:
    """Dead letters as one idempotent write (the token names them: a replay stores them
    once)."""
    digest = hashlib.blake2b(digest_size=16)
    for letter in letters:
        digest.update(f"{letter.job_id}\0{letter.source}\0{letter.reason}\0".encode())
    batch = SinkBatch(f"dead/{digest.hexdigest()}/{len(letters)}")
    batch.add("dead_letters", dead_letter_rows(letters))
    return batch


def rank_identity_rows(info: JobInfo, *, version: int = 0) -> dict[str, list]:
    """The `rank_identity` row of the rank whose job record `info` is (it must carry one)."""
    who = info.rank_identity
    if who is None:
        raise ValueError(f"job record {info.key} carries no rank identity")
    return {
        "job_id": [info.job_id],
        "attempt": [info.attempt],
        "rank": [who.rank],
        "local_rank": [who.local_rank],
        "dp_rank": [who.dp_rank],
        "pp_rank": [who.pp_rank],
        "tp_rank": [who.tp_rank],
        "cp_rank": [who.cp_rank],
        "host": [who.host],
        "node": [who.node or ""],
        "pod": [who.pod or ""],
        "gpu": [who.gpu],
        "pci_bus_id": [who.pci_bus_id or ""],
        "version": [version],
    }


def rank_identity_batch(info: JobInfo) -> SinkBatch:
    """A sink batch with `info`'s rank identity row (its token: job, attempt and rank)."""
    who = info.rank_identity
    rank = who.rank if who is not None else -1
    batch = SinkBatch(f"rank-identity/{info.job_id}/{info.attempt}/{rank}")
    batch.add(RANK_IDENTITY_TABLE, rank_identity_rows(info))
    return batch


def raw_op_rows(batch: RankStepBatch, batch_id: str) -> dict[str, Any]:
    """The `ops` rows of a rank-step batch (`batch_id`: its id, `batch_id_of`)."""
    n = batch.n_ops
    names = np.array(batch.optype_names, dtype=object)
    return {
        "job_id": [batch.job_id] * n,
        "attempt": np.full(n, batch.attempt, np.uint32),
        "step": np.full(n, batch.step, np.uint64),
        "rank": np.full(n, batch.rank, np.uint32),
        "dp_rank": np.full(n, batch.dp_rank, np.uint32),
        "pp_rank": np.full(n, batch.pp_rank, np.uint32),
        "tp_rank": np.full(n, batch.tp_rank, np.uint32),
        "cp_rank": np.full(n, batch.cp_rank, np.uint32),
        "optype": names[batch.optype].tolist(),
        "seq": batch.seq.astype(np.uint32),
        "microbatch": np.maximum(batch.microbatch, 0).astype(np.uint32),
        "chunk": np.maximum(batch.chunk, 0).astype(np.uint32),
        "start": batch.start_ns.astype("datetime64[ns]"),
        "duration_ns": batch.duration_ns.astype(np.uint64),
        "batch_id": [batch_id] * n,
    }


def raw_ops_token(parts: Sequence[Mapping[str, Any]]) -> str:
    """The dedup token of raw ops (a batch of their own): a digest of their batches' ids,
    so that a retried (or re-processed) write is stored once and two writes of other
    batches never share a token (a count of the host's writes did, after a restart).

    >>> part = lambda batch_id, n: {"batch_id": [batch_id] * n}
    >>> raw_ops_token([part("a", 2), part("b", 3)]) == raw_ops_token([part("a", 2), part("b", 3)])
    True
    >>> raw_ops_token([part("a", 2)]) == raw_ops_token([part("c", 2)])
    False
    """
    ids = [str(part["batch_id"][0]) for part in parts if len(part["batch_id"])]
    rows = sum(len(part["batch_id"]) for part in parts)
    return f"ops/{rows}/{digest_of(ids)}"


def joined_rows(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Rows of one table, given in parts, as one set of columns."""
    joined: dict[str, Any] = {}
    for name in parts[0]:
        values = [p[name] for p in parts]
        if isinstance(values[0], np.ndarray):
            joined[name] = np.concatenate(values)
        else:
            joined[name] = [v for part in values for v in part]
    return joined
