"""`lagscope analyze`: batch what-if analysis of a recorded trace (thin adapter)."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lagscope.cli.conventions import (
    STDOUT,
    UsageError,
    check_one_stdout,
    examples,
    write_output,
)
from lagscope.cli.job_summary import print_episode
from lagscope.cli.trace_inputs import add_trace_inputs, resolve_trace_inputs, trace_usage
from lagscope.simulator.defaults import (
    DEFAULT_DECOMPOSE_THRESHOLD,
    TIMELINE_DP_RANKS,
    TIMELINE_MAX_SLICES,
    TIMELINE_MIN_STEPS,
)

if TYPE_CHECKING:
    import numpy as np

    from lagscope.simulator.diagnose import Diagnosis, DiagnosisSettings
    from lagscope.simulator.episodes import Episode
    from lagscope.simulator.job_story import EpisodeState
    from lagscope.simulator.online_episodes import OnlineEpisodeSettings
    from lagscope.simulator.prepare import PreparedTrace
    from lagscope.simulator.timeline import TimelineWindow
    from lagscope.simulator.whatif import WhatIfResult


#: Image formats the heatmap can be written in, by file suffix (matplotlib's Agg writers).
HEATMAP_SUFFIXES = (".png", ".svg", ".pdf")
#: The output options; each takes a path or `-` for stdout.
OUTPUT_OPTIONS = ("json", "heatmap", "timeline", "report")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="what-if analysis of a recorded trace",
        usage=trace_usage("[options]"),
        description="How fast would the steps have been without stragglers, and who is to "
        "blame? Reads a reference-format trace (parquet), or the per-rank traces "
        "torch.profiler wrote, and the job's metadata (yaml; by default the one beside the "
        "trace, as `lagscope generate` and the reference traces lay them out).\n\n"
        "Every output option takes a path, or '-' for stdout (the summary then goes to "
        "stderr).",
        epilog=examples(
            "lagscope analyze trace-ST.parquet",
            "lagscope analyze out/",
            "lagscope analyze --trace trace.parquet --meta meta.yaml --json - | jq .slowdown",
            "lagscope analyze --trace trace.parquet --meta meta.yaml --report report.html "
            "--heatmap heatmap.png --timeline timeline.json",
            "lagscope analyze --profiler-trace traces/ --meta meta.yaml --steps 16-39",
            "lagscope analyze --trace big.parquet --meta big.yaml --timeline t.json "
            "--timeline-steps 40-42 --timeline-ranks 0-3,117",
        ),
    )
    add_trace_inputs(parser)
    _add_outputs(parser)
    _add_analysis_options(parser)
    parser.set_defaults(handler=run, extra="analyze", one_shot=True)


def _add_outputs(parser: argparse.ArgumentParser) -> None:
    """JSON, heatmap, timeline (and what it holds), HTML report."""
    parser.add_argument("--json", metavar="PATH", help="write the full result as JSON here")
    parser.add_argument(
        "--heatmap",
        metavar="PATH",
        help=f"write the DPxPP worker heatmap here ({', '.join(HEATMAP_SUFFIXES)}; '-' writes PNG)",
    )
    parser.add_argument(
        "--timeline",
        metavar="PATH",
        help="write a Perfetto/Chrome trace (actual vs ideal) here; a large job's holds a "
        "window (see --timeline-max-slices), and the summary says what it left out",
    )
    parser.add_argument(
        "--timeline-steps",
        metavar="STEPS",
        help="the steps the timeline holds, e.g. '40-42' (default: all that fit, around "
        "the slowest step)",
    )
    parser.add_argument(
        "--timeline-ranks",
        metavar="DP_RANKS",
        help="the DP ranks the timeline holds, e.g. '0-3,117' (default: all when "
        f"{TIMELINE_MIN_STEPS} steps of them fit, else the {TIMELINE_DP_RANKS - 1} slowest by "
        "S_w and a typical one)",
    )
    parser.add_argument(
        "--timeline-max-slices",
        type=int,
        default=TIMELINE_MAX_SLICES,
        metavar="N",
        help="the most ops the timeline holds of what --timeline-steps and --timeline-ranks "
        "leave open (default %(default)s: about 50 MB of JSON; 0: no limit)",
    )
    parser.add_argument(
        "--report", metavar="PATH", help="write the self-contained HTML report here"
    )


def _add_analysis_options(parser: argparse.ArgumentParser) -> None:
    """Which steps are analysed, and when attributions are reported."""
    parser.add_argument(
        "--steps",
        help="analyse only these steps, e.g. '16-39,404,410' (inputs are still derived from "
        "the whole trace, or from these steps alone where the whole does not fit in memory; "
        "ideal values come from the kept steps)",
    )
    parser.add_argument(
        "--skip-incomplete-steps",
        action="store_true",
        help="drop steps where some worker lacks ops instead of failing (they are listed)",
    )
    parser.add_argument(
        "--decompose-threshold",
        type=float,
        help="report attributions only when the slowdown reaches this (default: "
        f"{DEFAULT_DECOMPOSE_THRESHOLD}, or the settings' processor.decompose_threshold)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        metavar="PATH",
        help="the workers' yaml/json config file (as `lagscope worker --config`): its "
        "processor section (what opens an episode, what names a cause) applies here, as "
        "LAGSCOPE_PROCESSOR__* variables do, so the trace tells the story the cluster's "
        "workers tell",
    )
    parser.add_argument(
        "--always-decompose", action="store_true", help="report attributions at any slowdown"
    )


def check_outputs(args: argparse.Namespace) -> None:
    """Usage errors found before any work: two outputs on stdout, a heatmap path whose
    format cannot be drawn."""
    check_one_stdout(args, *OUTPUT_OPTIONS)
    for option in ("timeline_steps", "timeline_ranks"):
        if getattr(args, option, None) and not args.timeline:
            raise UsageError(f"--{option.replace('_', '-')} chooses what --timeline holds: add it")
    if getattr(args, "timeline_max_slices", 0) < 0:
        raise UsageError("--timeline-max-slices: a count of slices, or 0 for no limit")
    _check_outputs_spare_inputs(args)
    if args.heatmap and args.heatmap != STDOUT:
        suffix = Path(args.heatmap).suffix.lower()
        if suffix not in HEATMAP_SUFFIXES:
            raise UsageError(
                f"--heatmap {args.heatmap}: cannot draw a {suffix or 'suffix-less'} file; "
                f"use one of {', '.join(HEATMAP_SUFFIXES)}, or '-' for PNG on stdout"
            )


def _check_outputs_spare_inputs(args: argparse.Namespace) -> None:
    """An output written over one of the command's own inputs (`--json meta.yaml`, a
    slip of the shell's completion) would destroy the file the user came with."""
    inputs: dict[Path, str] = {}
    for option in ("trace", "meta"):
        if getattr(args, option, None):
            inputs[Path(getattr(args, option))] = f"--{option}"
    for given in getattr(args, "profiler_trace", None) or ():
        for path in sorted(Path(given).iterdir()) if Path(given).is_dir() else [Path(given)]:
            inputs[path] = "--profiler-trace"
    for option in OUTPUT_OPTIONS:
        value = getattr(args, option, None)
        if not value or value == STDOUT or not Path(value).is_file():
            continue
        for path, source in inputs.items():
            if path.is_file() and Path(value).samefile(path):
                raise UsageError(
                    f"--{option} {value}: is the command's input ({source}); writing there "
                    "would destroy it: give another path"
                )


