"""Chrome/Perfetto trace events for the actual and the ideal timeline, side by side.

One process per DP rank shows what was measured; one more process shows the simulated
ideal step (identical for every DP rank). Each stage gets one track per stream, so
compute, DP collectives and each direction of pipeline traffic do not overlap. Steps are
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

STREAMS: tuple[str, ...] = ("compute", "dp-comm", "pp-forward", "pp-backward", "other-comm")
STEP_GAP_FACTOR = 1.1


def stream_of(optype: str) -> int:
    if optype in ot.DP_OPTYPES:
        return 1
    if optype in (ot.FORWARD_SEND, ot.FORWARD_RECV):
        return 2
    if optype in (ot.BACKWARD_SEND, ot.BACKWARD_RECV):
        return 3
    if optype in ot.OTHER_COMM_OPTYPES:
        return 4
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
    measured ops first."""
    if clock_offsets_s is not None:
        prepared = apply_clock_offsets(prepared, clock_offsets_s)
    actual = "actual, clocks corrected" if clock_offsets_s is not None else "actual"
    model = prepared.model
    names = [str(n) for n in model.nodes]
    stages = model.node_stage()
    streams = np.array([stream_of(n.optype) for n in model.nodes])
    tids = stages * len(STREAMS) + streams
    ideal_pid = prepared.n_dp
    events: list[dict[str, Any]] = []
    for dp in range(prepared.n_dp):
        events.append(_meta("process_name", dp, 0, f"dp {dp} ({actual})"))
    events.append(_meta("process_name", ideal_pid, 0, "ideal (every DP rank)"))
    for pid in range(prepared.n_dp + 1):
        for stage in range(prepared.n_stages):
            for s, stream in enumerate(STREAMS):
                events.append(
                    _meta("thread_name", pid, stage * len(STREAMS) + s, f"pp {stage} {stream}")
                )

    offset = 0.0
    ideal_length = float(ideal_end.max())
    for step_index, step in enumerate(prepared.steps):
        start = prepared.start[:, step_index, :]
        end = start + prepared.duration[:, step_index, :]
        for dp in range(prepared.n_dp):
            for node in range(model.n_nodes):
                events.append(
                    _span(
                        names[node],
                        dp,
                        int(tids[node]),
                        offset + float(start[node, dp]),
                        float(prepared.duration[node, step_index, dp]),
                        int(step),
                        float(prepared.cost[node, step_index, dp]),
                        float(prepared.launch_delay[node, step_index, dp]),
                    )
                )
        for node in range(model.n_nodes):
            events.append(
                _span(
                    names[node],
                    ideal_pid,
                    int(tids[node]),
                    offset + float(ideal_start[node]),
                    float(ideal_end[node] - ideal_start[node]),
                    int(step),
                    None,
                    None,
                )
            )
        offset += STEP_GAP_FACTOR * max(float(end.max()), ideal_length)
    return events


def _meta(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}


def _span(
    name: str,
    pid: int,
    tid: int,
    start_s: float,
    duration_s: float,
    step: int,
    cost: float | None,
    delay: float | None,
) -> dict[str, Any]:
    args: dict[str, Any] = {"step": step}
    if cost is not None:
        args["cost_s"] = cost
        args["launch_delay_s"] = delay
    return {
        "ph": "X",
        "name": name,
        "pid": pid,
        "tid": tid,
        "ts": start_s * 1e6,
        "dur": max(duration_s, 0.0) * 1e6,
        "args": args,
    }
