"""The cap walk (parametric search) shared by the exact DP and the fixed-order DP, with its deadline.

T_est = S + (m - 1) b mixes a sum S with a bottleneck b; for a cap B on every term the least S(B)
is one DP pass (`dp.solve_exact`, `fixed_order.solve_fixed_order`), and `parametric_search` walks
the cap down (the module docstring of `dp` says why that is exact).

Time limit: every pass after the first answer gets the walk's deadline and gives up between two
of its DP levels once it has passed (`DeadlineReached`); the walk then returns the best placement
so far, not proved, with the best bound it has (`simple_bounds.simple_lower_bound` before the
least bottleneck is known, S_lb + (m - 1) b_min after).  Only the first pass of a walk without a
seed runs to its end whatever the limit: without it there is no placement to return.

Example (a deadline already past: the seed comes back, with a valid bound):
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage
    >>> inf = float("inf")
    >>> prob = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (1.0, 1.0)}, state_bytes=(1, 1),
    ...                activation_bytes=(1, 1), boundary_bytes=(0, 0),
    ...                devices=(DeviceSlot("d0", "a", "n", 99), DeviceSlot("d1", "a", "n", 99)),
    ...                bandwidth_bytes_s=((inf, 1.0), (1.0, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)), microbatches=2)
    >>> def never(cap, bottleneck, deadline):
    ...     check_deadline(deadline)
    ...     raise AssertionError("a pass ran past its deadline")
    >>> res = parametric_search(prob, never, time_limit_s=-1.0, seed=(Stage(0, 0, 1),))
    >>> res.iteration_s, res.bound_s, res.exact   # one stage: 2 x 4 s; the bound: S_lb + 1 x max(2, 4 / 2)
    (8.0, 6.0, False)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from hetpipe.partitioner.problem import Problem, Stage, evaluate
from hetpipe.partitioner.solvers.simple_bounds import simple_lower_bound, sum_lower_bound

#: Relative step below the last bottleneck when the cap is tightened (see `dp`'s module doc).
CAP_TOLERANCE = 1e-9


@dataclass(frozen=True)
class DPResult:
    """An optimal (or, for `solve_fixed_order`, best-in-order) placement."""

    stages: tuple[Stage, ...]
    iteration_s: float
    bound_s: float  # lower bound on T proven by the search (== iteration_s when exact and no stage offloads)
    caps_tried: int
    exact: bool


class DeadlineReached(Exception):
    """A DP pass ran past its deadline and was abandoned (`check_deadline`)."""


def check_deadline(deadline: float) -> None:
    """Raise `DeadlineReached` once `time.perf_counter()` is past `deadline` (seconds)."""
    if time.perf_counter() > deadline:
        raise DeadlineReached(f"deadline passed {time.perf_counter() - deadline:.3f} s ago")


#: One DP pass: (cap, bottleneck, deadline) -> (least S or least bottleneck, placement) or None.
MinSum = Callable[[float, bool, float], "tuple[float, tuple[Stage, ...]] | None"]


def walk_value_s(problem: Problem, stages: Sequence[Stage]) -> tuple[float, float]:
    """(S + (m - 1) b, T_est) of `stages`: what the cap walk minimises, and the estimate it reports.

    They differ by the offload tail max_s O_s only, which no DP pass prices (a max over stages): the
    walk is exact over S + (m - 1) b among the placements whose tails are under `Problem.offload_cap_s`,
    and `offload_walk.tail_walk` walks that cap.  Ranking placements by T_est inside the walk would
    drop, below an offloading placement's bottleneck, a placement with a slightly larger sum and no
    tail (the brute-force contract found such misses).
    """
    ev = evaluate(problem, stages, objective="estimate")
    return ev.iteration_s - ev.tail_s, ev.iteration_s


class _Walk:
    """The walk's state: the best placement (by S + (m - 1) b) and the best lower bound proved."""

    def __init__(self, problem: Problem, stages: Sequence[Stage], value: float, lower: float) -> None:
        self.problem, self.stages, self.value = problem, tuple(stages), value
        self.lower = lower
        self.tries = 0

    def offer(self, stages: Sequence[Stage]) -> None:
        value = walk_value_s(self.problem, stages)[0]
        if value < self.value:
            self.stages, self.value = tuple(stages), value

    def result(self, *, exact: bool) -> DPResult:
        t_est = walk_value_s(self.problem, self.stages)[1]
        return DPResult(self.stages, t_est, self.value if exact else min(self.value, self.lower), self.tries, exact)