def select_steps(spec: str, available: np.ndarray, option: str = "--steps") -> np.ndarray:
    """Mask of `available` steps (or other ids) named by '16-39,404': ranges keep the ids
    inside them (ids need not be contiguous); a single id or a range that matches nothing
    is an error of the command line (exit 2), naming `option`.

    >>> import numpy as np
    >>> select_steps("16-18,404", np.array([15, 16, 17, 19, 404])).tolist()
    [False, True, True, False, True]
    >>> select_steps("7", np.array([15, 16]))
    Traceback (most recent call last):
    ...
    lagscope.cli.conventions.UsageError: --steps: no step of the trace in '7'
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
            raise UsageError(f"{option}: {part!r} is not an id or a range like 16-39") from None
        hit = (available >= lo_id) & (available <= hi_id)
        if not hit.any():
            raise UsageError(f"{option}: no {_WHAT[option]} of the trace in {part!r}")
        keep |= hit
    if not keep.any():
        raise UsageError(f"{option}: no ids given")
    return keep


#: What the ids of each selecting option name, in its errors.
_WHAT = {"--steps": "step", "--timeline-steps": "analysed step", "--timeline-ranks": "DP rank"}


def run(args: argparse.Namespace) -> int:
    # Imported here, not at the top: registering the command must stay cheap.
    from lagscope.simulator.clocks import estimate_clock_offsets
    from lagscope.simulator.job_story import tell_trace
    from lagscope.simulator.prepare import prepare
    from lagscope.simulator.summary import summary_lines

    meta_found = resolve_trace_inputs(args)
    check_outputs(args)
    # When a result goes to stdout, the human summary goes to stderr, out of its way.
    say = functools.partial(
        print,
        file=sys.stderr if STDOUT in (getattr(args, o) for o in OUTPUT_OPTIONS) else sys.stdout,
    )
    meta, trace, source = _read_trace(args, say)
    prepared = prepare(trace, meta, skip_incomplete_steps=args.skip_incomplete_steps)
    # From every complete step, before --steps: more transfers, a tighter estimate.
    clocks = estimate_clock_offsets(prepared)
    if args.steps:
        prepared = prepared.select_steps(select_steps(args.steps, prepared.steps))
    settings = _analysis_settings(args)
    # The story decides the verdict that the summary, the JSON and the report all show:
    # the trace's diagnosis told with its episodes, as `lagscope run` tells it.
    told = tell_trace(
        prepared,
        meta,
        decompose_threshold=settings.decompose_threshold,
        episode_settings=settings.episodes,
        diagnosis_settings=settings.diagnosis,
    )
    result, diagnosis, episodes = told.result, told.verdict, told.episodes
    # Chosen before any output: a selection naming nothing is a mistake of the command line.
    window = timeline_window(args, prepared, result, diagnosis) if args.timeline else None
    say(
        f"lagscope analyze: {source} ({meta.trial_name}, dp {meta.dp_size} x pp "
        f"{meta.pp_size} x tp {meta.tp_size} x cp {meta.dsp_size}, vpp {meta.vpp_size})"
    )
    if meta_found is not None:
        say(f"  metadata            {meta_found}, found beside the trace")
    largest, stage, dp = clocks.largest()
    say(
        f"  clock offsets       largest {largest * 1e3:+.3f} ms (dp {dp}, pp {stage}), "
        f"from {clocks.n_transfers} transfers"
    )
    for line in summary_lines(result, diagnosis):
        say("  " + line)
    for state in episodes:
        print_episode(state, _episode(state), say, indent="  ")
    if args.json:
        _write_json(args, result, diagnosis, episodes, clocks, say)
    if args.heatmap:
        _write_heatmap(args, result, meta, say)
    if args.report:
        _write_report(args, source, meta, result, diagnosis, episodes, prepared, window, say)
    if args.timeline:
        assert window is not None
        _write_timeline(args, prepared, result, clocks, window, say)
    return 0


@dataclass(frozen=True)
class _Settings:
    """What the analysis of a trace takes of the workers' processor settings."""

    decompose_threshold: float
    episodes: OnlineEpisodeSettings | None = None
    diagnosis: DiagnosisSettings | None = None


