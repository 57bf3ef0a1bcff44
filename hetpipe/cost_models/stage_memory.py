"""M_s: the bytes one pipeline stage holds at its peak under the runtime's 1F1B (torch-free).

The single formula behind the optimisation contract's memory constraint:
`hetpipe.partitioner.problem.stage_memory_bytes` calls it, the DP and CP-SAT solvers
encode the same terms, and the runtime's memory ledger (`hetpipe.runtime.execute.held`)
counts the same things on a running stage: tests/test_memory_truth.py compares the two.
"""

from __future__ import annotations

#: Receives a pipeline rank posts ahead of the action that needs them (the runtime's
#: ``PipelineExecutor`` prefetch depth on NCCL, and on gloo when ranks outnumber cores).
#: Each holds a receive buffer of its cut's bytes from the moment it is posted.
RECV_PREFETCH = 3


def pipeline_stage_bytes(*, state_bytes: int, activation_bytes: int, in_bytes: int, out_bytes: int,
                         inflight: int, first: bool, recompute_saved_bytes: int = 0,
                         recompute_peak_bytes: int = 0) -> int:
    """Bytes a 1F1B pipeline stage holds at its peak: M_s of the optimisation contract.

    ``M_s = state + k·(A − saved_R + in + out) + peak_R + (RECV_PREFETCH + 1)·max(in, out)
    + [s = 0]·(k − 1)·out``

    * ``state``: parameters, gradients and optimizer state of its units (and tied replicas);
    * ``k = min(p − s, m)`` micro-batches in flight, each holding what autograd saves in
      the stage's units (``A``), the received input frame (``in``, the cut before: the
      runtime keeps it until the micro-batch's backward to read its gradient) and the
      stage's output (``out``, the cut after: autograd's root for the backward);
    * communication buffers: up to `RECV_PREFETCH` receive buffers posted ahead plus one
      send or received gradient not yet released, each at most the larger cut;
    * the first stage also keeps every warm-up activation send (``k − 1`` more) until its
      first receive (a rank waits for its sends at its next receive).

    * recomputed units R (`hetpipe.cost_models.recompute`): each in-flight micro-batch keeps
      only their inputs, ``saved_R = Σ_{u∈R} (A_u − in_u)`` less, and one recomputed unit's
      activations live again during its backward, ``peak_R = max_{u∈R} A_u``, once.

    ``in_bytes`` is 0 for the first stage, ``out_bytes`` 0 for the last.

    Example:
        >>> pipeline_stage_bytes(state_bytes=1000, activation_bytes=100, in_bytes=10, out_bytes=10,
        ...                      inflight=2, first=False)     # 1000 + 2*(100+10+10) + 4*10
        1280
        >>> pipeline_stage_bytes(state_bytes=1000, activation_bytes=100, in_bytes=0, out_bytes=10,
        ...                      inflight=3, first=True)      # 1000 + 3*110 + 4*10 + 2*10
        1390
        >>> pipeline_stage_bytes(state_bytes=1000, activation_bytes=100, in_bytes=10, out_bytes=10,
        ...                      inflight=2, first=False, recompute_saved_bytes=60,
        ...                      recompute_peak_bytes=70)     # 1000 + 2*(40+10+10) + 70 + 4*10
        1230
    """
    held = inflight * (activation_bytes - recompute_saved_bytes + in_bytes + out_bytes) + recompute_peak_bytes
    buffers = (RECV_PREFETCH + 1) * max(in_bytes, out_bytes) + (inflight - 1 if first else 0) * out_bytes
    return state_bytes + held + buffers
