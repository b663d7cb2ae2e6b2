"""The Megatron-core adapter's pin: the installed megatron-core is the supported line, every
function, class and field it hooks exists with the signature it expects, and installing a
monitor replaces exactly those (and `close()` puts them back).

An upgrade of megatron-core fails here, naming what moved, before any job records data
that cannot be analysed.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest

from lagscope.producers.megatron_seams import (
    FINALIZE,
    SCHEDULES,
    SEAMS,
    SUPPORTED_SERIES,
    Seam,
    UnsupportedMegatronVersion,
    check_seams,
    check_version,
    installed_version,
    seam_problem,
)
from tests.megatron_jobs.world import megatron_world_of_one  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(
    sys.version_info < (3, 12), reason="megatron-core 0.19 is published for Python >= 3.12 only"
)


def test_installed_megatron_core_is_the_supported_line() -> None:
    version = installed_version()
    assert version is not None, "megatron-core is a test dependency: it must be installed"
    assert check_version() == version
    assert version.startswith(f"{SUPPORTED_SERIES}.")


@pytest.mark.parametrize("seam", SEAMS, ids=lambda seam: seam.where)
def test_every_hooked_seam_is_there_with_the_expected_signature(seam: Seam) -> None:
    assert seam_problem(seam) is None


def test_check_seams_passes_on_the_installed_version() -> None:
    check_seams()


@pytest.mark.parametrize("version", ["0.20.0", "0.18.3", "1.0.0rc1"])
def test_another_release_line_is_refused_naming_both_versions(version: str) -> None:
    with pytest.raises(UnsupportedMegatronVersion) as raised:
        check_version(version)
    message = str(raised.value)
    assert f"megatron-core {version} is installed" in message
    assert f"supports megatron-core {SUPPORTED_SERIES}.x" in message


def test_a_changed_signature_is_named_with_both_parameter_lists() -> None:
    moved = Seam(SCHEDULES, "backward_step", ("input_tensor", "output_tensor", "config"), "test")
    problem = seam_problem(moved)
    assert problem == (
        f"{SCHEDULES}.backward_step takes (input_tensor, output_tensor, output_tensor_grad, "
        "config), expected (input_tensor, output_tensor, config)"
    )


def test_a_missing_function_is_named() -> None:
    problem = seam_problem(Seam(SCHEDULES, "forward_step_v2", ("x",), "test"))
    assert problem is not None and problem.startswith(f"{SCHEDULES}.forward_step_v2 is missing")


def test_a_timer_name_megatron_no_longer_calls_is_named() -> None:
    finalize = next(s for s in SEAMS if s.path == "finalize_model_grads")
    renamed = Seam(FINALIZE, finalize.path, finalize.parameters, "test", ("all-grads-synch",))
    assert seam_problem(renamed) == (
        f"{FINALIZE}.finalize_model_grads no longer calls config.timers('all-grads-synch')"
    )


def test_importing_lagscope_megatron_imports_neither_torch_nor_megatron() -> None:
    code = textwrap.dedent(
        """
        import sys
        import lagscope.megatron
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron"))
        print(heavy)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"


def _hooked_originals() -> dict[tuple[object, str], object]:
    """What the adapter replaces, by (owner, name), as megatron-core has it now."""
    schedules = importlib.import_module(SCHEDULES)
    buckets = importlib.import_module("megatron.core.distributed.param_and_grad_buffer")
    group = buckets._ParamAndGradBucketGroup
    names = [
        "forward_step",
        "backward_step",
        "P2PCommunicator",
        "forward_backward_no_pipelining",
        "forward_backward_pipelining_without_interleaving",
        "forward_backward_pipelining_with_interleaving",
    ]
    originals: dict[tuple[object, str], object] = {
        (schedules, n): vars(schedules)[n] for n in names
    }
    for name in ("start_grad_sync", "finish_grad_sync"):
        originals[(group, name)] = vars(group)[name]
    return originals


@pytest.mark.usefixtures("megatron_world_of_one")
def test_monitor_replaces_exactly_the_listed_seams_and_close_restores_them(tmp_path) -> None:
    import lagscope.megatron
    from lagscope.producers.megatron_p2p import TimedP2P

    schedules = importlib.import_module(SCHEDULES)
    p2p = importlib.import_module("megatron.core.pipeline_parallel.p2p_communication")
    originals = _hooked_originals()
    listed = {(seam.module, seam.path) for seam in SEAMS}
    for owner, name in originals:
        qualified = name if owner is schedules else f"{owner.__name__}.{name}"
        module = SCHEDULES if owner is schedules else owner.__module__
        assert (module, qualified) in listed, f"{module}.{qualified} is hooked but not pinned"

    monitor = lagscope.megatron.monitor(job_id="seams", log_dir=tmp_path, gc_probe=False)
    try:
        for (owner, name), original in originals.items():
            assert vars(owner)[name] is not original, f"{name} was not hooked"
        assert issubclass(schedules.P2PCommunicator, p2p.P2PCommunicator)
        assert issubclass(schedules.P2PCommunicator, TimedP2P)
        # get_forward_backward_func hands out the timed schedules (module globals).
        for pp, vp, name in (
            (1, None, "forward_backward_no_pipelining"),
            (2, None, "forward_backward_pipelining_without_interleaving"),
            (2, 2, "forward_backward_pipelining_with_interleaving"),
        ):
            handed_out = schedules.get_forward_backward_func(pp_size=pp, vp_size=vp)
            assert handed_out is vars(schedules)[name]
            assert handed_out.__wrapped__ is originals[(schedules, name)]
        with pytest.raises(RuntimeError, match="already monitoring this process"):
            lagscope.megatron.monitor(job_id="seams", log_dir=tmp_path)
    finally:
        monitor.close()
    for (owner, name), original in originals.items():
        assert vars(owner)[name] is original, f"{name} was not restored"
