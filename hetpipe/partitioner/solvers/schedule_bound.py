"""A tight lower bound on the 1F1B schedule's optimum, and the placements that reach it (issue 12 item 3).

The schedule T of a placement (p stages, m micro-batches, `schedule.replay`) is bounded below
stage by stage.  Write W_s = F_s + B_s, R_s = sum_{j>=s} W_j + 2 sum_{s<=j<p-1} C_j (micro-batch
i's round trip from stage s's forward to its backward), k_s = min(p - s, m) (1F1B's micro-batches
in flight on s) and R_0 - R_s = sum_{j<s} (W_j + 2 C_j).

* **Round trips.**  Rank s runs F(i + k_s) right after B(i) (1F1B's steady state), and B(i + k_s) ends at
  least R_s after F(i + k_s) starts (every op and transfer of that micro-batch's chain below s runs in
  series): a jump of k_s micro-batches costs R_s.  B(0) ends at least sum_{j<s} (F_j + C_j) + R_s after the
  start; after B(m - 1) the gradient crosses stages s-1..0 (sum_{j<s} (B_j + C_j)), then stage 0 steps.
  Every chain B(0) -> B(m - 1) on rank s therefore gives T >= R_0 + (the chain) + S_0.  With
  m - 1 = q k_s + r (q_s = ceil(m / k_s) - 1): q round trips and r single steps B(i) -> F(i + k_s) -> B(i + 1)
  of W_s each (they fit in the steady state when q >= 1): q_s R_s + r_s W_s.
* **Single steps.**  All m - 1 steps one by one: m - k_s steady ones of W_s, then k_s - 1 in the cool-down of
  B_s alone: (m - k_s) W_s + (k_s - 1) B_s.
* **Pairs** (session 9).  1F1B does not hide a cut between two neighbours: B(i) on s, F(i + k_s) on s, on
  s + 1 (its next backward after that forward is B(i + 2), as k_{s+1} = k_s - 1), B(i + 2) on s + 1 and on s:
  two micro-batches per P_s = W_s + W_{s+1} + 2 C_s.  With m - 1 - k_s = 2x + y (k_s >= 2, every such step
  starts at some B(i) with i + k_s <= m - 1, in the steady state): x pairs, y single steps, then one
  round trip, x P_s + y W_s + R_s (`pair_chain`).  It sets the pace where stages are one or two blocks and
  a cut is not small beside them (llama-7b on 64 cards: a 4090 stage of 87 ms, an A6000 one of 95 ms and
  their 10.7 ms cross-node cut make 101.5 ms per micro-batch against the largest W of 94.5 ms).
* **Work.**  Rank s runs m F and m B in series between the same fill and drain:
  T >= R_0 - R_s + m W_s + S_0.

Hence T >= R_0 + G + S_0 with G = max_s G_s (`stage_pace`).  Over every placement:

    T* >= min_P (R_0(P) + G(P)) + min over kinds of unit 0's step (its least floor, `verify._step_floors`)

`schedule_walk` bounds that minimum with the DP under caps gamma on G: every placement with
G <= gamma has, at each stage s with k stages from it to the end, R_s <= gamma / q_k,
W_s <= (gamma + R_s) / m, q_k R_s + r_k W_s <= gamma, (m - 1) W_s - (k - 1) F_s <= gamma and the pair
chain <= gamma; the
count-vector DP (`dp.CountDP`), whose suffix values are exactly the R_s, keeps only suffixes and stages
under those caps (`dp.PaceRule`: both grow with R_s and W_s, so the least-R_s suffix of a state passes
whenever any does), so its least R_0, R_0*(gamma), is at most that of any placement with G <= gamma.
With caps gamma_0 < ... < gamma_n solved, a placement with G in (gamma_{i-1}, gamma_i] has
R_0 + G > R_0*(gamma_i) + gamma_{i-1}, one with G <= gamma_0 has R_0 + G >= R_0*(gamma_0) + G_lb: the
least of those (a staircase) is the bound, and each pass splits its weakest band.  The pair chain needs
W_{s+1}: the DP keeps beside each state's least R the least x W_front + R of its suffixes (`dp.PaceRule`),
which bounds the chain exactly per next state, but the value keeps the least-R suffix, so the filter is a
relaxation (valid) and the argmin may break it; on the brute-force instances the walk still ends on the
pace optimum (tests/test_pace_walk.py checks it against enumeration).
* **Windows** (session 11).  The pair generalised: B(i) on s, F(i + k_s) down ranks s..s + w - 1 (rank
  s + w - 1 keeps k_s - w micro-batches back, so its next backward is B(i + w)), B(i + w) back up to s: w
  micro-batches per P_w = sum_{s..s+w-1} W + 2 sum of the w - 1 cuts inside; with m - 1 - k_s = x w + y,
  x P_w + y W_s + R_s (`window_pace`; w = 2 is the pair chain, w = k_s the round trips).  It binds where a
  run of stages with cuts between them is followed by faster ones (gpt2-xl on 64 cards: three-block A100
  stages of 19.9 ms over 1.33 ms cuts).  The count DP's filters take windows of 3..w ranks with
  ``windows=w`` (`level_caps`, `pace_rule.WindowCompanions`: a relaxation as the pair filter, the walk's bound
  stays valid; `pace_windows.widen` raises a plain walk's staircase with them; session 15); by default the DPs
  keep the pair chain only, and `pace_terms(..., windows=True)` adds every window per placement, for
  ranking and searching placements (gpt2-xl on 64 cards: paces of 3.34-3.36 s without windows, 3.44-3.46 s
  with, against replays of 3.46-3.47 s).

Every relaxation of the contract (faster links, more memory, merged kinds: `relax`) only lowers
R_s and W_s and admits more placements, so the walk on one still bounds the real optimum, and its
placements, realised on real cards, are candidates the schedule itself prefers.

Example (two equal stages of W = 3 s, free links, m = 4: T = (m + 1) W = 15 s; the bound: R_0 = 6 s
plus G = q_1 R_1 = 3 x 3 s, the last stage's m - 1 more micro-batches):
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem
    >>> inf = float("inf")
    >>> prob = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (2.0, 2.0)}, state_bytes=(1, 1),
    ...                activation_bytes=(1, 1), boundary_bytes=(0, 0),
    ...                devices=(DeviceSlot("d0", "a", "n", 99), DeviceSlot("d1", "a", "n", 99)),
    ...                bandwidth_bytes_s=((inf, inf), (inf, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)), microbatches=4)
    >>> walk = schedule_walk(prob)
    >>> round(walk.bound_s, 6), walk.exact, evaluate(prob, walk.placements[0]).iteration_s
    (15.0, True, 15.0)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from hetpipe.partitioner.problem import Problem, Stage, evaluate
from hetpipe.partitioner.solvers.cap_walk import CAP_TOLERANCE, DeadlineReached
from hetpipe.partitioner.solvers.dp import CountDP
from hetpipe.partitioner.solvers.pace_rule import LevelCaps, PaceRule
from hetpipe.partitioner.solvers.simple_bounds import sum_lower_bound

#: Distinct placements of the walk kept as candidates for the schedule's local search (best first; `verify`
#: ranks them again on real cards: a relaxation's best may need more cards of a kind than there are).
KEEP_PLACEMENTS = 8
#: Below the lowest cap solved, the first cap tried is this share of it (1% under the hints' G, a cap nothing
#: meets proves a 1% bound in one pass: issue 12 item 3 asks for 2%); the walk bisects after that.
PROBE = 0.99
#: Width of the weakest band, relative to the bound, below which a relaxation's walk may stop (`schedule_walk`'s
#: `band_tolerance`): no split raises the bound by more than the band's width, and a relaxation's argmin, which
#: may break its pair filter, does not close bands (gpt2-xl on 256 cards: 25 passes under 7.2333 s gained nothing).
BAND_TOLERANCE = 1e-4


@dataclass(frozen=True)
class ScheduleWalk:
    """min_P (R_0 + G) (module docstring) as a lower bound, and the walk's placements, best first."""

    bound_s: float  # lower bound on R_0 + G over every placement (the step floor not included)
    placements: tuple[tuple[Stage, ...], ...]
    exact: bool  # the walk ended (bound_s is the minimum), not the deadline
    passes: int
    #: The staircase's points (cap gamma, least R_0 under it) and G's floor: `pace_prices.tighten` raises points
    points: tuple[tuple[float, float], ...] = ()
    g_floor_s: float = 0.0


