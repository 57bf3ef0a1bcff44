"""Bound and verify: the solvers' placements priced by the schedule they will run (issue 17, item 1).

The DP, the relaxation and CP-SAT search the H-1F1B estimate (`evaluate(..., objective="estimate")`),
which they solve exactly.  The objective is the simulated 1F1B iteration with every stage's
optimizer step (`evaluate`, ``objective="schedule"``), so `verify`:

1. prices each candidate placement the solvers found with the schedule, and from 16 cards the placement of
   least windowed pace among `window_starts.starts` (least window cap over node orders: `_window_start`);
2. anneals the `ANNEAL_CHAINS` best on the windowed pace (`pace_search.anneal_passes`, `ANNEAL_SHARE` of the time
   the walks leave, more passes as it allows: its moves reach across the pipeline, its pricing costs a fraction of a replay), then
   improves the best by a local search under the schedule itself (`_neighbours`: move a cut,
   swap or merge two neighbouring stages, move a stage to an unused card or split it onto one;
   the recompute choice re-derived each time), first improvement, while it gets faster and
   fits, within `LOCAL_MOVES` evaluations and `LOCAL_SEARCH_S` seconds;
3. records a **valid lower bound** on the schedule optimum over every placement:

       T_sched >= m * max_b (F_b + B_b + S_b / m)     (rank b runs m F, m B and its step in series)
       T_sched >= m * max_s C_s                      (one link direction carries m messages in series)

   so T_sched >= m * b', where b' is the least bottleneck ``max(F_s + B_s', C_s)`` over all
   placements that fit (`dp.least_bottleneck` on the problem with B' = B + S_u / m per unit
   and every link twice as fast, so that its 2 C' = C).  Beyond the DP's state budget, m times
   the whole model's fastest per-unit work over the number of cards.  And the fill:

       T_sched >= sum_{j<b} (F_j + B_j) + m W_b + S_0    for every stage b

   (stage b's first forward waits for micro-batch 0 to cross stages j < b, its last backward's
   gradient must cross them back, and stage 0 steps last), with W_b = F_b + B_b.  With
   K = max_b (P_b + m W_b), P_b = sum_{j<b} W_j: W_b <= (K - P_b) / m, so
   K - P_{b+1} >= (1 - 1/m)(K - P_b) and X = P_p <= K (1 - r^p), r = (m - 1) / m:
   T_sched >= X / (1 - r^p) + S_0 with X >= every unit on its fastest kind and p <= the cards
   (or units).  Equal stages with free links take (m + p - 1) W; this bound says
   pW / (1 - r^p), below by about a sixth at p = m = 4, within 5% once m >= 8p.

   With the offload lever an offloading stage's step is its tail O_b instead of S_b, so both
   bounds count each unit's least step over the two (`_step_floors`: O is linear in the parameters).

   And the pace bound (`schedule_bound`, issue 12 item 3): rank s's backwards B(0) -> B(m - 1) form chains of
   round trips R_s below it, of pairs with the next rank and of its own steps, so T >= R_0 + max_s G_s + S_0 for every placement
   (`schedule_bound.stage_pace`), minimised over placements by the DP under caps on that max (on the problem;
   beyond the count DP's budget, the larger of the node-run relaxation's walk, `pace_runs`, kinds exact and
   no card counts but those priced on its weakest bands (`pace_prices`), and a count relaxation's (kinds merged
   in groups, `relax.pace_relaxation`), the count one first where counts bind: `counts_bind`;
   the walks stop once their bound is within `ENOUGH_GAP` of the candidates' own pace); its placements, realised on real cards, are more
   starts for the local search when they beat the candidates (at most `MAX_WALK_STARTS`).  Time: a
   quarter of `limit_s` for the bottleneck pass, up to `PACE_SHARE` in all with the pace
   bound, the rest for the local search.  Last, once the answer is final and its gap is above 2%, a finer cut
   of the count relaxation's kinds walks to T / 1.02 (`finer_walk.raise_bound`: its threshold prunes on that
   target); where its forecast fits `finer_walk.FINER_SHARE` of `limit_s` that share is kept from the start
   (the shares above are of the rest) and handed back once the pace walks leave the gap within 2%.
   `limit_s` is a hard deadline: no DP pass, window start, annealing move or search step starts past it, and a schedule pricing only where it is forecast to end by it
   (`pricing.Pricer`), but the first pricing of a candidate that fits (the answer needs one).  Only for 1F1B: the split schedules (`Problem.schedule`) keep the
   bounds above.

The answer is OPTIMAL only when the bound meets it; otherwise the plan records the gap.  The
brute-force tests check bound <= the enumerated schedule optimum <= answer.

Example:
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage
    >>> inf = float("inf")
    >>> prob = Problem(fwd_s={"a": (1.0,) * 4}, bwd_s={"a": (2.0,) * 4}, state_bytes=(1,) * 4,
    ...                activation_bytes=(1,) * 4, boundary_bytes=(0,) * 4,
    ...                devices=(DeviceSlot("d0", "a", "n", 100),),
    ...                bandwidth_bytes_s=((inf,),), latency_s=((0.0,),), microbatches=4)
    >>> out = verify(prob, [(Stage(0, 0, 3),)])
    >>> out.iteration_s, out.bound_s   # one stage: m (F + B), the bound meets it
    (48.0, 48.0)
"""

