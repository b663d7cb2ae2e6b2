"""The data loader's waits in a job run by `lagscope launch`, without the loader in hand.

`lagscope.torch.monitor(data=loader)` times the loader it is given. A job run unchanged
gives none, and its loop's iterator exists before the monitor does (the loop started it
in step 0), so the hook sits where every torch `DataLoader` iterator gets its next
batch: `_BaseDataLoaderIter.__next__`, which HF Accelerate's and PyTorch Lightning's
fetchers call too. Until the monitor starts it notes which datasets are read with
gradients on (the training data; an evaluation loop runs under `no_grad`); then the
batches of those datasets are `input-wait` ops of the step that waited for them, and
any other loader's pay one attribute check.
"""

from __future__ import annotations

import time
from typing import Any

from lagscope.producers.torch_hooks import INPUT_WAIT, record_input_wait

_perf_ns = time.perf_counter_ns


class InputWaits:
    """The hook on every data loader iterator of this process; `remove()` undoes it."""

    def __init__(self) -> None:
        import torch
        from torch.utils.data import dataloader

        self.monitor: Any = None
        #: id() of the datasets read with gradients on before the monitor started.
        self.training_datasets: set[int] = set()
        self._iterator_class = cls = dataloader._BaseDataLoaderIter
        self._original = original = cls.__dict__["__next__"]
        self._step = -1
        self._count = 0
        self._code = -1
        datasets = self.training_datasets
        grad_enabled = torch.is_grad_enabled
        state = self

        def __next__(iterator: Any) -> Any:
            monitor = state.monitor
            if monitor is None:
                if grad_enabled():
                    datasets.add(id(iterator._dataset))
                return original(iterator)
            if not monitor.active or id(iterator._dataset) not in datasets:
                return original(iterator)
            start = _perf_ns()
            item = original(iterator)
            record_input_wait(state, monitor, start, _perf_ns())
            return item

        __next__.__wrapped__ = original  # type: ignore[attr-defined]
        cls.__next__ = __next__

    def start(self, monitor: Any) -> None:
        """Record the training data's waits into `monitor` (a `Monitor`) from now on."""
        self._code = monitor.timer.code_of(INPUT_WAIT)
        self.monitor = monitor

    def remove(self) -> None:
        self.monitor = None
        self._iterator_class.__next__ = self._original
