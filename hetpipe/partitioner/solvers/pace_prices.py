"""Card counts priced into the node-run pace walk's bound (issue 12 item 3, session 14).

Why.  The node-run relaxation (`pace_runs.RunDP`) drops card counts: on gpt2-xl at 256 cards (32 A100s) the
pace walk's argmin under every cap near its bound puts 33 stages on A100s, so its bound (7.675 s) is the
least R_0 of pipelines the cluster cannot hold.  Counting the cards of a kind in the DP's state multiplies
its work by their number (33); pricing them does not.

The bound (Lagrangian relaxation; Fisher, Management Science 1981).  Let S be the kinds the walk's argmin
puts on more stages than they have cards, c_S their cards, n_S(P) a pipeline's stages on them.  Every real
placement with G <= gamma is a pipeline the node-run DP admits under the caps of gamma (`pace_runs`) with
n_S <= c_S, so for any price t >= 0 per stage

    R_0(P) >= R_0(P) + t (n_S(P) - c_S) >= min over admitted pipelines of (R_0 + t n_S) - t c_S = L(t)

(`RunDP.priced_min` minimises the priced value beside the least R its filters need, so its minimum is at
most every admitted pipeline's).  L is concave in t; `price_floor` maximises it by cutting planes on t
(each pass gives a line of slope n_S - c_S).  A floor at cap gamma holds for every smaller cap too (fewer
placements), so `tighten` raises every point of the walk's staircase at or below the cap it prices (the
top of the weakest band) and takes the staircase again (`schedule_bound.staircase`).

Measured (gpt2-xl, 256 cards, load ~7): the argmin holds 33 A100 stages at R_0 = 0.4409 s; 20 A100 stages
cost 0.5165 s, nothing between is cheaper on the hull, so L peaks at 0.4467 s (t = 5.8 ms): the bound
rises from 7.675 s to 7.681 s.  A duality gap is left (the exact least R_0 with 32 A100 stages is higher).

Example (three units, two cards of a fast kind and two of a slow one on two nodes, free links, every stage
under 4.5 s: one unit a stage; the walk's least R_0 puts all three on the fast kind, the cluster has two):
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem
    >>> from hetpipe.partitioner.solvers.pace_runs import RunDP
    >>> devs = tuple(DeviceSlot(f"d{i}", k, n, 99) for i, (k, n) in enumerate([("a", "n0"), ("b", "n0"), ("a", "n1"), ("b", "n1")]))
    >>> prob = Problem(fwd_s={"a": (1.0,) * 3, "b": (1.5,) * 3}, bwd_s={"a": (2.0,) * 3, "b": (3.0,) * 3},
    ...                state_bytes=(1,) * 3, activation_bytes=(1,) * 3, boundary_bytes=(0,) * 3, devices=devs,
    ...                bandwidth_bytes_s=((1.0,) * 4,) * 4, latency_s=((0.0,) * 4,) * 4, microbatches=4)
    >>> dp = RunDP(prob)
    >>> dp.min_sum(4.5)[0]                      # 3 + 3 + 3 s on kind "a" (no card counts)
    9.0
    >>> price_floor(dp, prob, 4.5, None)        # two on "a", one on "b": 3 + 3 + 4.5 s
    10.5
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Sequence

import numpy as np

from hetpipe.partitioner.problem import Problem
from hetpipe.partitioner.solvers.cap_walk import DeadlineReached
from hetpipe.partitioner.solvers.pace_rule import LevelCaps
from hetpipe.partitioner.solvers.pace_runs import RunDP, RunStage
from hetpipe.partitioner.solvers.schedule_bound import ScheduleWalk, level_caps, staircase

#: Priced passes per cap (`price_floor`): the cutting planes on t converge in a few where few count vectors
#: are on the hull (gpt2-xl on 256 cards: 33, 25 and 20 A100 stages, the peak in 2 passes; 64 cards, where
#: `verify` does not price, 4-5).
PRICE_PASSES = 6
#: Caps priced per walk (`tighten`): each raises every point at or below it, so the first (the weakest band's top)
#: lifts most of the staircase; the next ones the bands it left weakest.
TIGHTEN_CAPS = 4
#: Relative gap between the cutting-plane model's peak and the best L found at which `price_floor` stops.
PRICE_TOLERANCE = 1e-6


def over_counts(problem: Problem, picks: Sequence[RunStage]) -> list[str]:
    """The kinds a relaxed pipeline puts on more stages than the cluster has cards of them."""
    cards = Counter(d.kind for d in problem.devices)
    used = Counter(st.kind for st in picks)
    return sorted(k for k, n in used.items() if n > cards[k])


def price_floor(dp: RunDP, problem: Problem, gamma: float, pairs: bool | None = True, *,
                deadline: float = math.inf) -> float | None:
    """A lower bound on the least R_0 of the real placements with G <= `gamma` (module docstring): the unpriced
    least R_0 raised by pricing the kinds its argmin overuses; None when no pipeline meets the caps.
    `pairs`: the walk's pair filter (None: no level caps at all, `min_sum`'s plain cap on F + B)."""
    caps: LevelCaps | None = None if pairs is None else level_caps(problem.microbatches, gamma, pairs=pairs)
    top = gamma if caps is None else max(caps(k)[0] for k in range(1, dp.stages + 1))
    base = dp.min_sum(top, level_caps=caps, deadline=deadline)
    if base is None:
        return None
    over = over_counts(problem, base[1])
    if not over:
        return base[0]
    mask = np.array([1.0 if k in over else 0.0 for k in dp.kinds])
    limit = sum(1 for d in problem.devices if d.kind in over)
    lines = [(base[0], len([st for st in base[1] if st.kind in over]) - limit, 0.0)]  # L(t) <= P + slope (t - t0)
    best, low, high = base[0], 0.0, math.inf
    t = base[0] / max(1, dp.stages)  # a stage's share of R_0: the scale of what moving one off S costs
    for _ in range(PRICE_PASSES):
        if time.perf_counter() > deadline:
            break
        found = dp.priced_min(top, t * mask, level_caps=caps, deadline=deadline)
        if found is None:
            break
        value, slope = found[0] - t * limit, found[1] - limit
        best = max(best, value)
        lines.append((value, slope, t))
        low, high = (t, high) if slope > 0 else (low, t)
        if slope == 0:
            break
        t = 2.0 * t if math.isinf(high) else _crossing(lines, low, high)
        if math.isfinite(high) and _model(lines, t) <= best * (1.0 + PRICE_TOLERANCE):
            break  # the cutting planes' peak is what a pass found: L's maximum
    return best


def _model(lines: list[tuple[float, int, float]], t: float) -> float:
    """The cutting-plane model of L at t: the least of its lines L(t0) + slope (t - t0)."""
    return min(v + s * (t - t0) for v, s, t0 in lines)


def _crossing(lines: list[tuple[float, int, float]], low: float, high: float) -> float:
    """Where the cutting-plane model (`_model`: concave, piecewise linear) peaks on [low, high]: at a crossing of a
    rising and a falling line, or an end."""
    points = [low, high]
    for v1, s1, a in lines:
        for v2, s2, b in lines:
            if s1 > 0 > s2:
                x = (v2 - s2 * b - v1 + s1 * a) / (s1 - s2)
                if low < x < high:
                    points.append(x)
    return max(points, key=lambda t: _model(lines, t))


def tighten(walk: ScheduleWalk, dp: RunDP, problem: Problem, *, pairs: bool = True,
            deadline: float = math.inf) -> float:
    """The walk's bound with the caps of its weakest bands priced (`price_floor`, up to `TIGHTEN_CAPS`), each
    floor raising the staircase's points at and below its cap; the walk's own bound where nothing is gained."""
    points = dict(walk.points)
    if not points or walk.bound_s <= 0.0:
        return walk.bound_s
    bound, priced = walk.bound_s, set()
    for _ in range(TIGHTEN_CAPS):
        if time.perf_counter() > deadline:
            break
        _, low, high = staircase(points, walk.g_floor_s)
        if not math.isfinite(high):
            break
        # the largest cap with the same least R_0 as the weakest band's top: one floor there lifts every band
        # between them (gpt2-xl on 256 cards: 7.2333-7.3022 s, five bands, one argmin)
        high = max(c for c, v in points.items() if c >= high and math.isfinite(c) and v >= points[high])
        if high in priced:
            break  # its floor is in already: the weakest band is what pricing leaves
        priced.add(high)
        try:
            floor = price_floor(dp, problem, high, pairs, deadline=deadline)
        except DeadlineReached:
            break
        if floor is None or floor <= points[high]:
            break
        for cap in points:
            if cap <= high:
                points[cap] = max(points[cap], floor)
        bound = max(bound, staircase(points, walk.g_floor_s)[0])
    return bound
