"""The selective recompute level in the CP-SAT model (`cpsat._Model`): a boolean per position (issue 14).

A stage with `Stage.selective` is priced on the problem's selective variant (`cost_models.selective`):
its units' activation and recompute bytes less the level's freed bytes, its backward plus the dropped
nodes' seconds, and the level's peak added to M_s once, at every moment.  The DP takes per stage the
cheaper of its plain and its variant's tables; the model states the same choice:

    sel[j]              position j runs the level (offered under ``recompute="auto"`` only, as the DP)
    plain, variant      two recompute sets (`cpsat_recompute.RecomputeVars`): the plain problem's items,
                        savings and ranking, gated by 1 - sel[j], and the variant's, gated by sel[j];
                        each keeps its own prefix rule, so a stage recomputes a prefix of the order of
                        the problem it is priced on
    freed[j] <= sum_u (A_u - A'_u) in_[u][j],  freed[j] <= big * sel[j]
                        (A'_u the variant's activation bytes; taken off each in-flight micro-batch)
    compute[j] >= F_j + B_j + recompute ticks + sum_u ticks(sel_u) in_[u][j]   if on[j][c] and sel[j]
    every memory row of j: + peak * sel[j]

`freed` only relaxes memory, so the solver sets it to its upper bound whenever that helps (as the
offload lever's `saved`).  Ticks are rounded down per unit like every other time, so the model's
objective never exceeds the T of the same placement and CP-SAT's bound stays valid.  Extraction
re-chooses every lever exactly (`offload_walk.best_levers`, `recompute.choose_levers`).

Example (the level alone fits two units of 30 activation bytes on a 75-byte card; see
tests/test_selective_recompute.py):
    >>> import math
    >>> from hetpipe.cost_models.selective import SelectiveTables
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem
    >>> from hetpipe.partitioner.solvers.cpsat import solve_cpsat
    >>> prob = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (2.0, 2.0)}, state_bytes=(10, 10),
    ...                activation_bytes=(30, 30), boundary_bytes=(4, 0), devices=(DeviceSlot("d0", "a", "n", 75),),
    ...                bandwidth_bytes_s=((math.inf,),), latency_s=((0.0,),), microbatches=2, recompute="auto",
    ...                selective=SelectiveTables((12, 12), 15, {"a": (0.25, 0.25)}), objective="estimate")
    >>> res = solve_cpsat(prob, time_limit_s=5.0, seed=0)
    >>> res.status, res.iteration_s, res.stages[0].selective   # 2 x (2 + 4 + 0.5)
    ('OPTIMAL', 13.0, True)
"""

from __future__ import annotations

from typing import Any

from hetpipe.cost_models.selective import selective_variant
from hetpipe.partitioner.solvers.cpsat_recompute import RecomputeVars

#: One lower bound on compute[j]: (ticks, the literals that enforce it besides the position's class).
TickRow = tuple[Any, list[Any]]


class SelectiveVars:
    """The recompute lever with the selective level on a built `cpsat._Model` `m` (module docstring)."""

    def __init__(self, m: Any) -> None:
        md, prob = m.model, m.problem
        tab, variant = prob.selective, selective_variant(prob)
        self.m, self.peak_bytes = m, int(tab.peak_bytes)
        self.sel = [md.new_bool_var(f"sel_j{j}") for j in range(m.P)]
        self.plain = RecomputeVars(m, gate=lambda j: 1 - self.sel[j])
        self.variant = RecomputeVars(m, variant, gate=lambda j: self.sel[j], tag="rcs")
        # per unit: what the level takes off each in-flight micro-batch (the variant clamps at 0: min(A_u, freed_u))
        cut = [int(a) - int(v) for a, v in zip(prob.activation_bytes, variant.activation_bytes)]
        top = sum(cut)
        self.freed = []
        for j in range(m.P):
            freed = md.new_int_var(0, top, f"sel_freed_j{j}")
            md.add(freed <= sum(cut[u] * m.in_[u][j] for u in range(m.L) if cut[u]))
            md.add(freed <= top * self.sel[j])
            self.freed.append(freed)
        self.level_ticks = {k: [m.ticks(s) for s in tab.extra_s[k]] for k in prob.fwd_s}

    def tick_rows(self, j: int, kind: str) -> list[TickRow]:
        """Lower bounds on compute[j] beyond F_j + B_j on `kind`: the recomputed forwards of either set,
        and with sel[j] the level's dropped nodes too."""
        rc = self.plain.extra_ticks(j, kind) + self.variant.extra_ticks(j, kind)
        level = sum(t * self.m.in_[u][j] for u, t in enumerate(self.level_ticks[kind]) if t)
        return [(rc, []), (rc + level, [self.sel[j]])]

    def top_ticks(self, kind: str) -> int:
        """The most ticks the levers can add to one position on `kind` (the compute variables' horizon)."""
        return self.plain.top_ticks(kind) + sum(self.level_ticks[kind])

    def memory(self, j: int, inflight: int, *, backward: bool = True) -> Any:
        """Bytes the levers change on position j at a moment with `inflight` micro-batches (`RecomputeVars.memory`
        of both sets, the level's freed bytes per micro-batch and its peak once)."""
        return (self.plain.memory(j, inflight, backward=backward) + self.variant.memory(j, inflight, backward=backward)
                - inflight * self.freed[j] + self.peak_bytes * self.sel[j])

    def recomputes(self, j: int) -> Any:
        """A bool: position j recomputes a unit from either set (its backward moments then count)."""
        any_rc = self.m.model.new_bool_var(f"rc_any_j{j}")
        self.m.model.add_max_equality(any_rc, self.plain.literals(j) + self.variant.literals(j) or [0])
        return any_rc


def lever_vars(m: Any) -> RecomputeVars | SelectiveVars | None:
    """The recompute lever of model `m`: none, whole units (`RecomputeVars`), or with the selective level
    where the problem offers it under ``auto`` (as the DP and `recompute.selective_choices` do)."""
    prob = m.problem
    if prob.recompute == "none":
        return None
    if prob.recompute == "auto" and prob.selective is not None:
        return SelectiveVars(m)
    return RecomputeVars(m)
