"""Window chains raised into a finished pace walk's staircase (issue 12 item 3, session 15).

Why.  The pace walk's DP filters (`schedule_bound.level_caps`) keep round trips, single steps and the pair
chain; 1F1B's window chains of three or more ranks (`schedule_bound.window_pace`) set the pace of gpt2-xl on 64
cards (three-block A100 stages over 1.33 ms cuts), so the walk's least R_0 under a cap belongs to pipelines
whose windows break it.  With windows in the filters (`pace_rule.WindowCompanions`) a pass costs about twice a
plain one (64 cards, the count relaxation: 9 passes in 4 CPU s against 15), so under a time limit a walk with
them from the start ends lower.  `widen` keeps the plain walk and spends only the time it leaves.

The bound.  A point (gamma, R) of the walk's staircase says every pipeline whose chains are all under gamma has
R_0 >= R.  The windowed filters admit fewer pipelines, so their least R_0 under gamma, R_w(gamma), is another
such floor; a floor at gamma holds at every smaller cap too (fewer pipelines again), so each windowed pass
raises every point at or below its cap (as `pace_prices.tighten` does with priced floors) and the staircase
(`schedule_bound.staircase`) is taken again.  Each step re-solves the top of the weakest band with windows, or,
once that is windowed, splits the band at its middle.

Measured (gpt2-xl on 64 cards, the count relaxation of `relax.pace_relaxation`: A100 | 4090 A6000 V100 | the
rest, uncapped walks, CPU seconds at load ~10): pairs only 3.070 s (21 passes, 5 s), windows of three ranks
3.110 s (23 passes, 9 s), of four 3.126 s (24 passes, 15 s), of six the same; the relaxation's argmin paces
3.17 s with every window, so no window filter lifts that relaxation further (its merged kinds are what is left:
cut A100 / 4090 / A6000 / V100 / the rest, a 5.3e7-row DP, 3.171 s with pairs in 245 s, 3.211 s with windows of
three in 399 s, 3.227 s of four in 833 s; `benchmarks/pace_windows.py --fine`).

Example (`schedule_bound.window_pace`'s pipeline: four one-unit stages of W = 3, 3, 3, 1 s over cuts of 1, 1, 0
s, m = 16; the windowed filters raise the plain walk's bound to the windowed pace optimum):
    >>> import math
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem
    >>> from hetpipe.partitioner.solvers.dp import CountDP
    >>> from hetpipe.partitioner.solvers.schedule_bound import schedule_walk
    >>> devs = tuple(DeviceSlot(f"d{i}", "a", "n", 99) for i in range(4))
    >>> prob = Problem(fwd_s={"a": (1.0, 1.0, 1.0, 1 / 3)}, bwd_s={"a": (2.0, 2.0, 2.0, 2 / 3)},
    ...                state_bytes=(1,) * 4, activation_bytes=(1,) * 4, boundary_bytes=(1, 1, 0, 0), devices=devs,
    ...                bandwidth_bytes_s=tuple(tuple(math.inf if i == j else 1.0 for j in range(4)) for i in range(4)),
    ...                latency_s=((0.0,) * 4,) * 4, microbatches=16)
    >>> dp = CountDP(prob)
    >>> walk = schedule_walk(prob, dp=dp, hints=[tuple(Stage(i, i, i) for i in range(4))])
    >>> round(walk.bound_s, 3), round(widen(walk, dp, prob, windows=3), 3)   # pace optimum: R_0 = 14, G = 59
    (71.0, 73.0)
"""

from __future__ import annotations

import math
import time

from hetpipe.partitioner.problem import Problem, Stage  # noqa: F401  (Stage: the docstring's example)
from hetpipe.partitioner.solvers.cap_walk import DeadlineReached
from hetpipe.partitioner.solvers.dp import CountDP
from hetpipe.partitioner.solvers.schedule_bound import BAND_TOLERANCE, ScheduleWalk, level_caps, staircase

#: Widest window the filters of `widen` check by default (`pace_rule.WindowCompanions`): three ranks gain 0.040 s
#: of the 0.056 s that windows of up to four or six gain at 64 cards (gpt2-xl; the module docstring), at 60% of
#: the four's cost per pass.
WIDEST = 3
#: Windowed passes `widen` makes at most.
WIDEN_PASSES = 24


def widen(walk: ScheduleWalk, dp: CountDP, problem: Problem, *, windows: int = WIDEST, deadline: float = math.inf,
          enough_s: float = math.inf, max_passes: int = WIDEN_PASSES) -> float:
    """The walk's bound with windowed floors raised into its staircase (module docstring), until `deadline`
    (a pass past it is dropped), `max_passes`, a bound of `enough_s`, or a windowed band narrower than
    `BAND_TOLERANCE` of the bound; the walk's own bound where it has no points."""
    points = dict(walk.points)
    if not points or walk.bound_s <= 0.0:
        return walk.bound_s
    bound, windowed = walk.bound_s, set()
    m, cards = problem.microbatches, min(problem.num_units, len(problem.devices))
    for _ in range(max_passes):
        bound, low, high = staircase(points, walk.g_floor_s)
        if bound >= enough_s or time.perf_counter() > deadline:
            break
        if not math.isfinite(high):  # the top band (low, inf]: a cap above it, as `schedule_walk` doubles
            high = 2.0 * max(low, walk.g_floor_s)
        elif high in windowed:
            if high - low <= BAND_TOLERANCE * bound:
                break
            high = (low + high) / 2  # the band's top is windowed already: split it
        windowed.add(high)
        caps = level_caps(m, high, windows=windows)
        try:  # the front stage's cap as `schedule_walk` sets it: the largest of its levels'
            res = dp.min_sum(max(caps(k)[0] for k in range(1, cards + 1)), level_caps=caps, deadline=deadline)
        except DeadlineReached:
            break
        # a floor at a cap holds below it; a larger cap's floor holds at it (fewer pipelines under a smaller cap)
        floor = max([math.inf if res is None else res[0]] + [v for c, v in points.items() if c >= high])
        points[high] = floor
        for cap in points:
            if cap <= high:
                points[cap] = max(points[cap], floor)
    return max(walk.bound_s, staircase(points, walk.g_floor_s)[0])
