"""`solve_tp`: the best placement when stages may be tensor-parallel groups (issue 15).

1. The pipeline-only answer: `solve.solve` on the same problem with ``group_max = 1`` (the DP,
   relaxation or CP-SAT, verified under the schedule): the plan is never slower than it.
2. The group DP (`group_dp.solve_groups`, exact under the estimate T_est over cuts, groups,
   leads and orders; inside the offload lever's outer walk; with groups across two nodes
   (`Problem.group_nodes`) also over one node's groups only), when the cluster is small enough
   (`group_dp.MAX_GROUP_CARDS`) and its groups are priced within the time limit.
3. CP-SAT with group variables (`cpsat_groups.solve_cpsat_groups`, the same tables and walk), hinted
   by step 2's answer, or by step 1's where the DP declined (`GroupSpaceTooLarge`): always under
   ``solver="cpsat"``, under ``auto`` only where the DP declined.  Its answer is kept unless the DP's
   is better (a CP-SAT run cut short by its time limit); the plan's solver then says ``cpsat``.
   Neither ran (the model too large too, or the pricing past the limit): step 1's answer stands and
   the log says why.
4. `verify`'s local search under the schedule from every answer (the one-node groups' DP answer
   too); the fastest one is the plan (so groups across nodes never make it slower than one node's
   groups' answer under the schedule, where the DP reaches).

The bound recorded is valid over every placement, groups included: every rank runs its m forwards
and backwards in series, so T >= m · b_min with b_min the least possible max_s (F_s + B_s) over
every placement (`group_bound`: one bottleneck pass of the group DP with the links left out, or
beyond the DP's reach CP-SAT's proved bound on that bottleneck).  It is loose (it leaves out fill,
drain and the optimizer step), so group plans are ``FEASIBLE`` with their gap.

Example:
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem
    >>> from hetpipe.partitioner.tp_tables import BlockSplit, UnitSplit
    >>> blk = BlockSplit(parts=8, fwd_flops=1, allreduce_bytes=0, activation_bytes=0)
    >>> inf = float("inf")
    >>> prob = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (2.0, 2.0)}, state_bytes=(1, 1),
    ...                activation_bytes=(1, 1), boundary_bytes=(100, 0),
    ...                devices=(DeviceSlot("d0", "a", "n", 100), DeviceSlot("d1", "a", "n", 100)),
    ...                bandwidth_bytes_s=((inf, 10.0), (10.0, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)),
    ...                microbatches=4, tensor_parallel=(UnitSplit(3, 1.0, 1.0, (blk,)),) * 2, group_max=2)
    >>> sol = solve_tp(prob)
    >>> sol.solver, sol.iteration_s, sol.bound_s, [sorted(st.members) for st in sol.stages]   # one group, 4 x 3 s
    ('group-dp', 12.0, 12.0, [[0, 1]])
    >>> sol = solve_tp(prob, solver="cpsat")
    >>> sol.solver, sol.iteration_s, [sorted(st.members) for st in sol.stages]
    ('cpsat', 12.0, [[0, 1]])
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import Sequence

from hetpipe.partitioner.problem import Problem, Stage
from hetpipe.partitioner.solvers.cap_walk import DPResult
from hetpipe.partitioner.solvers.cpsat_groups import cpsat_group_bottleneck_s, solve_cpsat_groups
from hetpipe.partitioner.solvers.group_dp import (
    MAX_GROUP_CARDS, GroupSpaceTooLarge, GroupTablesDP, run_pass, candidate_groups, solve_groups)
from hetpipe.partitioner.solvers.offload_walk import tail_walk
from hetpipe.partitioner.solvers.solve import VERIFY_SHARE, Solution, solve
from hetpipe.partitioner.solvers.verify import LOCAL_SEARCH_S, verify

log = logging.getLogger(__name__)

#: Seconds CP-SAT gets at least, even when the DP or the pricing used up the plan's time limit:
#: enough to load the hint and check it on the small models where the DP ran (measured: the
#: 40 brute-force instances of tests/test_tp_solver.py solve to OPTIMAL in ~0.05 s CPU each).
MIN_CPSAT_S = 1.0
#: Seconds the CP-SAT bottleneck bound gets beyond the DP's reach (its proved bound is valid whenever it stops).
BOUND_CPSAT_S = 2.0


def used_devices(stages: tuple[Stage, ...]) -> set[int]:
    """Every card a placement uses: a group's members too."""
    return {d for st in stages for d in (st.members or (st.device,))}


def group_bound(problem: Problem, cost_cache: dict | None = None, *, seed: int = 0) -> float:
    """m · the least max_s (F_s + B_s) over every placement, groups included (module docstring)."""
    if len(problem.devices) > MAX_GROUP_CARDS:  # the set DP's bottleneck pass is out of reach: CP-SAT's bound
        try:
            b_min = cpsat_group_bottleneck_s(problem, time_limit_s=BOUND_CPSAT_S, seed=seed, cost_cache=cost_cache)
        except GroupSpaceTooLarge:
            return 0.0
        return problem.microbatches * b_min
    tab = GroupTablesDP(problem, candidate_groups(problem), cost_cache)
    tab.comm2[:] = 0.0  # a rank's own work only: the links are not in this bound
    out = run_pass(tab, math.inf, True, None)
    return 0.0 if out is None else problem.microbatches * out[0]


