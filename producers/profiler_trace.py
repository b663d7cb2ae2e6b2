"""Reader of the Chrome-trace JSON that torch.profiler (Kineto) writes per rank.

A user who already records `torch.profiler` traces gets the what-if analysis without
running the job again: this turns one trace file per rank into a lagscope `Trace`.

What the traces hold, and how it maps (torch 2.x, gloo or NCCL):

- **Steps** are the `ProfilerStep#N` annotations that `prof.step()` records when the
  profiler has a schedule; an op belongs to the step its start falls in. Steps that some
  rank lacks are left out.
- **Communication** is what the process-group backend annotates, e.g. `gloo:send`,
  `nccl:all_reduce` (on the GPU timeline when there is one, else on the CPU's). A p2p op
  takes its direction from the compute it serves (1F1B): a receive feeds the next
  compute, a send follows the previous one, so a receive before a backward is a
  backward-recv. The data-parallel gradient synchronisation (all-reduce or
  reduce-scatter) is `grads-reduce-scatter`, an all-gather `params-all-gather`; other
  collectives are counted and left out.
- **Compute** is the rank's main thread (the one with the step markers): top-level
  operators run by the autograd engine are backward, `Optimizer.*` annotations are the
  optimizer, all others forward. One forward (backward) op is a run of such operators
  between two p2p ops; a job has as many forward runs as backward runs, so runs that only
  allocate buffers around a p2p op are dropped (the shortest ones). On a GPU an operator
  lasts until the last kernel it launched ends (kernels carry their operator's
  `External id`).
- Code annotated with lagscope's own op type names (`record_function("forward-compute")`)
  needs none of this: when a rank has such annotations they are its compute ops.

Ranks map to (dp, stage) in Megatron's order (tensor-parallel rank fastest, then context,
then data, then pipeline); only tensor- and context-parallel rank 0 is analysed. Times
become seconds relative to each step's earliest op, as the reference format has them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lagscope.simulator import optypes as ot
from lagscope.simulator.errors import TraceError
from lagscope.simulator.trace import JobMeta, Trace

_STEP_MARKER = re.compile(r"^ProfilerStep#(\d+)$")
_BACKEND_OP = re.compile(r"^(?:gloo|nccl|mpi|ucc|xccl):([A-Za-z_]+)$")
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
_BACKWARD_PREFIX = "autograd::engine::evaluate_function"
_OPTIMIZER_PREFIX = "Optimizer."
_P2P = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}
#: Collectives by the lagscope op type they carry; the rest are counted, not analysed.
_COLLECTIVE_OPTYPE = {
    "all_reduce": ot.GRADS_REDUCE_SCATTER,
    "allreduce": ot.GRADS_REDUCE_SCATTER,
    "allreduce_coalesced": ot.GRADS_REDUCE_SCATTER,
    "reduce_scatter": ot.GRADS_REDUCE_SCATTER,
    "_reduce_scatter_base": ot.GRADS_REDUCE_SCATTER,
    "reduce_scatter_tensor_coalesced": ot.GRADS_REDUCE_SCATTER,
    "all_gather": ot.PARAMS_ALL_GATHER,
    "allgather": ot.PARAMS_ALL_GATHER,
    "_allgather_base": ot.PARAMS_ALL_GATHER,
    "all_gather_into_tensor_coalesced": ot.PARAMS_ALL_GATHER,
}
_GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


@dataclass(frozen=True)
class _Span:
    start_us: float
    end_us: float
    name: str


@dataclass
class ProfilerReadStats:
    """What the reader found, for the command's summary line."""

    files: int = 0
    ranks_analysed: int = 0
    steps: list[int] = field(default_factory=list)
    ops_by_type: dict[str, int] = field(default_factory=dict)
    skipped_collectives: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        """One line: files, ranks, steps, ops by type, collectives left out."""
        ops = ", ".join(f"{n} {name}" for name, n in sorted(self.ops_by_type.items()))
        line = (
            f"{self.files} torch.profiler trace(s), {self.ranks_analysed} worker(s), "
            f"steps {self.steps[0]}-{self.steps[-1]} ({len(self.steps)}): {ops}"
        )
        if self.skipped_collectives:
            skipped = ", ".join(f"{n} {k}" for k, n in sorted(self.skipped_collectives.items()))
            line += f"; not analysed: {skipped}"
        return line


