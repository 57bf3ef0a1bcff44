"""Optimizer-state offload on a running stage: the optimizer's state and step live in host memory.

A stage the plan marks ``offload`` (`hetpipe.cost_models.offload`) wraps its optimizer in
`HostOffloadOptimizer`: the inner optimizer is built over *host copies* of the stage's
parameters (fp32 master weights; pinned memory where CUDA is present, so the copies can be
asynchronous DMA), and each step

1. copies every gradient device -> host into the host copy's ``.grad``,
2. steps the inner optimizer there (its moments are host tensors, never on the card),
3. copies the updated host weights back host -> device.

On a CPU-only machine the device IS the host: the same three steps run (the state lives in a
separate CPU tensor set, the gradients are copied out, the weights copied back), so the code
path a GPU run takes is the one the tests exercise.  The arithmetic is the inner optimizer's on
bitwise copies, so the result equals the plain optimizer's (tests/test_offload_runtime.py).

The wrapper looks like the inner optimizer where the runtime needs it: ``state`` is keyed by
the *device* parameters (checkpoints save and restore the offloaded state by parameter name,
`hetpipe.runtime.checkpoint.state`), ``param_groups`` are the inner ones (learning-rate
schedules), and ``keeps_state_on_host`` tells the memory ledger (`execute.held.optimizer_bytes`)
that none of it is on the card.

Example:
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> opt = HostOffloadOptimizer([w], lambda ps: torch.optim.SGD(ps, lr=0.5))
    >>> w.grad = torch.full((3,), 2.0)
    >>> opt.step(); w.tolist()
    [0.0, 0.0, 0.0]
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, MutableMapping, Sequence

import torch
from torch import nn


def _host_copy(p: torch.Tensor) -> nn.Parameter:
    """A host copy of `p` (pinned where CUDA is present: the copies back can then be DMA)."""
    host = p.detach().to("cpu", copy=True)
    if torch.cuda.is_available():
        host = host.pin_memory()
    return nn.Parameter(host, requires_grad=p.requires_grad)


class _StateByDeviceParam(MutableMapping):
    """The inner optimizer's state, keyed by the device parameters instead of the host copies."""

    def __init__(self, owner: "HostOffloadOptimizer") -> None:
        self._owner = owner

    def _host(self, param: Any) -> nn.Parameter:
        return self._owner.host_of[id(param)]

    def __getitem__(self, param: Any) -> Any:
        return self._owner.inner.state[self._host(param)]

    def __setitem__(self, param: Any, value: Any) -> None:  # a checkpoint restore: the values to the host
        self._owner.inner.state[self._host(param)] = {
            k: v.to("cpu") if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in value.items()}

    def __delitem__(self, param: Any) -> None:
        del self._owner.inner.state[self._host(param)]

    def __iter__(self) -> Iterator[Any]:
        return (p for p, h in zip(self._owner.params, self._owner.host) if h in self._owner.inner.state)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class HostOffloadOptimizer:
    """`make(host_params)` stepped in host memory for `params` on the device (module docstring)."""

    keeps_state_on_host = True  # `execute.held.optimizer_bytes`: nothing of it is on the card

    def __init__(self, params: Sequence[nn.Parameter], make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
        self.params = list(params)
        self.host = [_host_copy(p) for p in self.params]
        self.host_of = {id(p): h for p, h in zip(self.params, self.host)}
        self.inner = make(self.host)
        self.state = _StateByDeviceParam(self)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """Gradients device -> host, the inner step on the host, weights host -> device."""
        for p, h in zip(self.params, self.host):
            h.grad = None if p.grad is None else p.grad.detach().to("cpu", copy=True)
        self.inner.step()
        for p, h in zip(self.params, self.host):
            p.copy_(h, non_blocking=h.is_pinned())
        if any(p.is_cuda for p in self.params):
            torch.cuda.synchronize()  # the next forward reads the weights: the copies must be done
        for h in self.host:
            h.grad = None  # the host gradient copy is transient

    @torch.no_grad()
    def reload_weights(self) -> None:
        """Weights device -> host copies: after the device parameters were replaced (a checkpoint
        restored into the stage), the host copies the next step updates must be those values."""
        for p, h in zip(self.params, self.host):
            h.copy_(p.detach())

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
