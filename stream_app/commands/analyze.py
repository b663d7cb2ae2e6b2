"""`lagscope analyze`: batch what-if analysis of a recorded trace (thin adapter)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from lagscope.simulator.defaults import DEFAULT_DECOMPOSE_THRESHOLD
from lagscope.simulator.errors import TraceError

if TYPE_CHECKING:
    import numpy as np


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="what-if analysis of a recorded trace",
        description="How fast would the steps have been without stragglers, and who is to "
        "blame? Reads a reference-format trace (parquet), or the per-rank traces "
        "torch.profiler wrote, and the job's metadata (yaml).",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", type=Path, help="trace parquet file")
    source.add_argument(
        "--profiler-trace",
        nargs="+",
        type=Path,
        metavar="PATH",
        help="torch.profiler (Kineto) Chrome-trace JSON, one file per rank: the files, or "
        "a directory holding them",
    )
    parser.add_argument("--meta", required=True, type=Path, help="job metadata yaml file")
    parser.add_argument("--json", type=Path, help="write the full result as JSON here")
    parser.add_argument("--heatmap", type=Path, help="write the DPxPP worker heatmap PNG here")
    parser.add_argument(
        "--timeline", type=Path, help="write a Perfetto/Chrome trace (actual vs ideal) here"
    )
    parser.add_argument("--report", type=Path, help="write the self-contained HTML report here")
    parser.add_argument(
        "--steps",
        help="analyse only these steps, e.g. '16-39,404,410' (inputs are still derived from "
        "the whole trace; ideal values come from the kept steps)",
    )
    parser.add_argument(
        "--skip-incomplete-steps",
        action="store_true",
        help="drop steps where some worker lacks ops instead of failing (they are listed)",
    )
    parser.add_argument(
        "--decompose-threshold",
        type=float,
        default=DEFAULT_DECOMPOSE_THRESHOLD,
        help="report attributions only when the slowdown reaches this (default %(default)s)",
    )
    parser.add_argument(
        "--always-decompose", action="store_true", help="report attributions at any slowdown"
    )
    parser.set_defaults(handler=run, extra="analyze")


def select_steps(spec: str, available: np.ndarray) -> np.ndarray:
    """Mask of `available` steps named by '16-39,404': ranges keep the steps inside them
    (step ids need not be contiguous); a single id or a range that matches nothing is an
    error.

    >>> import numpy as np
    >>> select_steps("16-18,404", np.array([15, 16, 17, 19, 404])).tolist()
    [False, True, True, False, True]
    >>> select_steps("7", np.array([15, 16]))
    Traceback (most recent call last):
    ...
    lagscope.simulator.errors.TraceError: --steps: no step of the trace in '7'
    """
    import numpy as np

    keep = np.zeros(available.shape, dtype=bool)
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        try:
            lo, sep, hi = part.partition("-") if not part.startswith("-") else (part, "", "")
            lo_id = int(lo)
            hi_id = int(hi) if sep else lo_id
        except ValueError:
            raise TraceError(f"--steps: {part!r} is not a step id or a range like 16-39") from None
        hit = (available >= lo_id) & (available <= hi_id)
        if not hit.any():
            raise TraceError(f"--steps: no step of the trace in {part!r}")
        keep |= hit
    if not keep.any():
        raise TraceError("--steps: no step ids given")
    return keep


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: registering the command must stay cheap.
    from lagscope.producers.reference_format import load_meta, load_trace
    from lagscope.simulator.clocks import estimate_clock_offsets
    from lagscope.simulator.diagnose import diagnose
    from lagscope.simulator.prepare import prepare
    from lagscope.simulator.summary import result_to_dict, summary_lines
    from lagscope.simulator.whatif import analyze

    meta = load_meta(args.meta)
    if args.profiler_trace:
        from lagscope.producers.profiler_trace import load_profiler_traces

        trace, read = load_profiler_traces(args.profiler_trace, meta)
        source = " ".join(map(str, args.profiler_trace))
        print(f"lagscope analyze: read {read.summary()}")
    else:
        trace = load_trace(args.trace)
        source = str(args.trace)
    prepared = prepare(trace, meta, skip_incomplete_steps=args.skip_incomplete_steps)
    # From every complete step, before --steps: more transfers, a tighter estimate.
    clocks = estimate_clock_offsets(prepared)
    if args.steps:
        prepared = prepared.select_steps(select_steps(args.steps, prepared.steps))
    result = analyze(prepared, decompose_threshold=args.decompose_threshold)
    print(
        f"lagscope analyze: {source} ({meta.trial_name}, dp {meta.dp_size} x pp "
        f"{meta.pp_size} x tp {meta.tp_size} x cp {meta.dsp_size}, vpp {meta.vpp_size})"
    )
    for line in summary_lines(result):
        print("  " + line)
    largest, stage, dp = clocks.largest()
    print(
        f"  clock offsets       largest {largest * 1e3:+.3f} ms (dp {dp}, pp {stage}), "
        f"from {clocks.n_transfers} transfers"
    )
    diagnosis = diagnose(result, prepared)
    print(f"  diagnosis           {diagnosis.cause}: {diagnosis.summary}")
    for advice in diagnosis.advice:
        print(
            f"  advice              {advice.action} (predicted speed-up "
            f"{advice.predicted_speedup:.3f}x): {advice.detail}"
        )
    if args.json:
        document = result_to_dict(result, always_decompose=args.always_decompose)
        document["diagnosis"] = diagnosis.as_dict()
        document["clock_offsets"] = clocks.as_dict()
        _write(args.json, json.dumps(document, indent=2))
    if args.heatmap:
        from lagscope.dashboards.heatmap import draw_worker_heatmap

        args.heatmap.parent.mkdir(parents=True, exist_ok=True)
        draw_worker_heatmap(
            result.worker_slowdown,
            args.heatmap,
            dp_size=meta.dp_size,
            pp_size=meta.pp_size,
            title=f"{meta.trial_name}: worker slowdown S_w",
        )
        print(f"  heatmap written to {args.heatmap}")
    if args.report:
        from lagscope.dashboards.report import ReportData, render_report

        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(
            render_report(
                ReportData(
                    title=f"lagscope: {meta.trial_name}",
                    subtitle=f"{source} — dp {meta.dp_size} x pp {meta.pp_size} x tp "
                    f"{meta.tp_size} x cp {meta.dsp_size}, vpp {meta.vpp_size}",
                    result=result,
                    diagnosis=diagnosis,
                    timeline_file=str(args.timeline) if args.timeline else None,
                )
            )
        )
        print(f"  report written to {args.report}")
    if args.timeline:
        from lagscope.simulator.timeline import trace_events
        from lagscope.simulator.whatif import WhatIfAnalysis

        ideal = WhatIfAnalysis(prepared, result.ideal_cost).ideal_timeline()
        events = trace_events(
            prepared, ideal.start[:, 0], ideal.end[:, 0], clock_offsets_s=clocks.offset_s
        )
        _write(args.timeline, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        print(f"  timeline written to {args.timeline} (open it in https://ui.perfetto.dev)")
    return 0


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if path.suffix == ".json" and path.name.startswith("analysis"):
        print(f"  result written to {path}", file=sys.stdout)
