"""The finer kind cut's walk, after the answer is final (issue 12 item 3, session 16).

Why.  `verify`'s count relaxation (`relax.pace_relaxation`) merges the kinds into groups (each at its fastest
member's speed) whose DP fits `relax.RELAXED_STATE_BUDGET` rows, so its walk fits a 10 s limit; gpt2-xl on 64 cards
then stays ~5% above its bound (A100 | 4090 A6000 V100 | the rest).  A finer cut (A100 | 4090 A6000 | V100 | the rest,
8.8e6 rows) with window chains of four ranks in the filters certifies 2% (3.190 s) in ~12 CPU s when its walk stops
at that target (`schedule_walk`'s `enough_s`: its passes drop the states that cannot end under it, `count_pass`).
The target needs the answer's T, so the walk runs last: `raise_bound`, given the final T, walks to T / (1 +
`TARGET_GAP`) where the time left covers its forecast.

The finer cut (`finer_groups`): the default cut with one of its groups split in two, the split of least
`relax.merge_loss` (what `pace_relaxation` minimises: the speed-ups the merge grants the cards a pipeline as long as
the answer uses) among those whose DP fits `FINER_STATE_BUDGET` rows.  On gpt2-xl at 64 cards (42 stages): 4090
A6000 | V100 loses 1.41, 4090 | A6000 V100 2.16, splits of the rest 2.48-3.28.

Valid: the finer cut's merged problem is a relaxation of the problem (`relax.merge_groups`), so its walk's bound
plus the least first step is a lower bound on the schedule optimum whatever passes finished (`schedule_walk`); the
bound kept is the larger of it and the one `verify` had.  The walk checks `deadline` between passes and inside
the DP (a pass past it is abandoned), as `verify`'s other walks.

Measured (`benchmarks/finer_walk.py`, planner_scale's gpt2-xl row on 64 cards, load 5.1-5.4): --time-limit 10 / 30
/ 60 s -> bound 3.108 / 3.192 / 3.198 s, gap 5.66 / 3.09 / 2.89% (T 3.294-3.293 s).  At 10 s the forecast does not fit
(nothing changes); at 60 s the walk ends on the cut's own limit, 3.198 s, which certifies 2% only for T <= 3.262 s.
Since the annealing runs in passes where time is left (`pace_search.anneal_passes`, session 17, load 2.4-2.7, two runs):
30 and 60 s -> T 3.253 s, and the walk stops at its target in 16 passes (9.1-13.8 s): bound 3.190 s, gap 1.96%.

Example (one kind: the node-free problem is the relaxation itself, no finer cut, the bound stays):
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage
    >>> prob = Problem(fwd_s={"a": (1.0,) * 4}, bwd_s={"a": (2.0,) * 4}, state_bytes=(1,) * 4,
    ...                activation_bytes=(1,) * 4, boundary_bytes=(0,) * 4,
    ...                devices=(DeviceSlot("d0", "a", "n", 100),),
    ...                bandwidth_bytes_s=((float("inf"),),), latency_s=((0.0,),), microbatches=4)
    >>> finer_groups(prob, stages=1) is None
    True
    >>> raise_bound(prob, (Stage(0, 0, 3),), iteration_s=48.0, bound_s=40.0, step_s=0.0, deadline=1e12)
    40.0
"""

from __future__ import annotations

import logging
import math
import time
from typing import Sequence

from hetpipe.partitioner.problem import Problem, Stage
from hetpipe.partitioner.solvers.cap_walk import DeadlineReached
from hetpipe.partitioner.solvers.dp import DEFAULT_STATE_BUDGET, CountDP, StateSpaceTooLarge
from hetpipe.partitioner.solvers.relax import (RELAXED_STATE_BUDGET, dp_rows, merge_groups, merge_loss, pace_groups,
                                               relaxed_problem)
from hetpipe.partitioner.solvers.schedule_bound import BAND_TOLERANCE, schedule_walk

log = logging.getLogger(__name__)

#: Gap (T / bound - 1) the walk aims for: issue 12 item 3's 2%.
TARGET_GAP = 0.02
#: Widest window chain in the finer walk's filters: on the four-group cut of gpt2-xl at 64 cards, windows of four
#: reach 3.198 s to their end against 3.183 s with three (benchmarks/results/pace_windows.md), both over 3.190 s.
FINER_WINDOWS = 4
#: DP rows the finer cut may have: the exact count DP's budget (the relaxation's walk makes 10-25 passes).
FINER_STATE_BUDGET = DEFAULT_STATE_BUDGET
#: CPU seconds per DP row and pass of a walk with windows of four that stops at its target: 11.9 s for 14 passes
#: over 8.8e6 rows (gpt2-xl, 64 cards, load 8-10: results/pace_windows.md).
SECONDS_PER_ROW_PASS = 11.9 / (14 * 8_812_800)
#: Passes the forecast counts: what that walk took to its 2% target.
FORECAST_PASSES = 14
#: Share of `verify`'s limit kept for the finer walk where its forecast fits in it (`reserve_s`): the walk's wall
#: under load is about twice its CPU seconds (this 2-core VM at load 7: 18 CPU s in a 30 s `solve`), and the
#: searches before it (pace walks, annealing, local search) keep the other half.
FINER_SHARE = 0.5


