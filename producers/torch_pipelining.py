"""`torch.distributed.pipelining` schedules (GPipe, 1F1B, interleaved 1F1B, ...) instrumented
from the schedule object: its stages give the pipeline group, this rank's stage and model
chunks (stage index = chunk x pp + pp rank), and their submodules get the module hooks.

The stages build their p2p ops in `get_{fwd,bwd}_{send,recv}_ops`; wrapping those four
methods on each stage object tags every op's tensor with its direction, which the p2p
wrapper reads (with two pipeline ranks and virtual stages, the peer's stage alone cannot
tell a forward from a backward transfer). The schedule attributes read here (`_stage` of
single-stage schedules, `_stages` of multi-stage ones) are private: `check_pipelining_seams`
verifies them and `tests/test_torch_seams.py` fails when they move.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lagscope.producers.torch_monitor import Monitor

_OP_BUILDERS = {
    "get_fwd_send_ops": "forward",
    "get_fwd_recv_ops": "forward",
    "get_bwd_send_ops": "backward",
    "get_bwd_recv_ops": "backward",
}
_STAGE_ATTRIBUTES = ("submod", "stage_index", "num_stages", "group")


def check_pipelining_seams() -> list[str]:
    """What no longer matches in torch.distributed.pipelining (empty when intact)."""
    from torch.distributed.pipelining import schedules, stage

    problems = []
    base = getattr(stage, "_PipelineStageBase", None)
    if base is None:
        return ["torch.distributed.pipelining.stage._PipelineStageBase is missing"]
    for name in _OP_BUILDERS:
        if not callable(getattr(base, name, None)):
            problems.append(f"_PipelineStageBase.{name} is missing")
    init_source = _source(base.__init__)
    for name in _STAGE_ATTRIBUTES:
        if f"self.{name} =" not in init_source:
            problems.append(f"_PipelineStageBase no longer sets self.{name}")
    single = _source(schedules.PipelineScheduleSingle.__init__)
    multi = _source(schedules.PipelineScheduleMulti.__init__)
    if "self._stage = " not in single:
        problems.append("PipelineScheduleSingle no longer sets self._stage")
    if "self._stages = " not in multi:
        problems.append("PipelineScheduleMulti no longer sets self._stages")
    return problems


def _source(function: Any) -> str:
    import inspect

    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def stages_of(schedule: Any) -> list[Any]:
    """The pipeline stages this rank runs in `schedule`, in chunk order."""
    stages = getattr(schedule, "_stages", None)
    if stages is None:
        single = getattr(schedule, "_stage", None)
        if single is None:
            raise TypeError(
                f"{type(schedule).__name__} is not a torch.distributed.pipelining schedule "
                "(it has neither _stage nor _stages)"
            )
        stages = [single]
    return sorted(stages, key=lambda s: s.stage_index)


def tag_directions(monitor: Monitor, stage: Any) -> None:
    """Make the stage's p2p ops carry their direction to the p2p wrapper."""
    hints = monitor.direction_hints
    for name, direction in _OP_BUILDERS.items():
        build = getattr(stage, name)

        def tagged(*args: Any, _build: Any = build, _direction: str = direction) -> Any:
            ops = _build(*args)
            if monitor.active:
                for op in ops:
                    hints[id(op.tensor)] = _direction
            return ops

        setattr(stage, name, tagged)
