"""What one rank holds during a step, keyed by (virtual stage, micro-batch).

A plain pipeline rank has one stage, so its keys differ only in the micro-batch; a rank of an
interleaved plan holds several chunks (`hetpipe.runtime.execute.chunks.RankStages`) and the same
micro-batch is in flight on several of them at once (its forward on chunk 1 before its backward on
chunk 0), hence the virtual stage in every key.

Example:
    >>> st = StepState()
    >>> st.forward_s[(2, 0)] = 0.5; st.forward_s[(0, 0)] = 0.25
    >>> st.per_microbatch(st.forward_s, 1)
    (0.75,)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

#: (virtual stage, micro-batch)
Key = tuple[int, int]


def key(action: Any) -> Key:
    """The (virtual stage, micro-batch) an F/B/W/SEND/RECV action works on."""
    return action.stage, action.microbatch


@dataclass
class StepState:
    """One step's tensors in flight and timings (mutable; a fresh one per step)."""

    inputs: dict[Key, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    outputs: dict[Key, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    losses: dict[Key, torch.Tensor] = field(default_factory=dict)
    loss_values: list[torch.Tensor] = field(default_factory=list)
    received: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    grads_in: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    grads_out: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    pending_w: dict[Key, Any] = field(default_factory=dict)  # `split_backward.PendingWeight` per B awaiting W
    forward_s: dict[Key, float] = field(default_factory=dict)
    backward_s: dict[Key, float] = field(default_factory=dict)
    comm_wait_s: float = 0.0
    grad_norm: float | None = None

    @staticmethod
    def per_microbatch(seconds: dict[Key, float], microbatches: int) -> tuple[float, ...]:
        """Seconds per micro-batch summed over the rank's chunks (one term for a plain stage)."""
        out = [0.0] * microbatches
        for (_, mb), s in seconds.items():
            out[mb] += s
        return tuple(out)