def finer_groups(problem: Problem, *, stages: int,
                 state_budget: int = RELAXED_STATE_BUDGET) -> list[list[str]] | None:
    """The finer cut (module docstring) of `relax.pace_groups(problem, stages=stages)`, or None where that
    relaxation merges nothing (its walk is on the node-free problem) or no split fits `FINER_STATE_BUDGET`.
    Like `pace_groups` it reads kinds, units and F + B only (no link tables)."""
    groups = pace_groups(problem, stages=stages, state_budget=state_budget)
    if groups is None:
        return None
    best: tuple[float, list[list[str]]] | None = None
    for i, group in enumerate(groups):
        for cut in range(1, len(group)):
            split = groups[:i] + [group[:cut], group[cut:]] + groups[i + 1:]
            if dp_rows(problem, split) > FINER_STATE_BUDGET:
                continue
            loss = round(merge_loss(problem, split, stages), 9)
            if best is None or loss < best[0]:
                best = (loss, split)
    return None if best is None else best[1]


def forecast_s(problem: Problem, groups: Sequence[Sequence[str]]) -> float:
    """Seconds the finer walk is forecast to take: its DP rows x `FORECAST_PASSES` x `SECONDS_PER_ROW_PASS`."""
    return dp_rows(problem, groups) * FORECAST_PASSES * SECONDS_PER_ROW_PASS


def reserve_s(problem: Problem, *, stages: int, limit_s: float, state_budget: int = RELAXED_STATE_BUDGET) -> float:
    """Seconds `verify` keeps for the finer walk from its start: `FINER_SHARE` of `limit_s` where the schedule is
    1F1B, a finer cut exists for pipelines of `stages` stages and its forecast fits in that share; else 0.  (The gap
    is known only once the pace walks end: `verify` then hands the time back where it is within `TARGET_GAP`.)

    Example (one kind: no finer cut, nothing kept):
        >>> from hetpipe.partitioner.problem import DeviceSlot
        >>> prob = Problem(fwd_s={"a": (1.0,)}, bwd_s={"a": (2.0,)}, state_bytes=(1,), activation_bytes=(1,),
        ...                boundary_bytes=(0,), devices=(DeviceSlot("d0", "a", "n", 100),),
        ...                bandwidth_bytes_s=((float("inf"),),), latency_s=((0.0,),), microbatches=4)
        >>> reserve_s(prob, stages=1, limit_s=60.0)
        0.0
    """
    if problem.schedule != "1f1b" or limit_s <= 0 or stages <= 0:
        return 0.0
    groups = finer_groups(problem, stages=stages, state_budget=state_budget)
    share_s = FINER_SHARE * limit_s
    return share_s if groups is not None and forecast_s(problem, groups) <= share_s else 0.0


def raise_bound(problem: Problem, answer: Sequence[Stage], *, iteration_s: float, bound_s: float, step_s: float,
                deadline: float, state_budget: int = RELAXED_STATE_BUDGET) -> float:
    """`bound_s`, raised by the finer cut's walk (module docstring) to T / (1 + `TARGET_GAP`) at most, where the gap
    is above `TARGET_GAP`, the schedule is 1F1B (the pace bound's), a finer cut exists and its forecast ends by
    `deadline` (`time.perf_counter()` seconds); `step_s` is the least first step (`verify.first_step_floor`).
    `state_budget` is the default cut's (`relax.pace_relaxation`; tests make it small)."""
    target = iteration_s / (1.0 + TARGET_GAP)
    if problem.schedule != "1f1b" or bound_s >= target or not answer:
        return bound_s
    groups = finer_groups(problem, stages=len(answer), state_budget=state_budget)
    if groups is None:
        return bound_s
    need_s, left_s = forecast_s(problem, groups), deadline - time.perf_counter()
    if need_s > left_s:
        log.info("finer cut walk skipped: forecast %.1f s, %.1f s left (gap %.2f%%)", need_s, left_s,
                 100 * (iteration_s / bound_s - 1) if bound_s > 0 else math.inf)
        return bound_s
    began = time.perf_counter()
    fine, _ = merge_groups(relaxed_problem(problem), groups)
    try:  # the merged problem keeps the cards' order: the answer is one of its placements (the first cap)
        dp = CountDP(fine, state_budget=FINER_STATE_BUDGET, deadline=deadline)
        walk = schedule_walk(fine, deadline=deadline, dp=dp, hints=[tuple(answer)], enough_s=target - step_s,
                             band_tolerance=BAND_TOLERANCE, windows=FINER_WINDOWS)
    except (StateSpaceTooLarge, DeadlineReached):
        return bound_s
    found = walk.bound_s + step_s if walk.bound_s > 0 and math.isfinite(walk.bound_s) else 0.0
    log.info("finer cut %s: bound %.4f s (was %.4f s, T %.4f s) in %d passes, %.1f s (forecast %.1f s, %.1f s left)",
             " / ".join(" ".join(g) for g in groups), found, bound_s, iteration_s, walk.passes,
             time.perf_counter() - began, need_s, left_s)
    return max(bound_s, found)