def _analysis_settings(args: argparse.Namespace) -> _Settings:
    """The workers' processor settings (`lagscope run` and `lagscope worker` read the same
    model, flags > variables > --config file > defaults), loaded only when a file or a
    variable gives one: the model costs ~0.1 s of imports and changes nothing otherwise."""
    import os

    from lagscope.producers.config_names import processor_settings_given

    if args.config is None and not processor_settings_given(os.environ):
        threshold = args.decompose_threshold
        return _Settings(DEFAULT_DECOMPOSE_THRESHOLD if threshold is None else threshold)
    from lagscope.producers.config import load_config
    from lagscope.stream_app.worker_config import WorkerConfig

    processor = load_config(
        WorkerConfig,
        file=args.config,
        overrides={"processor": {"decompose_threshold": args.decompose_threshold}},
    ).processor
    return _Settings(processor.decompose_threshold, processor.episodes, processor.diagnosis)


def _read_trace(args: argparse.Namespace, say: Callable[..., None]) -> tuple[Any, Any, str]:
    """The job's metadata, its trace (reference parquet or torch.profiler's), and how the
    summary names where it came from."""
    from lagscope.cli.trace_memory import read_window, replay_it, weight_beyond_memory
    from lagscope.producers.reference_format import load_meta, load_trace
    from lagscope.simulator.errors import TraceError

    meta = load_meta(args.meta)
    if args.profiler_trace:
        from lagscope.producers.profiler_trace import load_profiler_traces

        trace, read = load_profiler_traces(args.profiler_trace, meta)
        say(f"lagscope analyze: read {read.summary()}")
        return meta, trace, " ".join(map(str, args.profiler_trace))
    path = Path(args.trace)
    weight = weight_beyond_memory(path)
    if weight is None:
        return meta, load_trace(path, meta=meta, meta_path=args.meta), str(path)
    if not args.steps:
        raise TraceError(
            f"{weight.too_large(path)}: analyse a window of its steps (--steps), or "
            f"{replay_it(path, args.meta)}"
        )
    chosen = functools.partial(select_steps, args.steps)
    return meta, read_window(path, meta, args.meta, weight, chosen, say), str(path)


def _episode(state: EpisodeState) -> Episode:
    """An episode as the hosts' reports list it."""
    from lagscope.simulator.episodes import Episode

    live = state.episode
    return Episode(live.onset, live.recovery, state.diagnosis, (f"worker/{live.dp}.{live.stage}",))


