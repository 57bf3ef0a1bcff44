"""The ``auto`` time limit (the default): a first solve of `AUTO_FIRST_S`, and one more of `AUTO_MORE_S` only where
the first answer is more than issue 12's 2% from its proven bound and its search ran out of time.

A number given as the limit stays a hard deadline for the whole solve (`solve`'s *Time limit*).  Under ``auto`` the
second solve starts afresh with the longer limit (its shares, the annealing's passes and the finer kind cut's walk
all scale with it), and the answer is the faster of the two placements with the larger of the two proven bounds
(each bound is valid for the same problem, so their maximum is too).  Why these figures: gpt2-xl on 64 cards of
eight kinds is the one built-in row above 2% at 10 s (5.58%); at 60 s it reaches 1.96% in 34 s of wall on a quiet
2-core VM, and still 1.96% with every deadline read on a clock at twice the CPU seconds, where 30 s gives 3.64%
(benchmarks/results/finer_walk.md).  Every other row of benchmarks/results/planner_scale.md is within 2% at 10 s,
so the default costs them nothing more.

Example:
    >>> time_budget("auto"), time_budget(5)
    (TimeBudget(first_s=10.0, more_s=60.0), TimeBudget(first_s=5.0, more_s=0.0))
    >>> budget = time_budget("auto")
    >>> wants_more(budget, iteration_s=3.294, bound_s=3.110, wall_s=10.1)   # 5.6% and the limit used
    True
    >>> wants_more(budget, iteration_s=3.294, bound_s=3.110, wall_s=2.0)    # the search ended by itself
    False
    >>> wants_more(time_budget(10.0), iteration_s=3.294, bound_s=3.110, wall_s=10.1)  # a given limit holds
    False
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Callable

from hetpipe.cost_models.validate import check_solver_options
from hetpipe.partitioner.solvers.finer_walk import TARGET_GAP

log = logging.getLogger(__name__)

#: The value of ``time_limit_s`` / ``--time-limit`` that asks for the two-step budget.
AUTO = "auto"
#: The first solve's limit under ``auto``: the default limit of every release before it.
AUTO_FIRST_S = 10.0
#: The second solve's limit under ``auto`` (module docstring: the measured 60 s row).
AUTO_MORE_S = 60.0
#: Share of the first limit its solve must have used for the second to run: a search that ended well before its
#: limit (proved, or every search done) would not use more time.  `solve` ends within its limit plus one pricing.
USED_SHARE = 0.9


@dataclass(frozen=True)
class TimeBudget:
    """Seconds of the first solve, and of the second one that may follow it (0: the limit is a hard deadline)."""

    first_s: float
    more_s: float


@dataclass(frozen=True)
class Budgeted:
    """`solve_in_budget`'s answer: the `Solution`, and the seconds of limit its solves were given."""

    solution: Any  # solve.Solution (or tp_solve's)
    limit_s: float


def time_budget(time_limit_s: float | str) -> TimeBudget:
    """``"auto"`` -> (`AUTO_FIRST_S`, `AUTO_MORE_S`); a number -> (it, 0); anything else a `ConfigError`
    (`cost_models.validate.check_solver_options`'s)."""
    if time_limit_s == AUTO:
        return TimeBudget(AUTO_FIRST_S, AUTO_MORE_S)
    check_solver_options("auto", time_limit_s, 0)
    return TimeBudget(float(time_limit_s), 0.0)


def first_limit_s(time_limit_s: float | str) -> float:
    """The limit of one solve: the number given, or `AUTO_FIRST_S` under ``auto`` (for the searches that take no
    second solve: replicas, the left-out reasons, the baselines' adoption).

    >>> first_limit_s("auto"), first_limit_s(3)
    (10.0, 3.0)
    """
    return time_budget(time_limit_s).first_s


def wants_more(budget: TimeBudget, *, iteration_s: float, bound_s: float, wall_s: float) -> bool:
    """Whether the second solve runs: the budget has one, the gap (T - bound) / T is above `TARGET_GAP`, and the
    first solve used at least `USED_SHARE` of its limit."""
    gap = (iteration_s - bound_s) / iteration_s if iteration_s > 0 else 0.0
    return budget.more_s > 0 and gap > TARGET_GAP and wall_s >= USED_SHARE * budget.first_s


def solve_in_budget(solve_fn: Callable[..., Any], problem: Any, budget: TimeBudget, **options: Any) -> Budgeted:
    """``solve_fn(problem, time_limit_s=..., **options)`` under `budget`: the first solve, and where `wants_more`
    the second; then the `Solution` is the faster placement with the larger bound (status ``OPTIMAL`` where they
    meet), its ``wall_s`` the two walls summed, and the limit the two limits summed."""
    first = solve_fn(problem, time_limit_s=budget.first_s, **options)
    if not wants_more(budget, iteration_s=first.iteration_s, bound_s=first.bound_s, wall_s=first.wall_s):
        return Budgeted(first, budget.first_s)
    log.info("time limit auto: gap %.2f%% after %.3g s, solving again with %.3g s", 100 * first.gap, first.wall_s,
             budget.more_s)
    second = solve_fn(problem, time_limit_s=budget.more_s, **options)
    best = second if second.iteration_s < first.iteration_s else first
    bound = min(max(first.bound_s, second.bound_s), best.iteration_s)
    status = "OPTIMAL" if bound >= best.iteration_s * (1 - 1e-9) else "FEASIBLE"
    return Budgeted(replace(best, bound_s=bound, status=status, wall_s=first.wall_s + second.wall_s),
                    budget.first_s + budget.more_s)