def profiler_trace_files(paths: Iterable[str | Path]) -> list[Path]:
    """The trace files named by `paths`: files as given, directories expanded to the
    trace files inside them."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            # torch.profiler's tensorboard handler names its files *.pt.trace.json; a
            # directory without such names is taken to hold only traces.
            found = sorted(path.glob("*.pt.trace.json")) or sorted(path.glob("*.json"))
            if not found:
                raise TraceError(f"{path}: no profiler trace (*.json) in this directory")
            files.extend(found)
        elif path.exists():
            files.append(path)
        else:
            raise TraceError(f"{path}: no such file or directory")
    return files


def load_profiler_traces(
    paths: Sequence[str | Path], meta: JobMeta
) -> tuple[Trace, ProfilerReadStats]:
    """Read one torch.profiler Chrome trace per rank into a lagscope trace of `meta`'s job."""
    files = profiler_trace_files(paths)
    stats = ProfilerReadStats(files=len(files))
    per_rank: dict[int, tuple[Path, dict[int, list[_Op]]]] = {}
    for path in files:
        document = _read_json(path)
        rank = _rank_of(path, document, meta)
        if rank in per_rank:
            raise TraceError(f"{path}: rank {rank} also comes from {per_rank[rank][0]}")
        tp_rank, cp_rank, _, stage = _coordinates(rank, meta)
        if tp_rank or cp_rank:
            continue
        per_rank[rank] = (path, _rank_ops(path, document, stats, _fixed_direction(stage, meta)))
    if not per_rank:
        raise TraceError("no trace of a tensor- and context-parallel rank 0 was given")
    expected = meta.dp_size * meta.pp_size
    if len(per_rank) != expected:
        have = sorted(per_rank)
        raise TraceError(
            f"the job has {expected} (dp, stage) worker(s) but traces of {len(have)} were "
            f"given (ranks {have[:16]}); every worker's trace is needed"
        )
    common = set.intersection(*(set(steps) for _, steps in per_rank.values()))
    if not common:
        raise TraceError("the traces share no ProfilerStep: were they recorded together?")
    stats.ranks_analysed = len(per_rank)
    stats.steps = sorted(common)
    return _to_trace(per_rank, sorted(common), meta, stats), stats


# -- one file --------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if path.name.endswith(".gz"):
        raise TraceError(f"{path}: compressed traces are not read; gunzip it first")
    try:
        document = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"{path}: cannot read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        raise TraceError(f"{path}: not a Chrome trace (no 'traceEvents' list)")
    return document


def _rank_of(path: Path, document: dict[str, Any], meta: JobMeta) -> int:
    info = document.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        rank = int(info["rank"])
        world = info.get("world_size")
        if isinstance(world, int) and world != meta.world_size:
            raise TraceError(
                f"{path}: recorded in a world of {world} ranks but the job metadata says "
                f"world_size={meta.world_size}"
            )
    else:
        match = _RANK_IN_NAME.search(path.name)
        if not match:
            raise TraceError(
                f"{path}: the trace names no rank (no distributedInfo, no 'rankN' in the file name)"
            )
        rank = int(match.group(1))
    if not 0 <= rank < meta.world_size:
        raise TraceError(f"{path}: rank {rank} outside the job's world of {meta.world_size}")
    return rank


def _coordinates(rank: int, meta: JobMeta) -> tuple[int, int, int, int]:
    """(tp, cp, dp, pp) of a global rank, tensor-parallel fastest (Megatron's order).

    >>> from lagscope.simulator.trace import JobMeta
    >>> _coordinates(5, JobMeta(dp_size=2, pp_size=2, tp_size=2, world_size=8))
    (1, 0, 0, 1)
    """
    tp = rank % meta.tp_size
    rest = rank // meta.tp_size
    cp = rest % meta.dsp_size
    rest //= meta.dsp_size
    return tp, cp, rest % meta.dp_size, rest // meta.dp_size


