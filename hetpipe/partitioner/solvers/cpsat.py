"""CP-SAT model of the pipeline-partitioning contract (`problem.evaluate`).

Positions are numbered from the END of the pipeline: position j = 0 is the last
stage, j = p - 1 the first.  That makes 1F1B's in-flight count of a stage,
min(j + 1, m), a constant per position, so memory is linear.  A position is given
a device *class* (`dp.device_classes`: same kind, node, memory and links), never a
particular device, so identical cards create no symmetric solutions.

Variables (L units, P = min(L, #devices) positions, C classes):
    on[j][c]     position j runs on a device of class c
    active[j]    position j is used (the pipeline has p = sum_j active[j] stages)
    in_[u][j]    unit u belongs to the stage at position j
    pos[u]       = sum_j j * in_[u][j]; positions fall by 0 or 1 from unit to unit
    cut[u]       = pos[u] - pos[u+1]: a stage ends after unit u
    last[u][j]   = in_[u][j] AND cut[u]: unit u ends the stage at j, a cut follows
    compute[j]   F_j + B_j in ticks; comm[j] the round trip 2*C of the cut after j+1 ... j
    bottleneck   max of every compute[j] and comm[j]
Objective: sum_j compute[j] + sum_j comm[j] + (m - 1) * bottleneck (ticks).
Recomputation (`Problem.recompute` auto/all): `cpsat_recompute.RecomputeVars`, a prefix of each
position's recompute order, its forward ticks in compute[j] and its bytes in the memory rows; with the
selective level (`Problem.selective`, under auto) `cpsat_selective.SelectiveVars`: a boolean per
position choosing the plain or the variant's prefix, its seconds and bytes.
Optimizer offload (`Problem.offload` auto/all): `cpsat_offload.OffloadVars`, a boolean per
position, its bytes off every memory row and max_j O_j added to the objective.
Backward transients (memory model 4): `transient_vars`, T_j >= each unit's transient on j, in every
backward moment's row, enforced where j recomputes or holds a unit with a transient.
The optimizer step's moment (memory model 5): `cpsat_step.step_rows`, a row per class on its kind's U.

Times are integers: seconds * `scale`, rounded DOWN, so the model's objective never
exceeds the true T of the same placement and CP-SAT's best bound stays a valid lower
bound.  Every solution is re-evaluated in floating point by `problem.evaluate`; an OPTIMAL whose
re-evaluated T exceeds the objective by more than the rounding can explain (`rounding_slack_ticks`)
is reported FEASIBLE, with the bound (the model then under-priced something the contract charges).

Example:
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem
    >>> inf = float("inf")
    >>> prob = Problem(fwd_s={"a": (1.0,) * 4}, bwd_s={"a": (2.0,) * 4}, state_bytes=(1,) * 4,
    ...                activation_bytes=(1,) * 4, boundary_bytes=(0,) * 4,
    ...                devices=(DeviceSlot("d0", "a", "n", 100), DeviceSlot("d1", "a", "n", 100)),
    ...                bandwidth_bytes_s=((inf, 1.0), (1.0, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)),
    ...                microbatches=4)
    >>> res = solve_cpsat(prob, time_limit_s=5.0, seed=0)
    >>> res.status, res.iteration_s
    ('OPTIMAL', 30.0)
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Sequence

from ortools.sat.python import cp_model

from hetpipe.partitioner.solvers.cpsat_offload import offload_vars
from hetpipe.partitioner.solvers.cpsat_selective import lever_vars
from hetpipe.partitioner.solvers.offload_walk import best_levers
from hetpipe.partitioner.solvers.dp import DeviceClass, device_classes
from hetpipe.partitioner.problem import Problem, Stage, TiedCopy, evaluate
from hetpipe.partitioner.solvers.cpsat_step import step_rows
from hetpipe.schedule.held import position_held_terms

log = logging.getLogger(__name__)

#: Ticks per iteration-time upper bound: times are resolved to 1e-7 of T (see module doc).
TICKS_PER_T = 10**7
#: CP-SAT search workers; the reference VM has 2 cores (DEVELOPERS.md).
DEFAULT_WORKERS = 2


@dataclass(frozen=True)
class CpSatResult:
    """What CP-SAT returned, re-evaluated in floating point."""

    stages: tuple[Stage, ...] | None
    status: str  # OPTIMAL | FEASIBLE | INFEASIBLE | UNKNOWN | MODEL_INVALID
    iteration_s: float  # evaluate() of `stages`; inf when none
    bound_s: float  # CP-SAT's best objective bound, in seconds (a valid lower bound on T)
    wall_s: float


class _Model:
    """Builds the model of the module docstring; one method per constraint family."""

    def __init__(self, problem: Problem, classes: Sequence[DeviceClass], scale: float) -> None:
        self.problem, self.classes, self.scale = problem, tuple(classes), scale
        self.L, self.m = problem.num_units, problem.microbatches
        self.P = min(self.L, len(problem.devices))
        self.model = cp_model.CpModel()
        self._variables()
        self._placement()
        self._unit_order()
        self.levers = lever_vars(self)  # recomputation (`cpsat_recompute`), with the selective level (`cpsat_selective`)
        self.offload = offload_vars(self)  # `cpsat_offload`: None when the problem cannot offload
        self._compute_times()
        self._comm_times()
        self._memory()
        self._objective()

    def ticks(self, seconds: float) -> int:
        return int(math.floor(seconds * self.scale))

    def _variables(self) -> None:
        md, L, P, C = self.model, self.L, self.P, len(self.classes)
        self.on = [[md.new_bool_var(f"on_j{j}_c{c}") for c in range(C)] for j in range(P)]
        self.active = [md.new_bool_var(f"active_j{j}") for j in range(P)]
        self.in_ = [[md.new_bool_var(f"in_u{u}_j{j}") for j in range(P)] for u in range(L)]
        self.pos = [md.new_int_var(0, P - 1, f"pos_u{u}") for u in range(L)]
        self.cut = [md.new_bool_var(f"cut_u{u}") for u in range(L - 1)]
        self.last = [[md.new_bool_var(f"last_u{u}_j{j}") for j in range(P)] for u in range(L - 1)]

    def _placement(self) -> None:
        md = self.model
        # A position holds at most one class; it is active iff it holds one.
        for j in range(self.P):
            md.add(sum(self.on[j]) == self.active[j])
        # Used positions form a prefix 0..p-1 (position 0 = last stage always exists).
        md.add(self.active[0] == 1)
        for j in range(self.P - 1):
            md.add(self.active[j] >= self.active[j + 1])
        # A class lends at most as many positions as it has devices.
        for c, cls in enumerate(self.classes):
            md.add(sum(self.on[j][c] for j in range(self.P)) <= cls.count)

    def _unit_order(self) -> None:
        md, L, P = self.model, self.L, self.P
        # Every unit sits on exactly one active position.
        for u in range(L):
            md.add_exactly_one(self.in_[u])
            md.add(self.pos[u] == sum(j * self.in_[u][j] for j in range(P)))
            for j in range(P):
                md.add_implication(self.in_[u][j], self.active[j])
        # Stages are contiguous and in unit order: positions fall by 0 or 1, from p-1 to 0.
        md.add(self.pos[L - 1] == 0)
        md.add(self.pos[0] == sum(self.active) - 1)
        for u in range(L - 1):
            md.add(self.cut[u] == self.pos[u] - self.pos[u + 1])
            # last[u][j] = in_[u][j] AND cut[u]
            for j in range(P):
                md.add_bool_and([self.in_[u][j], self.cut[u]]).only_enforce_if(self.last[u][j])
                md.add_bool_or([self.in_[u][j].Not(), self.cut[u].Not(), self.last[u][j]])
            md.add(self.last[u][0] == 0)  # nothing follows the last stage

    def _compute_times(self) -> None:
        md, prob = self.model, self.problem
        per_unit = {c: [self.ticks(prob.fwd_s[cl.kind][u] + prob.bwd_s[cl.kind][u]) for u in range(self.L)]
                    for c, cl in enumerate(self.classes)}
        # the levers can add each unit's forward once more (and the selective level's seconds)
        horizon = max(sum(v) + (self.levers.top_ticks(self.classes[c].kind) if self.levers is not None else 0)
                      for c, v in per_unit.items())
        self.compute = [md.new_int_var(0, horizon, f"compute_j{j}") for j in range(self.P)]
        fastest = [min(per_unit[c][u] for c in per_unit) for u in range(self.L)]
        for j in range(self.P):
            # F_j + B_j of the units on position j, on the kind of its class (+ the levers' ticks, each row
            # enforced with its literals: recomputed forwards; the selective level's where it runs).
            for c, cl in enumerate(self.classes):
                work = sum(per_unit[c][u] * self.in_[u][j] for u in range(self.L))
                rows = self.levers.tick_rows(j, cl.kind) if self.levers is not None else [(0, [])]
                for extra, when in rows:
                    md.add(self.compute[j] >= work + extra).only_enforce_if([self.on[j][c], *when])
            # Redundant: never faster than the fastest kind (tightens the relaxation).
            md.add(self.compute[j] >= sum(fastest[u] * self.in_[u][j] for u in range(self.L)))
        self.horizon = horizon

    def _round_trip_ticks(self, a: int, b: int, u: int) -> int:
        """2 * C over the cut after unit u from class a to class b (a 0-byte cut still pays the latency)."""
        src, dst = self.classes[a].members[0], self.classes[b].members[-1]
        if src == dst:
            return 0
        return self.ticks(2.0 * self.problem.comm_s(src, dst, u))

    def _comm_times(self) -> None:
        md, C = self.model, len(self.classes)
        top = max((self._round_trip_ticks(a, b, u) for a in range(C) for b in range(C)
                   for u in range(self.L - 1)), default=0)
        self.comm = [md.new_int_var(0, top, f"comm_j{j}") for j in range(self.P)]
        md.add(self.comm[0] == 0)
        for j in range(1, self.P):
            # Round trip of the cut between position j and j-1, priced by both ends' classes.
            for a in range(C):
                for b in range(C):
                    terms = [self._round_trip_ticks(a, b, u) * self.last[u][j] for u in range(self.L - 1)]
                    md.add(self.comm[j] >= sum(terms)).only_enforce_if([self.on[j][a], self.on[j - 1][b]])
        self.comm_top = top

    def _memory(self) -> None:
        md, prob, L = self.model, self.problem, self.L
        bd, grad = prob.boundary_bytes, prob.grad_bytes or (0,) * L
        held_out = prob.boundary_held_bytes or (0,) * L
        # bytes of the cut after position j (between j and j-1): sum_u last[u][j] * boundary[u], and of
        # its gradient message
        cut_bytes = [sum(bd[u] * self.last[u][j] for u in range(L - 1)) for j in range(self.P)]
        gd = prob.boundary_grad_bytes or bd
        cut_grad = [sum(gd[u] * self.last[u][j] for u in range(L - 1)) for j in range(self.P)]
        for j in range(self.P):
            cut_out, cut_in = cut_bytes[j], (cut_bytes[j + 1] if j + 1 < self.P else 0)
            grad_out, grad_in = cut_grad[j], (cut_grad[j + 1] if j + 1 < self.P else 0)
            copies = self._tied_copies(j)
            state = sum((prob.state_bytes[u] - grad[u]) * self.in_[u][j] for u in range(L)) + sum(
                t.state_bytes * copy for t, copy in copies)
            grads = sum(grad[u] * self.in_[u][j] for u in range(L))
            # A_s: held storages once, less the output cut's held share (`problem.stage_activation_bytes`)
            act = sum(prob.activation_bytes[u] * self.in_[u][j] for u in range(L))
            act -= sum(held_out[u] * self.last[u][j] for u in range(L - 1))
            cap = sum(cl.usable_bytes * self.on[j][c] for c, cl in enumerate(self.classes))
            # M_j <= usable bytes of its class at every moment t of its action list (`pipeline_stage_bytes`);
            # the first stage (unit 0 here) has its own list.  Recomputed units keep their inputs (k_t times
            # less per moment) and one is live again (`RecomputeVars.memory`).
            recomputes = self.levers.recomputes(j) if self.levers is not None else None
            offloaded = self.offload.saved[j] if self.offload is not None else 0
            transient, has_transient = transient_vars(md, prob, self.in_, j)
            for first, when in ((True, self.in_[0][j]), (False, self.in_[0][j].Not())):
                for t in position_held_terms(j, first=first, microbatches=self.m):
                    # a backward's moment counts with a recomputation's peak or a transient (T_j, memory model 4)
                    gates = [g for g in (recomputes, has_transient) if g is not None] if t.backward else [None]
                    levers = (self.levers.memory(j, t.microbatches, backward=bool(t.backward))
                              if self.levers is not None else 0)
                    for gate in gates:
                        md.add(state + t.grads * grads + t.microbatches * (act + cut_in + cut_out) + t.in_frames * cut_in
                               + t.in_grad_frames * grad_in + t.out_frames * cut_out + t.out_grad_frames * grad_out
                               + levers + (transient if t.backward else 0) - offloaded <= cap
                               ).only_enforce_if([when] if gate is None else [when, gate])
            levers = self.levers.memory(j, 0, backward=False) if self.levers is not None else 0
            step_rows(self, j, state + grads + levers, copies)  # memory model 5: the step's moment

    def _tied_copies(self, j: int) -> list[tuple[TiedCopy, cp_model.IntVar]]:
        """Tied-parameter replicas on position j, each with its literal: copy >= (holds a user) - (holds the owner)."""
        out = []
        for g, t in enumerate(self.problem.tied):
            copy = self.model.new_bool_var(f"tied{g}_copy_j{j}")
            for u in t.user_units:
                if u != t.owner_unit:
                    self.model.add(copy >= self.in_[u][j] - self.in_[t.owner_unit][j])
            out.append((t, copy))
        return out

    def _objective(self) -> None:
        md = self.model
        self.bottleneck = md.new_int_var(0, max(self.horizon, self.comm_top), "bottleneck")
        md.add_max_equality(self.bottleneck, self.compute + self.comm)
        tail = self.offload.tail if self.offload is not None else 0  # max_j O_j (`problem.step_tail_s`)
        md.minimize(sum(self.compute) + sum(self.comm) + (self.m - 1) * self.bottleneck + tail)

    def hint(self, stages: Sequence[Stage]) -> None:
        """Seed the search with a known placement (the DP's or a heuristic's)."""
        md, p = self.model, len(stages)
        cls_of = {d: c for c, cl in enumerate(self.classes) for d in cl.members}
        for s, st in enumerate(stages):
            j = p - 1 - s
            for u in range(st.first_unit, st.last_unit + 1):
                md.add_hint(self.pos[u], j)
        for j in range(self.P):
            md.add_hint(self.active[j], j < p)
            for c in range(len(self.classes)):
                md.add_hint(self.on[j][c], j < p and cls_of[stages[p - 1 - j].device] == c)

    def extract(self, solver: cp_model.CpSolver) -> tuple[Stage, ...]:
        p = sum(solver.value(a) for a in self.active)
        used = {c: 0 for c in range(len(self.classes))}
        stages = []
        for j in range(p - 1, -1, -1):
            c = next(c for c in range(len(self.classes)) if solver.value(self.on[j][c]))
            units = [u for u in range(self.L) if solver.value(self.in_[u][j])]
            stages.append(Stage(self.classes[c].members[used[c]], units[0], units[-1]))
            used[c] += 1
        return best_levers(self.problem, stages)  # the smallest fitting prefix (ticks may tie), offload exactly


def solve_cpsat(problem: Problem, *, time_limit_s: float, seed: int, hint: Sequence[Stage] | None = None,
                upper_bound_s: float | None = None, workers: int = DEFAULT_WORKERS,
                num_stages: int | None = None) -> CpSatResult:
    """Solve `problem` with CP-SAT (see the module docstring); `hint` seeds the search.

    `num_stages` forces pipelines of exactly that many stages.
    """
    start = time.perf_counter()
    if hint is not None:
        upper_bound_s = evaluate(problem, hint, objective="estimate").iteration_s
    if upper_bound_s is None or not math.isfinite(upper_bound_s):
        upper_bound_s = _crude_upper_bound_s(problem)
    built = _Model(problem, device_classes(problem), TICKS_PER_T / max(upper_bound_s, 1e-30))
    if num_stages is not None:
        built.model.add(sum(built.active) == num_stages)
    if hint is not None and (num_stages is None or len(hint) == num_stages):
        built.hint(hint)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.random_seed = int(seed)
    solver.parameters.num_workers = workers
    code = solver.solve(built.model)
    status = solver.status_name(code)
    wall = time.perf_counter() - start
    if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        stages = built.extract(solver)
        bound = solver.best_objective_bound / built.scale
        value = evaluate(problem, stages, objective="estimate").iteration_s
        if code == cp_model.OPTIMAL and value > bound + rounding_slack_ticks(built) / built.scale:
            # the model priced its answer below the contract: its optimum need not be the contract's
            log.warning("CP-SAT's optimum %.6g s is priced %.6g s by evaluate: reporting FEASIBLE", bound, value)
            status = "FEASIBLE"
        return CpSatResult(stages, status, value, bound, wall)
    log.info("CP-SAT returned %s after %.2f s", status, wall)
    return CpSatResult(None, status, math.inf, math.inf if code == cp_model.INFEASIBLE else 0.0, wall)


def rounding_slack_ticks(built: _Model) -> int:
    """The most ticks the model's rounding can take off one placement's objective: every time is floored once per
    unit and term (F + B, up to two recompute items, the selective level: < 4 ticks a unit in each compute[j], so
    < 4 L in their sum and in the bottleneck, counted m - 1 times more), once per cut (comm[j], the bottleneck's
    too) and once per unit and tied replica in the offload tail.  A solution whose `evaluate` T exceeds CP-SAT's
    objective by more was priced below the contract by the model, and its OPTIMAL proves nothing about T.

    Example: 5 units on 3 positions, 8 micro-batches, one tied group: (4 * 5 + 1) * 8 + 5 + 3 + 1 + 1 ticks.
        >>> from types import SimpleNamespace
        >>> rounding_slack_ticks(SimpleNamespace(L=5, m=8, P=3, problem=SimpleNamespace(tied=(0,))))
        178
    """
    return (4 * built.L + 1) * built.m + built.L + built.P + len(built.problem.tied) + 1


def _crude_upper_bound_s(problem: Problem) -> float:
    """An upper bound on any placement's T: every unit on its slowest kind plus every cut on the slowest link."""
    kinds = list(problem.fwd_s)
    work = sum(max(problem.fwd_s[k][u] + problem.bwd_s[k][u] for k in kinds) for u in range(problem.num_units))
    n = len(problem.devices)
    comm = max((2 * problem.comm_s(a, b, u) for a in range(n) for b in range(n) if a != b
                for u in range(problem.num_units)), default=0.0)
    return problem.microbatches * (work + problem.num_units * comm)


def transient_vars(md: cp_model.CpModel, prob: Problem, in_: Sequence[Sequence[cp_model.IntVar]],
                   j: int) -> tuple[cp_model.LinearExpr | int, cp_model.IntVar | None]:
    """T_j and a bool "T_j > 0" of position j (memory model 4, `problem.stage_transient_bytes`): one aux var
    >= each unit's transient where the unit is on j (the least such value is the max; the memory rows only
    push it down), the bool >= each such unit's literal, <= their sum.  (0, None) when no unit has one."""
    table = prob.transient_bwd_bytes or (0,) * prob.num_units
    units = [u for u, b in enumerate(table) if b > 0]
    if not units:
        return 0, None
    peak = md.new_int_var(0, max(table), f"transient_j{j}")
    has = md.new_bool_var(f"has_transient_j{j}")
    for u in units:
        md.add(peak >= int(table[u]) * in_[u][j])
        md.add(has >= in_[u][j])
    md.add(has <= sum(in_[u][j] for u in units))
    return peak, has
