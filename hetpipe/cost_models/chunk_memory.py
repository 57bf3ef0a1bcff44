"""M of a rank that holds several chunks (interleaved virtual stages): the contract's M_s summed per moment.

A rank of ``interleaved:V`` holds V chunks, each with its own state, activations and cuts.  Its
peak is **not** the sum of the chunks' own peaks: at each moment t of the rank's action list
(`hetpipe.schedule.held_virtual.rank_held_terms`: one `HeldCounts` per chunk) it holds

    Σ_c (state_c − G_c) + max_t Σ_c [ g_{t,c} G_c + k_{t,c} (A_c − saved_c + in_c + out_c) + i_{t,c} in_c
                                     + i'_{t,c} in'_c + o_{t,c} out_c + o'_{t,c} out'_c ]  (+ peak_c inside
                                     chunk c's backward when c recomputes)

which is `pipeline_stage_bytes`'s formula with every term per chunk (one chunk: the same number).
The rank steps all its chunks' parameters with one optimizer (`runtime.interleaved_run`: one
optimizer over the stage's parameters), so its step moment (memory model 5) holds Σ_c state_c plus
Σ_c step_list_c (the foreach list over every parameter) + max_c step_tensor_c (one tensor at a time).

Example (two chunks; two micro-batches in flight in each, then one in each with gradients):
    >>> a = ChunkTerms(state_bytes=1000, grad_bytes=250, activation_bytes=100, in_bytes=0, out_bytes=10)
    >>> b = ChunkTerms(state_bytes=500, grad_bytes=100, activation_bytes=50, in_bytes=10, out_bytes=0)
    >>> held = ((HeldCounts(0, 2, out_frames=1), HeldCounts(0, 2, in_frames=1)),
    ...         (HeldCounts(1, 1), HeldCounts(1, 1)))
    >>> pipeline_rank_bytes((a, b), held)   # 750 + 400 + max(220 + 10 + 120 + 10, 250 + 110 + 100 + 60)
    1670
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hetpipe.cost_models.stage_memory import HeldCounts


@dataclass(frozen=True)
class ChunkTerms:
    """One chunk's (or stage's) terms of M, in bytes (see `pipeline_stage_bytes` for each)."""

    state_bytes: int
    activation_bytes: int
    in_bytes: int
    out_bytes: int
    grad_bytes: int = 0
    in_grad_bytes: int | None = None  # None: the whole input cut
    out_grad_bytes: int | None = None  # None: the whole output cut
    recompute_saved_bytes: int = 0
    recompute_peak_bytes: int = 0
    weight_grad_bytes: int = 0  # split schedules: what one micro-batch keeps from B to W
    transient_bwd_bytes: int = 0  # memory model 4: the most a unit's backward allocates beyond the ledger
    step_list_bytes: int = 0  # memory model 5: the foreach step's list over the chunk's parameters
    step_tensor_bytes: int = 0  # memory model 5: the per-tensor step's temporaries of its largest tensor

    def moment_bytes(self, c: HeldCounts) -> int:
        """What the chunk holds beyond state - G at a moment with counts `c` (recompute peak excluded)."""
        in_grad = self.in_bytes if self.in_grad_bytes is None else self.in_grad_bytes
        out_grad = self.out_bytes if self.out_grad_bytes is None else self.out_grad_bytes
        per_mb = self.activation_bytes - self.recompute_saved_bytes + self.in_bytes + self.out_bytes
        return c.bytes(grad_bytes=self.grad_bytes, per_microbatch=per_mb, in_bytes=self.in_bytes, in_grad=in_grad,
                       out_bytes=self.out_bytes, out_grad=out_grad, weight_grad=self.weight_grad_bytes)


def pipeline_rank_bytes(chunks: Sequence[ChunkTerms], held: Sequence[Sequence[HeldCounts]]) -> int:
    """Bytes a rank holding `chunks` holds at its peak over the moments `held` (module docstring)."""
    peak = None
    for moment in held:
        inside = [i for i, c in enumerate(moment) if c.backward]
        extra = sum(chunks[i].recompute_peak_bytes + chunks[i].transient_bwd_bytes for i in inside)
        if inside and extra <= 0:  # a backward moment matters only where a recompute or a transient adds to it
            continue
        total = sum(t.moment_bytes(c) for t, c in zip(chunks, moment)) + extra
        peak = total if peak is None else max(peak, total)
    step = sum(t.grad_bytes + t.step_list_bytes for t in chunks) + max((t.step_tensor_bytes for t in chunks), default=0)
    return sum(t.state_bytes - t.grad_bytes for t in chunks) + max(peak or 0, step)
