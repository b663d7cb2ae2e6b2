"""lagscope: find stragglers in large-scale LLM training while the job runs.

The public surface is small and stable:

- `lagscope.torch`: `monitor(...)`, one call that records a torch.distributed job;
- `lagscope.megatron`: `monitor(...)`, the same at megatron-core's own seams;
- `lagscope.timer`: `OpTimer`, the per-rank op timer for call sites you time yourself;
- the command line, `lagscope --help`.

Everything else (`lagscope.producers`, `lagscope.simulator`, `lagscope.stream_app`,
`lagscope.store`, `lagscope.dashboards`, `lagscope.deploy`, and `lagscope.cli`, the command
line's code) is internal and may change between releases.
Importing `lagscope` itself imports nothing else, so a training process pays for what it
uses and no more.
"""

__version__ = "0.4.0"
