"""`solve_tp`: the best placement when stages may be tensor-parallel groups (issue 15).

1. The pipeline-only answer: `solve.solve` on the same problem with ``group_max = 1`` (the DP,
   relaxation or CP-SAT, verified under the schedule): the plan is never slower than it.
2. The group DP (`group_dp.solve_groups`, exact under the estimate T_est over cuts, groups,
   leads and orders; inside the offload lever's outer walk; with groups across two nodes
   (`Problem.group_nodes`) also over one node's groups only), when the cluster is small enough
   (`group_dp.MAX_GROUP_CARDS`) and its groups are priced within the time limit; else step 1's
   answer stands and the log says why.
3. `verify`'s local search under the schedule from every answer; the fastest one is the plan
   (so groups across nodes never make it slower than one node's groups' answer under the schedule).

CP-SAT has no group variables: ``solver="cpsat"`` runs it for step 1 only, and the group
answer is the DP's (the plan's solver is then ``group-dp``).  The bound recorded is valid over
every placement, groups included: every rank runs its m forwards and backwards in series, so
T >= m · b_min with b_min the least possible max_s (F_s + B_s) over every placement
(`group_bound`: one bottleneck pass of the group DP with the links left out).  It is loose (it
leaves out fill, drain and the optimizer step), so group plans are ``FEASIBLE`` with their gap.

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
    >>> sol.solver, sol.iteration_s, sol.bound_s, [st.members for st in sol.stages]   # one group, 4 x 3 s
    ('group-dp', 12.0, 12.0, [(0, 1)])
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace

from hetpipe.partitioner.problem import Problem, Stage
from hetpipe.partitioner.solvers.group_dp import (
    GroupSpaceTooLarge, GroupTablesDP, run_pass, candidate_groups, solve_groups)
from hetpipe.partitioner.solvers.offload_walk import tail_walk
from hetpipe.partitioner.solvers.solve import VERIFY_SHARE, Solution, solve
from hetpipe.partitioner.solvers.verify import LOCAL_SEARCH_S, verify

log = logging.getLogger(__name__)


def used_devices(stages: tuple[Stage, ...]) -> set[int]:
    """Every card a placement uses: a group's members too."""
    return {d for st in stages for d in (st.members or (st.device,))}


def group_bound(problem: Problem, cost_cache: dict | None = None) -> float:
    """m · the least max_s (F_s + B_s) over every placement, groups included (module docstring)."""
    tab = GroupTablesDP(problem, candidate_groups(problem), cost_cache)
    tab.comm2[:] = 0.0  # a rank's own work only: the links are not in this bound
    out = run_pass(tab, math.inf, True, None)
    return 0.0 if out is None else problem.microbatches * out[0]


def solve_tp(problem: Problem, *, solver: str = "auto", time_limit_s: float = 10.0, seed: int = 0) -> Solution:
    """Best placement of `problem` with its stages free to be groups (module docstring)."""
    start = time.perf_counter()
    pipe = solve(replace(problem, group_max=1), solver=solver, time_limit_s=time_limit_s / 2, seed=seed)
    if problem.group_max < 2 or not problem.tensor_parallel:
        return pipe
    left = max(0.0, time_limit_s - (time.perf_counter() - start))
    if solver == "cpsat":
        log.info("CP-SAT has no tensor-parallel group variables: it solved the pipeline-only problem; "
                 "groups are the exact group DP's (solver group-dp)")
    try:
        cache: dict = {}  # group costs, shared by every pass and the bound
        deadline = time.perf_counter() + left  # the group tables are priced within the plan's time limit
        grp = tail_walk(problem, lambda p, _: solve_groups(p, time_limit_s=left, cost_cache=cache, deadline=deadline))
        # the one-node groups' answer too: T_est's optimum over more groups may replay slower under the schedule
        near = (tail_walk(replace(problem, group_nodes=1), lambda p, _: solve_groups(
            p, time_limit_s=left, cost_cache=cache, deadline=deadline)) if problem.group_nodes > 1 else None)
    except GroupSpaceTooLarge as err:
        log.warning("tensor-parallel groups not searched: %s; the plan is pipeline-only", err)
        return pipe
    if grp is None:
        return pipe
    seeds = [grp.stages, *([near.stages] if near is not None else []), pipe.stages]
    checked = verify(problem, seeds, limit_s=min(LOCAL_SEARCH_S, VERIFY_SHARE * time_limit_s))
    stages, value = checked.stages, checked.iteration_s
    if pipe.iteration_s <= value:
        stages, value = pipe.stages, pipe.iteration_s
    bound = min(group_bound(problem, cache), value)
    status = "OPTIMAL" if bound >= value * (1 - 1e-9) else "FEASIBLE"
    used = used_devices(stages)
    return Solution(stages, "group-dp", status, value, bound, time.perf_counter() - start,
                    tuple(i for i in range(len(problem.devices)) if i not in used))
