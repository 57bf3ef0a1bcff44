"""What a pipeline rank holds, in bytes: parameters, gradients, optimizer state, saved activations, messages.

`HeldBytes` counts unique storages (a view or a tensor saved twice is one
allocation) by category after every action; the executor feeds it the tensors
autograd saves (``saved_tensors_hooks``), each micro-batch's stage inputs and
outputs, and posted receive buffers and outgoing gradients.  Parameters and buffers
("static" storages) are counted once as ``params``, never as activations.

Example:
    >>> import torch
    >>> w = torch.zeros(4)
    >>> held = HeldBytes({w.untyped_storage().data_ptr()})
    >>> act = torch.ones(8)
    >>> held.add(0, [act, act[:2], w])   # bytes added: a view and a parameter add nothing more
    32
    >>> held.add_known(1, 32)            # micro-batch 1 holds what micro-batch 0 did
    >>> held.observe()["activations"]
    64
    >>> held.release(0); held.release(1)
    >>> held.totals["activations"], held.peaks["activations"]
    (0, 64)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping, Sequence

import torch

MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations", "comm")


def storage_key(t: torch.Tensor) -> tuple[int, int] | None:
    """(data pointer, bytes) of the storage behind ``t``; None when it has no plain storage."""
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse / nested tensors have no plain storage
        return None
    return st.data_ptr(), st.nbytes()


@dataclass
class HeldBytes:
    """Accounting of held bytes by `MEMORY_CATEGORIES` (mutable; one per executor)."""

    static_ptrs: set[int]
    totals: dict[str, int] = field(default_factory=lambda: dict.fromkeys(MEMORY_CATEGORIES, 0))
    saved: dict[int, dict[int, int]] = field(default_factory=dict)  # micro-batch -> storage ptr -> bytes
    comm_held: dict[Any, int] = field(default_factory=dict)
    peaks: dict[str, int] = field(default_factory=lambda: {"activations": 0, "comm": 0, "total": 0})
    _owner: dict[int, int] = field(default_factory=dict, repr=False)  # storage ptr -> micro-batch holding it

    def add(self, mb: int, tensors: Sequence[torch.Tensor], *, received: Sequence[torch.Tensor] = ()) -> int:
        """Count the storages of ``tensors`` as micro-batch ``mb``'s activations (each storage once).

        ``received``: tensors viewed in a received message frame; that storage counts as its
        tensors' bytes, like the message buffers (`set_comm`): the frame's header and padding
        are the wire format's, not the model's.  Returns the bytes this call added.
        """
        held, added = self.saved.setdefault(mb, {}), 0
        frames: dict[int, int] = {}
        for t in received:
            key = storage_key(t)
            if key:
                frames[key[0]] = frames.get(key[0], 0) + t.numel() * t.element_size()
        for t in [*received, *tensors]:
            key = storage_key(t) if isinstance(t, torch.Tensor) else None
            if key and key[0] not in self.static_ptrs and key[0] not in self._owner:
                held[key[0]] = frames.get(key[0], key[1])
                self._owner[key[0]] = mb
                added += held[key[0]]
        self.totals["activations"] += added
        return added

    def add_retained(self, mb: int, tensors: Sequence[torch.Tensor], *, frames: Sequence[torch.Tensor] = ()) -> int:
        """Count what a split backward keeps from B to W as micro-batch ``mb``'s (each storage once).

        ``frames``: the received gradient tensors; one that a kept tensor views (W reads the received
        gradient itself) counts as its tensors' bytes, like `add`'s ``received``; the others were freed.

        Example (W keeps a view of the received 16 bytes and an 8-byte gradient of its own):
            >>> held = HeldBytes(set())
            >>> got, other = torch.ones(4), torch.ones(2)
            >>> held.add_retained(0, [got.view(2, 2), torch.zeros(2)], frames=[got, other])
            24
        """
        ptrs = {k[0] for k in map(storage_key, tensors) if k}
        kept = [t for t in frames if (k := storage_key(t)) and k[0] in ptrs]
        return self.add(mb, tensors, received=kept)

    def add_known(self, mb: int, num_bytes: int) -> None:
        """Count ``num_bytes`` as micro-batch ``mb``'s activations without looking at storages.

        For a micro-batch whose forward is known to hold what an earlier, identical one
        held (``add``'s return value); released by `release` like the rest.
        """
        held = self.saved.setdefault(mb, {})
        key = -1 - len(held)  # never a real data pointer
        held[key] = num_bytes
        self.totals["activations"] += num_bytes

    def release(self, mb: int) -> None:
        """Micro-batch ``mb``'s backward is done: its activations are freed."""
        for ptr in self.saved.get(mb, {}):
            self._owner.pop(ptr, None)
        self.totals["activations"] -= sum(self.saved.pop(mb, {}).values())

    def set_comm(self, key: Any, num_bytes: int | None) -> None:
        if num_bytes is None:
            self.comm_held.pop(key, None)
        else:
            self.comm_held[key] = num_bytes
        self.totals["comm"] = sum(self.comm_held.values())

    def observe(self) -> Mapping[str, int]:
        """Update the peaks; returns a read-only live view of the totals (copy it to keep it)."""
        totals, peaks = self.totals, self.peaks
        peaks["activations"] = max(peaks["activations"], totals["activations"])
        peaks["comm"] = max(peaks["comm"], totals["comm"])
        peaks["total"] = max(peaks["total"], sum(totals.values()))
        return self._view

    def __post_init__(self) -> None:
        self._view = MappingProxyType(self.totals)


def grad_bytes(params: Sequence[torch.nn.Parameter]) -> int:
    """Bytes of the gradients the parameters hold now."""
    return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors (Adam's moments appear after its first step).

    Adam's per-parameter ``step`` counter is left out: torch keeps it on the CPU unless the
    optimizer is capturable or fused, so it takes no device memory.  An optimizer that keeps its
    state on the host (`hetpipe.runtime.stage.offload.HostOffloadOptimizer`) holds none on the card.
    """
    if getattr(optimizer, "keeps_state_on_host", False):
        return 0
    return sum(v.numel() * v.element_size() for state in optimizer.state.values() for k, v in state.items()
               if isinstance(v, torch.Tensor) and not (k == "step" and v.dim() == 0))
