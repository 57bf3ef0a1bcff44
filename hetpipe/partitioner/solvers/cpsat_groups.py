"""CP-SAT with tensor-parallel group variables (issue 15): cuts, groups, leads and order together.

The model searches what the group DP (`group_dp.solve_groups`) searches: pipelines whose stages
run on disjoint candidate groups (`group_dp.candidate_groups`: each card alone, or 2..group_max
cards of one node), every cut, every lead, every order, under the estimate
S + (m - 1) b (T_est less the offload tail, which `offload_walk.tail_walk` walks around it, as
for the DP).  A group's price is not additive over units (its shares come from the whole run's
water filling, its integer parts from largest remainder), so the model reads the DP's own tables
(`group_dp.GroupTablesDP.band`): per member set, position and unit range [lo, hi], F_s + B_s,
inf where it does not fit.  Width-1 stages carry their recompute / offload / selective levers
through the same tables (the pipeline DP's `StageTables`).  So CP-SAT and the DP optimise one
objective over one set of placements, which `tests/test_tp_cpsat.py` checks against brute force.

Positions are numbered from the end (j = 0: the last stage), so a stage's position is its
stages-after count, which its memory and in-flight count depend on.  Variables (P positions,
K member sets, L units, n cards):

    span[j][lo, hi]   position j holds units [lo, hi] (only ranges some set can run there)
    on[j][k]          position j runs on member set k (a card alone is a set of one)
    lead[j][d]        card d leads position j: it exchanges the cuts with the neighbouring leads
    active[j]         = sum span[j] = sum on[j]; positions form a prefix 0..p-1
    compute[j]        >= ticks(k, j, lo, hi) * span[j][lo, hi] when on[j][k]   (F_j + B_j)
    comm[j]           >= 2 C over the cut after hi_j, lead j -> lead j-1        (j >= 1)
    bottleneck        = max of every compute[j] and comm[j]
Objective: sum compute + sum comm + (m - 1) bottleneck (ticks).  ``bound_only``: minimise the
largest compute[j] alone (links left out), whose proved bound times m bounds T under the schedule
(every rank runs its m forwards and backwards in series: `tp_solve.group_bound`).

Times are integer ticks, rounded DOWN (`TICKS_PER_ENTRY` for the largest entry), so CP-SAT's
bound is a valid lower bound; every answer is re-evaluated by `problem.evaluate`.  A hint (the
group DP's answer, or the pipeline-only one beyond the DP's reach) caps every stage and round
trip at its S + (m - 1) b over m (a better placement has m b <= S + (m - 1) b, since S >= b).

Where it stops: the model has P x K x (unit ranges) terms, K growing as C(node cards, group_max)
x group_max; `MAX_MODEL_TERMS` bounds it (`GroupSpaceTooLarge` above), and the tables are priced
within the caller's deadline like the DP's.

Example (two equal cards; a group of both halves each unit's split work):
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem
    >>> from hetpipe.partitioner.tp_tables import BlockSplit, UnitSplit
    >>> blk = BlockSplit(parts=8, fwd_flops=1, allreduce_bytes=0, activation_bytes=0)
    >>> inf = float("inf")
    >>> prob = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (2.0, 2.0)}, state_bytes=(1, 1),
    ...                activation_bytes=(1, 1), boundary_bytes=(100, 0),
    ...                devices=(DeviceSlot("d0", "a", "n", 100), DeviceSlot("d1", "a", "n", 100)),
    ...                bandwidth_bytes_s=((inf, 10.0), (10.0, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)),
    ...                microbatches=4, tensor_parallel=(UnitSplit(3, 1.0, 1.0, (blk,)),) * 2, group_max=2)
    >>> res = solve_cpsat_groups(prob, time_limit_s=10.0, seed=0)
    >>> res.status, res.iteration_s, [(sorted(s.members), s.first_unit, s.last_unit) for s in res.stages]
    ('OPTIMAL', 12.0, [([0, 1], 0, 1)])
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Sequence

from ortools.sat.python import cp_model

from hetpipe.partitioner.problem import Problem, Stage, evaluate
from hetpipe.partitioner.recompute import with_recompute
from hetpipe.partitioner.solvers.cap_walk import walk_value_s
from hetpipe.partitioner.solvers.cpsat import DEFAULT_WORKERS, CpSatResult
from hetpipe.partitioner.solvers.group_dp import GroupSpaceTooLarge, GroupTablesDP, candidate_groups

log = logging.getLogger(__name__)

#: Ticks given to the largest stage time or round trip in the model: each term is resolved to
#: 1e-7 of it, as `cpsat.TICKS_PER_T` resolves T (at most one tick lost per term, 2P + m terms: within the
#: 1e-5 relative tolerance the CP-SAT tests allow).  Not finer: at 1e9 ticks OR-Tools 9.15's presolve
#: returned a wrong OPTIMAL (68.85 s where 62.82 s was feasible) on `tests/test_tp_solver._instance(0)`.
TICKS_PER_ENTRY = 10**7
#: Terms (position x member set x unit range) above which the model is not built.  One CP-SAT
#: term costs ~100 bytes in the model proto and more in the presolve: 2e6 terms ~ a few GB.
MAX_MODEL_TERMS = 2_000_000
#: Relative slack on the hint's cap (floating-point ties with the hint itself).
CAP_SLACK = 1e-9

Span = tuple[int, int]  # (first unit, last unit), inclusive


@dataclass(frozen=True)
class PositionTables:
    """Per position j and member set k: the seconds of each unit range set k may run at j."""

    sets: tuple[tuple[int, ...], ...]  # member sets, sorted cards; a set of one is a width-1 stage
    costs: dict[tuple[int, int], dict[Span, float]]  # (j, k) -> {(lo, hi): F + B seconds}
    round_trip_s: tuple[tuple[tuple[float, ...], ...], ...]  # [a][b][u]: 2 C over the cut after u, a -> b

    @property
    def positions(self) -> int:
        return 1 + max((j for j, _ in self.costs), default=-1)

    def terms(self) -> int:
        return sum(len(v) for v in self.costs.values())


def position_tables(problem: Problem, *, cap: float = math.inf, cost_cache: dict | None = None,
                    deadline: float = math.inf) -> PositionTables:
    """The group DP's stage costs per (position, member set, range) under `cap` (module docstring).

    Raises `GroupSpaceTooLarge` when pricing passes `deadline` or the model would exceed `MAX_MODEL_TERMS`.
    """
    groups = candidate_groups(problem)
    index: dict[tuple[int, ...], int] = {}
    for g, members in enumerate(groups):  # one group per member set: the lead does not change F + B
        index.setdefault(tuple(sorted(members)), g)
    tab = GroupTablesDP(problem, groups, cost_cache, deadline)
    L, n = problem.num_units, len(problem.devices)
    sets = tuple(index)
    costs: dict[tuple[int, int], dict[Span, float]] = {}
    total = 0
    for j in range(min(L, n)):
        for k, members in enumerate(sets):
            band = tab.band(index[members], j, cap)
            finite = {(lo, lo + w): float(band[lo, w]) for lo in range(L) for w in range(L - lo)
                      if math.isfinite(band[lo, w])}
            if finite:
                costs[(j, k)] = finite
                total += len(finite)
        if total > MAX_MODEL_TERMS:
            raise GroupSpaceTooLarge(f"the CP-SAT group model has more than {MAX_MODEL_TERMS} terms "
                                     f"({len(sets)} member sets x {L} units)")
    trips = tuple(tuple(tuple(2.0 * problem.comm_s(a, b, u) if a != b else 0.0 for u in range(L))
                        for b in range(n)) for a in range(n))
    return PositionTables(sets, costs, trips)


class _GroupModel:
    """The model of the module docstring over `PositionTables`; one method per constraint family."""

    def __init__(self, problem: Problem, tables: PositionTables, *, cap: float, bound_only: bool = False) -> None:
        self.problem, self.tables, self.bound_only = problem, tables, bound_only
        self.L, self.n, self.P = problem.num_units, len(problem.devices), max(tables.positions, 1)
        top = max([c for v in tables.costs.values() for c in v.values()]
                  + [t for row in tables.round_trip_s for col in row for t in col if t <= cap] + [1e-30])
        self.scale = TICKS_PER_ENTRY / top
        self.cap_ticks = self.ticks(cap) + 1 if math.isfinite(cap) else self.ticks(top) + 1
        self.model = cp_model.CpModel()
        self._variables()
        self._placement()
        self._path()
        self._compute()
        if not bound_only:
            self._comm()
        self._objective()

    def ticks(self, seconds: float) -> int:
        return int(math.floor(seconds * self.scale))

    def _variables(self) -> None:
        md, t = self.model, self.tables
        self.span = [{s: md.new_bool_var(f"span_j{j}_{s[0]}_{s[1]}")
                      for s in sorted({s for (jj, _), v in t.costs.items() if jj == j for s in v})}
                     for j in range(self.P)]
        self.on = [{k: md.new_bool_var(f"on_j{j}_k{k}") for (jj, k) in t.costs if jj == j} for j in range(self.P)]
        self.lead = [[md.new_bool_var(f"lead_j{j}_d{d}") for d in range(self.n)] for j in range(self.P)]
        self.active = [md.new_bool_var(f"active_j{j}") for j in range(self.P)]

    def _placement(self) -> None:
        md, sets = self.model, self.tables.sets
        for j in range(self.P):
            # A position holds one member set and one range iff it is used; used positions form a prefix.
            md.add(sum(self.on[j].values()) == self.active[j])
            md.add(sum(self.span[j].values()) == self.active[j])
            # Its lead is one of its members.
            md.add(sum(self.lead[j]) == self.active[j])
            for d in range(self.n):
                md.add(self.lead[j][d] <= sum(v for k, v in self.on[j].items() if d in sets[k]))
        md.add(self.active[0] == 1)
        for j in range(self.P - 1):
            md.add(self.active[j] >= self.active[j + 1])
        # Each card is in at most one stage's group.
        for d in range(self.n):
            md.add(sum(v for j in range(self.P) for k, v in self.on[j].items() if d in sets[k]) <= 1)

    def ends(self, j: int, u: int) -> cp_model.LinearExpr | int:
        """1 iff position j's stage ends with unit u."""
        return sum(v for (lo, hi), v in self.span[j].items() if hi == u)

    def starts(self, j: int, u: int) -> cp_model.LinearExpr | int:
        return sum(v for (lo, hi), v in self.span[j].items() if lo == u)

    def _path(self) -> None:
        md = self.model
        # The last stage ends with the last unit; every other range ends just before the next position's.
        md.add(self.ends(0, self.L - 1) == 1)
        for j in range(1, self.P):
            for u in range(1, self.L):
                md.add(self.ends(j, u - 1) == self.starts(j - 1, u))
        # Redundant: every unit lies in exactly one stage.
        for u in range(self.L):
            md.add(sum(v for j in range(self.P) for (lo, hi), v in self.span[j].items() if lo <= u <= hi) == 1)

    def _compute(self) -> None:
        md = self.model
        self.compute = [md.new_int_var(0, self.cap_ticks, f"compute_j{j}") for j in range(self.P)]
        for j in range(self.P):
            fastest: dict[Span, int] = {}
            for k, on in self.on[j].items():
                row = self.tables.costs[(j, k)]
                ticks = {s: self.ticks(c) for s, c in row.items()}
                # F_j + B_j of the range on set k at position j (the DP's table, levers included).
                md.add(self.compute[j] >= sum(t * self.span[j][s] for s, t in ticks.items())).only_enforce_if(on)
                # Ranges the set cannot run here (memory, or beyond the cap) are not allowed with it.
                barred = [v for s, v in self.span[j].items() if s not in row]
                if barred:
                    md.add(sum(barred) == 0).only_enforce_if(on)
                for s, t in ticks.items():
                    fastest[s] = min(fastest.get(s, t), t)
            # Redundant: never below the fastest set's time for the range (tightens the relaxation).
            md.add(self.compute[j] >= sum(t * self.span[j][s] for s, t in fastest.items()))

    def _comm(self) -> None:
        md, trips = self.model, self.tables.round_trip_s
        self.comm = [md.new_int_var(0, self.cap_ticks, f"comm_j{j}") for j in range(self.P)]
        md.add(self.comm[0] == 0)
        for j in range(1, self.P):
            ends = [self.ends(j, u) for u in range(self.L - 1)]
            for a in range(self.n):
                for b in range(self.n):
                    if a == b:
                        continue
                    # Round trip over the cut after position j's last unit, lead j -> lead j-1.
                    terms = [self.ticks(trips[a][b][u]) * ends[u] for u in range(self.L - 1)]
                    md.add(self.comm[j] >= sum(terms)).only_enforce_if([self.lead[j][a], self.lead[j - 1][b]])

    def _objective(self) -> None:
        md, m = self.model, self.problem.microbatches
        self.bottleneck = md.new_int_var(0, self.cap_ticks, "bottleneck")
        if self.bound_only:
            md.add_max_equality(self.bottleneck, self.compute)
            md.minimize(self.bottleneck)
            return
        md.add_max_equality(self.bottleneck, self.compute + self.comm)
        md.minimize(sum(self.compute) + sum(self.comm) + (m - 1) * self.bottleneck)

    def hint(self, stages: Sequence[Stage]) -> None:
        """Seed the search with a placement (front to back) whose ranges the tables hold."""
        md, p = self.model, len(stages)
        at = {p - 1 - s: st for s, st in enumerate(stages)}
        for j in range(self.P):
            st = at.get(j)
            members = tuple(sorted(st.members or (st.device,))) if st else None
            md.add_hint(self.active[j], st is not None)
            for s, v in self.span[j].items():
                md.add_hint(v, st is not None and s == (st.first_unit, st.last_unit))
            for k, v in self.on[j].items():
                md.add_hint(v, self.tables.sets[k] == members)
            for d in range(self.n):
                md.add_hint(self.lead[j][d], st is not None and st.device == d)

    def extract(self, solver: cp_model.CpSolver) -> tuple[Stage, ...]:
        """The placement front to back, each width-1 stage's levers chosen as the DP chooses them."""
        plain = []
        for j in range(self.P - 1, -1, -1):
            if not solver.value(self.active[j]):
                continue
            lo, hi = next(s for s, v in self.span[j].items() if solver.value(v))
            members = self.tables.sets[next(k for k, v in self.on[j].items() if solver.value(v))]
            lead = next(d for d in range(self.n) if solver.value(self.lead[j][d]))
            group = (lead, *(d for d in members if d != lead)) if len(members) > 1 else ()
            plain.append(Stage(lead, lo, hi, members=group))
        return with_recompute(self.problem, tuple(plain))


