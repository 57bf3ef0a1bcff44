"""The recomputation lever in the CP-SAT model (`cpsat._Model`): a prefix of each stage's order.

A stage recomputes the first r units of its order (`cost_models.recompute`), the order of
its device kind's keys (saved bytes per recompute second), where its first unit's key uses
no input bytes.  So every unit has two *items*, its key as a stage's first unit (F) and as
a later unit (N), and per kind one ranking of all items (key descending, ties by unit
index; items that save nothing are left out).  A stage's order is that ranking restricted
to the items that apply to it, so a prefix of the order is "every applicable item ranked
above a threshold":

    z[j][kind][t]          threshold chain of position j: z[t+1] -> z[t] (items 0..t-1 are in)
    rc[item][j]            the item's unit is recomputed on position j
    rc -> applicable       F: u is position j's first unit; N: u is on j but not first
    rc & on(kind) -> z[t]  only items above the threshold ...
    z[t] & on(kind) & applicable -> rc     ... and all of them (a prefix, nothing skipped)

``all`` fixes rc = applicable; ``none`` builds nothing.  With the selective level (`cpsat_selective`)
a position's prefix is drawn from one of two such sets: the plain problem's and, built on its selective
variant (its own items, savings and ranking), the variant's; a ``gate`` per position says which may act.  The model adds each recomputed
unit's forward ticks to compute[j], takes sum (A_u - in_u) rc off each in-flight
micro-batch and adds peak[j] >= A_u rc once (`pipeline_stage_bytes`).  The optimum picks
the smallest fitting prefix by itself up to ties in rounded ticks; `cpsat` re-chooses it
exactly with `recompute.with_recompute` on extraction.
"""

from __future__ import annotations

import math
from typing import Any

from ortools.sat.python import cp_model

#: One recompute item: (unit, is the stage's first unit, saved bytes per micro-batch).
Item = tuple[int, bool, int]


def _items(prob: Any) -> list[Item]:
    out: list[Item] = []
    for u in range(prob.num_units):
        a = int(prob.unit_recompute_bytes[u])
        if a > 0:
            out.append((u, True, a))
        if u > 0 and a - int(prob.boundary_bytes[u - 1]) > 0:
            out.append((u, False, a - int(prob.boundary_bytes[u - 1])))
    return out


def _ranking(prob: Any, kind: str, items: list[Item]) -> list[int]:
    """Item indices in the kind's order (saved bytes per forward second, descending; ties by unit)."""
    def key(i: int) -> tuple[float, int]:
        u, _, saved = items[i]
        f = float(prob.fwd_s[kind][u])
        return (-(saved / f) if f > 0 else -math.inf, u)
    return sorted(range(len(items)), key=key)


class RecomputeVars:
    """The lever's variables on a built `cpsat._Model` `m` (its in_, last, on, classes)."""

    def __init__(self, m: Any, problem: Any = None, *, gate: Any = None, tag: str = "rc") -> None:
        """The lever on `m` for `problem` (default `m.problem`; the selective variant's, `cpsat_selective`);
        `gate(j)` (a 0/1 expression, None = always 1) says whether position j may recompute from this set."""
        self.m, md, P = m, m.model, m.P
        self.prob, self.tag = (m.problem if problem is None else problem), tag
        prob = self.prob
        self.items = _items(prob)
        first = [[self._first(u, j) for j in range(P)] for u in range(m.L)]
        self.rc = [[md.new_bool_var(f"{tag}_i{i}_j{j}") for j in range(P)] for i in range(len(self.items))]
        for i, (u, is_first, _) in enumerate(self.items):
            for j in range(P):
                appl = first[u][j] if is_first else m.in_[u][j] - first[u][j]
                if prob.recompute == "all":
                    md.add(self.rc[i][j] == appl)
                else:
                    md.add(self.rc[i][j] <= appl)
                if gate is not None:  # only the set the position's level chose (`cpsat_selective`)
                    md.add(self.rc[i][j] <= gate(j))
        if prob.recompute == "auto":
            self._prefixes(first)

    def _first(self, u: int, j: int) -> Any:
        """1 iff unit u opens position j's stage (unit 0 opens the first stage)."""
        m = self.m
        if u == 0:
            return m.in_[0][j]
        return m.last[u - 1][j + 1] if j + 1 < m.P else 0

    def _prefixes(self, first: list[list[Any]]) -> None:
        m, md = self.m, self.m.model
        kinds = sorted({c.kind for c in m.classes})
        for kind in kinds:
            rank = _ranking(self.prob, kind, self.items)
            for j in range(m.P):
                on = sum(m.on[j][c] for c, cl in enumerate(m.classes) if cl.kind == kind)
                z = [md.new_bool_var(f"{self.tag}_prefix_{kind}_j{j}_t{t}") for t in range(len(rank))]
                for t in range(len(rank) - 1):
                    md.add(z[t + 1] <= z[t])  # a threshold: ranks 0..t-1 in, the rest out
                for t, i in enumerate(rank):
                    u, is_first, _ = self.items[i]
                    appl = first[u][j] if is_first else m.in_[u][j] - first[u][j]
                    md.add(self.rc[i][j] + on - 1 <= z[t])  # recomputed -> above the threshold
                    md.add(z[t] + on + appl - 2 <= self.rc[i][j])  # above it and applicable -> recomputed

    def extra_ticks(self, j: int, kind: str) -> Any:
        """Forward ticks the recomputed units of position j add on `kind`."""
        prob = self.prob
        return sum(self.m.ticks(prob.fwd_s[kind][u]) * self.rc[i][j] for i, (u, _, _) in enumerate(self.items))

    def tick_rows(self, j: int, kind: str) -> list[tuple[Any, list[Any]]]:
        """Lower bounds on compute[j] beyond F_j + B_j on `kind` (as `cpsat_selective.SelectiveVars.tick_rows`)."""
        return [(self.extra_ticks(j, kind), [])]

    def top_ticks(self, kind: str) -> int:
        """The most ticks recomputation can add to one position on `kind`: every unit's forward once more."""
        return sum(self.m.ticks(f) for f in self.prob.fwd_s[kind])

    def memory(self, j: int, inflight: int, *, backward: bool = True) -> Any:
        """Bytes recomputation changes on position j at a moment with `inflight` micro-batches: - k * sum
        saved, plus the one-off peak inside a backward (`backward`)."""
        md, prob = self.m.model, self.prob
        saved = sum(s * self.rc[i][j] for i, (_, _, s) in enumerate(self.items))
        if not backward:
            return -inflight * saved
        top = max((int(a) for a in prob.unit_recompute_bytes), default=0)
        peak = md.new_int_var(0, top, f"{self.tag}_peak_j{j}")
        for i, (u, _, _) in enumerate(self.items):
            md.add(peak >= int(prob.unit_recompute_bytes[u]) * self.rc[i][j])
        return peak - inflight * saved

    def recomputes(self, j: int) -> Any:
        """A bool: position j recomputes some unit (its backward moments then count, `pipeline_stage_bytes`)."""
        any_rc = self.m.model.new_bool_var(f"{self.tag}_any_j{j}")
        self.m.model.add_max_equality(any_rc, self.literals(j) or [0])
        return any_rc

    def literals(self, j: int) -> list[Any]:
        """Position j's recompute literals, one per item."""
        return [self.rc[i][j] for i in range(len(self.items))]

    def units(self, solver: cp_model.CpSolver, j: int) -> tuple[int, ...]:
        return tuple(sorted(u for i, (u, _, _) in enumerate(self.items) if solver.value(self.rc[i][j])))
