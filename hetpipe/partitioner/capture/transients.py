"""The bytes a backward allocates beyond what the memory ledger holds (memory model 4's transient term).

The runtime's ledger (`hetpipe.runtime.execute.held`) counts parameters, gradients, optimizer
state, each in-flight micro-batch's saved activations and the messages; inside a backward the
allocator also holds the gradients autograd computes on the way, live at once until the next
node consumes them.  On an H200 (benchmarks/results/gpu_check.md) the cross-entropy's backward
was the whole excess: ``torch.cuda.max_memory_allocated`` over a one-stage step exceeded the
ledger by exactly 2 x the logits bytes (gpt2-small/medium 4 x 1024 tokens: 2 x 785.3 MiB;
llama-1b 1 x 2048: 2 x 1002.0 MiB): the gradient of the log-probabilities and that of the
logits, both logits-sized and alive at once (``nll_loss_backward`` then ``_log_softmax_backward_data``).

`BackwardPeak` measures it on meta: a `TorchDispatchMode` that counts every storage an op
allocates while it is active (views and in-place results share their input's storage and add
nothing) and releases it when its last tensor is collected (a weak reference per tensor: autograd
keeps the C++ tensor and with it the Python object alive while it needs it), and records the
largest sum of live bytes.  The loss's backward runs under it in `measure.measure_loss`; what it
returns is `LossCosts.transient_bwd_bytes`, added to the last unit (`liveness.with_loss`).

Example (cross-entropy over 4 x 10 logits, fp32: 2 x 160 bytes, and the 4-byte seed of
``loss.backward()``):
    >>> import torch.nn.functional as F
    >>> logits = torch.empty(4, 10, device="meta", requires_grad=True)
    >>> loss = F.cross_entropy(logits, torch.zeros(4, dtype=torch.long, device="meta"))
    >>> with BackwardPeak("fp32") as peak:
    ...     loss.backward()
    >>> peak.peak_bytes
    324
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hetpipe.cost_models.activations import storage_bytes, storage_key


class BackwardPeak(TorchDispatchMode):
    """Largest live bytes of the storages allocated while active (`peak_bytes`; module docstring)."""

    def __init__(self, precision: str) -> None:
        super().__init__()
        self.precision = precision
        self.peak_bytes = 0
        self._live_bytes = 0
        self._refs: dict[int, int] = {}  # storage key -> tensors alive on it
        self._sizes: dict[int, int] = {}  # storage key -> its bytes in `precision`

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self._live_bytes -= self._sizes.pop(key)

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        key = storage_key(t)
        if key in inputs and key not in self._refs:
            return  # a view or an in-place result of a tensor made before the mode: nothing new
        if key not in self._refs:
            self._refs[key], self._sizes[key] = 0, storage_bytes(t, self.precision)
            self._live_bytes += self._sizes[key]
            self.peak_bytes = max(self.peak_bytes, self._live_bytes)
        self._refs[key] += 1
        weakref.finalize(t, self._release, key)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {storage_key(a) for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out