from __future__ import annotations

import math
import time
from functools import partial
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

from hetpipe.partitioner.problem import Evaluation, Problem, Stage, evaluate
from hetpipe.partitioner.recompute import with_recompute
from hetpipe.partitioner.solvers.cap_walk import DeadlineReached
from hetpipe.partitioner.solvers.dp import CountDP, StateSpaceTooLarge, check_kinds_fit, least_bottleneck
from hetpipe.partitioner.solvers.finer_walk import TARGET_GAP, raise_bound, reserve_s
from hetpipe.partitioner.solvers.offload_walk import best_levers
from hetpipe.partitioner.solvers.pace_prices import tighten
from hetpipe.partitioner.solvers.pace_runs import RunDP, run_terms
from hetpipe.partitioner.solvers.pace_search import RESTART_STAGES, FastPace, anneal_passes, applies
from hetpipe.partitioner.solvers.pace_windows import widen
from hetpipe.partitioner.solvers.pricing import Pricer, price_in_order
from hetpipe.partitioner.solvers.relax import pace_relaxation, realised
from hetpipe.partitioner.solvers.schedule_bound import BAND_TOLERANCE, pace_terms, schedule_walk
from hetpipe.partitioner.solvers.window_starts import starts as window_starts

#: Schedule evaluations the local search may spend (each replays O(p m) actions).
LOCAL_MOVES = 3000
#: Share of `verify`'s time by which the pace walks must end (measured: the walks' placements gain more
#: than the local search does; benchmarks/planner_scale.py; 0.7 before session 11's annealing, which gains
#: more than the walks' last tenth at 64 cards, where their bound stays 25% below the answers).
PACE_SHARE = 0.6
#: Placements of the pace walks that start a local search (best first; each new pipeline length costs a
#: schedule compilation, seconds at 1,024 cards).
MAX_WALK_STARTS = 2
#: Share of the pace walks' time the count relaxation may take where card counts bind (`pace_bound`): the
#: node runs get the rest (a walk past its deadline keeps the passes it finished).
FIRST_WALK_SHARE = 0.65
#: Share of the node-run walks' time the pair-aware walk may take (`_runs_walk`; the walk without the pair
#: filter, whose placements realise faster, gets the rest: under load ~15 a first walk with all of it left none).
PAIR_WALK_SHARE = 0.5
#: Gap to the best candidate's R_0 + G + S_0 (at most its T) at which the pace walks stop tightening their
#: bound (a tighter one changes no answer; issue 12 item 3 asks for 2%).
ENOUGH_GAP = 0.005
#: Share of the time the pace walks leave that the annealing on the windowed pace takes (`pace_search`), before
#: the local search under the replayed schedule: on gpt2-xl at 64 cards (load ~10) one second of it reaches
#: 3.511 s from 3.604 s, where the replayed local search's moves stop at 3.548 s.
ANNEAL_SHARE = 0.75
#: Starts the annealing takes in turn (`pace_search.anneal_chains`), least windowed pace first: the least can sit
#: in a basin its moves do not leave (session 15, gpt2-xl on 64 cards: the window start 3.376 s of pace, annealed
#: 3.25-3.34 s over ten seeds; the next start, 3.60 s, annealed 3.25-3.27 s); one below `RESTART_STAGES` stages
#: (the suite's thousands of small `solve` calls: each chain stops after its first round without a new best).
ANNEAL_CHAINS = 2
#: Share of `verify`'s time the placements of least window cap may take to build, first (`window_starts`: four
#: orders, 1.0-1.3 s of CPU for gpt2-xl on 64 and 256 cards, where the best replays in 3.38 s and 7.83 s against
#: the candidates' 3.60 s and 8.11-9.57 s; past it the orders left are skipped, a cut bisection keeps its best).
WINDOW_STARTS_SHARE = 0.2
#: Fewest cards for which they are built: window chains of three or more stages set the pace of long pipelines
#: (gpt2-xl on 256 cards); the suite's thousands of small `solve` calls (a few cards) would pay milliseconds each.
WINDOW_STARTS_CARDS = 16
#: Seconds the local search may spend at most (by default; `solve` gives it a fifth of its time limit
#: when that is less).
LOCAL_SEARCH_S = 2.0


