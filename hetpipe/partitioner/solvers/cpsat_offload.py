"""The optimizer-offload lever in the CP-SAT model (`cpsat._Model`): a boolean per position.

    off[j]            position j keeps its optimizer state on the host
    off[j] <= sum of on[j][c] over the classes that can offload (host figures known)
    ``all``: off[j] >= on[j][c] for each such class
    copy[g][j]        position j holds a replica of tied group g (a user here, the owner not: exact both ways)
    params[j]         trainable parameters on j: floor(sum_u G_u in_[u][j] / grad bytes per param)
                      + floor(sum_g S_g copy[g][j] / state bytes per param)   (`problem.stage_params`)
    saved[j] <= host_bytes_per_param * params[j],  saved[j] <= big * off[j]    (taken off every memory row)
    tail >= ticks(O on class c) of j's units and of its replicas, if off[j] and on[j][c]   (T += tail)

`saved` only relaxes memory, so the solver sets it to its upper bound whenever that helps; the
tail is rounded down like every other time (the model's objective never exceeds the real T).  The
replicas' parameters are in the tail as in `saved`: a tail of the units' share only (before session 14)
let a replica's stage offload its bytes while paying less than its O_s, so CP-SAT proved OPTIMAL a
placement priced above the contract's optimum (tests/test_cpsat_offload_exact.py).  The tail's per-unit
floors of P_u stay a lower bound where gradient bytes are no multiple of the bytes per parameter
(captured models' always are); `cpsat.solve_cpsat` then reports FEASIBLE if that under-prices its answer.
Extraction re-chooses the levers exactly (`offload_walk.best_levers`).
"""

from __future__ import annotations

from typing import Any


class OffloadVars:
    """The lever's variables on a built `cpsat._Model` `m` (its in_, on, classes, ticks)."""

    def __init__(self, m: Any) -> None:
        md, prob, rates = m.model, m.problem, m.problem.offload_rates
        self.m = m
        unit_params = [g // rates.grad_bytes_per_param for g in prob.grad_bytes]
        able = [c for c, cl in enumerate(m.classes) if self._able(cl)]
        self.off = [md.new_bool_var(f"off_j{j}") for j in range(m.P)]
        top = (sum(prob.grad_bytes) // rates.grad_bytes_per_param
               + sum(t.state_bytes for t in prob.tied) // rates.state_bytes_per_param)
        self.saved, tails = [], []
        for j in range(m.P):
            md.add(self.off[j] <= sum(m.on[j][c] for c in able))
            if prob.offload == "all":
                for c in able:
                    md.add(self.off[j] >= m.on[j][c])
            copies = self._tied_copies(j, rates)
            saved = md.new_int_var(0, top * rates.host_bytes_per_param, f"off_saved_j{j}")
            md.add(saved <= rates.host_bytes_per_param * self._params(j, copies, top))
            md.add(saved <= top * rates.host_bytes_per_param * self.off[j])
            self.saved.append(saved)
            tails.append((j, copies))
        self.tail = md.new_int_var(0, max(1, self._tail_top(top, able)), "off_tail")
        for j, copies in tails:
            for c in able:
                per_unit = self._unit_tail_ticks(c, unit_params)
                per_copy = self._unit_tail_ticks(c, [b // rates.state_bytes_per_param for b, _ in copies])
                md.add(self.tail >= sum(per_unit[u] * m.in_[u][j] for u in range(m.L))
                       + sum(t * copy for t, (_, copy) in zip(per_copy, copies))
                       ).only_enforce_if([self.off[j], m.on[j][c]])

    def _params(self, j: int, copies: list[tuple[int, Any]], top: int) -> Any:
        """P_j as `problem.stage_params` counts it: floor(units' gradient bytes / per parameter) + floor(replicas'
        state bytes / per parameter), each floor an integer variable bounded above (it only relaxes memory)."""
        md, m, rates = self.m.model, self.m, self.m.problem.offload_rates
        own, tied = md.new_int_var(0, top, f"off_params_j{j}"), md.new_int_var(0, top, f"off_tied_params_j{j}")
        md.add(rates.grad_bytes_per_param * own <= sum(m.problem.grad_bytes[u] * m.in_[u][j] for u in range(m.L)))
        md.add(rates.state_bytes_per_param * tied <= sum(b * copy for b, copy in copies))
        return own + tied

    def _able(self, cls: Any) -> bool:
        dev, rates = self.m.problem.devices[cls.members[0]], self.m.problem.offload_rates
        return dev.host_link_bytes_s > 0 and dev.host_memory_bytes_s > 0 and rates.host_bytes_per_param > 0

    def _unit_tail_ticks(self, c: int, unit_params: list[int]) -> list[int]:
        """Per parameter count (a unit's, a replica's), its share of O on class c in ticks, rounded down
        (the sum never above the real tail)."""
        dev, rates = self.m.problem.devices[self.m.classes[c].members[0]], self.m.problem.offload_rates
        per_param = rates.link_bytes_per_param / dev.host_link_bytes_s + rates.step_bytes_per_param / dev.host_memory_bytes_s
        return [self.m.ticks(n * per_param) for n in unit_params]

    def _tail_top(self, top: int, able: list[int]) -> int:
        return max((sum(self._unit_tail_ticks(c, [top])) for c in able), default=0)

    def _tied_copies(self, j: int, rates: Any) -> list[tuple[int, Any]]:
        """(state bytes, copy literal) of each tied group position j may hold a replica of (copy = a user
        here, the owner not)."""
        md, m, copies = self.m.model, self.m, []
        for g, t in enumerate(m.problem.tied):
            users = [u for u in t.user_units if u != t.owner_unit]
            if not users:
                continue
            copy = md.new_bool_var(f"off_tied{g}_j{j}")
            for u in users:
                md.add(copy >= m.in_[u][j] - m.in_[t.owner_unit][j])
            md.add(copy <= sum(m.in_[u][j] for u in users))
            md.add(copy <= 1 - m.in_[t.owner_unit][j])
            copies.append((t.state_bytes, copy))
        return copies


def offload_vars(m: Any) -> OffloadVars | None:
    """The lever on model `m`, or None when its problem cannot offload."""
    prob = m.problem
    if prob.offload == "never" or prob.offload_rates is None or not prob.grad_bytes:
        return None
    return OffloadVars(m)