def parametric_search(problem: Problem, min_sum: MinSum, *, time_limit_s: float,
                      seed: Sequence[Stage] | None = None, lower_bound_s: float | None = None) -> DPResult | None:
    """The cap walk around `min_sum(cap, bottleneck, deadline)` (module docstring).

    `min_sum(cap, False, ...)` is min S under the cap; `min_sum(cap, True, ...)` the least
    achievable bottleneck under it (the same DP with max in place of +).  Any placement
    better than the best found has S >= S_lb and so a bottleneck below
    (best - S_lb) / (m - 1): the walk scans only [b_min, that].  A feasible `seed`
    placement caps the first passes at its bottleneck, so no pass runs uncapped.
    The walk ranks by S + (m - 1) b (`walk_value_s`); the result reports T_est of the best,
    and its bound is on S + (m - 1) b, so also on T_est (the tail is >= 0).  A walk stopped at
    its deadline reports `lower_bound_s` (default `simple_lower_bound`, valid for one card per
    stage; a caller whose stages may be groups of cards passes a bound valid for them).
    """
    m, deadline = problem.microbatches, time.perf_counter() + time_limit_s
    lower = simple_lower_bound(problem) if lower_bound_s is None else lower_bound_s
    seed_ev = evaluate(problem, seed, objective="estimate") if seed is not None else None
    if seed_ev is not None and seed_ev.fits and m > 1:
        walk, s_lb, cap0 = _Walk(problem, seed, seed_ev.iteration_s - seed_ev.tail_s, lower), None, seed_ev.bottleneck_s
    else:
        first = min_sum(math.inf, False, math.inf)  # the first answer is owed whatever the limit
        if first is None:
            return None
        s_lb = first[0]
        ev = evaluate(problem, first[1], objective="estimate")
        walk, cap0 = _Walk(problem, first[1], ev.iteration_s - ev.tail_s, lower), ev.bottleneck_s
        walk.tries = 1
        if m == 1:  # T = S: the least sum is optimal
            return walk.result(exact=True)
    try:
        return _walk_down(problem, min_sum, walk, cap0=cap0, s_lb=s_lb, deadline=deadline)
    except DeadlineReached:
        return walk.result(exact=False)


def _walk_down(problem: Problem, min_sum: MinSum, walk: _Walk, *, cap0: float, s_lb: float | None,
               deadline: float) -> DPResult | None:
    """The walk below `cap0` (any feasible placement's bottleneck); None if nothing fits at all."""
    m = problem.microbatches
    s_lb = sum_lower_bound(problem) if s_lb is None else s_lb
    walk.tries += 2
    least = min_sum(cap0 * (1.0 + CAP_TOLERANCE), True, deadline)  # a placement with bottleneck <= cap0 exists ...
    if least is None:  # ... unless rounding hid it: fall back to the uncapped pass
        least = min_sum(math.inf, True, deadline)
        if least is None:
            return None
    b_min = least[0]
    walk.lower = max(walk.lower, s_lb + (m - 1) * b_min)
    bottom = min_sum(b_min * (1.0 + CAP_TOLERANCE), False, deadline)  # the window's floor: least sum at b_min
    if bottom is not None:
        walk.offer(bottom[1])
    cap = (walk.value - s_lb) / (m - 1)
    while cap > b_min * (1.0 + CAP_TOLERANCE):  # walk down; S only grows as the cap falls
        walk.tries += 1
        res = min_sum(cap, False, deadline)
        if res is None:
            break
        s_cap, stages = res
        walk.offer(stages)
        if s_cap + (m - 1) * b_min >= walk.value * (1.0 - CAP_TOLERANCE):
            break
        walk.lower = max(walk.lower, s_cap + (m - 1) * b_min)  # the placements left: bottleneck <= cap, S >= s_cap
        if time.perf_counter() > deadline:
            return walk.result(exact=False)
        cap = min(evaluate(problem, stages, objective="estimate").bottleneck_s,
                  (walk.value - s_lb) / (m - 1)) * (1.0 - CAP_TOLERANCE)
    return walk.result(exact=True)
