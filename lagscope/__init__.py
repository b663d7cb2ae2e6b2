"""lagscope: find stragglers in large-scale LLM training while the job runs.

The public surface is small and stable:

- `lagscope.timer`: `OpTimer`, the per-rank op timer that training code calls;
- the command line, `lagscope --help`.

Everything else (`lagscope.producers`, `lagscope.simulator`, `lagscope.stream_app`,
`lagscope.dashboards`, `lagscope.deploy`) is internal and may change between releases.
Importing `lagscope` itself imports nothing else, so a training process pays for what it
uses and no more.
"""

__version__ = "0.2.0"
