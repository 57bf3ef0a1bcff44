"""The optimizer step's moment in the CP-SAT model (memory model 5; `cpsat._Model`): one row per position and class.

    params[j]   = sum_u step_param_bytes[u] in_[u][j] + sum_g step_bytes_g copy[g][j]      (P_j, linear)
    largest[j] >= step_tensor_bytes[u] in_[u][j],  >= step_bytes_g copy[g][j]               (only where a kind needs it)
    state_j + G_j + levers_j(0 micro-batches) + a_c params[j] + b_c largest[j] <= usable_c
                                                  if on[j][c] and not off[j]

with (a_c, b_c) the step's multiples on class c's kind (`Problem.step_transient`,
`hetpipe.cost_models.step_transient`); levers_j at no micro-batch in flight is the selective level's
peak where it runs (`SelectiveVars.memory`), 0 for whole-unit recomputation.  ``largest`` only appears
with a positive coefficient in rows it must satisfy, so the least value the solver can pick is the max
(as `cpsat.transient_vars`).  An offloading position steps on its host (`problem.stage_step_transient`):
no row.  The tied copies are `cpsat._Model._tied_copies`' literals (exact where a row pushes on them).
"""

from __future__ import annotations

from typing import Any, Sequence


def step_rows(m: Any, j: int, held: Any, copies: Sequence[tuple[Any, Any]]) -> None:
    """Add position j's step rows to model `m` (module docstring); ``held`` = state_j + G_j + the levers' bytes
    at no micro-batch in flight, ``copies`` = (TiedCopy, copy literal) of the tied groups j may replicate."""
    prob, md = m.problem, m.model
    rules = [(c, prob.step_transient.get(cl.kind)) for c, cl in enumerate(m.classes)]
    rules = [(c, r) for c, r in rules if r is not None and (r.list_multiple or r.tensor_multiple)]
    if not rules:
        return
    per_unit = prob.step_param_bytes or (0,) * m.L
    params = sum(int(b) * m.in_[u][j] for u, b in enumerate(per_unit) if b) + sum(
        t.step_bytes * copy for t, copy in copies if t.step_bytes)
    largest = _largest(m, j, copies) if any(r.tensor_multiple for _, r in rules) else 0
    gate = [m.offload.off[j].Not()] if m.offload is not None else []
    for c, rule in rules:
        md.add(held + rule.list_multiple * params + rule.tensor_multiple * largest <= m.classes[c].usable_bytes
               ).only_enforce_if([m.on[j][c], *gate])


def _largest(m: Any, j: int, copies: Sequence[tuple[Any, Any]]) -> Any:
    """An integer variable >= the bytes of every stepped tensor position j holds (its units' largest, replicas)."""
    table = m.problem.step_tensor_bytes or (0,) * m.L
    top = max([int(b) for b in table] + [t.step_bytes for t, _ in copies], default=0)
    largest = m.model.new_int_var(0, top, f"step_largest_j{j}")
    for u, b in enumerate(table):
        if b:
            m.model.add(largest >= int(b) * m.in_[u][j])
    for t, copy in copies:
        if t.step_bytes:
            m.model.add(largest >= t.step_bytes * copy)
    return largest