@dataclass(frozen=True)
class Verified:
    """The best placement under the schedule, its T and the valid lower bound on the optimum."""

    stages: tuple[Stage, ...]
    iteration_s: float
    bound_s: float
    improved: bool  # the local search beat every candidate


def schedule_bound(problem: Problem) -> float:
    """A lower bound on the schedule objective over every placement (module docstring, item 3)."""
    return _bound_and_placement(problem)[0]


def _bound_and_placement(problem: Problem, deadline: float = math.inf) -> tuple[float, tuple[Stage, ...] | None]:
    """`schedule_bound` and the placement of least bottleneck it found (another start for the search);
    past `deadline` (`time.perf_counter()` seconds) the least-bottleneck pass gives way to the cards' share."""
    m = problem.microbatches
    steps = _step_floors(problem, launch=False)
    bwd = {k: tuple(b + steps[k][u] / m for u, b in enumerate(problem.bwd_s[k]))
           for k in problem.bwd_s}
    cards = min(len(problem.devices), problem.num_units)
    placement = None
    try:
        if time.perf_counter() > deadline:  # no time for the pass: the cards' share (its copy alone is p^2 floats)
            raise DeadlineReached("the least-bottleneck pass has no time")
        check_kinds_fit(problem)  # before building the relaxed copy: its link tables are p^2 floats
        relaxed = replace(problem, bwd_s=bwd,
                          bandwidth_bytes_s=tuple(tuple(2.0 * b for b in row) for row in problem.bandwidth_bytes_s),
                          latency_s=tuple(tuple(0.5 * t for t in row) for row in problem.latency_s))
        least = least_bottleneck(relaxed, deadline=deadline)
        bottleneck = 0.0 if least is None else m * least[0]
        placement = None if least is None else _levers(problem, least[1])
    except (StateSpaceTooLarge, DeadlineReached):
        work = sum(min(problem.fwd_s[k][u] + bwd[k][u] for k in bwd) for u in range(problem.num_units))
        bottleneck = m * work / cards
    return max(bottleneck, fill_bound(problem, cards)), placement


