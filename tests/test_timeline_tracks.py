"""The Perfetto timeline keeps every op: on no track does a complete slice overlap another
without nesting in it (Perfetto drops such a slice; on AR 2,697 were lost). Perfetto's trace
processor downloads its binary at run time, which this machine cannot, so the nesting rule
is checked here on every track, as Perfetto reads the times (whole nanoseconds)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import pytest

from lagscope.simulator.clocks import estimate_clock_offsets
from lagscope.simulator.generate import JobSpec, SlowLink, SlowWorker, generate_job
from lagscope.simulator.prepare import PreparedTrace, prepare
from lagscope.simulator.timeline import STREAMS, assign_lanes, choose_window, trace_events
from lagscope.simulator.whatif import WhatIfAnalysis, analyze
from tests.conftest import analyzed_reference


def timeline_of(prepared: PreparedTrace) -> list[dict[str, Any]]:
    """What `lagscope analyze --timeline` writes for `prepared`."""
    result = analyze(prepared)
    ideal = WhatIfAnalysis(prepared, result.ideal_cost).ideal_timeline()
    offsets = estimate_clock_offsets(prepared).offset_s
    return trace_events(prepared, ideal.start[:, 0], ideal.end[:, 0], clock_offsets_s=offsets)


def partial_overlaps(events: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(track, slice, slice it overlaps) for every slice that neither nests in nor follows
    the open slices before it on its track."""
    tracks: dict[tuple[int, int], list[tuple[int, int, str]]] = defaultdict(list)
    for event in events:
        if event["ph"] == "X":
            start = round(event["ts"] * 1000)
            tracks[event["pid"], event["tid"]].append(
                (start, start + round(event["dur"] * 1000), event["name"])
            )
    found = []
    for track, slices in tracks.items():
        open_slices: list[tuple[int, int, str]] = []
        for start, end, name in sorted(slices, key=lambda s: (s[0], -s[1])):
            while open_slices and open_slices[-1][1] <= start:
                open_slices.pop()
            if open_slices and end > open_slices[-1][1]:
                found.append((str(track), name, open_slices[-1][2]))
            open_slices.append((start, end, name))
    return found


def generated_job() -> PreparedTrace:
    """Interleaved 1F1B with overlapped DP reductions, a slow link and a slow worker."""
    spec = JobSpec(
        name="timeline",
        dp=2,
        pp=4,
        vpp=2,
        microbatches=8,
        steps=12,
        seed=5,
        overlapped_dp=True,
        stragglers=(
            SlowWorker(dp=1, stage=2, factor=1.5, start_step=3, end_step=9),
            SlowLink(stage=1, factor=3.0),
        ),
    )
    job = generate_job(spec)
    return prepare(job.trace, job.meta)


@pytest.mark.parametrize("name", ["AR", "ST", "SE", "generated"])
def test_no_slice_overlaps_another_on_its_track_and_none_is_lost(name: str) -> None:
    prepared = generated_job() if name == "generated" else analyzed_reference(name)[0]
    events = timeline_of(prepared)
    assert partial_overlaps(events) == []
    spans = [e for e in events if e["ph"] == "X"]
    n_ops = prepared.model.n_nodes * len(prepared.steps)
    assert len(spans) == n_ops * (prepared.n_dp + 1)  # every op, measured and ideal
    # Every track is named after its stage and stream of work.
    thread_names = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"
    }
    assert {(e["pid"], e["tid"]) for e in spans} <= set(thread_names)
    assert all(any(f" {stream}" in label for stream in STREAMS) for label in thread_names.values())


def test_overlapping_slices_take_a_second_lane_and_back_to_back_ones_share_one() -> None:
    slices = [(0, 10, "a", {}), (10, 20, "b", {}), (15, 30, "c", {}), (30, 40, "d", {})]
    lanes = assign_lanes(slices)
    assert [[name for _, _, name, _ in lane] for lane in lanes] == [["a", "b", "d"], ["c"]]


def test_a_stream_with_ops_in_flight_at_once_gets_numbered_lanes() -> None:
    """AR's measured compute ops overlap by up to ~120 us (kernel timestamps): the overlap
    goes to "pp 0 compute (2)", the rest stays on "pp 0 compute"."""
    events = timeline_of(analyzed_reference("AR")[0])
    labels = {e["args"]["name"] for e in events if e["name"] == "thread_name" and e["pid"] == 0}
    assert "pp 0 compute" in labels and "pp 0 compute (2)" in labels
    assert "pp 0 pp-forward send" in labels and "pp 0 pp-forward recv" in labels


def test_a_window_keeps_the_chosen_dp_ranks_and_steps_whole() -> None:
    """A window of a larger job: its DP ranks are processes of their own numbers, the ideal
    process after them, every op of the window's steps kept and none overlapping."""
    spec = JobSpec(
        name="window", dp=12, pp=2, microbatches=4, steps=10, seed=3,
        stragglers=(SlowWorker(dp=9, stage=1, factor=2.0, start_step=4, end_step=6),),
    )  # fmt: skip
    job = generate_job(spec)
    prepared = prepare(job.trace, job.meta)
    result = analyze(prepared)
    n_nodes = prepared.model.n_nodes
    # Room for two steps of every DP rank, not for four: the slowest 7 and a typical one.
    window = choose_window(
        result.step_slowdown, result.worker_slowdown, n_nodes, max_slices=2 * n_nodes * 13
    )
    assert len(window.dp_ranks) == 8 and window.dp_ranks[0] == 9
    assert window.n_slices <= 2 * n_nodes * 13
    kept = prepared.steps[window.steps]
    assert kept.size == window.n_slices // (n_nodes * 9)
    slowest = int(prepared.steps[np.argmax(result.step_slowdown)])
    assert slowest in kept.tolist()
    ideal = WhatIfAnalysis(prepared, result.ideal_cost).ideal_timeline()
    events = trace_events(
        prepared.select_steps(window.steps),
        ideal.start[:, 0],
        ideal.end[:, 0],
        dp_ranks=window.dp_ranks,
    )
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == window.n_slices
    assert {e["pid"] for e in spans} == {*window.dp_ranks, 12}
    assert partial_overlaps(events) == []
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names[9].startswith("dp 9 ") and names[12].startswith("ideal")
    line = window.describe(prepared.steps, prepared.n_dp)
    assert f"({kept.size} of 10: the slowest and its neighbours)" in line
    assert "(8 of 12: the 7 slowest by S_w" in line
    assert f"left out {10 - kept.size} steps and 4 DP ranks to stay under" in line


def test_a_small_job_is_drawn_whole() -> None:
    prepared, result = analyzed_reference("ST")
    window = choose_window(result.step_slowdown, result.worker_slowdown, prepared.model.n_nodes)
    assert window.steps.all() and window.dp_ranks == [0, 1]
    assert "left out" not in window.describe(prepared.steps, prepared.n_dp)