def _write_json(
    args: argparse.Namespace,
    result: WhatIfResult,
    diagnosis: Diagnosis,
    episodes: list[EpisodeState],
    clocks: Any,
    say: Callable[..., None],
) -> None:
    import dataclasses

    from lagscope.simulator.summary import result_to_dict
    from lagscope.simulator.verdict import verdict_of

    document = result_to_dict(result, always_decompose=args.always_decompose)
    document["verdict"] = verdict_of(diagnosis).as_dict()
    document["diagnosis"] = diagnosis.as_dict()
    document["episodes"] = [
        {
            **dataclasses.asdict(state.episode),
            "gpu_seconds_lost": state.gpu_seconds_lost,
            "verdict": verdict_of(state.diagnosis, recovered_at=state.episode.recovery).as_dict(),
        }
        for state in episodes
    ]
    document["clock_offsets"] = clocks.as_dict()
    where = write_output(args.json, json.dumps(document, indent=2), option="--json")
    say(f"  result written to {where}")


def _write_heatmap(
    args: argparse.Namespace, result: WhatIfResult, meta: Any, say: Callable[..., None]
) -> None:
    import io

    from lagscope.dashboards.heatmap import draw_worker_heatmap

    image = io.BytesIO()
    suffix = Path(args.heatmap).suffix.lower() if args.heatmap != STDOUT else ".png"
    draw_worker_heatmap(
        result.worker_slowdown,
        image,
        image_format=suffix.lstrip("."),
        dp_size=meta.dp_size,
        pp_size=meta.pp_size,
        title=f"{meta.trial_name}: worker slowdown S_w",
    )
    where = write_output(args.heatmap, image.getvalue(), option="--heatmap")
    say(f"  heatmap written to {where}")


def _write_report(
    args: argparse.Namespace,
    source: str,
    meta: Any,
    result: WhatIfResult,
    diagnosis: Diagnosis,
    episodes: list[EpisodeState],
    prepared: PreparedTrace,
    window: TimelineWindow | None,
    say: Callable[..., None],
) -> None:
    from lagscope.dashboards.report import ReportData, render_report

    html = render_report(
        ReportData(
            title=f"lagscope: {meta.trial_name}",
            subtitle=f"{source} — dp {meta.dp_size} x pp {meta.pp_size} x tp "
            f"{meta.tp_size} x cp {meta.dsp_size}, vpp {meta.vpp_size}",
            result=result,
            diagnosis=diagnosis,
            episodes=[(s.episode.onset, s.episode.recovery, s.diagnosis) for s in episodes],
            timeline_file=args.timeline if args.timeline not in (None, STDOUT) else None,
            timeline_note=window.describe(prepared.steps, prepared.n_dp) if window else None,
        )
    )
    where = write_output(args.report, html, option="--report")
    say(f"  report written to {where}")


def _write_timeline(
    args: argparse.Namespace,
    prepared: PreparedTrace,
    result: WhatIfResult,
    clocks: Any,
    window: TimelineWindow,
    say: Callable[..., None],
) -> None:
    from lagscope.simulator.timeline import trace_events
    from lagscope.simulator.whatif import WhatIfAnalysis

    ideal = WhatIfAnalysis(prepared, result.ideal_cost).ideal_timeline()
    events = trace_events(
        prepared.select_steps(window.steps),
        ideal.start[:, 0],
        ideal.end[:, 0],
        clock_offsets_s=clocks.offset_s,
        dp_ranks=window.dp_ranks,
    )
    document = json.dumps({"traceEvents": events, "displayTimeUnit": "ms"})
    say(f"  {window.describe(prepared.steps, prepared.n_dp)}")
    where = write_output(args.timeline, document, option="--timeline")
    say(f"  timeline written to {where} (open it in https://ui.perfetto.dev)")


def timeline_window(
    args: argparse.Namespace, prepared: PreparedTrace, result: WhatIfResult, diagnosis: Diagnosis
) -> TimelineWindow:
    """The steps and DP ranks the timeline holds: those the options name, what they leave
    open chosen to fit --timeline-max-slices."""
    import numpy as np

    from lagscope.dashboards.stragglers import verified_workers
    from lagscope.simulator.timeline import choose_window

    steps = None
    if args.timeline_steps:
        steps = select_steps(args.timeline_steps, prepared.steps, option="--timeline-steps")
    dp_ranks = None
    if args.timeline_ranks:
        every_dp = np.arange(prepared.n_dp)
        chosen = select_steps(args.timeline_ranks, every_dp, option="--timeline-ranks")
        dp_ranks = every_dp[chosen].tolist()
    return choose_window(
        np.asarray(result.step_slowdown, dtype=float),
        result.worker_slowdown,
        prepared.model.n_nodes,
        steps=steps,
        dp_ranks=dp_ranks,
        first_dp=[dp for dp, _ in verified_workers(diagnosis.evidence)],
        max_slices=args.timeline_max_slices,
    )