@dataclass(frozen=True)
class _Op:
    optype: str
    start_us: float
    end_us: float


def _fixed_direction(stage: int, meta: JobMeta) -> dict[str, str]:
    """The direction of p2p ops that the stage alone decides: the first stage only receives
    gradients and sends activations, the last only receives activations and sends
    gradients. Middle stages (and virtual pipelines, whose chunks wrap around) are left to
    the compute order.

    >>> meta = JobMeta(dp_size=1, pp_size=3, tp_size=1, world_size=3)
    >>> _fixed_direction(0, meta), _fixed_direction(2, meta), _fixed_direction(1, meta)
    ({'recv': 'backward', 'send': 'forward'}, {'recv': 'forward', 'send': 'backward'}, {})
    """
    if meta.pp_size < 2 or meta.vpp_size > 1:
        return {}
    if stage == 0:
        return {"recv": "backward", "send": "forward"}
    if stage == meta.pp_size - 1:
        return {"recv": "forward", "send": "backward"}
    return {}


def _rank_ops(
    path: Path,
    document: dict[str, Any],
    stats: ProfilerReadStats,
    fixed_direction: dict[str, str],
) -> dict[int, list[_Op]]:
    """Every step's lagscope ops of one rank."""
    spans = [e for e in document["traceEvents"] if isinstance(e, dict) and e.get("ph") == "X"]
    markers = [
        (int(m.group(1)), e)
        for e in spans
        if isinstance(e.get("name"), str) and (m := _STEP_MARKER.match(e["name"]))
    ]
    if not markers:
        raise TraceError(
            f"{path}: no ProfilerStep#N markers; record with a torch.profiler schedule and "
            f"call prof.step() once per training step"
        )
    main_thread = markers[0][1].get("tid")
    kernel_end = _kernel_ends(spans)
    comm = _backend_comm(spans)
    compute = _main_thread_compute(spans, main_thread, kernel_end)

    steps: dict[int, list[_Op]] = {}
    for step, marker in sorted(markers, key=lambda m: m[1]["ts"]):
        lo = float(marker["ts"])
        hi = lo + float(marker.get("dur", 0.0))
        step_comm = [c for c in comm if lo <= c.start_us < hi]
        step_compute = [c for c in compute if lo <= c.start_us < hi]
        steps[step] = _step_ops(path, step, step_comm, step_compute, stats, fixed_direction)
    return steps


def _kernel_ends(spans: list[dict[str, Any]]) -> dict[Any, float]:
    """Latest end of the GPU work each operator (`External id`) launched."""
    ends: dict[Any, float] = {}
    for e in spans:
        if e.get("cat") in _GPU_CATEGORIES:
            key = (e.get("args") or {}).get("External id")
            if key is not None:
                end = float(e["ts"]) + float(e.get("dur", 0.0))
                ends[key] = max(ends.get(key, end), end)
    return ends


def _backend_comm(spans: list[dict[str, Any]]) -> list[_Span]:
    """The backend's communication annotations, GPU-side ones preferred."""
    found: dict[str, list[_Span]] = {"gpu_user_annotation": [], "user_annotation": []}
    for e in spans:
        category = e.get("cat")
        if category not in found or not isinstance(e.get("name"), str):
            continue
        match = _BACKEND_OP.match(e["name"])
        if match:
            start = float(e["ts"])
            found[category].append(
                _Span(start, start + float(e.get("dur", 0.0)), match.group(1).lower())
            )
    chosen = found["gpu_user_annotation"] or found["user_annotation"]
    return sorted(chosen, key=lambda s: s.start_us)


