"""`lagscope generate`: a synthetic 3D-parallel job in the reference format, with ground
truth (thin adapter around simulator.generate)."""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lagscope.cli.conventions import UsageError, claim_output_dir, examples
from lagscope.simulator.errors import TraceError, describe_validation_error

#: What `generate` writes into --out, and all it ever replaces there.
GENERATED_FILES = ("trace.parquet", "meta.yaml", "truth.json", "spec.json")

if TYPE_CHECKING:
    from lagscope.simulator.generate import Injection

#: JobSpec's defaults, shown in --help without importing the generator (its module needs
#: numpy); tests/test_cli_consistency.py keeps them equal to the model's.
SPEC_DEFAULTS: dict[str, int | float] = {
    "dp": 4, "pp": 4, "vpp": 1, "tp": 1, "microbatches": 8, "steps": 20, "seed": 0,
    "noise_cv": 0.02,
}  # fmt: skip

# The generator, pydantic and yaml are imported when the command runs, not when it is
# registered: `lagscope --help` must stay cheap.


@functools.cache
def _injection_adapter() -> Any:
    from pydantic import TypeAdapter

    from lagscope.simulator.generate import Injection

    return TypeAdapter(Injection)


def parse_injection(text: str) -> Injection:
    """'slow_worker:dp=1,stage=2,factor=1.5,start_step=10,end_step=30' -> SlowWorker."""
    import yaml
    from pydantic import ValidationError

    kind, _, params = text.partition(":")
    fields: dict[str, object] = {"kind": kind.strip()}
    for item in filter(None, (p.strip() for p in params.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--inject {text!r}: expected name=value, got {item!r}")
        fields[name.strip()] = yaml.safe_load(value)
    try:
        return _injection_adapter().validate_python(fields)
    except ValidationError as exc:
        problems = describe_validation_error(exc, "kind")
        raise UsageError(f"--inject {text!r}: {problems}") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="generate a synthetic job trace with injected stragglers and ground truth",
        description="Simulates a Megatron-style 1F1B (or interleaved) job and writes "
        "trace.parquet, meta.yaml and truth.json into --out. Flags override --spec; "
        "what neither sets keeps JobSpec's default.",
        epilog=examples(
            "lagscope generate --out jobs/clean --dp 4 --pp 4 --steps 40",
            "lagscope generate --out jobs/slow --inject "
            "slow_worker:dp=1,stage=2,factor=1.5,start_step=10,end_step=30",
            "lagscope generate --out jobs/from-spec --spec spec.yaml --seed 3",
        ),
    )
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="DIR",
        help="output directory: new, empty, or an earlier generate's (its files are replaced)",
    )
    parser.add_argument(
        "--spec", type=Path, metavar="PATH", help="a JobSpec as yaml/json (flags override)"
    )
    for name, meaning in (
        ("dp", "data-parallel replicas"),
        ("pp", "pipeline stages"),
        ("vpp", "virtual stages (model chunks) per pipeline rank; >1 is interleaved 1F1B"),
        ("tp", "tensor-parallel ranks per stage (one worker stands for them)"),
        ("microbatches", "micro-batches per step"),
        ("steps", "training steps"),
        ("seed", "random seed"),
    ):
        parser.add_argument(
            f"--{name}",
            type=int,
            help=f"{meaning} (default: the --spec's, else {SPEC_DEFAULTS[name]})",
        )
    parser.add_argument(
        "--noise-cv",
        type=float,
        help="coefficient of variation of costs (default: the --spec's, else "
        f"{SPEC_DEFAULTS['noise_cv']})",
    )
    parser.add_argument(
        "--overlapped-dp",
        action="store_true",
        default=None,
        help="overlap the data-parallel gradient reduction with the last backward passes",
    )
    parser.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="KIND:k=v,...",
        help="a straggler, e.g. slow_worker:dp=1,stage=2,factor=1.5,start_step=10,end_step=30 "
        "(kinds: slow_worker, last_stage_imbalance, sequence_imbalance, gc_pauses, "
        "slow_link, launch_delay); repeatable (default: the --spec's, else none)",
    )
    parser.set_defaults(handler=run, extra="analyze")


def run(args: argparse.Namespace) -> int:
    import yaml
    from pydantic import ValidationError

    from lagscope.producers.reference_format import write_meta, write_traces
    from lagscope.simulator.generate import JobGenerator, JobSpec

    spec_data: dict = {}
    if args.spec:
        try:
            spec_data = yaml.safe_load(args.spec.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise TraceError(f"{args.spec}: cannot read the job spec ({exc})") from None
    for name in ("dp", "pp", "vpp", "tp", "microbatches", "steps", "seed"):
        if getattr(args, name) is not None:
            spec_data[name] = getattr(args, name)
    if args.overlapped_dp:
        spec_data["overlapped_dp"] = True
    if args.noise_cv is not None:
        spec_data.setdefault("cost", {})["noise_cv"] = args.noise_cv
    if args.inject:
        spec_data["stragglers"] = [
            *spec_data.get("stragglers", []),
            *(parse_injection(t).model_dump() for t in args.inject),
        ]
    try:
        spec = JobSpec.model_validate(spec_data)
    except ValidationError as exc:
        problems = describe_validation_error(exc, "spec")
        raise TraceError(f"invalid job spec: {problems}") from None
    # A folder of anything else (a recorded trace.parquet of the user's) is refused, never
    # overwritten; a rerun into generate's own folder replaces its four files.
    claim_output_dir(args.out, command="generate", own=GENERATED_FILES)
    # A run of steps at a time, each written before the next is simulated: memory follows
    # a run (`RUN_OPS`), not the job (a 12,288-GPU job's 2,000 steps are 250 M ops).
    generator = JobGenerator(spec)
    ops = write_traces((run.trace for run in generator.runs()), args.out / "trace.parquet",
                       spec.meta())  # fmt: skip
    truth = generator.truth()
    write_meta(spec.meta(), args.out / "meta.yaml")
    (args.out / "truth.json").write_text(json.dumps(truth.to_dict(), indent=2))
    (args.out / "spec.json").write_text(spec.model_dump_json(indent=2))
    print(
        f"lagscope generate: {ops} ops, {spec.steps} steps, dp {spec.dp} x pp "
        f"{spec.pp} (vpp {spec.vpp}); true slowdown {truth.slowdown:.4f}; written to "
        f"{args.out}/"
    )
    return 0