def hint_cap_s(problem: Problem, hint: Sequence[Stage] | None) -> float:
    """The largest stage time or round trip a placement better than `hint` can have: its
    S + (m - 1) b over m (S >= b); inf without a hint that fits."""
    if hint is None:
        return math.inf
    ev = evaluate(problem, hint, objective="estimate")
    if not ev.fits:
        return math.inf
    return walk_value_s(problem, hint)[0] / problem.microbatches * (1.0 + CAP_SLACK)


def solve_cpsat_groups(problem: Problem, *, time_limit_s: float, seed: int, hint: Sequence[Stage] | None = None,
                       workers: int = DEFAULT_WORKERS, cost_cache: dict | None = None,
                       deadline: float = math.inf) -> CpSatResult:
    """The best placement over cuts, groups, leads and orders by CP-SAT (module docstring).

    `hint` seeds the search and caps the tables (it must fit `problem` as given, offload cap
    included); `deadline` (a `time.perf_counter()` value) bounds the pricing; `time_limit_s` the
    pricing and the search together (the search gets at least 0.01 s).  Raises
    `GroupSpaceTooLarge` when the tables or the model are too large.
    """
    start = time.perf_counter()
    cap = hint_cap_s(problem, hint)
    tables = position_tables(problem, cap=cap, cost_cache=cost_cache, deadline=deadline)
    if not tables.costs:
        return CpSatResult(None, "INFEASIBLE", math.inf, math.inf, time.perf_counter() - start)
    built = _GroupModel(problem, tables, cap=cap)
    if hint is not None and math.isfinite(cap):
        built.hint(hint)
    solver = _solver(time_limit_s - (time.perf_counter() - start), seed, workers)  # the pricing took its share
    code = solver.solve(built.model)
    status, wall = solver.status_name(code), time.perf_counter() - start
    log.info("CP-SAT groups: %s after %.2f s (%d terms, %d member sets)", status, wall, tables.terms(),
             len(tables.sets))
    if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        stages = built.extract(solver)
        bound = solver.best_objective_bound / built.scale
        return CpSatResult(stages, status, evaluate(problem, stages, objective="estimate").iteration_s, bound, wall)
    if code == cp_model.INFEASIBLE and math.isfinite(cap):  # nothing beats the hint: it is optimal
        return CpSatResult(tuple(hint or ()), "OPTIMAL", evaluate(problem, hint, objective="estimate").iteration_s,
                           walk_value_s(problem, hint)[0], wall)
    return CpSatResult(None, status, math.inf, math.inf if code == cp_model.INFEASIBLE else 0.0, wall)


def cpsat_group_bottleneck_s(problem: Problem, *, time_limit_s: float, seed: int, cost_cache: dict | None = None,
                             deadline: float = math.inf) -> float:
    """A lower bound on the least max_s (F_s + B_s) over every placement, groups included (0.0 if
    CP-SAT proves nothing): CP-SAT's proved bound on the ``bound_only`` model."""
    tables = position_tables(problem, cost_cache=cost_cache, deadline=deadline)
    if not tables.costs:
        return 0.0
    built = _GroupModel(problem, tables, cap=math.inf, bound_only=True)
    solver = _solver(time_limit_s, seed, DEFAULT_WORKERS)
    code = solver.solve(built.model)
    if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return max(0.0, solver.best_objective_bound / built.scale)
    return 0.0


def _solver(time_limit_s: float, seed: int, workers: int) -> cp_model.CpSolver:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, float(time_limit_s))
    solver.parameters.random_seed = int(seed)
    solver.parameters.num_workers = workers
    return solver