def _main_thread_compute(
    spans: list[dict[str, Any]], main_thread: Any, kernel_end: dict[Any, float]
) -> list[_Span]:
    """Top-level operators of the main thread, named F, B or O (or a lagscope op type)."""
    events = sorted(
        (
            e
            for e in spans
            if e.get("tid") == main_thread
            and e.get("cat") in ("cpu_op", "user_annotation")
            and isinstance(e.get("name"), str)
            and not _STEP_MARKER.match(e["name"])
            and not _BACKEND_OP.match(e["name"])
        ),
        key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))),
    )
    named = [e for e in events if e["name"] in ot.KNOWN_OPTYPES]
    if named:
        return [
            _Span(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e["name"])
            for e in named
        ]
    out: list[_Span] = []
    covered_until = -np.inf
    for e in events:
        start = float(e["ts"])
        end = start + float(e.get("dur", 0.0))
        if start < covered_until:
            if out and kernel_end:
                # A nested operator's kernels extend the top-level one it belongs to.
                key = (e.get("args") or {}).get("External id")
                if key in kernel_end and kernel_end[key] > out[-1].end_us:
                    out[-1] = _Span(out[-1].start_us, kernel_end[key], out[-1].name)
            continue
        covered_until = end
        name = e["name"]
        if name.startswith(_BACKWARD_PREFIX):
            kind = "B"
        elif name.startswith(_OPTIMIZER_PREFIX):
            kind = "O"
        elif name.startswith("c10d::") or name == "record_param_comms":
            continue  # enqueues communication; the backend annotation times it
        else:
            kind = "F"
        key = (e.get("args") or {}).get("External id")
        out.append(_Span(start, max(end, kernel_end.get(key, end)), kind))
    return out


def _step_ops(
    path: Path,
    step: int,
    comm: list[_Span],
    compute: list[_Span],
    stats: ProfilerReadStats,
    fixed_direction: dict[str, str],
) -> list[_Op]:
    """One rank's ops of one step: compute runs, p2p with a direction, collectives.

    Where the stage decides a p2p op's direction it is taken from there: the compute order
    is a guess that a loaded host can get wrong (a receive posted late, after the compute
    it was meant for had started)."""
    p2p = [c for c in comm if c.name in _P2P]
    ops: list[_Op] = []
    if any(c.name in ot.KNOWN_OPTYPES for c in compute):
        ops.extend(_Op(c.name, c.start_us, c.end_us) for c in compute)
        runs = [(_kind_of(c.name), c.start_us, c.end_us) for c in compute]
    else:
        runs = _compute_runs(path, step, compute, p2p)
        optype = {"F": ot.FORWARD_COMPUTE, "B": ot.BACKWARD_COMPUTE, "O": ot.OPTIMIZER}
        ops.extend(_Op(optype[kind], lo, hi) for kind, lo, hi in runs)
    directed = [(kind, lo, hi) for kind, lo, hi in runs if kind in "FB"]
    run_starts = np.array([lo for _, lo, _ in directed])
    run_ends = np.array([hi for _, _, hi in directed])
    for c in p2p:
        side = _P2P[c.name]
        if side in fixed_direction:
            ops.append(_Op(f"{fixed_direction[side]}-{side}", c.start_us, c.end_us))
            continue
        if side == "recv":
            # A receive feeds the first compute that starts after it was posted.
            later = np.flatnonzero(run_starts >= c.start_us)
            if later.size == 0:
                raise TraceError(
                    f"{path}: step {step}: a receive at {c.start_us} us feeds no compute"
                )
            kind = directed[int(later[0])][0]
        else:
            earlier = np.flatnonzero(run_ends <= c.start_us + 1.0)
            if earlier.size == 0:
                raise TraceError(
                    f"{path}: step {step}: a send at {c.start_us} us follows no compute"
                )
            kind = directed[int(earlier[-1])][0]
        direction = "forward" if kind == "F" else "backward"
        ops.append(_Op(f"{direction}-{side}", c.start_us, c.end_us))
    for c in comm:
        if c.name in _P2P:
            continue
        optype = _COLLECTIVE_OPTYPE.get(c.name)
        if optype is None:
            stats.skipped_collectives[c.name] = stats.skipped_collectives.get(c.name, 0) + 1
            continue
        ops.append(_Op(optype, c.start_us, c.end_us))
    return ops


def _kind_of(optype: str) -> str:
    if optype == ot.FORWARD_COMPUTE:
        return "F"
    if optype == ot.BACKWARD_COMPUTE:
        return "B"
    return "O"


