"""The optimizer-offload lever in the CP-SAT model (`cpsat._Model`): a boolean per position.

    off[j]            position j keeps its optimizer state on the host
    off[j] <= sum of on[j][c] over the classes that can offload (host figures known)
    ``all``: off[j] >= on[j][c] for each such class
    params[j]         trainable parameters on j: sum_u P_u in_[u][j] + tied replicas' (exact copy literals)
    saved[j] <= host_bytes_per_param * params[j],  saved[j] <= big * off[j]    (taken off every memory row)
    tail >= ticks(O_u on class c) summed over j's units, if off[j] and on[j][c]   (T += tail)

`saved` only relaxes memory, so the solver sets it to its upper bound whenever that helps; the
tail is rounded down like every other time (the model's objective never exceeds the real T).
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
        top = sum(unit_params) + sum(t.state_bytes // rates.state_bytes_per_param for t in prob.tied)
        self.saved, tails = [], []
        for j in range(m.P):
            md.add(self.off[j] <= sum(m.on[j][c] for c in able))
            if prob.offload == "all":
                for c in able:
                    md.add(self.off[j] >= m.on[j][c])
            params = sum(unit_params[u] * m.in_[u][j] for u in range(m.L)) + self._tied_params(j, rates)
            saved = md.new_int_var(0, top * rates.host_bytes_per_param, f"off_saved_j{j}")
            md.add(saved <= rates.host_bytes_per_param * params)
            md.add(saved <= top * rates.host_bytes_per_param * self.off[j])
            self.saved.append(saved)
            tails.append((j, able))
        self.tail = md.new_int_var(0, max(1, self._tail_top(top, able)), "off_tail")
        for j, classes in tails:
            for c in classes:
                per_unit = self._unit_tail_ticks(c, unit_params)
                md.add(self.tail >= sum(per_unit[u] * m.in_[u][j] for u in range(m.L))
                       ).only_enforce_if([self.off[j], m.on[j][c]])

    def _able(self, cls: Any) -> bool:
        dev, rates = self.m.problem.devices[cls.members[0]], self.m.problem.offload_rates
        return dev.host_link_bytes_s > 0 and dev.host_memory_bytes_s > 0 and rates.host_bytes_per_param > 0

    def _unit_tail_ticks(self, c: int, unit_params: list[int]) -> list[int]:
        """Per unit, its share of O on class c in ticks, rounded down (tied replicas' share left out:
        a lower bound, never above the real tail)."""
        dev, rates = self.m.problem.devices[self.m.classes[c].members[0]], self.m.problem.offload_rates
        per_param = rates.link_bytes_per_param / dev.host_link_bytes_s + rates.step_bytes_per_param / dev.host_memory_bytes_s
        return [self.m.ticks(n * per_param) for n in unit_params]

    def _tail_top(self, top: int, able: list[int]) -> int:
        return max((sum(self._unit_tail_ticks(c, [top])) for c in able), default=0)

    def _tied_params(self, j: int, rates: Any) -> Any:
        """Trainable parameters of the tied replicas position j holds (copy = a user here, the owner not)."""
        md, m, total = self.m.model, self.m, 0
        for g, t in enumerate(m.problem.tied):
            users = [u for u in t.user_units if u != t.owner_unit]
            if not users:
                continue
            copy = md.new_bool_var(f"off_tied{g}_j{j}")
            for u in users:
                md.add(copy >= m.in_[u][j] - m.in_[t.owner_unit][j])
            md.add(copy <= sum(m.in_[u][j] for u in users))
            md.add(copy <= 1 - m.in_[t.owner_unit][j])
            total = total + (t.state_bytes // rates.state_bytes_per_param) * copy
        return total


def offload_vars(m: Any) -> OffloadVars | None:
    """The lever on model `m`, or None when its problem cannot offload."""
    prob = m.problem
    if prob.offload == "never" or prob.offload_rates is None or not prob.grad_bytes:
        return None
    return OffloadVars(m)
