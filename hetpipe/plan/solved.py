"""`solve_for_plan`: the searches a single-pipeline plan runs on its `Problem`, under the plan's time limit.

The solve (with tensor-parallel groups where asked) within `partitioner.solvers.time_budget`'s budget (``auto``: a
second, longer solve where the first stopped more than 2% from its bound), then the baselines, their adoption where
one is faster, the schedule choice and the left-out devices' reasons, each of those under one solve's limit.

Example (two equal cards, four equal units: two stages of two units, proved optimal):
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem
    >>> inf = float("inf")
    >>> prob = Problem(fwd_s={"a": (1.0,) * 4}, bwd_s={"a": (2.0,) * 4}, state_bytes=(1,) * 4,
    ...                activation_bytes=(1,) * 4, boundary_bytes=(0,) * 4,
    ...                devices=(DeviceSlot("d0", "a", "n", 100), DeviceSlot("d1", "a", "n", 100)),
    ...                bandwidth_bytes_s=((inf, 1.0), (1.0, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)),
    ...                microbatches=4)
    >>> got = solve_for_plan(prob, solver="auto", time_limit_s="auto", seed=0, schedule="1f1b", tensor_parallel="off")
    >>> got.solution.status, got.solution.iteration_s, got.limit_s   # proved at once: no second solve
    ('OPTIMAL', 30.0, 10.0)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from hetpipe.cost_models.quantities import human_bytes
from hetpipe.errors import InfeasibleError
from hetpipe.partitioner.problem import Problem
from hetpipe.partitioner.selective_mode import forced_problem, lift
from hetpipe.partitioner.solvers.time_budget import time_budget
from hetpipe.plan.left_out import left_out_reasons
from hetpipe.plan.schema import BaselineReport, LeftOut


@dataclass(frozen=True)
class Solved:
    """What `solve_for_plan` found: the problem as planned (its schedule chosen), the solution, the baselines,
    the left-out devices' reasons, and the seconds of limit the solves were given (both under ``auto``'s second)."""

    problem: Problem
    solution: Any  # partitioner.solvers.solve.Solution
    baselines: dict[str, BaselineReport]
    left_out: tuple[LeftOut, ...]
    limit_s: float


def solve_for_plan(problem: Problem, *, solver: str, time_limit_s: float | str, seed: int, schedule: str,
                   tensor_parallel: str) -> Solved:
    """The plan's searches (module docstring).  Under ``recompute="selective"`` all of it runs on
    `selective_mode.forced_problem` (which prices every placement as the forced problem does) and the answer's
    stages are lifted to run the level."""
    from hetpipe.partitioner.solvers.solve import VERIFY_SHARE, solve
    from hetpipe.partitioner.solvers.time_budget import solve_in_budget
    from hetpipe.partitioner.solvers.tp_solve import solve_tp
    from hetpipe.partitioner.solvers.verify import LOCAL_SEARCH_S
    from hetpipe.plan.adopt import adopt_faster_baselines
    from hetpipe.partitioner.schedule_choice import choose_schedule
    from hetpipe.plan.baseline_report import baseline_reports

    work = forced_problem(problem)  # `problem` itself unless the level is forced
    budget = time_budget(time_limit_s)
    try:
        got = solve_in_budget(solve_tp if tensor_parallel == "auto" else solve, work, budget, solver=solver, seed=seed)
    except InfeasibleError as err:
        if work is problem or problem.selective is None:
            raise
        raise InfeasibleError(f"{str(err).rstrip('.')} (--recompute selective: the figures above are with the level "
                              "on every stage, the usable memory each card's less the level's peak, "
                              f"{human_bytes(problem.selective.peak_bytes)}, which every stage holds once; "
                              "--recompute auto may fit with whole units)") from None
    sol, limit_s = got.solution, got.limit_s
    one_s = budget.first_s  # the searches below: one solve's limit
    base = baseline_reports(work)  # forced onto every card, and on the best cards (issue 17)
    sol = adopt_faster_baselines(work, sol, base, limit_s=min(LOCAL_SEARCH_S, VERIFY_SHARE * one_s))
    work, sol = choose_schedule(work, sol, option=schedule, limit_s=min(LOCAL_SEARCH_S, VERIFY_SHARE * one_s))
    left = left_out_reasons(work, sol, solver=solver, time_limit_s=one_s, seed=seed)
    if problem.recompute != "selective":
        return Solved(work, sol, base, left, limit_s)
    return Solved(dataclasses.replace(problem, schedule=work.schedule),
                  dataclasses.replace(sol, stages=lift(sol.stages)), base, left, limit_s)