def _compute_runs(
    path: Path, step: int, compute: list[_Span], p2p: list[_Span]
) -> list[tuple[str, float, float]]:
    """Runs of same-kind operators, cut at every p2p op and every change of kind."""
    cuts = np.array(sorted(c.start_us for c in p2p))
    runs: list[list] = []
    for c in compute:
        segment = int(np.searchsorted(cuts, c.start_us))
        if runs and runs[-1][0] == c.name and runs[-1][3] == segment:
            runs[-1][2] = max(runs[-1][2], c.end_us)
            runs[-1][4] += c.end_us - c.start_us
        else:
            runs.append([c.name, c.start_us, c.end_us, segment, c.end_us - c.start_us])
    n_backward = sum(1 for r in runs if r[0] == "B")
    forward = [i for i, r in enumerate(runs) if r[0] == "F"]
    if n_backward and len(forward) < n_backward:
        raise TraceError(
            f"{path}: step {step}: {len(forward)} forward run(s) but {n_backward} backward "
            f"run(s); cannot tell the micro-batches apart"
        )
    if n_backward:
        # Buffer allocations around p2p ops form short forward-looking runs of their own.
        keep = set(sorted(forward, key=lambda i: runs[i][4], reverse=True)[:n_backward])
        runs = [r for i, r in enumerate(runs) if r[0] != "F" or i in keep]
    optimizer = [r for r in runs if r[0] == "O"]
    merged = [r for r in runs if r[0] != "O"]
    if optimizer:
        merged.append(["O", optimizer[0][1], max(r[2] for r in optimizer), -1, 0.0])
    return [(r[0], r[1], r[2]) for r in merged]


# -- all ranks -------------------------------------------------------------------------


def _to_trace(
    per_rank: dict[int, tuple[Path, dict[int, list[_Op]]]],
    steps: list[int],
    meta: JobMeta,
    stats: ProfilerReadStats,
) -> Trace:
    names = ("dp_rank", "stage", "rank", "step", "optype", "start_us", "dur_us", "seq_id")
    rows: dict[str, list] = {name: [] for name in (*names, "mc", "gmc", "mb_id")}
    for rank, (_, by_step) in sorted(per_rank.items()):
        _, _, dp, stage = _coordinates(rank, meta)
        for step in steps:
            seq: dict[str, int] = {}
            for op in sorted(by_step[step], key=lambda o: (o.start_us, o.optype)):
                n = seq.get(op.optype, 0)
                seq[op.optype] = n + 1
                is_compute = op.optype in (ot.FORWARD_COMPUTE, ot.BACKWARD_COMPUTE)
                rows["dp_rank"].append(dp)
                rows["stage"].append(stage)
                rows["rank"].append(rank)
                rows["step"].append(step)
                rows["optype"].append(op.optype)
                rows["start_us"].append(op.start_us)
                rows["dur_us"].append(max(op.end_us - op.start_us, 0.0))
                rows["seq_id"].append(n)
                rows["mc"].append(0 if is_compute else -1)
                rows["gmc"].append(stage if is_compute else -1)
                rows["mb_id"].append(n if is_compute else -1)
                stats.ops_by_type[op.optype] = stats.ops_by_type.get(op.optype, 0) + 1
    step = np.asarray(rows["step"], dtype=np.int64)
    start_us = np.asarray(rows["start_us"], dtype=np.float64)
    step_ids, step_idx = np.unique(step, return_inverse=True)
    origin = np.full(step_ids.size, np.inf)
    np.minimum.at(origin, step_idx, start_us)
    columns = {name: np.asarray(values) for name, values in rows.items()}
    columns["start_ts"] = ((start_us - origin[step_idx]) * 1e-6).astype(np.float32)
    columns["duration"] = (columns.pop("dur_us") * 1e-6).astype(np.float32)
    del columns["start_us"]
    columns["optype"] = np.asarray(rows["optype"], dtype=object)
    source = f"<torch.profiler traces of {len(per_rank)} rank(s)>"
    return Trace.from_columns(columns, source=source)