def cpsat_pass(problem: Problem, *, hint: Sequence[Stage] | None, seed: int, cost_cache: dict,
               deadline: float) -> DPResult | None:
    """One run of `solve_cpsat_groups` as an inner solver of `tail_walk` (None: nothing found)."""
    deadline = max(deadline, time.perf_counter() + MIN_CPSAT_S)  # pricing and search share it
    res = solve_cpsat_groups(problem, time_limit_s=deadline - time.perf_counter(), seed=seed, hint=hint,
                             cost_cache=cost_cache, deadline=deadline)
    if res.stages is None:
        log.info("CP-SAT with group variables: %s", res.status)
        return None
    return DPResult(res.stages, res.iteration_s, min(res.bound_s, res.iteration_s), 0, res.status == "OPTIMAL")


def group_dp_walk(problem: Problem, *, cost_cache: dict, deadline: float) -> DPResult | None:
    """The exact group DP inside the offload lever's outer walk, each pass given the time left to `deadline`
    (a `time.perf_counter()` value); raises `GroupSpaceTooLarge` where the DP declines."""
    return tail_walk(problem, lambda p, _: solve_groups(p, time_limit_s=max(0.0, deadline - time.perf_counter()),
                                                        cost_cache=cost_cache, deadline=deadline))


def group_search(problem: Problem, *, solver: str, pipe: Sequence[Stage], seed: int, cost_cache: dict,
                 deadline: float) -> tuple[DPResult, str] | None:
    """Steps 2 and 3 of the module docstring: the group answer and the solver that found it."""
    dp, declined = None, ""
    try:
        dp = group_dp_walk(problem, cost_cache=cost_cache, deadline=deadline)
    except GroupSpaceTooLarge as err:
        declined = str(err)
    if solver == "dp" or (solver == "auto" and not declined):
        if declined:
            log.warning("tensor-parallel groups not searched: %s; the plan is pipeline-only", declined)
        return None if dp is None else (dp, "group-dp")
    hint = tuple(dp.stages) if dp is not None else tuple(pipe)
    try:
        cp = tail_walk(problem, lambda p, first: cpsat_pass(p, hint=hint if first else None, seed=seed,
                                                            cost_cache=cost_cache, deadline=deadline))
    except GroupSpaceTooLarge as err:
        log.warning("tensor-parallel groups not searched by CP-SAT: %s%s", err,
                    f" (the group DP: {declined})" if declined else "; the plan is the group DP's")
        cp = None
    if cp is not None and (dp is None or cp.iteration_s <= dp.iteration_s * (1 + 1e-9)):
        return cp, "cpsat"
    return None if dp is None else (dp, "group-dp")


def one_node_answer(problem: Problem, *, cost_cache: dict, deadline: float) -> DPResult | None:
    """With groups across two nodes, the group DP's answer over one node's groups only (T_est's optimum
    over more groups may replay slower under the schedule); None without them or beyond the DP."""
    if problem.group_nodes <= 1:
        return None
    try:
        return group_dp_walk(replace(problem, group_nodes=1), cost_cache=cost_cache, deadline=deadline)
    except GroupSpaceTooLarge:
        return None


def solve_tp(problem: Problem, *, solver: str = "auto", time_limit_s: float = 10.0, seed: int = 0) -> Solution:
    """Best placement of `problem` with its stages free to be groups (module docstring)."""
    start = time.perf_counter()
    pipe = solve(replace(problem, group_max=1), solver=solver, time_limit_s=time_limit_s / 2, seed=seed)
    if problem.group_max < 2 or not problem.tensor_parallel:
        return pipe
    left = max(0.0, time_limit_s - (time.perf_counter() - start))
    cache: dict = {}  # group costs, shared by every pass, both solvers and the bound
    deadline = time.perf_counter() + left  # the group tables are priced within the plan's time limit
    found = group_search(problem, solver=solver, pipe=pipe.stages, seed=seed, cost_cache=cache, deadline=deadline)
    if found is None:
        return pipe
    grp, name = found
    near = one_node_answer(problem, cost_cache=cache, deadline=deadline)
    seeds = [grp.stages, *([near.stages] if near is not None else []), pipe.stages]
    checked = verify(problem, seeds, limit_s=min(LOCAL_SEARCH_S, VERIFY_SHARE * time_limit_s))
    stages, value = checked.stages, checked.iteration_s
    if pipe.iteration_s <= value:
        stages, value = pipe.stages, pipe.iteration_s
    bound = min(group_bound(problem, cache, seed=seed), value)
    status = "OPTIMAL" if bound >= value * (1 - 1e-9) else "FEASIBLE"
    used = used_devices(stages)
    return Solution(stages, name, status, value, bound, time.perf_counter() - start,
                    tuple(i for i in range(len(problem.devices)) if i not in used))
