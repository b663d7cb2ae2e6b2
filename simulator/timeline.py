"""Chrome/Perfetto trace events for the actual and the ideal timeline, side by side.

One process per DP rank shows what was measured; one more process shows the simulated
ideal step (identical for every DP rank). Each stage gets one track per stream of work
(compute, DP collectives, each side and direction of pipeline traffic, other
collectives), and more where a stream has several ops in flight at once (`trace_events`). Steps are
laid out back to back (each offset by 1.1 x the previous step's length) so that several
steps can be read in one view; times are microseconds. With estimated clock offsets
(`simulator/clocks.py`) the measured ops are drawn on one common clock, so a send and its
receive line up even when the two ranks' clocks disagree.

A large job's whole timeline is more than Perfetto can open (12,288 GPUs, 20 steps: 1.55 M
slices, 306 MB of JSON), so a timeline holds a window (`choose_window`): the steps and DP
ranks asked for, or by default the slowest step and its neighbours on the DP ranks that
matter, as many as fit in `DEFAULT_MAX_SLICES`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lagscope.simulator import optypes as ot
from lagscope.simulator.defaults import (
    TIMELINE_DP_RANKS,
    TIMELINE_MAX_SLICES,
    TIMELINE_MIN_STEPS,
)
from lagscope.simulator.prepare import PreparedTrace, apply_clock_offsets

STREAMS: tuple[str, ...] = (
    "compute",
    "dp-comm",
    "pp-forward send",
    "pp-forward recv",
    "pp-backward send",
    "pp-backward recv",
    "other-comm",
)
STEP_GAP_FACTOR = 1.1
DEFAULT_MAX_SLICES = TIMELINE_MAX_SLICES
DEFAULT_DP_RANKS = TIMELINE_DP_RANKS
MIN_WINDOW_STEPS = TIMELINE_MIN_STEPS


def stream_of(optype: str) -> int:
    """The stream of work an op runs on: compute, DP collectives, each direction and side
    of pipeline traffic (a send and a receive run at the same time), other collectives."""
    if optype in ot.DP_OPTYPES:
        return 1
    if optype == ot.FORWARD_SEND:
        return 2
    if optype == ot.FORWARD_RECV:
        return 3
    if optype == ot.BACKWARD_SEND:
        return 4
    if optype == ot.BACKWARD_RECV:
        return 5
    if optype in ot.OTHER_COMM_OPTYPES:
        return 6
    return 0


def trace_events(
    prepared: PreparedTrace,
    ideal_start: np.ndarray,
    ideal_end: np.ndarray,
    *,
    clock_offsets_s: np.ndarray | None = None,
    dp_ranks: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """Events for every step of `prepared` (select its steps first for a window);
    `ideal_*` are the ideal timeline per node; `clock_offsets_s` ([stage, dp], seconds
    each worker's clock runs ahead) corrects the measured ops first; `dp_ranks`: the DP
    ranks drawn (all when None), each the process of its own number.

    Perfetto drops a complete slice that overlaps another on its track without nesting in
    it. Ops on one stream do overlap now and then (measured timestamps of back-to-back
    kernels disagree by microseconds; collectives of several buckets are in flight at
    once), so a stream takes as many tracks ("lanes") as it has ops in flight at once:
    every slice is kept, none is moved or cut. Times are whole nanoseconds, so a slice
    that starts where the previous one ended does not overlap it by a rounding error."""
    if clock_offsets_s is not None:
        prepared = apply_clock_offsets(prepared, clock_offsets_s)
    actual = "actual, clocks corrected" if clock_offsets_s is not None else "actual"
    shown = list(range(prepared.n_dp)) if dp_ranks is None else [int(d) for d in dp_ranks]
    slices = _slices(prepared, ideal_start, ideal_end, shown)
    ideal_pid = prepared.n_dp
    events: list[dict[str, Any]] = []
    for dp in shown:
        events.append(_meta("process_name", dp, 0, f"dp {dp} ({actual})"))
    events.append(_meta("process_name", ideal_pid, 0, "ideal (every DP rank)"))
    for pid in [*shown, ideal_pid]:
        tid = 0
        for stream_id in range(prepared.n_stages * len(STREAMS)):
            stage, stream = divmod(stream_id, len(STREAMS))
            lanes = assign_lanes(slices.get((pid, stream_id), []))
            for lane, lane_slices in enumerate(lanes or [[]]):
                label = f"pp {stage} {STREAMS[stream]}" + (f" ({lane + 1})" if lane else "")
                events.append(_meta("thread_name", pid, tid, label))
                events.extend(_span(name, pid, tid, a, b, args) for a, b, name, args in lane_slices)
                tid += 1
    return events


#: A slice: (start ns, end ns, name, args).
_Slice = tuple[int, int, str, dict[str, Any]]


def _slices(
    prepared: PreparedTrace, ideal_start: np.ndarray, ideal_end: np.ndarray, shown: list[int]
) -> dict[tuple[int, int], list[_Slice]]:
    """The slices of every (pid, stream id): the measured ops of the DP ranks `shown`,
    and the ideal timeline (pid n_dp), steps laid one after another."""
    model = prepared.model
    names = [str(n) for n in model.nodes]
    streams = np.array([stream_of(n.optype) for n in model.nodes])
    stream_ids = model.node_stage() * len(STREAMS) + streams
    ideal_pid = prepared.n_dp
    slices: dict[tuple[int, int], list[_Slice]] = {}

    def add(pid: int, node: int, start_s: float, duration_s: float, args: dict) -> None:
        start_ns = round(start_s * 1e9)
        end_ns = start_ns + max(round(duration_s * 1e9), 0)
        key = (pid, int(stream_ids[node]))
        slices.setdefault(key, []).append((start_ns, end_ns, names[node], args))

    offset = 0.0
    ideal_length = float(ideal_end.max())
    for step_index, step in enumerate(prepared.steps):
        start = prepared.start[:, step_index, :]
        end = start + prepared.duration[:, step_index, :]
        for dp in shown:
            for node in range(model.n_nodes):
                add(
                    dp,
                    node,
                    offset + float(start[node, dp]),
                    float(prepared.duration[node, step_index, dp]),
                    {
                        "step": int(step),
                        "cost_s": float(prepared.cost[node, step_index, dp]),
                        "launch_delay_s": float(prepared.launch_delay[node, step_index, dp]),
                    },
                )
        for node in range(model.n_nodes):
            add(
                ideal_pid,
                node,
                offset + float(ideal_start[node]),
                float(ideal_end[node] - ideal_start[node]),
                {"step": int(step)},
            )
        offset += STEP_GAP_FACTOR * max(float(end.max()), ideal_length)
    return slices


def assign_lanes(
    slices: list[tuple[int, int, str, dict[str, Any]]],
) -> list[list[tuple[int, int, str, dict[str, Any]]]]:
    """Slices of one stream spread over the fewest lanes in which no two overlap (greedy
    interval partitioning by start time: a slice joins the first lane that has ended)."""
    lanes: list[list[tuple[int, int, str, dict[str, Any]]]] = []
    lane_end: list[int] = []
    for item in sorted(slices, key=lambda s: (s[0], s[1])):
        lane = next((i for i, ended in enumerate(lane_end) if ended <= item[0]), len(lanes))
        if lane == len(lanes):
            lanes.append([])
            lane_end.append(0)
        lanes[lane].append(item)
        lane_end[lane] = item[1]
    return lanes


def _meta(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}


def _span(
    name: str, pid: int, tid: int, start_ns: int, end_ns: int, args: dict[str, Any]
) -> dict[str, Any]:
    # Microseconds with three decimals: exactly the nanoseconds computed above.
    return {
        "ph": "X",
        "name": name,
        "pid": pid,
        "tid": tid,
        "ts": start_ns / 1000,
        "dur": (end_ns - start_ns) / 1000,
        "args": args,
    }


@dataclass(frozen=True)
class TimelineWindow:
    """The part of a job a timeline holds: `steps` (a mask over the analysed steps) of
    `dp_ranks`, and why those."""

    steps: np.ndarray
    dp_ranks: list[int]
    n_slices: int
    max_slices: int
    #: How the DP ranks were chosen, when not asked for.
    dp_reason: str = ""
    steps_reason: str = ""

    def describe(self, all_steps: np.ndarray, n_dp: int) -> str:
        """One line: what the timeline holds and what it leaves out."""
        kept = all_steps[self.steps]
        text = (
            f"timeline: steps {_step_runs(all_steps, self.steps)} ({kept.size} of "
            f"{all_steps.size}"
            f"{self.steps_reason}), DP ranks {_ranges(self.dp_ranks, sort=False)} "
            f"({len(self.dp_ranks)} of {n_dp}{self.dp_reason}); {self.n_slices:,} slices"
        )
        left_steps, left_dp = all_steps.size - kept.size, n_dp - len(self.dp_ranks)
        if left_steps or left_dp:
            left = " and ".join(
                f"{count:,} {what}"
                for count, what in ((left_steps, "steps"), (left_dp, "DP ranks"))
                if count
            )
            text += f"; left out {left}"
            if self.steps_reason or self.dp_reason:
                text += f" to stay under {self.max_slices:,} slices"
            text += " (--timeline-steps, --timeline-ranks choose)"
        return text


def choose_window(
    step_slowdown: np.ndarray,
    worker_slowdown: np.ndarray,
    n_nodes: int,
    *,
    steps: np.ndarray | None = None,
    dp_ranks: Sequence[int] | None = None,
    first_dp: Sequence[int] = (),
    max_slices: int = DEFAULT_MAX_SLICES,
) -> TimelineWindow:
    """The window of a timeline: the `steps` mask and `dp_ranks` asked for; what is not
    asked for fills `max_slices` (0: no limit). By default every DP rank when
    MIN_WINDOW_STEPS of them fit, else the DEFAULT_DP_RANKS slowest (`first_dp`, the
    verified workers' replicas, first; then by their worst S_w) and one typical; and the
    slowest step with as many neighbours as fit. Each step of a DP rank is `n_nodes`
    slices; the ideal timeline adds one DP rank's worth.

    Twenty DP ranks of 10 ops a step, the slowest step the fourth, dp 7 the slowest rank:

    >>> step_slowdown = np.array([1.0, 1.0, 1.1, 1.3, 1.1, 1.0, 1.0, 1.0])
    >>> worker_slowdown = np.linspace(1.0, 1.1, 20)[None, :]  # [stage, dp]
    >>> worker_slowdown[0, 7] = 1.5
    >>> window = choose_window(step_slowdown, worker_slowdown, 10, max_slices=300)
    >>> window.steps.astype(int).tolist(), window.dp_ranks, window.n_slices
    ([0, 0, 1, 1, 1, 0, 0, 0], [7, 19, 18, 17, 16, 15, 14, 6], 270)
    """
    n_steps, n_dp = step_slowdown.size, worker_slowdown.shape[1]
    budget = max_slices if max_slices > 0 else np.inf
    dp_reason = ""
    if dp_ranks is None:
        wanted = MIN_WINDOW_STEPS if steps is None else int(np.count_nonzero(steps))
        enough = min(wanted, n_steps) * n_nodes * (n_dp + 1) <= budget
        if n_dp <= DEFAULT_DP_RANKS or enough:
            dp_ranks = list(range(n_dp))
        else:
            dp_ranks = _slowest_and_typical(worker_slowdown, first_dp, DEFAULT_DP_RANKS)
            dp_reason = f": the {len(dp_ranks) - 1} slowest by S_w and dp {dp_ranks[-1]}, typical"
    steps_reason = ""
    if steps is None:
        per_step = n_nodes * (len(dp_ranks) + 1)
        count = n_steps if budget == np.inf else int(max(1, min(n_steps, budget // per_step)))
        steps = np.zeros(n_steps, dtype=bool)
        if count >= n_steps:
            steps[:] = True
        else:
            slowest = int(np.nanargmax(np.where(np.isfinite(step_slowdown), step_slowdown, -1)))
            first = min(max(0, slowest - (count - 1) // 2), n_steps - count)
            steps[first : first + count] = True
            steps_reason = ": the slowest and its neighbours"
    n_slices = int(np.count_nonzero(steps)) * n_nodes * (len(dp_ranks) + 1)
    return TimelineWindow(
        steps=steps,
        dp_ranks=list(dp_ranks),
        n_slices=n_slices,
        max_slices=max_slices,
        dp_reason=dp_reason,
        steps_reason=steps_reason,
    )


def _slowest_and_typical(worker_slowdown: np.ndarray, first: Sequence[int], k: int) -> list[int]:
    """`k` DP ranks: those in `first`, then the highest worst-S_w; last, the one whose
    worst S_w is the median, to compare with."""
    worst = np.nanmax(np.where(np.isfinite(worker_slowdown), worker_slowdown, -np.inf), axis=0)
    chosen = list(dict.fromkeys(int(d) for d in first if 0 <= d < worst.size))[: k - 1]
    for dp in np.argsort(-worst, kind="stable").tolist():
        if len(chosen) >= k - 1:
            break
        if dp not in chosen:
            chosen.append(int(dp))
    rest = [dp for dp in np.argsort(worst, kind="stable").tolist() if dp not in chosen]
    if rest:
        chosen.append(int(rest[len(rest) // 2]))
    return chosen


def _step_runs(steps: np.ndarray, kept: np.ndarray) -> str:
    """The kept steps as runs of neighbouring analysed steps, each named by its first and
    last id (a recorded trace's ids jump: AR's 44 steps run from 16 to 1238).

    >>> _step_runs(np.array([16, 21, 27, 404, 408]), np.array([True, True, True, False, True]))
    '16-27, 408'
    """
    positions = np.flatnonzero(kept).tolist()
    runs: list[list[int]] = []
    for position in positions:
        if runs and position == runs[-1][-1] + 1:
            runs[-1].append(position)
        else:
            runs.append([position])
    parts = [str(steps[r[0]]) if len(r) == 1 else f"{steps[r[0]]}-{steps[r[-1]]}" for r in runs]
    return ", ".join(parts[:12]) + (f", ... ({len(parts) - 12} more)" if len(parts) > 12 else "")


def _ranges(ids: Sequence[int], sort: bool = True) -> str:
    """'3-5, 9' for [3, 4, 5, 9]: runs of consecutive ids (in the given order unless
    `sort`), at most 12 runs shown.

    >>> _ranges([3, 4, 5, 9]), _ranges([100, 17, 18], sort=False)
    ('3-5, 9', '100, 17-18')
    """
    values = sorted(ids) if sort else list(ids)
    runs: list[list[int]] = []
    for value in values:
        if runs and value == runs[-1][-1] + 1:
            runs[-1].append(value)
        else:
            runs.append([value])
    parts = [str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs]
    return ", ".join(parts[:12]) + (f", ... ({len(parts) - 12} more)" if len(parts) > 12 else "")
