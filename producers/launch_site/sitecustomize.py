"""Imported by Python at the start of every process of a job run by `lagscope launch`
(this folder is first on the job's PYTHONPATH; `lagscope.producers.injection`).

It installs the automatic monitor, which waits for torch or megatron-core to be imported
and costs nothing before; then it runs the `sitecustomize` module this one hides, if the
job's environment has one. Nothing here may stop the job: a failure is one line on
stderr and the job runs unrecorded.
"""

import os
import sys


def _install() -> None:
    if os.environ.get("LAGSCOPE_LAUNCH") != "1":
        return
    try:
        from lagscope.producers import auto_monitor
    except Exception as exc:  # lagscope not importable by this interpreter
        print(
            f"lagscope launch: {sys.executable} cannot import lagscope ({exc}); this process "
            "runs unrecorded",
            file=sys.stderr,
        )
        return
    auto_monitor.install()


def _run_the_hidden_sitecustomize() -> None:
    """The environment's own sitecustomize (a distribution's, a site's), which this file
    shadows on the path: found further along the path and run as it would have been."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


_install()
_run_the_hidden_sitecustomize()
