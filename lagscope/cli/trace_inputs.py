"""Where a recorded job is: the trace and metadata options `analyze` and `replay` share.

A user who drops a trace on the command line names it and nothing else: the trace as a
plain argument (a parquet file, `generate`'s output directory, or torch.profiler's files),
and the job's metadata found beside it when `--meta` is not given, under the names the
reference traces, `generate` and the examples use.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lagscope.cli.conventions import UsageError
from lagscope.simulator.errors import TraceError


def trace_usage(rest: str) -> str:
    """A command's usage lines for its two ways of naming the trace (argparse draws a
    group that holds a plain argument as if every member were optional)."""
    return (
        f"%(prog)s TRACE [--meta PATH] {rest}\n"
        f"       %(prog)s (--trace PATH | --profiler-trace PATH...) [--meta PATH] {rest}"
    )


def add_trace_inputs(parser: argparse.ArgumentParser) -> None:
    """The trace (a plain argument, `--trace` or `--profiler-trace`) and `--meta`."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "recorded",
        nargs="*",
        default=[],
        type=Path,
        metavar="TRACE",
        help="the trace: a parquet file, a directory holding one (generate's output), or "
        "torch.profiler JSON files or a directory of them",
    )
    source.add_argument("--trace", type=Path, metavar="PATH", help="trace parquet file")
    source.add_argument(
        "--profiler-trace",
        nargs="+",
        type=Path,
        metavar="PATH",
        help="torch.profiler (Kineto) Chrome-trace JSON, one file per rank: the files, or "
        "a directory holding them",
    )
    parser.add_argument(
        "--meta",
        type=Path,
        metavar="PATH",
        help="job metadata yaml (default: the one beside the trace: meta-NAME.yaml for "
        "trace-NAME.parquet, NAME.yaml for NAME.parquet, or meta.yaml)",
    )


def resolve_trace_inputs(args: argparse.Namespace) -> Path | None:
    """Fill `args.trace` or `args.profiler_trace`, and `args.meta`, from what was given;
    returns the metadata file found beside the trace, or None when `--meta` named it."""
    if args.recorded:
        _sort_recorded(args)
    if args.meta is not None:
        return None
    places = [args.trace] if args.trace else list(args.profiler_trace)
    for place in places:
        if not place.exists():
            raise TraceError(f"{place}: no such file or directory")
    for place in places:
        found = meta_beside(place)
        if found is not None:
            args.meta = found
            return found
    looked = ", ".join(str(path) for path in _candidates(places[0]))
    raise UsageError(
        f"--meta: not given, and no job metadata beside {places[0]} (looked for {looked}); "
        "name it with --meta: a yaml of the job's dp_size, pp_size and world_size at least "
        "(tp_size, dsp_size, vpp_size: 1 when left out)"
    )


def meta_beside(trace: Path) -> Path | None:
    """The job metadata file that goes with `trace`, when one lies beside it.

    >>> meta_beside(Path("tests/data/reference-traces/trace-ST.parquet")).name
    'meta-ST.yaml'
    >>> meta_beside(Path("nowhere/trace.parquet")) is None
    True
    """
    return next((path for path in _candidates(trace) if path.is_file()), None)


def _candidates(trace: Path) -> list[Path]:
    """Where `meta_beside` looks for the metadata of `trace`, in order.

    >>> [str(p) for p in _candidates(Path("traces/trace-ST.parquet"))]
    ['traces/meta-ST.yaml', 'traces/trace-ST.yaml', 'traces/meta.yaml']
    >>> [str(p) for p in _candidates(Path("run/rank0.pt.trace.json"))]
    ['run/meta.yaml', 'meta.yaml']
    """
    if trace.suffix == ".parquet" and not trace.is_dir():
        # `meta-ST.yaml` beside `trace-ST.parquet` (the reference traces), `big.yaml`
        # beside `big.parquet`, `meta.yaml` (what `generate` writes).
        names = [f"{trace.stem}.yaml", "meta.yaml"]
        if trace.stem.startswith(("trace-", "trace_")):
            names.insert(0, "meta" + trace.stem.removeprefix("trace") + ".yaml")
        return [trace.parent / name for name in dict.fromkeys(names)]
    # torch.profiler's files, or a directory of them: the metadata in their directory, or
    # beside it (a job's directory holding `traces/` and `meta.yaml`).
    folder = trace if trace.is_dir() else trace.parent
    return [folder / "meta.yaml", folder.parent / "meta.yaml"]


def _sort_recorded(args: argparse.Namespace) -> None:
    """A plain TRACE argument as `--trace` (one parquet file, or a directory holding
    exactly one) or as `--profiler-trace` (JSON files, or a directory of them)."""
    recorded: list[Path] = args.recorded
    if len(recorded) == 1 and recorded[0].suffix == ".parquet":
        args.trace = recorded[0]
        return
    if len(recorded) == 1 and recorded[0].is_dir():
        parquets = sorted(recorded[0].glob("*.parquet"))
        if len(parquets) == 1:
            args.trace = parquets[0]
            return
        if len(parquets) > 1:
            names = ", ".join(p.name for p in parquets[:4]) + (", ..." * (len(parquets) > 4))
            raise UsageError(
                f"{recorded[0]}: holds {len(parquets)} traces ({names}); name one of them"
            )
        _refuse_rank_logs(recorded[0])
    for path in recorded:
        if path.suffix == ".parquet":
            raise UsageError(
                f"{path}: one parquet trace at a time (the other arguments are "
                "torch.profiler's JSON files)"
            )
    args.profiler_trace = recorded


def _refuse_rank_logs(folder: Path) -> None:
    """A folder of lagscope's own per-rank logs (what the timers and `replay` write) is not
    a trace: `lagscope run` is the command that reads them."""
    from lagscope.producers.log import RANK_DIR_PREFIX, list_rank_dirs

    log_dir = folder.parent if folder.name.startswith(RANK_DIR_PREFIX) else folder
    if list_rank_dirs(log_dir):
        raise UsageError(
            f"{folder}: per-rank logs of lagscope's timers, not a trace; "
            f"`lagscope run --log-dir {log_dir}` analyses them"
        )
