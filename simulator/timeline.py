"""Chrome/Perfetto trace events for the actual and the ideal timeline, side by side.

One process per DP rank shows what was measured; one more process shows the simulated
ideal step (identical for every DP rank). Each stage gets one track per stream of work
(compute, DP collectives, each side and direction of pipeline traffic, other
collectives), and more where a stream has several ops in flight at once (`trace_events`). Steps are
laid out back to back (each offset by 1.1 x the previous step's length) so that several
steps can be read in one view; times are microseconds. With estimated clock offsets
(`simulator/clocks.py`) the measured ops are drawn on one common clock, so a send and its
receive line up even when the two ranks' clocks disagree.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lagscope.simulator import optypes as ot
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
) -> list[dict[str, Any]]:
    """Events for every step of `prepared`; `ideal_*` are the ideal timeline per node;
    `clock_offsets_s` ([stage, dp], seconds each worker's clock runs ahead) corrects the
    measured ops first.

    Perfetto drops a complete slice that overlaps another on its track without nesting in
    it. Ops on one stream do overlap now and then (measured timestamps of back-to-back
    kernels disagree by microseconds; collectives of several buckets are in flight at
    once), so a stream takes as many tracks ("lanes") as it has ops in flight at once:
    every slice is kept, none is moved or cut. Times are whole nanoseconds, so a slice
    that starts where the previous one ended does not overlap it by a rounding error."""
    if clock_offsets_s is not None:
        prepared = apply_clock_offsets(prepared, clock_offsets_s)
    actual = "actual, clocks corrected" if clock_offsets_s is not None else "actual"
    model = prepared.model
    names = [str(n) for n in model.nodes]
    stages = model.node_stage()
    streams = np.array([stream_of(n.optype) for n in model.nodes])
    stream_ids = stages * len(STREAMS) + streams
    ideal_pid = prepared.n_dp
    # (pid, stream id) -> its slices as (start ns, end ns, name, args)
    slices: dict[tuple[int, int], list[tuple[int, int, str, dict[str, Any]]]] = {}

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
        for dp in range(prepared.n_dp):
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

    events: list[dict[str, Any]] = []
    for dp in range(prepared.n_dp):
        events.append(_meta("process_name", dp, 0, f"dp {dp} ({actual})"))
    events.append(_meta("process_name", ideal_pid, 0, "ideal (every DP rank)"))
    for pid in range(prepared.n_dp + 1):
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