def pace_bound(problem: Problem, *, deadline: float, hints: Sequence[Sequence[Stage]] = (),
               enough_s: float = math.inf) -> tuple[float, list[tuple[Stage, ...]]]:
    """`schedule_bound.schedule_walk`'s bound plus the least first step, and its placements on real cards.

    On the problem itself when its DP fits; else the larger of two relaxations' bounds: node runs with
    every kind exact and no card counts (`pace_runs.RunDP`) and a count relaxation with groups of kinds merged
    (`relax.pace_relaxation`), the second in the time the first leaves; their placements realised on
    real cards.  The count relaxation goes first where card counts bind (`counts_bind`): there the node
    runs, which may put every stage on the fastest kind, bound little.  0 and none when no walk finishes
    a pass by `deadline`; a bound of `enough_s` ends the relaxations' walks."""
    if time.perf_counter() > deadline:  # no pass could finish: the walks' DP tables are not even built
        return 0.0, []
    first_step = first_step_floor(problem)
    enough = enough_s - first_step
    try:  # on the problem itself the walk may end on the pace optimum: a plan proved OPTIMAL where it meets T
        walk = schedule_walk(problem, deadline=deadline, hints=hints, dp=CountDP(problem, deadline=deadline))
        return walk.bound_s + first_step, [_levers(problem, p) for p in walk.placements]
    except StateSpaceTooLarge:
        pass
    except DeadlineReached:  # its count vectors were not listed in time (`dp._Lattice.build`)
        return 0.0, []
    # where counts bind, the count relaxation first, with a share of the time (the node runs' placements are
    # still worth having); else the node runs first with all of it (the count relaxation is weak there)
    # (the node runs' prices on card counts only where they lead: at 64 cards 2.28 -> 2.51 s, under the count
    # relaxation's 3.07 s, for 2.3 s of CPU the walk for placements would lose)
    walks, first_share = (([_merged_walk, partial(_runs_walk, priced=False)], FIRST_WALK_SHARE) if counts_bind(problem, hints)
                          else ([_runs_walk, _merged_walk], 1.0))
    bound, placed = 0.0, []
    for walk_fn, share in zip(walks, (first_share, 1.0)):
        now = time.perf_counter()
        if now > deadline or bound >= enough:
            break
        found, more = walk_fn(problem, deadline=now + share * (deadline - now), hints=hints, enough_s=enough)
        bound, placed = max(bound, found), placed + more
    placed.sort(key=lambda p: sum(pace_terms(problem, p, windows=True)))  # realised: their own pace on real cards
    return (bound + first_step if bound else 0.0), placed


def counts_bind(problem: Problem, hints: Sequence[Sequence[Stage]]) -> bool:
    """Whether the most numerous kind has fewer cards than half the stages of the longest hint: then a
    relaxation without card counts (`pace_runs`) places most stages on kinds the cluster lacks cards of
    (llama-7b on 64 cards of eight kinds, 8 per kind, 25 stages: node runs 12.7 s, counts 14.9 s)."""
    kinds: dict[str, int] = {}
    for d in problem.devices:
        kinds[d.kind] = kinds.get(d.kind, 0) + 1
    return 2 * max(kinds.values(), default=0) < max((len(h) for h in hints), default=0)


def _runs_walk(problem: Problem, *, deadline: float, hints: Sequence[Sequence[Stage]],
               enough_s: float, priced: bool = True) -> tuple[float, list[tuple[Stage, ...]]]:
    """The node-run relaxation's walks (`pace_runs.RunDP`): their bound on R_0 + G and their placements realised.

    First with the pair chain (the bound: llama-7b on 1,024 cards 118.08 s against 111.79 s without) in
    `PAIR_WALK_SHARE` of the time, then, in the time left, without it for placements: the pair filter is a relaxation whose argmins break it, so
    that walk's placements realise slower (gpt2-xl on 256 cards: 9.28 s against 8.19 s without).  With `priced`,
    the pair walk's weakest bands are raised by pricing the card counts it drops (`pace_prices.tighten`)."""
    try:
        runs = RunDP(problem)
    except StateSpaceTooLarge:
        return 0.0, []
    bound, placed = 0.0, []
    for pairs, share in ((True, PAIR_WALK_SHARE), (False, 1.0)):
        now = time.perf_counter()
        if now > deadline or bound >= enough_s:
            break
        walk_deadline = now + share * (deadline - now)
        walk = schedule_walk(problem, deadline=walk_deadline, hints=hints, dp=runs, enough_s=enough_s, pairs=pairs,
                             terms=lambda picks: run_terms(problem.microbatches, picks), band_tolerance=BAND_TOLERANCE)
        # the card counts the relaxation drops, priced on its weakest bands (`pace_prices`: gpt2-xl on 256 cards
        # 7.675 -> 7.681 s in three passes); the walk for placements gets the time left
        bound = max(bound, tighten(walk, runs, problem, pairs=pairs, deadline=walk_deadline) if pairs and priced else walk.bound_s)
        placed += [_levers(problem, r) for r in map(runs.realise, walk.placements) if r is not None]
    return bound, placed


