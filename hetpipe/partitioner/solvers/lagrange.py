"""A lower bound on T that keeps every device kind exact: the card counts are priced, not counted.

Why.  The node-free relaxation (`relax.py`) is solved by a DP over how many cards of each
kind a pipeline suffix uses; with many kinds that space is too large, so its slowest kinds
merge into one class as fast as the fastest of them.  When a good pipeline needs those kinds
(gpt2-xl on 64 cards of eight kinds: one block per card, the slowest kind used sets the
bottleneck), the merged bound is far too low (2.48 s against T = 3.14 s).

The bound.  Fix a cap b on every term (as the exact DP's cap walk does) and a price
lambda_k >= 0 per kind k.  Drop the rule "at most count_k cards of kind k" and charge each
stage on kind k lambda_k instead:

    LS(b, lambda) = min over pipelines P with every term <= b of
                    S(P) + sum_stages lambda_kind  -  sum_k lambda_k count_k.

A pipeline that respects the counts uses n_k <= count_k cards of kind k, so its added
charge sum_k lambda_k (n_k - count_k) is <= 0: LS(b, lambda) <= S*(b), the least sum
of any real pipeline whose terms are all <= b (weak Lagrangian duality).  Without counts
the minimisation is a DP over (stages after this one, kind, start unit): tiny.  The prices
move by cutting planes (`_priced_sum`).

From sums to T.  A plan with bottleneck b* in (b_i, b_{i+1}] has S >= S*(b_{i+1}) (a looser cap
only lowers the least sum) and (m - 1) b* > (m - 1) b_i, so

    T >= LS(b_{i+1}, lambda) + (m - 1) b_i          for that interval,

and b* >= b_lo, the relaxation's least bottleneck.  A plan with b* above
b_hi = (T_best - S_lb) / (m - 1) is no better than T_best.  So
min(T_best, min over the intervals of their bounds) is a valid lower bound on the optimum;
`lagrange_bound` splits the weakest interval until every one proves the target or time runs out.

Everything is priced on the node-free relaxation (`relax.relaxed_problem`: a card of each kind
as roomy as the kind's largest, every link as fast as the fastest between those kinds), with
the exact DP's own stage tables (`dp.StageTables`: memory per position, recomputation choice,
cuts), so every real plan is a relaxed plan with no larger terms.

Example (two kinds, one card each: the fast kind cannot run both stages):
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem
    >>> inf = float("inf")
    >>> p = Problem({"f": (1.0, 1.0), "s": (3.0, 3.0)}, {"f": (0.0, 0.0), "s": (0.0, 0.0)}, (0, 0), (0, 0), (0, 0),
    ...             (DeviceSlot("a", "f", "n", 9), DeviceSlot("b", "s", "n", 9)),
    ...             ((inf, 1.0), (1.0, inf)), ((0.0, 0.0), (0.0, 0.0)), 3)
    >>> b = lagrange_bound(p, best_s=6.0, floor_s=1.0, time_limit_s=5.0, target_gap=0.01)
    >>> b.proved, 6.0 * 0.99 <= b.bound_s <= 6.0   # the optimum: both units on "f", S = 2, b = 2, T = 2 + 2 * 2
    (True, True)
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from hetpipe.partitioner.problem import Problem
from hetpipe.partitioner.solvers.dp import StageTables, device_classes
from hetpipe.partitioner.solvers.simple_bounds import sum_lower_bound
from hetpipe.partitioner.solvers.relax import relaxed_problem

log = logging.getLogger(__name__)

#: Price updates per cap; each is one DP over (position, kind, unit), milliseconds here.
PRICE_STEPS = 40
#: Relative gap between the cutting-plane model and the best bound at which the prices stop moving.
CONVERGED = 1e-6
#: Share of the target's slack (T_best - goal) a sweep step takes where the goal cannot be proved
#: (its piece's bound then falls short of LS(hi) + (m - 1) hi by at most that share).
SHORT_STEP = 0.25
#: Least step, relative to T_best / (m - 1), so a sweep always ends.
MIN_SPLIT = 1e-6


@dataclass(frozen=True)
class LagrangeBound:
    """A lower bound on T (seconds) and whether it reached the target asked for."""

    bound_s: float
    caps_tried: int
    proved: bool


class _PricedDP:
    """LS(b, lambda) for one cap b: the counts priced by lambda (module docstring)."""

    def __init__(self, tab: StageTables, cap_s: float, stages: int) -> None:
        self.tab, self.L, self.stages = tab, tab.L, stages
        C = len(tab.classes)
        self.width = tab.width(cap_s)
        # bands[j, c]: a stage of kind c with j stages after it, inf where it breaks the cap or memory
        self.bands = np.stack([np.stack([tab.band(c, j, cap_s, self.width) for c in range(C)])
                               for j in range(stages)])
        self.comm = np.where(tab.comm2 <= cap_s, tab.comm2, np.inf)  # (C, C, L+1): 2C from c to f at a cut
        self.ends = tab.hi[:, :self.width]  # (L+1, W): the next stage's start unit
        self.counts = np.asarray([c.count for c in tab.classes], dtype=np.float64)

    def solve(self, prices: np.ndarray) -> tuple[float, np.ndarray]:
        """(LS(b, prices), cards of each kind the minimising pipeline uses)."""
        value = self.bands[0].min(axis=2) + prices[:, None]  # (C, L+1): the last stage
        best, where, picks = value[:, 0].min(), (0, int(value[:, 0].argmin())), []
        for j in range(1, self.stages):
            tot = self.comm + value[None, :, :]  # (C, C', L+1): to next kind f starting at v
            f_best = tot.argmin(axis=1)
            h = np.take_along_axis(tot, f_best[:, None, :], axis=1)[:, 0, :]  # (C, L+1)
            cand = self.bands[j] + h[:, self.ends]  # (C, L+1, W)
            w_best = cand.argmin(axis=2)
            value = np.take_along_axis(cand, w_best[..., None], axis=2)[..., 0] + prices[:, None]
            picks.append((f_best, w_best))
            if value[:, 0].min() < best:
                best, where = value[:, 0].min(), (j, int(value[:, 0].argmin()))
        used = np.zeros(len(prices))
        if not math.isfinite(best):
            return math.inf, used
        j, c, u = where[0], where[1], 0
        while True:  # walk the minimising pipeline front to back, counting its kinds
            used[c] += 1
            if j == 0:
                break
            f_best, w_best = picks[j - 1]
            nxt = int(self.ends[u, w_best[c, u]])
            c, u, j = int(f_best[c, nxt]), nxt, j - 1
        return float(best - prices @ self.counts), used


def _priced_sum(dp: _PricedDP, prices: np.ndarray, target: float, deadline: float) -> tuple[float, np.ndarray]:
    """max over the prices tried of LS(b, prices) (each a valid bound), stopping at `target`.

    Kelley's cutting planes: every pipeline the DP returns is a plane LS <= c_P + lambda . (n_P - count);
    the next prices maximise the lowest plane (a small LP, GLOP) within 0 <= lambda <= `target`
    (a box: the search stays finite where no pipeline respects the counts).  Plain subgradient
    steps zig-zag here (each minimiser piles every stage on one kind).  Returns (bound, its prices).
    """
    best, best_prices, cuts = -math.inf, prices.copy(), []
    box = max(target, 1e-9)
    for _ in range(PRICE_STEPS):
        value, used = dp.solve(prices)
        if value > best:
            best, best_prices = value, prices.copy()
        if not math.isfinite(value) or value >= target or time.perf_counter() > deadline:
            break
        over = used - dp.counts
        cuts.append((value - float(prices @ over), over))  # LS <= c_P + lambda . over, c_P = S(P)
        top, prices = _master(cuts, box)
        if top <= best + CONVERGED * max(1.0, abs(best)):  # the LP cannot promise more: best is the dual optimum
            break
    return best, best_prices


def _master(cuts: list[tuple[float, np.ndarray]], box: float) -> tuple[float, np.ndarray]:
    """max_w,lambda w s.t. w <= c_P + lambda . over_P for every cut, 0 <= lambda <= box: (w, lambda)."""
    lp = pywraplp.Solver.CreateSolver("GLOP")
    lam = [lp.NumVar(0.0, box, f"price{k}") for k in range(len(cuts[0][1]))]
    w = lp.NumVar(-lp.infinity(), lp.infinity(), "w")
    for c, over in cuts:
        lp.Add(w <= c + sum(float(o) * x for o, x in zip(over, lam) if o))
    lp.Maximize(w)
    if lp.Solve() != pywraplp.Solver.OPTIMAL:  # cannot happen (bounded, feasible); stop searching
        return -math.inf, np.zeros(len(lam))
    return w.solution_value(), np.asarray([x.solution_value() for x in lam])


def bottleneck_floor(problem: Problem) -> float:
    """A lower bound on any plan's bottleneck: its slowest unit on the fastest kind, and S_lb spread
    over every card (`dp.simple_lower_bound`'s b).

    Example:
        >>> from hetpipe.partitioner.problem import DeviceSlot
        >>> p = Problem({"a": (1.0, 3.0)}, {"a": (0.0, 0.0)}, (0, 0), (0, 0), (0, 0),
        ...             (DeviceSlot("x", "a", "n", 1),), ((1.0,),), ((0.0,),), 3)
        >>> bottleneck_floor(p)
        4.0
    """
    kinds = list(problem.fwd_s)
    fastest = [min(problem.fwd_s[k][u] + problem.bwd_s[k][u] for k in kinds) for u in range(problem.num_units)]
    return max(max(fastest, default=0.0), sum(fastest) / max(1, len(problem.devices)))


def lagrange_bound(problem: Problem, *, best_s: float, floor_s: float, time_limit_s: float,
                   target_gap: float = 0.0) -> LagrangeBound:
    """A lower bound on T for `problem` (module docstring).

    `best_s`: T of a feasible plan; `floor_s`: a valid lower bound on any plan's bottleneck
    (the relaxation's least bottleneck); the search stops once the bound reaches
    ``best_s * (1 - target_gap)`` or after `time_limit_s` (checked before every DP).
    """
    start = time.perf_counter()
    deadline = start + time_limit_s
    m1, goal = problem.microbatches - 1, best_s * (1.0 - target_gap)
    if m1 <= 0 or not math.isfinite(best_s):
        return LagrangeBound(0.0, 0, False)
    b_hi = (best_s - sum_lower_bound(problem)) / m1
    if b_hi <= floor_s:
        return LagrangeBound(best_s, 0, True)  # no plan better than best_s can exist
    relaxed = relaxed_problem(problem)
    tab = StageTables(relaxed, device_classes(relaxed))
    stages = min(problem.num_units, len(problem.devices))
    prices: dict[float, np.ndarray] = {}

    def sum_bound(cap: float, need: float) -> float:
        near = min(prices, key=lambda c: abs(c - cap)) if prices else None
        start_prices = prices[near] if near is not None else np.zeros(len(tab.classes))
        value, prices[cap] = _priced_sum(_PricedDP(tab, cap, stages), start_prices, need, deadline)
        return value

    # Sweep the bottleneck down from b_hi.  LS(hi) proves every b* in (lo, hi] with
    # LS(hi) + m1 * lo >= goal, so the next cap is lo; where LS(hi) cannot prove the goal
    # at all, the piece is a short step (`SHORT_STEP` of the target's slack) with its own bound.
    bound, hi, ls = best_s, b_hi, sum_lower_bound(problem)
    short = max(SHORT_STEP * (best_s - goal), MIN_SPLIT * best_s) / m1
    while hi > floor_s:
        if time.perf_counter() > deadline:  # what is left, (floor, hi]: S*(b) >= S*(last cap) >= its LS
            bound = min(bound, ls + m1 * floor_s)
            break
        ls = sum_bound(hi, goal - m1 * floor_s)
        lo = max(floor_s, min((goal - ls) / m1, hi - short))
        log.debug("cap %.6g s: LS %.6g s, proves (%.6g, %.6g] >= %.6g s", hi, ls, lo, hi, ls + m1 * lo)
        bound, hi = min(bound, ls + m1 * lo), lo
    log.info("lagrange bound %.6g s after %d caps in %.2f s (T %.6g s)", bound, len(prices),
             time.perf_counter() - start, best_s)
    return LagrangeBound(bound, len(prices), bound >= goal)
