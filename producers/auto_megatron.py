"""megatron-core in a job run by `lagscope launch`: `lagscope.megatron`'s monitor, started
without a line in the job.

The monitor times megatron's schedules by replacing the module globals that
`get_forward_backward_func()` returns; a job fetches that function once, before its
loop, and before anything could start a monitor. So as soon as
`megatron.core.pipeline_parallel.schedules` is imported, its three schedule functions
become stand-ins (same signatures) that, at the first training call, start
`MegatronMonitor` (the model-parallel groups exist by then) and from then on call
whatever the module holds: the timed schedule while a monitor records, megatron's own
otherwise. A job that imports a schedule function by name gets the stand-in as well.

The optimizer is learnt at its first update (torch's global step hook, from inside the
inner torch optimizer's step: the outermost megatron-core optimizer whose `step` is
running, else the torch optimizer itself); from then on a step ends at the update, as
with `lagscope.megatron.monitor(optimizer=...)`. Step 0, whose update that is, is not
recorded (nor is it the job's steady state). A job that starts
`lagscope.megatron.monitor()` itself keeps its own.
"""

from __future__ import annotations

import functools
import sys
import threading
from types import ModuleType
from typing import Any

from lagscope.producers import import_hooks

#: The module whose schedule functions are replaced (`producers.megatron_seams.SCHEDULES`).
SCHEDULES = "megatron.core.pipeline_parallel.schedules"

#: The schedule functions `get_forward_backward_func` hands out (the adapter times these).
SCHEDULE_FUNCTIONS = (
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_pipelining_with_interleaving",
)

_monitor: Any = None
#: "waiting" for the first training call, "started" (a monitor or a reason why not),
#: "standing down" (the job runs its own monitor).
_state = "waiting"
_own_start = False
_inside = threading.local()


def install() -> None:
    import_hooks.when_imported(SCHEDULES, _schedules_imported)


def _schedules_imported(schedules: ModuleType) -> None:
    from lagscope.producers import integration_start

    integration_start.listen_for_starts(_monitor_starting)
    # Only attribute look-ups and assignments: nothing here can fail the job's import.
    for name in SCHEDULE_FUNCTIONS:
        original = getattr(schedules, name, None)
        if original is not None:
            setattr(schedules, name, _stand_in(schedules, name, original))


def _stand_in(schedules: ModuleType, name: str, original: Any) -> Any:
    @functools.wraps(original)
    def schedule(*args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "yes", False):  # called by the timed schedule wrapping this one
            return original(*args, **kwargs)
        if _state == "waiting" and not kwargs.get("forward_only", False):
            _start()
        current = getattr(schedules, name)
        if current is schedule:
            return original(*args, **kwargs)
        _inside.yes = True
        try:
            return current(*args, **kwargs)
        finally:
            _inside.yes = False

    return schedule


def _start() -> None:
    global _state, _monitor, _own_start
    _state = "started"
    from lagscope.producers import megatron_adapter

    if megatron_adapter._active is not None:  # the job's own, started before
        return
    from lagscope.producers.auto_monitor import say
    from lagscope.producers.torch_sampling import Schedule

    _own_start = True
    try:
        # Step 0 is not recorded: its update is where the optimizer is learnt, so it is the
        # one step without an optimizer op (and the job's warm-up, as for lagscope.torch).
        _monitor = megatron_adapter.MegatronMonitor(optimizer=None, schedule=Schedule(skip_first=1))
    except Exception as exc:  # never stop the job
        say(f"megatron-core: {exc}; the job runs unrecorded")
        return
    finally:
        _own_start = False
    from torch.optim import optimizer as optimizers

    _updates.append(optimizers.register_optimizer_step_post_hook(_first_update))


#: The global optimizer hook's handle (kept: a global hook may not remove itself).
_updates: list[Any] = []


def _first_update(optimizer: Any, args: Any, kwargs: Any) -> None:
    global _updates
    monitor = _monitor
    if monitor is None or getattr(monitor, "_steps_end_at_optimizer", True):
        return
    monitor.attach_optimizer(_outermost_megatron_optimizer() or optimizer)


def _outermost_megatron_optimizer() -> Any:
    """The megatron-core optimizer whose `step` runs furthest out on this thread's stack
    (a `ChainedOptimizer` around its parts), or None."""
    try:
        from megatron.core.optimizer.optimizer import MegatronOptimizer
    except ImportError:
        return None
    found = None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "step":
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, MegatronOptimizer):
                found = candidate
        frame = frame.f_back
    return found


def _monitor_starting(api: str) -> None:
    global _state, _monitor
    if _own_start:
        return
    if _monitor is not None:
        from lagscope.producers.auto_monitor import say

        say(f"the job starts {api}() itself: it records from here on")
        monitor, _monitor = _monitor, None
        monitor.close()
    _state = "standing down"


def recording() -> bool:
    """Whether megatron-core's monitor records this process (the torch side then stays
    out of it)."""
    return _monitor is not None