def _merged_walk(problem: Problem, *, deadline: float, hints: Sequence[Sequence[Stage]],
                 enough_s: float) -> tuple[float, list[tuple[Stage, ...]]]:
    """The count relaxation's walk (`relax.pace_relaxation`: kinds cut into groups of least merge loss, each at
    its fastest member's speed): its bound and placements realised."""
    # the groups are chosen for pipelines as long as the candidate of least pace (what the bound must meet)
    best = min(hints, key=lambda h: sum(pace_terms(problem, h, windows=True)), default=None)
    relaxed, members = pace_relaxation(problem, stages=None if best is None else len(best))
    try:  # the relaxation prices the hints lower or equal
        dp = CountDP(relaxed, deadline=deadline)  # its lattice checks the deadline (seconds)
        walk = schedule_walk(relaxed, deadline=deadline, hints=hints, enough_s=enough_s, band_tolerance=BAND_TOLERANCE,
                             dp=dp)
    except (StateSpaceTooLarge, DeadlineReached):
        return 0.0, []
    real = [realised(problem, relaxed, members, p, deadline=deadline) for p in walk.placements]
    # window chains of three ranks in the time the plain walk leaves, if any (`pace_windows`: gpt2-xl on 64 cards
    # 3.070 -> 3.107 s given 12 CPU s, 3.110 s at 14; a windowed walk from the start ends lower under a limit)
    bound = widen(walk, dp, relaxed, deadline=deadline, enough_s=enough_s)
    return bound, [_levers(problem, r.stages) for r in real if r is not None]


def first_step_floor(problem: Problem) -> float:
    """The least step stage 0 can take: unit 0's least step floor over the kinds (`_step_floors`)."""
    return min(s[0] for s in _step_floors(problem, launch=True).values())


