"""Real multi-process torch.distributed jobs (gloo on CPU, 127.0.0.1, free ports) that
record themselves through `lagscope.torch` only, for the tests and for developing the
analysis against real noise.

    python -m tests.torch_jobs.pipeline_1f1b --log-dir /tmp/j --steps 60
    python -m tests.torch_jobs.ddp --log-dir /tmp/d --slow-rank 1 --slow-phase backward \
        --slow-steps 20-39
    python -m tests.torch_jobs.pipelining --log-dir /tmp/p --schedule interleaved
    python -m tests.torch_jobs.comm_kinds --log-dir /tmp/c

then `lagscope run --logs DIR` (or `tests.torch_jobs.harness.analyse(DIR)` in-process).
Every job takes the same knobs (`harness.Knobs`): a straggler (rank, steps, factor, phase:
forward, backward or input), a late sender (rank, steps, ms), the GC probe, sampling.
"""
