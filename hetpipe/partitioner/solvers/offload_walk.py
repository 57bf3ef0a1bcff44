"""The solvers' outer walk over the offload tail: T_est = S + (m - 1) b + max_s O_s stays exact.

What is searched: the solvers search the H-1F1B estimate exactly (`solvers/verify.py` then prices
the answer under the schedule).  The estimate counts no on-card optimizer step S_s; with the
offload lever it counts ``max_s O_s`` over the offloading stages (`problem.step_tail_s`), since
an offloading stage's step IS its tail (in the schedule T it is that stage's step, replayed after
its last backward) and an estimate without it would see offloading as free memory.  So here
T_est = S + (m - 1) b + max_s O_s, with S = sum_s (F_s + B_s) + sum_s 2 C_s and b the bottleneck:
a max over stages, which the DP's per-stage sums cannot carry.  For a cap Theta on every stage's
tail (`Problem.offload_cap_s`) the per-stage choice is exact (`recompute.choose_levers`), so
V(Theta) = min over placements whose tails are all <= Theta of S + (m - 1) b is what one run
of the inner solver finds.  The walk:

    Theta_0 = inf;  P_i = argmin V(Theta_i), T_i = T_est(P_i) (its real tail theta_i <= Theta_i);
    Theta_{i+1} = theta_i lowered by a relative tick;  stop when theta_i = 0, nothing fits,
    or V(Theta_{i+1}) >= best T_est so far (any placement with tail <= Theta_{i+1} has T_est >= V).

Exactness (over T_est): let P* be optimal with tail theta*, and Theta_i the last cap >= theta*.
Then V(Theta_i) <= S* + (m - 1) b*, and P_i's tail theta_i <= Theta_i; if theta_i > theta* the
walk goes on to Theta_{i+1} >= theta* (up to the tick), contradicting the choice of i, so
theta_i <= theta* and T_i <= T*.  A walk stopped by the bound test stops only when no
placement under the next cap can beat the best found.  Each step lowers the cap strictly,
so the walk ends; in practice after a few passes (the first placement without offload ends it).
The merge with the schedule objective changes none of this: the on-card S_s is not in T_est
(as for every problem), and O_s enters it only through the max; nothing here claims the schedule
optimum, which `verify` brackets by its bound (each unit's least of S_u and its share of O_s).

`best_levers` is the same choice for one fixed placement: its stages' tails are the only caps
that matter, so trying each (and 0) finds the best levers of that placement exactly.  Under the
schedule a uniform cap is not enough: there an offloading stage's tail O_s is its step, replayed
after its own last backward, so a tail hidden by the drain (a late stage's) is cheap while the same
tail on stage 0, the last to finish, adds itself to T; a cap that lets stage 1 offload also lets
stage 0 offload whenever O_0 <= O_1 (the estimate counts only the max).  Per stage two choices can
be best under the schedule (T is non-decreasing in every B_s and every step): the least added
seconds without offload, and the least with it (every offload choice has the same tail O_s), so
`best_levers` enumerates which stages offload (`schedule_levers`; exact up to `SUBSETS_MAX` subsets
of the stages where both fit, a first-improvement descent from the best cap beyond).  GPT-2 XL on
the home lab at 0.95x its memory: the caps' best offloads both stages (6.5955 s: stage 0's 0.457 s
tail is the iteration's end); offloading stage 1 only, with stage 0 on the selective level: 6.4193 s.

Example (two units of one parameter each fit the 24-byte card only by offloading 2 x 8 bytes):
    >>> from hetpipe.cost_models.offload import offload_rates
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage
    >>> from hetpipe.partitioner.solvers.dp import solve_exact
    >>> prob = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (1.0, 1.0)}, state_bytes=(16, 16),
    ...                activation_bytes=(0, 0), boundary_bytes=(0, 0), grad_bytes=(4, 4),
    ...                devices=(DeviceSlot("d", "a", "n", 24, 8.0, 28.0),), bandwidth_bytes_s=((1.0,),),
    ...                latency_s=((0.0,),), microbatches=1, offload="auto", offload_rates=offload_rates("adam", "fp32"))
    >>> res = tail_walk(prob, lambda p, first: solve_exact(p))
    >>> res.iteration_s, res.stages[0].offload   # 4 s compute + 2 params * (8/8 + 28/28) s
    (8.0, True)
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Callable, Sequence

from hetpipe.partitioner.problem import Problem, Stage, evaluate, offload_if, stage_memory_bytes
from hetpipe.partitioner.recompute import choose_levers, with_recompute
from hetpipe.partitioner.solvers.cap_walk import DPResult

#: Relative tick the cap is lowered by below the last tail (floating-point ties).
TAIL_TICK = 1e-9
#: Most offload subsets `schedule_levers` enumerates (2^4: four stages free to offload or not; each is a
#: schedule replay, and the local search re-chooses levers for every neighbour); beyond, a descent.
SUBSETS_MAX = 16

#: One run of an inner solver under `problem.offload_cap_s`; `first` is True on the uncapped pass
#: (a seed placement chosen without a cap may be used only there).
Inner = Callable[[Problem, bool], "DPResult | None"]


def tail_walk(problem: Problem, inner: Inner) -> DPResult | None:
    """The best placement over the offload lever (module docstring); `inner` itself when it cannot offload."""
    if problem.offload == "never" or problem.offload_rates is None:
        return inner(problem, True)
    cap, first, best, bound = math.inf, True, None, None
    exact = True
    while True:
        res = inner(replace(problem, offload_cap_s=cap), first)
        if res is None:
            break
        ev = evaluate(problem, res.stages, objective="estimate")  # the surrogate `inner` solves
        exact &= res.exact
        if first and not res.exact:  # the uncapped pass's bound (on S + (m-1) b, tails >= 0) bounds every T
            bound = res.bound_s
        if best is None or ev.iteration_s < best.iteration_s:
            best = replace(res, iteration_s=ev.iteration_s)
        if ev.tail_s <= 0.0 or res.iteration_s - ev.tail_s >= best.iteration_s:
            break
        cap, first = min(cap, ev.tail_s) * (1.0 - TAIL_TICK), False
    if best is None:
        return None
    stages = best_levers(problem, best.stages)
    value = evaluate(problem, stages, objective="estimate").iteration_s
    if value < best.iteration_s:
        best = replace(best, stages=stages, iteration_s=value)
    lower = best.iteration_s if exact or bound is None else min(bound, best.iteration_s)
    return replace(best, bound_s=lower, exact=exact)


def best_levers(problem: Problem, stages: Sequence[Stage], objective: str = "estimate") -> tuple[Stage, ...]:
    """`stages` (cuts and devices kept) with the levers that minimise T among those that fit: exactly under
    the estimate; under ``objective="schedule"`` the best of the same tries (each stage's tail as the cap).

    Example:
        >>> from hetpipe.partitioner.problem import DeviceSlot
        >>> p = Problem(fwd_s={"a": (1.0,)}, bwd_s={"a": (1.0,)}, state_bytes=(16,), activation_bytes=(0,),
        ...             boundary_bytes=(0,), grad_bytes=(4,), devices=(DeviceSlot("d", "a", "n", 99, 1.0, 1.0),),
        ...             bandwidth_bytes_s=((1.0,),), latency_s=((0.0,),), microbatches=1, offload="auto")
        >>> best_levers(p, (Stage(0, 0, 0, offload=True),))[0].offload   # it fits without: no tail
        False
    """
    if problem.offload == "never":
        return with_recompute(problem, stages)
    if objective == "schedule" and problem.offload == "auto":
        return schedule_levers(problem, stages)
    caps = {0.0, math.inf} | {offload_if(problem, st).tail_s for st in stages}
    tries = [with_recompute(replace(problem, offload_cap_s=c), stages) for c in sorted(caps)]
    evals = [evaluate(problem, t, objective=objective) for t in tries]
    return min(zip(evals, tries), key=lambda e: (not e[0].fits, e[0].iteration_s))[1]


def schedule_levers(problem: Problem, stages: Sequence[Stage]) -> tuple[Stage, ...]:
    """`stages` with the levers of least schedule T under ``offload="auto"`` (module docstring): per stage its best
    choice without offload and with it; every subset of the stages where both fit, up to `SUBSETS_MAX`, else a
    first-improvement descent over single stages from the best uniform cap.

    Example (the card's own step takes 5 s, the host's 1 + 1 s: offloading pays though the state fits;
    one cap on the tails, as the estimate needs, would keep it on the card):
        >>> from hetpipe.cost_models.offload import offload_rates
        >>> from hetpipe.partitioner.problem import DeviceSlot
        >>> p = Problem(fwd_s={"a": (1.0,)}, bwd_s={"a": (1.0,)}, state_bytes=(16,), activation_bytes=(0,),
        ...             boundary_bytes=(0,), grad_bytes=(4,), devices=(DeviceSlot("d", "a", "n", 99, 8.0, 28.0),),
        ...             bandwidth_bytes_s=((1.0,),), latency_s=((0.0,),), microbatches=1, offload="auto",
        ...             offload_rates=offload_rates("adam", "fp32"), step_s={"a": (5.0,)})
        >>> stages = schedule_levers(p, (Stage(0, 0, 0),))
        >>> stages[0].offload, evaluate(p, stages).iteration_s   # F + B + O_s = 1 + 1 + (8/8 + 28/28)
        (True, 4.0)
    """
    plain = tuple(replace(st, recompute_units=(), offload=False, selective=False) for st in stages)
    # per stage: the least added seconds without offload, and with it (``all``: offload wherever the stage can)
    never, always = replace(problem, offload_cap_s=-math.inf), replace(problem, offload="all")
    pairs = [(st, st) if st.members else (choose_levers(never, plain, s), choose_levers(always, plain, s))
             for s, st in enumerate(plain)]
    fit = [(_fits(problem, plain, s, a), _fits(problem, plain, s, b)) for s, (a, b) in enumerate(pairs)]
    both = [s for s, (a, b) in enumerate(pairs) if a != b and all(fit[s])]
    # the rest take the one that fits (without offload where both do or neither: infeasible anyway)
    base = [b if a != b and fit[s][1] and not fit[s][0] else a for s, (a, b) in enumerate(pairs)]

    def priced(offloading: frozenset[int]) -> tuple[tuple[bool, float], tuple[Stage, ...]]:
        trial = tuple(pairs[s][1] if s in offloading else base[s] for s in range(len(plain)))
        ev = evaluate(problem, trial, objective="schedule")
        return (not ev.fits, ev.iteration_s), trial

    if 2 ** len(both) <= SUBSETS_MAX:
        subsets = (frozenset(c) for r in range(len(both) + 1) for c in itertools.combinations(both, r))
        return min((priced(c) for c in subsets), key=lambda e: e[0])[1]
    caps = {0.0, math.inf} | {offload_if(problem, st).tail_s for st in plain}
    current = min((priced(frozenset(s for s in both if offload_if(problem, plain[s]).tail_s <= c)) + (c,)
                   for c in caps), key=lambda e: e[0])
    chosen, value = frozenset(s for s in both if offload_if(problem, plain[s]).tail_s <= current[2]), current[0]
    better = True
    while better:
        better = False
        for s in both:
            key, _ = priced(chosen ^ {s})
            if key < value:
                chosen, value, better = chosen ^ {s}, key, True
    return priced(chosen)[1]


def _fits(problem: Problem, plain: Sequence[Stage], s: int, stage: Stage) -> bool:
    """Whether stage `s` of `plain` fits its card with the levers of `stage`."""
    trial = list(plain)
    trial[s] = stage
    return stage_memory_bytes(problem, trial, s) <= problem.devices[stage.device].usable_bytes