def _step_floors(problem: Problem, *, launch: bool) -> dict[str, tuple[float, ...]]:
    """Per kind, per unit: the least a unit adds to its stage's step in the schedule.  S_u (with the kind's
    launch share when `launch`), or, where a stage on that kind may offload, the least of S_u and the
    unit's share of O_s: its parameters (grad_bytes // bytes per parameter, which sum to at most the
    stage's P_s) at the fastest host link and memory of a card of the kind (no launch on the host)."""
    kinds = set(problem.fwd_s)
    out = {k: tuple(s + (problem.step_launch_s.get(k, 0.0) if launch else 0.0) for s in problem.step_s[k])
           if k in problem.step_s else (0.0,) * problem.num_units for k in kinds}
    rates = problem.offload_rates
    if problem.offload == "never" or rates is None or rates.host_bytes_per_param <= 0 or not problem.grad_bytes:
        return out
    for k in kinds:
        per_param = min((rates.link_bytes_per_param / d.host_link_bytes_s + rates.step_bytes_per_param / d.host_memory_bytes_s
                         for d in problem.devices if d.kind == k and d.host_link_bytes_s > 0 and d.host_memory_bytes_s > 0),
                        default=math.inf)
        if not math.isinf(per_param):
            out[k] = tuple(min(s, problem.grad_bytes[u] // rates.grad_bytes_per_param * per_param)
                           for u, s in enumerate(out[k]))
    return out


def fill_bound(problem: Problem, cards: int) -> float:
    """X / (1 - r^p) + S_0 of the module docstring (item 3), p = `cards`.

    Example:
        >>> from hetpipe.partitioner.problem import DeviceSlot
        >>> prob = Problem(fwd_s={"a": (1.0,) * 4}, bwd_s={"a": (2.0,) * 4}, state_bytes=(1,) * 4,
        ...                activation_bytes=(1,) * 4, boundary_bytes=(0,) * 4,
        ...                devices=(DeviceSlot("d0", "a", "n", 100),) * 4,
        ...                bandwidth_bytes_s=((1.0,) * 4,) * 4, latency_s=((0.0,) * 4,) * 4, microbatches=4)
        >>> round(fill_bound(prob, 4), 3)   # 12 / (1 - 0.75^4); equal stages of W = 3 take 7 x 3 = 21
        17.554
    """
    m = problem.microbatches
    work = sum(min(problem.fwd_s[k][u] + problem.bwd_s[k][u] for k in problem.fwd_s) for u in range(problem.num_units))
    return work / (1.0 - ((m - 1) / m) ** cards) + first_step_floor(problem)


def _neighbours(problem: Problem, stages: tuple[Stage, ...]) -> Iterator[tuple[Stage, ...]]:
    """Placements one move away, recompute sets re-derived: a cut moved anywhere between its neighbours,
    two neighbouring stages swapped or merged onto one of their cards, a stage moved to an unused card
    or split onto one (one card per kind and node: the others are the same to the schedule)."""
    return (_levers(problem, c) for c in _moves(problem, tuple(replace(st, recompute_units=()) for st in stages)))


def _levers(problem: Problem, stages: Sequence[Stage]) -> tuple[Stage, ...]:
    """`stages` with their levers re-derived: the recompute prefix, and where a stage may offload the best
    offload choice under the schedule among each stage's tail as the cap (`offload_walk.best_levers`)."""
    if problem.offload == "never":
        return with_recompute(problem, stages)
    return best_levers(problem, stages, "schedule")


def _moves(problem: Problem, plain: tuple[Stage, ...]) -> Iterator[tuple[Stage, ...]]:
    """The moves of `_neighbours`, without recompute sets, lazily."""
    for s in range(len(plain) - 1):
        a, b = plain[s], plain[s + 1]
        for cut in range(a.first_unit, b.last_unit):
            if cut != a.last_unit:
                yield plain[:s] + (replace(a, last_unit=cut), replace(b, first_unit=cut + 1)) + plain[s + 2:]
        yield plain[:s] + (replace(a, device=b.device, members=b.members),
                           replace(b, device=a.device, members=a.members)) + plain[s + 2:]  # groups swap whole
        for dev in (a.device, b.device):
            yield plain[:s] + (Stage(dev, a.first_unit, b.last_unit),) + plain[s + 2:]
    used = {d for st in plain for d in (st.members or (st.device,))}  # a group's members are all used
    spare = {(d.kind, d.node): i for i, d in reversed(list(enumerate(problem.devices))) if i not in used}
    for s, st in enumerate(plain):
        for dev in spare.values():
            yield plain[:s] + (replace(st, device=dev, members=()),) + plain[s + 1:]
            for cut in range(st.first_unit, st.last_unit):
                head, tail = replace(st, last_unit=cut), replace(st, first_unit=cut + 1)
                yield plain[:s] + (head, replace(tail, device=dev, members=())) + plain[s + 1:]
                yield plain[:s] + (replace(head, device=dev, members=()), tail) + plain[s + 1:]


def verify(problem: Problem, candidates: Sequence[Sequence[Stage]], *, num_stages: int | None = None,
           limit_s: float = LOCAL_SEARCH_S) -> Verified:
    """The fastest of `candidates` (and of the least-bottleneck placement) under the schedule, each
    locally improved (keeping `num_stages` stages when given), with `schedule_bound`."""
    start_s = time.perf_counter()
    # the finer kind cut's walk runs last, on the final T (`finer_walk`); its share is kept where its forecast fits
    kept_s = reserve_s(problem, stages=len(candidates[0]) if candidates else 0, limit_s=limit_s)
    limit_s -= kept_s
    # the hard deadline: past it nothing starts, and a pricing only where it is forecast to end in time (`Pricer`),
    # but the first pricing of a candidate that fits (the answer needs one: `solve`'s allowance past its limit)
    pricer = Pricer(problem, deadline=start_s + max(limit_s, 0.0), price_fn=evaluate)
    bound, least = _bound_and_placement(problem, start_s + limit_s / 4)
    # the pace bound's round trips follow 1F1B's order (F(i + k) right after B(i)); the split schedules keep theirs
    starts = [tuple(c) if problem.offload == "never" else _levers(problem, c) for c in candidates]
    # the answer's pricing first, within the limit where the limit leaves any time (a compile: 0.5 s at 1,024 cards)
    priced = price_in_order(pricer, starts, first_only=True)
    # the walks stop near the candidates' own pace (at most their T, cheap to price: no schedule replay); not the
    # window start's, whose lower pace may not replay faster (llama-7b on 1,024 cards: the bound 117.80 -> 117.51 s)
    enough_s = min((sum(pace_terms(problem, c, windows=True)) for c in starts), default=math.inf) + first_step_floor(problem)
    # the window start only where its pace promises more than `ENOUGH_GAP` (its replay compiles a new pipeline
    # length: at 1,024 cards `verify` overran its time by 0.6 s of CPU for 0.15%)
    starts += [w for w in _window_start(problem, num_stages, deadline=start_s + WINDOW_STARTS_SHARE * limit_s,
                                        hard_deadline=pricer.deadline)
               if sum(pace_terms(problem, w, windows=True)) + first_step_floor(problem) < enough_s * (1.0 - ENOUGH_GAP)]
    paced, placed = (pace_bound(problem, deadline=start_s + PACE_SHARE * limit_s, hints=candidates,
                                enough_s=enough_s * (1.0 - ENOUGH_GAP)) if problem.schedule == "1f1b" else (0.0, []))
    bound = max(bound, paced)
    priced = price_in_order(pricer, starts, priced)  # a new pipeline length compiles its schedule once (seconds)
    starts = [c for c in starts if c in priced]  # past the deadline: those priced in time
    given_s = min((ev.iteration_s for ev in priced.values() if ev.fits), default=math.inf)
    if kept_s and bound * (1.0 + TARGET_GAP) >= given_s:  # within the target: the searches get the kept time back
        pricer.deadline, limit_s, kept_s = pricer.deadline + kept_s, limit_s + kept_s, 0.0
    now = time.perf_counter()
    # where the bound is within `ENOUGH_GAP` of the given answer no search pays (1,024 cards: 0.5%, and the
    # annealed placement's replay would compile a new pipeline length, seconds there)
    annealed = (_annealed(problem, starts + placed, priced, num_stages, now + ANNEAL_SHARE * pricer.left_s(),
                          floor_s=bound - first_step_floor(problem), pricer=pricer)
                if bound < given_s * (1.0 - ENOUGH_GAP) and pricer.left_s() > 0 else [])
    walked = 0
    for extra in ([least] if least is not None else []) + placed:
        if pricer.left_s() <= 0 or walked >= MAX_WALK_STARTS:
            break
        if (num_stages is None or len(extra) == num_stages) and extra not in priced and pricer.fits(extra):
            priced[extra] = ev = pricer.price(extra)
            if extra is least or (ev.fits and ev.iteration_s < given_s):  # the walk's: only what beats the given
                starts.append(extra)
                walked += extra is not least
    limit_s = max(0.0, limit_s - (time.perf_counter() - start_s))
    best, best_s, first_s = _searched(problem, starts, annealed, priced, num_stages, limit_s, pricer)
    # the answer is final: the finer kind cut's walk to T / 1.02 in the kept time and what is left, if its forecast fits
    bound = raise_bound(problem, best, iteration_s=best_s, bound_s=bound, step_s=first_step_floor(problem),
                        deadline=pricer.deadline + kept_s)
    return Verified(best, best_s, min(bound, best_s), best_s < first_s)


def _searched(problem: Problem, starts: list[tuple[Stage, ...]], annealed: list[tuple[Stage, ...]],
              priced: dict[tuple[Stage, ...], Evaluation], num_stages: int | None, limit_s: float,
              pricer: Pricer) -> tuple[tuple[Stage, ...], float, float]:
    """`_local_search` from each start and annealed placement that fits, `limit_s` shared among them: (the best
    placement found, its T, the least T of the starts but the annealed ones)."""
    best, best_s, first_s = None, math.inf, math.inf
    for start in starts + annealed:
        ev = priced[start]
        if not ev.fits:
            continue
        first_s = min(first_s, ev.iteration_s) if start not in annealed else first_s
        found, found_s = _local_search(problem, start, ev.iteration_s, num_stages, limit_s / len(starts + annealed),
                                       pricer=pricer)
        if found_s < best_s:
            best, best_s = found, found_s
    if best is None:
        raise ValueError("verify needs at least one candidate placement that fits")
    return best, best_s, first_s


def _annealed(problem: Problem, starts: list[tuple[Stage, ...]], priced: dict[tuple[Stage, ...], Evaluation],
              num_stages: int | None, deadline: float, floor_s: float,
              pricer: Pricer | None = None) -> list[tuple[Stage, ...]]:
    """`pace_search.anneal_passes` until `deadline` from the `ANNEAL_CHAINS` distinct starts of least windowed pace
    that fit (the given candidates, the walks' placements and `_window_start`: no replay needed to choose): [its placement] (priced into `priced`)
    when it is new and fits, else []; nothing where the pace search does not apply (levers, groups, split
    schedules; under `auto` it anneals the plain view, `_plain_view`) or the stage count is fixed; `floor_s` (the bound less the least step) ends it early.
    With `pricer`, the annealing ends in time for its placement's pricing (forecast for a new pipeline length) before
    the pricer's deadline, and a placement whose pricing is not forecast to end by then is dropped."""
    plain = _plain_view(problem)
    if num_stages is not None or not applies(plain):
        return []
    pace = FastPace(plain)
    fitting = [s for s in starts if not any(st.recompute_units or st.offload or st.selective for st in s)
               and (priced[s] if s in priced else evaluate(problem, s, objective="estimate")).fits]
    if not fitting:
        return []
    chains = sorted(dict.fromkeys(fitting), key=pace.value)
    chains = chains[:ANNEAL_CHAINS if len(chains[0]) >= RESTART_STAGES else 1]  # short: one chain, as it stops early
    if pricer is not None:
        deadline = min(deadline, pricer.deadline - pricer.forecast_s(chains[0], new=True))
    found = anneal_passes(plain, chains, deadline=deadline, floor_s=floor_s)
    if found in priced or (pricer is not None and not pricer.fits(found)):
        return []
    priced[found] = ev = pricer.price(found) if pricer is not None else evaluate(problem, found, objective="schedule")
    return [found] if ev.fits else []


def _window_start(problem: Problem, num_stages: int | None, *, deadline: float,
                  hard_deadline: float = math.inf) -> list[tuple[Stage, ...]]:
    """[The placement of least windowed pace among `window_starts`'] (a candidate like the solvers': gpt2-xl on
    256 cards 7.88 s against their 8.11-9.57 s), or [] below `WINDOW_STARTS_CARDS` cards, with a fixed stage
    count, or where the pace search does not apply (as `_annealed`)."""
    plain = _plain_view(problem)
    if num_stages is not None or len(problem.devices) < WINDOW_STARTS_CARDS or not applies(plain):
        return []
    built = window_starts(plain, deadline=deadline, hard_deadline=hard_deadline)
    return [min(built, key=FastPace(plain).value)] if built else []


def _plain_view(problem: Problem) -> Problem:
    """`problem` without the levers a solver may leave unused (``recompute="auto"``, the selective level,
    ``offload="auto"``): a placement with no lever set costs the same in both, so `anneal` (plain placements
    only) also searches under ``auto`` (`solve`: auto never above none)."""
    if problem.recompute == "all" or problem.offload == "all":
        return problem
    return replace(problem, recompute="none", offload="never", selective=None)


def _local_search(problem: Problem, best: tuple[Stage, ...], best_s: float, num_stages: int | None,
                  limit_s: float, pricer: Pricer | None = None) -> tuple[tuple[Stage, ...], float]:
    """First-improvement descent over `_neighbours` within `LOCAL_MOVES` evaluations and `limit_s`; with `pricer`,
    a move whose pricing is not forecast to end by its deadline is skipped (one of a new pipeline length compiles),
    and none is tried past it (a search after one that overran its `limit_s` would end past it by as much)."""
    start, moves, better = time.perf_counter(), 0, True
    end = start + limit_s if pricer is None else min(start + limit_s, pricer.deadline)
    while better and moves < LOCAL_MOVES and time.perf_counter() < end:
        better = False
        for cand in _neighbours(problem, best):
            if num_stages is not None and len(cand) != num_stages:
                continue
            moves += 1
            if moves >= LOCAL_MOVES or time.perf_counter() > end:
                break
            if pricer is not None and not pricer.fits(cand):
                continue
            ev = pricer.price(cand) if pricer is not None else evaluate(problem, cand, objective="schedule")
            if ev.fits and ev.iteration_s < best_s * (1 - 1e-12):
                best, best_s, better = cand, ev.iteration_s, True
                break
    return best, best_s
