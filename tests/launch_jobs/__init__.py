"""Training scripts as their users write them, without a line of lagscope, for the tests
of `lagscope launch` (tests/test_launch_jobs.py): each is run as a user runs it (torchrun,
a script that spawns its ranks, PyTorch Lightning's own launcher) and takes its straggler
from its own arguments (`straggler.py`, a sibling module the scripts import as
`straggler`: a script's folder is first on its path).

    lagscope launch --follow -- python -m torch.distributed.run --standalone \
        --nproc-per-node 2 tests/launch_jobs/ddp_train.py --slow-rank 1 --slow-steps 15-29
"""
