"""M_s: the bytes one pipeline stage holds at its peak under the runtime's 1F1B (torch-free).

The single formula behind the optimisation contract's memory constraint:
`hetpipe.partitioner.problem.stage_memory_bytes` calls it, the DP and CP-SAT solvers
encode the same terms, and the runtime's memory ledger (`hetpipe.runtime.execute.held`)
counts the same things on a running stage: tests/test_memory_truth.py compares the two.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass
from typing import Sequence

#: Version of the memory model (the terms of M_s and what the per-unit tables mean); plans
#: record it (`Plan.memory_model`) and `hetpipe check` refuses to compare across versions.
#: 1: every unit's activation_bytes counted each storage it saves, so a storage saved by two
#:    units of a stage, or a saved stage input or output, counted twice.
#: 2: a storage a micro-batch keeps counts once, in the unit that produces it, and the held
#:    share of the output cut (``boundary_held_bytes``) is counted in out_s only; messages and
#:    gradients at the moments the runtime's action list holds them (`HeldCounts`); split
#:    schedules also hold the gradients W reads (`HeldCounts.weight_grads`, plan version 5 tables:
#:    a split plan without them prices them 0, as before).
#: 3: a split (zero-bubble) backward's gradients kept from B to W (`Unit.weight_grad_bytes`) counted,
#:    a middle stage's received gradient freed at B; interleaved send frames held until the second
#:    RECV after them.  1F1B / GPipe stages are priced as in 2 (`SAME_AS_PREVIOUS`).
#: 4: inside a backward, the most bytes one of the stage's units allocates there beyond the ledger
#:    (``transient_bwd_bytes``: `Unit.transient_bwd_bytes`, the loss's 2 x logits measured on an H200);
#:    plans of model 3 lack the tables (0) and price as 4 does.
#: 5: the optimizer step's moment: parameters, gradients and optimizer state plus U_s, what the step
#:    allocates at once (`hetpipe.cost_models.step_transient`: Adam's foreach 1 x the stepped parameter
#:    bytes, its per-tensor loop at most 3 x the largest tensor); plans of models 3 and 4 lack the tables (0)
#:    and price as 5 does (`PRICED_AS_CURRENT`).
MEMORY_MODEL = 5
#: Plans of these memory models price every stage as `MEMORY_MODEL` does (their transient tables are 0).
PRICED_AS_CURRENT = (3, 4)
#: Plans of memory model 2 whose schedule is neither split nor interleaved price their stages as 3 does.
SAME_AS_PREVIOUS = 2

#: Receives a pipeline rank posts ahead of the action that needs them (the runtime's
#: ``PipelineExecutor`` prefetch depth on NCCL, and on gloo when ranks outnumber cores).
#: Each holds a receive buffer of its cut's bytes from the moment it is posted.
RECV_PREFETCH = 3


@dataclass(frozen=True, order=True)
class HeldCounts:
    """What a pipeline rank holds after one of its actions, in multiples of its stage's sizes.

    ``grads``: the parameter gradients exist (0 before the step's first backward: the runtime
    frees them at every step's start); ``microbatches`` in flight, each holding ``A + in +
    out``; messages of the input cut (``in_frames``: activation receives posted ahead;
    ``in_grad_frames``: gradient sends not yet waited for) and of the output cut
    (``out_frames``: activation sends not yet waited for; ``out_grad_frames``: gradient
    receives posted ahead and received gradients kept until their backward); ``weight_grads``
    micro-batches between a split backward's B and W, each keeping the gradients W reads.
    `hetpipe.schedule.held` replays the runtime's action lists to find them.
    """

    grads: int
    microbatches: int
    in_frames: int = 0
    in_grad_frames: int = 0
    out_frames: int = 0
    out_grad_frames: int = 0
    backward: int = 0  # 1: inside a backward, where a recomputed unit's activations live again
    weight_grads: int = 0  # split backward: micro-batches past their B, before their W (what W reads)

    def dominated_by(self, other: HeldCounts) -> bool:
        return self.backward == other.backward and all(a <= b for a, b in zip(astuple(self), astuple(other)))

    def bytes(self, *, grad_bytes: int, per_microbatch: int, in_bytes: int, in_grad: int, out_bytes: int,
              out_grad: int, weight_grad: int = 0) -> int:
        return (self.grads * grad_bytes + self.microbatches * per_microbatch + self.in_frames * in_bytes
                + self.in_grad_frames * in_grad + self.out_frames * out_bytes + self.out_grad_frames * out_grad
                + self.weight_grads * weight_grad)


def pipeline_stage_bytes(*, state_bytes: int, grad_bytes: int = 0, activation_bytes: int, in_bytes: int, out_bytes: int,
                         held: Sequence[HeldCounts], in_grad_bytes: int | None = None, out_grad_bytes: int | None = None,
                         recompute_saved_bytes: int = 0, recompute_peak_bytes: int = 0, weight_grad_bytes: int = 0,
                         transient_bwd_bytes: int = 0, step_list_bytes: int = 0, step_tensor_bytes: int = 0) -> int:
    """Bytes a pipeline stage holds at its peak: M_s of the optimisation contract.

    ``M_s = state - G + max_t (g_t·G + k_t·(A - saved_R + in + out) + i_t·in + i'_t·in' + o_t·out + o'_t·out'
    + w_t·Wg [+ peak_R + T_s inside a backward], G + U_s)``

    over the moments ``t`` of one training step (``held``: `hetpipe.schedule.held.stage_held_terms`):

    * ``state``: parameters, gradients, optimizer state and buffers of its units (and tied
      replicas); ``G`` of it are parameter gradients, which exist only from the step's
      first backward (``grad_bytes`` 0: counted at every moment, an upper bound);
    * ``k_t`` micro-batches in flight (1F1B: at most min(p - s, m)), each holding what its
      backward needs: ``A`` (`hetpipe.partitioner.problem.stage_activation_bytes`), the
      received input frame ``in`` (the cut before; 0 on the first stage) and the output
      ``out`` (the cut after: autograd's root; 0 on the last stage);
    * messages of the cuts' sizes -- ``in``/``out`` for activations, ``in'``/``out'`` for
      gradients (the cut's tensors that require grad; default: the whole cut): receive
      buffers posted up to `RECV_PREFETCH` actions ahead, a received gradient kept until its
      backward, every send's copy until the rank waits for it (at its next receive);
    * recomputed units R (`hetpipe.cost_models.recompute`): each in-flight micro-batch keeps
      only their inputs, ``saved_R = Σ_{u∈R} (A_u − in_u)`` less, and one recomputed unit's
      activations live again inside a backward, ``peak_R = max_{u∈R} A_u``: the moments ``t``
      inside a backward (``HeldCounts.backward``) count, plus ``peak_R``, only when R is not empty;
    * split (zero-bubble) schedules: ``w_t`` micro-batches past their B and before their W, each
      keeping ``Wg`` (``weight_grad_bytes``: the sum of its units' `Unit.weight_grad_bytes`, the
      gradients W's matmuls read; 0 on the first stage, whose W is its whole backward);
    * backward transients (memory model 4): ``T_s = max_u transient_bwd_bytes[u]`` over the stage's
      units, what a unit's backward allocates at once beyond the terms above (the LM loss: the
      gradients of the log-probabilities and of the logits, 2 x logits bytes); the moments inside a
      backward count, plus ``peak_R + T_s``, when that sum is > 0 (an upper bound where the recomputed
      unit with the largest A_u is not the one with the largest transient);
    * the optimizer step (memory model 5): state and gradients only (sends waited for), plus U_s =
      ``step_list_bytes + step_tensor_bytes`` (`hetpipe.cost_models.step_transient`; 0 where it offloads).

    Example (a middle stage of 3 and the first, 4 micro-batches):
        >>> mid = (HeldCounts(1, 2, 1, 0, 1, 2), HeldCounts(1, 1, 2, 1, 0, 1))
        >>> pipeline_stage_bytes(state_bytes=1000, grad_bytes=250, activation_bytes=100, in_bytes=10,
        ...                      out_bytes=20, out_grad_bytes=16, held=mid)  # 1000 + 2*130 + 10 + 20 + 2*16
        1322
        >>> first = (HeldCounts(1, 3, out_frames=1, out_grad_frames=3), HeldCounts(0, 3, out_frames=3, out_grad_frames=3))
        >>> pipeline_stage_bytes(state_bytes=1000, grad_bytes=250, activation_bytes=100, in_bytes=0,
        ...                      out_bytes=10, held=first)          # 750 + max(250 + 330 + 40, 330 + 60)
        1370
        >>> last = (HeldCounts(0, 1), HeldCounts(1, 1, backward=1))  # the last stage: a forward, then its backward
        >>> kw = dict(state_bytes=1000, grad_bytes=250, activation_bytes=100, in_bytes=10, out_bytes=0, held=last)
        >>> pipeline_stage_bytes(**kw, transient_bwd_bytes=64), pipeline_stage_bytes(**kw, step_list_bytes=300)
        (1174, 1300)
    """
    in_grad = in_bytes if in_grad_bytes is None else in_grad_bytes
    out_grad = out_bytes if out_grad_bytes is None else out_grad_bytes
    sizes = dict(grad_bytes=grad_bytes, per_microbatch=activation_bytes - recompute_saved_bytes + in_bytes + out_bytes,
                 in_bytes=in_bytes, in_grad=in_grad, out_bytes=out_bytes, out_grad=out_grad, weight_grad=weight_grad_bytes)
    peak = max(c.bytes(**sizes) for c in held if not c.backward)
    inside = recompute_peak_bytes + transient_bwd_bytes
    if inside > 0:  # inside a backward that recomputes or allocates transients
        peak = max([peak] + [c.bytes(**sizes) + inside for c in held if c.backward])
    return state_bytes - grad_bytes + max(peak, grad_bytes + step_list_bytes + step_tensor_bytes)  # and the step