def round_trip_factor(m: int, k: int) -> int:
    """q_k = ceil(m / min(k, m)) - 1: how many more round trips R_s rank s waits for (module docstring).

    Example:
        >>> [round_trip_factor(8, k) for k in (1, 2, 3, 8, 9)]
        [7, 3, 2, 0, 0]
    """
    return -(-m // min(k, m)) - 1


def level_caps(m: int, gamma: float, *, pairs: bool = True, windows: int = 2) -> LevelCaps:
    """The DP's caps, which every placement with G <= gamma meets, at k stages from the end (`stage_pace`):
    q_k R_s <= gamma gives R_s <= gamma / q_k; with W_s <= R_s, m W_s - R_s <= gamma gives W_s <= (gamma + R cap) / m;
    and the round trips and single steps themselves, exactly, as the DP's `PaceRule` (one part in 10^9 of slack:
    the DP adds the same seconds in another order than `pace_terms`); with `windows` >= 3 also the window chains of
    3..`windows` ranks (`window_pace`) that have at least one whole window (x >= 1)."""
    def caps(k: int) -> tuple[float, float, PaceRule]:
        q, kk = round_trip_factor(m, k), min(k, m)
        value = gamma / q if q > 0 else math.inf
        # single steps: (m - kk) W + (kk - 1) B = (m - 1) W - (kk - 1) F
        x, y = (pair_counts(m, k) if pairs else None) or (-1, 0)
        rule = PaceRule(trips=q, steps=leftover_trips(m, k) if q > 0 else 0, weighted=m - 1, forward=kk - 1,
                        cap=gamma * (1.0 + 1e-9), pairs=x, pair_steps=y, windows=window_counts(m, k, windows))
        return min(value, (gamma + value) / m), value, rule
    return caps


def leftover_trips(m: int, k: int) -> int:
    """r_k = m - 1 - q_k min(k, m): the single steps B(i) -> B(i + 1) left beside q_k round trips (module docstring).

    Example:
        >>> [leftover_trips(8, k) for k in (1, 2, 3, 8, 9)]
        [0, 1, 1, 7, 7]
    """
    return m - 1 - round_trip_factor(m, k) * min(k, m)


def stage_pace(m: int, k: int, fwd_s: float, bwd_s: float, round_trip_s: float, pair_s: float = 0.0) -> float:
    """G_s of one stage with k stages from it to the end (module docstring): the longest of its chains
    B(0) -> B(m - 1) (all round trips; pairs with the next stage, `pair_chain`, when `pair_s` =
    W_s + W_{s+1} + 2 C_s is given; all single steps), or its m micro-batches' work past its round trip.

    Example (m = 8, k = 3, F = 1, B = 2, R = 10: 2 round trips and 1 single step of F + B):
        >>> stage_pace(8, 3, 1.0, 2.0, 10.0)
        23.0
        >>> stage_pace(8, 3, 1.0, 2.0, 10.0, pair_s=9.0)   # 2 pairs of 9 s, then one round trip
        28.0
    """
    work = fwd_s + bwd_s
    kk = min(k, m)
    q = round_trip_factor(m, k)  # with q >= 1 the r single steps fit in the steady state (F between the Bs)
    trips = q * round_trip_s + leftover_trips(m, k) * work if q > 0 else 0.0
    singles = (m - kk) * work + (kk - 1) * bwd_s
    pairs = pair_chain(m, k, work, pair_s, round_trip_s) if pair_s > 0 else 0.0
    return max(trips, singles, pairs, m * work - round_trip_s)


def pair_counts(m: int, k: int) -> tuple[int, int] | None:
    """(x, y) of `pair_chain`: x = floor((m - 1 - k) / 2) pairs and y = (m - 1 - k) mod 2 single steps, or
    None where the chain does not exist (no next stage, or fewer than k + 1 micro-batches).

    Example:
        >>> pair_counts(8, 3), pair_counts(8, 2), pair_counts(8, 1), pair_counts(4, 5)
        ((2, 0), (2, 1), None, None)
    """
    left = m - 1 - k
    if k < 2 or left < 0:
        return None
    return left // 2, left % 2


def window_counts(m: int, k: int, widest: int) -> tuple[tuple[int, int, int], ...]:
    """(w, x, y) of the window chains of 3..`widest` ranks (`window_pace`) of a front stage with k stages to the
    end: w <= k, m - 1 - k = x w + y with x >= 1 (the chain needs k <= m - 1).

    Example:
        >>> window_counts(16, 4, 4), window_counts(16, 3, 4), window_counts(5, 4, 4)
        (((3, 3, 2), (4, 2, 3)), ((3, 4, 0),), ())
    """
    left = m - 1 - k
    return tuple((w, left // w, left % w) for w in range(3, min(widest, k) + 1) if left >= w)


def pair_chain(m: int, k: int, work_s: float, pair_s: float, round_trip_s: float) -> float:
    """A chain B(0) -> B(m - 1) on rank s through the pair window {s, s + 1} (module docstring, *Pairs*):
    x pairs of `pair_s` = W_s + W_{s+1} + 2 C_s, y single steps of W_s, then one round trip R_s
    (`pair_counts`); 0 where the chain does not exist.

    Example (m = 8, k = 2: B(0) -> B(2) -> B(4) by pairs, B(5) by a single step, B(7) by the round trip):
        >>> pair_chain(8, 2, 3.0, 8.0, 8.0)
        27.0
    """
    counts = pair_counts(m, k)
    if counts is None:
        return 0.0
    x, y = counts
    return x * pair_s + y * work_s + round_trip_s


def pace_terms(problem: Problem, stages: Sequence[Stage], *, windows: bool = False) -> tuple[float, float]:
    """(R_0, G) of a placement from its stage costs (`evaluate`), G = max_s `stage_pace`; with `windows`, G also
    takes every rank's window chains (`window_pace`: what the DPs leave out, for ranking and searching placements)."""
    costs = evaluate(problem, stages, objective="estimate").stages
    m, p = problem.microbatches, len(costs)
    suffix, g, after = 0.0, 0.0, 0.0  # after: W_{s+1}
    for s in range(p - 1, -1, -1):
        work, cut2 = costs[s].fwd_s + costs[s].bwd_s, (2.0 * costs[s].send_s if s < p - 1 else 0.0)
        suffix += work + cut2
        pair = work + after + cut2 if s < p - 1 else 0.0
        g = max(g, stage_pace(m, p - s, costs[s].fwd_s, costs[s].bwd_s, suffix, pair))
        after = work
    if windows:
        g = max(g, window_pace(m, [c.fwd_s + c.bwd_s for c in costs], [c.send_s for c in costs[:-1]]))
    return suffix, g


def window_pace(m: int, work_s: Sequence[float], send_s: Sequence[float]) -> float:
    """The longest window chain of any rank (module docstring, *Windows*): rank s with k = p - s stages from it
    to the end and a window of w = 2..k ranks s..s + w - 1, P_w = sum of their W + 2 sum of the w - 1 cuts
    between them; with m - 1 - k = x w + y, the chain B(0) -> B(m - 1) is x P_w + y W_s + R_s.  `work_s`: W per
    stage, `send_s`: C per cut (p - 1).  w = 2 is `pair_chain`, w = k the round trips; 0 for one stage.

    Example (stages of W = 3, 3, 3, 1 s, cuts of 1, 1, 0 s, m = 16: rank 0's window of three ranks takes
    9 + 2 x (1 + 1) = 13 s per three micro-batches, more per micro-batch than its pairs (8 s per two) and its
    round trips (R_0 = 14 s per four: the fast last stage); m - 1 - k = 11 = 3 x 3 + 2: 3 x 13 + 2 x 3 + 14 s,
    against 57 s for its pair chain):
        >>> window_pace(16, [3.0, 3.0, 3.0, 1.0], [1.0, 1.0, 0.0])
        59.0
    """
    p = len(work_s)
    if p < 2:
        return 0.0
    work = np.asarray(work_s, dtype=float)
    cut2 = np.concatenate((2.0 * np.asarray(send_s, dtype=float), [0.0]))
    ends = np.concatenate(([0.0], np.cumsum(work + cut2)))  # ends[j] = sum_{t<j} (W_t + 2 C_t)
    best = 0.0
    for s in range(max(0, p - m + 1), p - 1):  # k = p - s in 2..m - 1: at least one micro-batch left over
        k = p - s
        left = m - 1 - k
        w = np.arange(2, k + 1)
        windows = ends[s + w] - ends[s] - cut2[s + w - 1]  # P_w: the window's own cuts, not the one after it
        chains = (left // w) * windows + (left % w) * work[s] + (ends[p] - ends[s])
        best = max(best, float(chains.max()))
    return best


def staircase(points: dict[float, float], g_floor: float) -> tuple[float, float, float]:
    """(bound, band's low gamma, band's high gamma) of the weakest band: with gamma_0 < ... < gamma_n the
    caps solved (R_0*(inf) among them), a placement with G in (gamma_{i-1}, gamma_i] has
    R_0 + G > R_0*(gamma_i) + gamma_{i-1}; one with G <= gamma_0 has R_0 + G >= R_0*(gamma_0) + g_floor."""
    caps = sorted(points)
    best = (points[caps[0]] + g_floor, g_floor, caps[0])
    for low, high in zip(caps, caps[1:]):
        if points[high] + low < best[0]:
            best = (points[high] + low, low, high)
    return best


def _next_cap(points: dict[float, float], low: float, high: float, g_floor: float, enough_s: float,
              probed: bool) -> tuple[float, bool]:
    """`schedule_walk`'s next cap in the weakest band (low, high], and whether the probe under the least cap is spent."""
    if not math.isfinite(high):  # the top band (low, inf] is proved by R_0*(inf) + low: `enough_s` needs
        top = enough_s - points[math.inf]  # a cap at enough_s - R_0*(inf) at most (one pass, not a doubling)
        return (top if low < top < 2 * max(low, g_floor) else 2 * max(low, g_floor)), probed
    # one probe just under the least cap, then bisection (a relaxation's optimum may lie far below)
    if low <= g_floor and not probed:
        return max((low + high) / 2, PROBE * high), True
    return (low + high) / 2, probed


def schedule_walk(problem: Problem, *, deadline: float = math.inf, dp: CountDP | None = None,
                  max_passes: int = 48, hints: Sequence[Sequence[Stage]] = (),
                  terms: Callable[[Any], tuple[float, float]] | None = None, enough_s: float = math.inf,
                  pairs: bool = True, band_tolerance: float = 0.0, windows: int = 2) -> ScheduleWalk:
    """min_P (R_0 + G) bounded by a staircase over caps gamma (module docstring): each pass solves the
    least R_0 under one cap, in the weakest band (its middle; just below its top when the band
    reaches down to G_lb), until the bound meets the best placement found, `max_passes`, or
    `deadline` (a pass past it is abandoned).  The first cap is the least G of `hints` (placements of
    `problem`; R_0*(inf) >= S_lb stands in for the uncapped pass).  Raises `StateSpaceTooLarge`
    beyond the DP's budget.  `dp` may be any DP with `CountDP.min_sum`'s protocol whose placements
    `terms` prices (R_0, G) as the DP does (`pace_runs.RunDP`); by default the count DP and `pace_terms`.
    The walk also ends once its bound reaches `enough_s` (a caller that needs no tighter bound than that), or once
    the weakest band is narrower than `band_tolerance` times the bound (0: never; `BAND_TOLERANCE` for relaxations).
    Below the first cap it probes once at `PROBE` times the least cap, then bisects: infeasible caps cost almost
    nothing (the DP stops at its first empty level), and a relaxation's optimum may lie far below the hints
    (gpt2-xl on 256 cards: 20% below; one-percent steps took 22 passes, bisection 7)."""
    dp = CountDP(problem) if dp is None else dp
    terms = (lambda placement: pace_terms(problem, placement, windows=windows > 2)) if terms is None else terms
    m = problem.microbatches
    cards = min(problem.num_units, len(problem.devices))
    g_floor = round_trip_factor(m, cards) * sum_lower_bound(problem)  # G >= q_p R_0 >= q_p S_lb
    points: dict[float, float] = {}  # cap gamma -> least R_0 of the placements with G <= gamma (inf: none)
    found: list[tuple[float, tuple[Stage, ...]]] = []
    gamma, passes, probed = math.inf, 0, False
    if hints:
        points[math.inf] = sum_lower_bound(problem)
        gamma = min(pace_terms(problem, h, windows=windows > 2)[1] for h in hints)
    while passes < max_passes:
        caps = level_caps(m, gamma, pairs=pairs, windows=windows)
        # only R_0 under enough_s - low matters in the band (low, gamma] (`count_pass.Threshold`): a pass drops the
        # rest, and a floor of theta stands where nothing is left (the count DP only; `RunDP` has no prefix floor)
        theta = enough_s - max((c for c in points if c < gamma), default=g_floor) if isinstance(dp, CountDP) else math.inf
        try:
            res = dp.min_sum(max(caps(k)[0] for k in range(1, cards + 1)), level_caps=caps, deadline=deadline,
                             **({"threshold": theta} if math.isfinite(theta) else {}))
        except DeadlineReached:
            break
        passes += 1
        points[gamma] = min(theta, math.inf if res is None else res[0])
        if res is not None:
            real_r0, g = terms(res[1])
            found.append((real_r0 + g, res[1]))
            if g <= gamma:  # the caps at g admit it and no more than at gamma: R_0*(g) >= the same least R_0
                points.setdefault(g, res[0])
        if not found and not math.isfinite(points[gamma]):
            break  # nothing fits at all
        bound, low, high = staircase(points, g_floor)
        if bound >= min(min((v for v, _ in found), default=math.inf) * (1.0 - CAP_TOLERANCE), enough_s) \
                or time.perf_counter() > deadline or high - low <= band_tolerance * bound:
            break  # (a band that narrow: splitting it raises the bound by at most its width)
        gamma, probed = _next_cap(points, low, high, g_floor, enough_s, probed)
    if not found:  # inf only when the uncapped pass found nothing fits; 0 when no pass finished; else the floors
        bound = staircase(points, g_floor)[0] if passes and all(map(math.isfinite, points.values())) else 0.0
        return ScheduleWalk(math.inf if points.get(math.inf, 0.0) == math.inf else bound, (), False, passes,
                            tuple(points.items()), g_floor)
    bound = staircase(points, g_floor)[0]
    found.sort(key=lambda vs: vs[0])
    distinct = tuple(dict.fromkeys(s for _, s in found))  # passes under nearby caps often return the same one
    return ScheduleWalk(bound, distinct[:KEEP_PLACEMENTS],
                        bound >= found[0][0] * (1.0 - CAP_TOLERANCE), passes, tuple(points.items()), g_floor)
