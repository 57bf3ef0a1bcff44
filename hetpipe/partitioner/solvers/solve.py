"""`solve`: the best placement of a `Problem`, with proof of how good it is.

Strategy (issue #3):

1. A fast **heuristic** (`fixed_order.solve_fixed_order` on a few device orders, dropping
   the slowest devices one at a time) seeds everything below.
2. **Exact DP** (`dp.solve_exact`) over device-class count vectors whenever that space
   is small enough (`dp.DEFAULT_STATE_BUDGET`): it is exact for the whole contract
   (free device subset and order, memory, links), so its answer is reported as
   ``OPTIMAL`` with bound = objective.
3. Otherwise the node-free **relaxation** (`relax.relaxed_bound`) gives a valid lower
   bound and a realised placement; if the gap is above `GOOD_ENOUGH_GAP`, the
   **Lagrangian bound** (`lagrange.lagrange_bound`: every kind exact, card counts priced)
   tightens it; if the gap is still above and time is left, **CP-SAT** (`cpsat.solve_cpsat`) starts from the best placement as a hint, with
   a time limit and a seed.  The plan records solver, status, bound and gap.

4. **Bound and verify** (`verify.verify`): the estimate's answer (and, beyond the exact DP, the
   heuristic's and the relaxation's placements: `Solution.alternatives`) is priced by the schedule
   it will run (the objective, `evaluate`), improved by a local search under that schedule,
   and given a valid lower bound on the schedule optimum; the status is ``OPTIMAL`` only when
   they meet.  A problem whose objective is ``estimate`` (a plan made before version 4) stops
   after step 3.

**Time limit.**  ``time_limit_s`` is a deadline for all of the above: each search gets a share and checks the
clock between steps (a DP level, a pass, an annealing or local-search move, a window start's cap), and `verify`
(which gets what the estimate leaves, nothing where it used the whole limit) starts no step past the limit and a
schedule pricing only where it is forecast to end by then (`pricing.Pricer`).  One step may end past it: the
**final pricing**, the schedule replay of the answer `verify` returns where it has no time left (its first
candidate that fits; under ``recompute="auto"`` also the none pass's answer, `_at_most_floor`), with the
compile of its pipeline's program when that length is new: measured 2-11 ms of CPU at 32 cards, 0.1-0.2 s at
256 and 0.45-0.6 s at 1,024 (`pricing`), times the load.  So the wall of `solve` is at most the limit plus
that pricing, plus the step between two clock checks that spans the limit (a DP level, a window start's table, a
memory check of new pipeline positions: up to ~0.15 s of CPU at 1,024 cards; `benchmarks/results/limit_trace.md`).
Not bounded so: CP-SAT's least search (`MIN_CPSAT_S`, where ``solver="cpsat"`` insists on it) and its model's
build (`cpsat_build_s` forecasts it); the estimate's overrun of its share (its lattice, its first passes) comes out
of `verify`'s.

``solver="cpsat"`` always runs CP-SAT (hinted by the DP, relaxation or heuristic answer);
``solver="dp"`` insists on the exact DP.  Whatever runs, the returned placement is
re-evaluated with `problem.evaluate`, so T and memory are exactly the contract's.

Example:
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem
    >>> inf = float("inf")
    >>> prob = Problem(fwd_s={"a": (1.0,) * 4}, bwd_s={"a": (2.0,) * 4}, state_bytes=(1,) * 4,
    ...                activation_bytes=(1,) * 4, boundary_bytes=(0,) * 4,
    ...                devices=(DeviceSlot("d0", "a", "n", 100), DeviceSlot("d1", "a", "n", 100)),
    ...                bandwidth_bytes_s=((inf, 1.0), (1.0, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)),
    ...                microbatches=4)
    >>> sol = solve(prob)
    >>> sol.solver, sol.status, sol.iteration_s, round(sol.bound_s, 2), sol.unused_devices  # (m+p-1)(F+B)
    ('dp', 'OPTIMAL', 30.0, 30.0, ())

    (the schedule bound R_0 + G of `schedule_bound`: 12 s of round trip plus the last stage's 3 more
    micro-batches of 6 s meets T.)
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace

from hetpipe.errors import ConfigError, InfeasibleError
from hetpipe.partitioner.selective_mode import forced_problem, lift
from hetpipe.partitioner.solvers.cpsat import solve_cpsat
from hetpipe.partitioner.solvers.cap_walk import DPResult
from hetpipe.partitioner.solvers.dp import StateSpaceTooLarge, solve_exact
from hetpipe.partitioner.solvers.simple_bounds import simple_lower_bound
from hetpipe.partitioner.solvers.fixed_order import solve_fixed_order
from hetpipe.partitioner.solvers.infeasible import explain_infeasible
from hetpipe.partitioner.solvers.offload_walk import best_levers, tail_walk
from hetpipe.partitioner.solvers.lagrange import bottleneck_floor, lagrange_bound
from hetpipe.partitioner.problem import Problem, Stage, evaluate
from hetpipe.partitioner.solvers.relax import relaxed_bound
from hetpipe.partitioner.solvers.verify import verify

log = logging.getLogger(__name__)

SOLVERS = ("auto", "dp", "cpsat")
#: Devices dropped one by one (slowest first) when the heuristic looks for a shorter pipeline.
HEURISTIC_MAX_DROPPED = 4
#: Units x devices above which the exact DP is seeded with the heuristic's placement
#: (its bottleneck caps the DP's first passes; below this the DP is fast anyway).
SEED_ABOVE = 200
#: Share of the remaining time limit the relaxation bound may take on clusters beyond the DP.
RELAXATION_SHARE = 0.7
#: Gap to the relaxation bound under which CP-SAT is not started: in our measurements it did
#: not close a sub-1% gap on 64 cards within 10 s (benchmarks/planner_speed.py).
GOOD_ENOUGH_GAP = 0.01
#: Share of the time limit the schedule's local search may take at most (`verify.LOCAL_SEARCH_S` caps it)
#: where a placement is verified after `solve` (plan/build.py, tp_solve.py).
VERIFY_SHARE = 0.2
#: Share of `solve`'s time limit kept for `verify` (its pace walks and local search; it also gets whatever
#: the estimate's search leaves): measured on benchmarks/planner_scale.py, the walks at 256 and 1,024 cards
#: need 1-3 s on the 2-core VM and the estimate's search settles in 2-4 s there.
SCHEDULE_SHARE = 0.4
#: Share of the time left after the relaxation that the kind-exact Lagrangian bound may take
#: (`lagrange.lagrange_bound`); CP-SAT gets the rest if the gap is still above `GOOD_ENOUGH_GAP`.
LAGRANGE_SHARE = 0.6
#: Gap the Lagrangian bound aims for: below `GOOD_ENOUGH_GAP`, so reaching it settles the solve.
LAGRANGE_GAP = GOOD_ENOUGH_GAP / 2
#: Share of the estimate's time the searches with fewer levers may take together under an ``auto`` lever
#: (`_without_recompute`): half, so that auto's own estimate search keeps at least the other half.
NO_RECOMPUTE_SHARE = 0.5
#: Under ``recompute="auto"`` the ``none`` pass (`_none_floor`) is `--recompute none`'s own search within the limit
#: less this share, and auto returns at most its answer (`_at_most_floor`); auto's own search (levers on, seeded with
#: the none pass's placement, `_floor_seed`) gets the rest, so that its bound is auto's own (the none pass's is not
#: valid with levers) and the limit holds.  Session 13 gave the none pass the whole limit and auto's search this
#: share on top: 10.0-12.5 s of wall for a 10 s limit (`benchmarks/memory_levers.py` table 3).
LEVER_MIN_SHARE = 0.1
#: Least search time worth starting CP-SAT for, after its model is built.
MIN_CPSAT_S = 2.0
#: Seconds to build the CP-SAT model per (position x unit x class pair) term, measured on the
#: 2-core VM: 64 positions x 98 units x 8^2 class pairs took 1.9 s.
CPSAT_BUILD_S_PER_TERM = 1.9 / (64 * 98 * 64)
#: Seconds per (position x recompute item x kind) term of the recompute lever's prefix encoding,
#: measured on the 2-core VM: 96-layer GPT on 64 cards of 4 kinds, 2.5 s more with it (64 x 196 x 4).
CPSAT_LEVER_BUILD_S_PER_TERM = 2.5 / (64 * 196 * 4)


def cpsat_build_s(problem: Problem) -> float:
    """Estimated seconds to build the CP-SAT model of `problem` (see CPSAT_BUILD_S_PER_TERM)."""
    from hetpipe.partitioner.solvers.dp import device_classes

    classes = len(device_classes(problem))
    positions = min(problem.num_units, len(problem.devices))
    # the recompute lever (`cpsat_recompute`): per position, kind and item (two per unit) a prefix literal; with
    # the selective level (`cpsat_selective`) a second such set, the variant's
    sets = 2 if problem.selective is not None else 1
    lever = 2 * sets * problem.num_units * len(problem.fwd_s) if problem.recompute == "auto" else 0
    return positions * (CPSAT_BUILD_S_PER_TERM * problem.num_units * classes * classes
                        + CPSAT_LEVER_BUILD_S_PER_TERM * lever)


@dataclass(frozen=True)
class Solution:
    """A solved placement and how it was found."""

    stages: tuple[Stage, ...]
    solver: str  # dp | cpsat | relaxation | heuristic
    status: str  # OPTIMAL | FEASIBLE
    iteration_s: float
    bound_s: float  # proven lower bound on T (== iteration_s when OPTIMAL)
    wall_s: float
    unused_devices: tuple[int, ...]
    # other placements the search met (the heuristic's, the relaxation's realised): more starts for `verify`,
    # where an estimate-worse placement can be schedule-better (gpt2-xl on 1,024 cards: 29.47 s against 31.6 s)
    alternatives: tuple[tuple[Stage, ...], ...] = ()

    @property
    def gap(self) -> float:
        """Relative optimality gap (0 when proved optimal)."""
        if self.iteration_s <= 0:
            return 0.0
        return max(0.0, (self.iteration_s - self.bound_s) / self.iteration_s)


def device_speed_order(problem: Problem) -> list[int]:
    """Device indices, fastest kind first (by the whole model's time on that kind), ties by id order."""
    work = {k: sum(f + b for f, b in zip(problem.fwd_s[k], problem.bwd_s[k])) for k in problem.fwd_s}
    return sorted(range(len(problem.devices)), key=lambda d: work[problem.devices[d].kind])


def _candidate_orders(problem: Problem) -> list[list[int]]:
    """Device sequences worth trying: node blocks (fast nodes first / last), and plain speed order."""
    speed = device_speed_order(problem)
    rank = {d: i for i, d in enumerate(speed)}
    nodes: dict[str, list[int]] = {}
    for d in speed:
        nodes.setdefault(problem.devices[d].node, []).append(d)
    by_node = sorted(nodes.values(), key=lambda ds: sum(rank[d] for d in ds) / len(ds))
    blocks = [d for ds in by_node for d in ds]
    orders = [blocks, blocks[::-1], [d for ds in by_node[::-1] for d in ds], speed]
    out: list[list[int]] = []
    for order in orders:
        if order not in out:
            out.append(order)
    return out


def heuristic(problem: Problem, *, time_limit_s: float = 10.0, num_stages: int | None = None) -> DPResult | None:
    """Best fixed-order DP over `_candidate_orders`, also with the slowest devices left out."""
    start = time.perf_counter()
    best: DPResult | None = None
    speed = device_speed_order(problem)
    for order in _candidate_orders(problem):
        for dropped in range(0, HEURISTIC_MAX_DROPPED + 1):
            keep = set(speed[: len(speed) - dropped])
            seq = [d for d in order if d in keep][: problem.num_units]
            if not seq or (num_stages is not None and len(seq) != num_stages):
                continue
            left = time_limit_s - (time.perf_counter() - start)
            if left <= 0 and best is not None:
                return best
            res = tail_walk(problem, lambda p, _: solve_fixed_order(p, seq, time_limit_s=max(left, 0.0)))
            if res is not None and (best is None or res.iteration_s < best.iteration_s):
                best = res
    return best


def _unused(problem: Problem, stages: tuple[Stage, ...]) -> tuple[int, ...]:
    used = {st.device for st in stages}
    return tuple(i for i in range(len(problem.devices)) if i not in used)


def _from_dp(problem: Problem, res: DPResult, *, name: str, wall_s: float, proved: bool,
             bound_s: float = 0.0) -> Solution:
    """A Solution from a DP answer; `proved` only for the exact DP's completed walk."""
    if proved:
        return Solution(res.stages, name, "OPTIMAL", res.iteration_s, res.iteration_s, wall_s,
                        _unused(problem, res.stages))
    bound = min(bound_s, res.iteration_s)
    status = "OPTIMAL" if bound >= res.iteration_s * (1 - 1e-9) else "FEASIBLE"  # a bound that meets T proves it
    return Solution(res.stages, name, status, res.iteration_s, bound, wall_s, _unused(problem, res.stages))


def _better(a: DPResult | None, b: DPResult | None) -> DPResult | None:
    if a is None or (b is not None and b.iteration_s < a.iteration_s):
        return b
    return a


def solve(problem: Problem, *, solver: str = "auto", time_limit_s: float = 10.0, seed: int = 0,
          num_stages: int | None = None, explain: bool = True) -> Solution:
    """Best placement of `problem` (see the module docstring).

    Raises `InfeasibleError` (with the missing memory and what would help, unless `explain` is
    false: that search costs ~30 feasibility solves) when no placement fits, and `ConfigError` for
    an unknown solver name.  Under ``recompute="auto"`` (schedule objective) the answer is never above
    `--recompute none`'s: the same search runs first within 1 - `LEVER_MIN_SHARE` of the limit (`_none_floor`), auto's
    own gets the rest, and the better of the two answers is returned; under an ``auto`` lever the schedule search also starts from the
    estimate's answers with fewer levers (`_without_recompute`), so it never returns a T above theirs.
    """
    if problem.recompute == "selective":  # the level forced on every stage: its reduced problem (`selective_mode`)
        sol = solve(forced_problem(problem), solver=solver, time_limit_s=time_limit_s, seed=seed, num_stages=num_stages,
                    explain=explain)
        return replace(sol, stages=lift(sol.stages))
    begin = time.perf_counter()
    floor = _none_floor(problem, solver=solver, time_limit_s=(1.0 - LEVER_MIN_SHARE) * time_limit_s, seed=seed,
                        num_stages=num_stages)
    if floor is not None:  # auto's own search: what the none pass left of the limit
        time_limit_s = max(time_limit_s - (time.perf_counter() - begin), 0.0)
    begin = time.perf_counter()
    verify_s = 0.0 if problem.objective == "estimate" else SCHEDULE_SHARE * time_limit_s
    plain, hint = _without_recompute(problem, solver=solver, time_limit_s=NO_RECOMPUTE_SHARE * (time_limit_s - verify_s),
                                     seed=seed, num_stages=num_stages, with_none=floor is None)
    # the fewer-lever answers (and the none pass's) seed auto's search: the best one's bottleneck caps the DP's first
    # passes; after the none pass its placement is the seed the heuristic would look for (whose first fixed-order DP
    # alone took 0.8 s of CPU at 96 layers on 32 cards, most of auto's share)
    hint = _floor_seed(problem, hint, floor, num_stages)
    found = solve_estimate(problem, solver=solver, time_limit_s=time_limit_s - verify_s - (time.perf_counter() - begin),
                           seed=seed, num_stages=num_stages, explain=explain, hint=hint, heuristic_seed=floor is None)
    if problem.objective == "estimate":
        return found
    start = time.perf_counter()
    # the estimate's unused time too; none where it used the whole limit: `verify` then prices its first start that
    # fits and returns (the final pricing, the one step the limit allows past itself: module docstring, *Time
    # limit*; it had a quarter of its share, all of it past the limit)
    left_s = max(time_limit_s - (start - begin), 0.0)
    # the schedule search from auto's answers, the fewer-lever estimates' and none's schedule answer (auto's choices
    # contain theirs; `verify` returns at most its best start's T and anneals the plain view of auto as it does none)
    starts = list(dict.fromkeys([found.stages, *found.alternatives, *plain, *([floor.stages] if floor else [])]))
    checked = verify(problem, starts, num_stages=num_stages, limit_s=left_s)
    stages, value = _at_most_floor(problem, checked.stages, checked.iteration_s, floor)
    bound = min(checked.bound_s, value)  # the bound is auto's own (verify's, on `problem`); the none pass's is not
    status = "OPTIMAL" if bound >= value * (1 - 1e-9) else "FEASIBLE"
    return Solution(stages, found.solver, status, value, bound, found.wall_s + time.perf_counter() - start,
                    _unused(problem, stages))


def _floor_seed(problem: Problem, hint: tuple[Stage, ...] | None, floor: Solution | None,
                num_stages: int | None) -> tuple[Stage, ...] | None:
    """The seed of auto's estimate search: the better on `problem` of `hint` (the fewer-lever answer) and the none
    pass's placement (`floor`), each with its levers re-chosen (`_hinted`); `hint` where there is no none pass."""
    if floor is None:
        return hint
    best = _better(_hinted(problem, hint, num_stages), _hinted(problem, floor.stages, num_stages))
    return best.stages if best is not None else hint


def _at_most_floor(problem: Problem, stages: tuple[Stage, ...], value: float,
                   floor: Solution | None) -> tuple[tuple[Stage, ...], float]:
    """The better of auto's answer (`stages`, T `value`) and the none pass's `floor` (priced on `problem`: the same T,
    no lever set), so auto <= none whatever `verify`'s search did with the time it had."""
    if floor is None:
        return stages, value
    ev = evaluate(problem, floor.stages)
    return (floor.stages, ev.iteration_s) if ev.fits and ev.iteration_s < value else (stages, value)


def _none_floor(problem: Problem, *, solver: str, time_limit_s: float, seed: int,
                num_stages: int | None) -> Solution | None:
    """Under ``recompute="auto"`` and the schedule objective: `--recompute none`'s whole search (`solve` with
    ``recompute="none"``, no selective level, within `time_limit_s`: 1 - `LEVER_MIN_SHARE` of auto's), whose answer
    auto returns where its own is not better (`_at_most_floor`): auto <= none by construction.  Before (a none pass at half the limit, a start of
    auto's schedule search) auto stayed above none where that pass was cut short: 96 layers on 16 and 32 cards
    (`benchmarks/memory_levers.py` table 3), and on 8 without the start (2.4554 s against 2.4507 s;
    tests/test_recompute_auto_floor.py).  None when nothing fits so, or for other settings."""
    if problem.recompute != "auto" or problem.objective == "estimate":
        return None
    try:
        return solve(replace(problem, recompute="none", selective=None), solver=solver, time_limit_s=time_limit_s,
                     seed=seed, num_stages=num_stages, explain=False)
    except InfeasibleError:
        return None


def _fewer_levers(problem: Problem, with_none: bool = True) -> list[Problem]:
    """The same problem with the ``auto`` levers it offers partly off: offload ``never`` (recompute and the
    selective level kept), and (`with_none`) no lever at all; empty unless recompute or offload is ``auto``."""
    out: list[Problem] = []
    if problem.offload == "auto":
        out.append(replace(problem, offload="never"))
    if problem.recompute == "auto" and with_none:
        out.append(replace(problem, recompute="none", selective=None, offload="never" if problem.offload == "auto"
                           else problem.offload))
    return out


def _without_recompute(problem: Problem, *, solver: str, time_limit_s: float, seed: int, num_stages: int | None,
                       with_none: bool = True) -> tuple[list[tuple[Stage, ...]], tuple[Stage, ...] | None]:
    """Under an ``auto`` lever and the schedule objective: the estimate's answers of the same search with fewer
    levers (`_fewer_levers`; within `time_limit_s` together), which `solve` starts `verify` from, and the one whose
    estimate is least on `problem` (its levers re-chosen), which seeds auto's estimate search; ([], None) when
    none fits or for other settings.

    Why: ``auto``'s choices contain the fewer levers', so its T must never exceed theirs, but the schedule
    objective is searched locally (`verify`) from starts the estimate's solvers and pace walks find, and
    those differ once a lever lowers the estimate: 96 layers on 8 mixed cards (`benchmarks/memory_levers.py`,
    table 3) gave recompute auto 2.4554 s against none 2.4507 s, the no-recompute placement never reached from
    auto's starts; GPT-2 XL on the home lab at 1.15x its memory (`benchmarks/memory_tightness.py`) gave every
    lever 6.365 s (an offloading stage: the estimate's optimum) against 6.192 s with offload never.  Under
    ``recompute="auto"`` none's whole search (`_none_floor`) runs first, within 1 - `LEVER_MIN_SHARE` of the limit:
    its schedule answer is a start too, and auto returns it where its own is not better."""
    if problem.objective == "estimate":
        return [], None
    fewer, starts, best = _fewer_levers(problem, with_none), [], None
    begin = time.perf_counter()
    for k, sub in enumerate(fewer):
        left = time_limit_s - (time.perf_counter() - begin)
        try:
            found = solve_estimate(sub, solver=solver, time_limit_s=left / (len(fewer) - k), seed=seed,
                                   num_stages=num_stages, explain=False)
        except InfeasibleError:
            continue
        starts += [found.stages, *found.alternatives]
        best = _better(best, _hinted(problem, found.stages, num_stages))
    return starts, best.stages if best is not None else None


def solve_estimate(problem: Problem, *, solver: str = "auto", time_limit_s: float = 10.0, seed: int = 0,
                   num_stages: int | None = None, explain: bool = True,
                   hint: tuple[Stage, ...] | None = None, heuristic_seed: bool = True) -> Solution:
    """The placement the solvers prove best under the H-1F1B estimate (T and bound are the estimate's);
    `hint`, a placement that fits (e.g. the answer without a lever), seeds the search like the heuristic's, which
    runs beyond `SEED_ABOVE` unless `heuristic_seed` is false and `hint` fits."""
    if solver not in SOLVERS:
        raise ConfigError(f"unknown solver {solver!r}; use one of: {', '.join(SOLVERS)}")
    if not problem.devices:
        raise ConfigError("the cluster has no devices; add at least one device to the cluster file")
    start = time.perf_counter()
    warm = _hinted(problem, hint, num_stages)
    if problem.num_units * len(problem.devices) > SEED_ABOVE and (heuristic_seed or warm is None):
        warm = _better(heuristic(problem, time_limit_s=time_limit_s / 8, num_stages=num_stages), warm)
    try:  # the offload lever's outer walk around the DP (`offload_walk`; the DP alone without offload)
        exact = tail_walk(problem, lambda p, first: solve_exact(
            p, time_limit_s=time_limit_s - (time.perf_counter() - start), exact_stages=num_stages,
            seed=warm.stages if warm and first else None))
    except StateSpaceTooLarge as err:
        if solver == "dp":
            raise ConfigError(f"the exact DP is too large for this cluster ({err}); use --solver cpsat or auto") from None
        return _large(problem, warm, start=start, time_limit_s=time_limit_s, seed=seed, num_stages=num_stages,
                      explain=explain)
    if exact is None:
        raise _infeasible(problem, explain)
    if solver != "cpsat" or not exact.exact:
        return _from_dp(problem, exact, name="dp", wall_s=time.perf_counter() - start, proved=exact.exact,
                        bound_s=exact.bound_s)
    return _with_cpsat(problem, exact, lower_bound_s=exact.iteration_s, start=start, time_limit_s=time_limit_s,
                       seed=seed, num_stages=num_stages, explain=explain)


def _hinted(problem: Problem, hint: tuple[Stage, ...] | None, num_stages: int | None) -> DPResult | None:
    """`hint` as a seed of the search (its levers re-chosen for `problem`), or None when it does not fit."""
    if hint is None or (num_stages is not None and len(hint) != num_stages):
        return None
    stages = best_levers(problem, hint)
    ev = evaluate(problem, stages, objective="estimate")
    return DPResult(stages, ev.iteration_s, 0.0, 0, False) if ev.fits else None


def _infeasible(problem: Problem, explain: bool) -> InfeasibleError:
    """The error for no placement that fits: explained (`explain_infeasible`) or plain."""
    return explain_infeasible(problem) if explain else InfeasibleError("no placement fits in memory")


def _large(problem: Problem, warm: DPResult | None, *, start: float, time_limit_s: float, seed: int,
           num_stages: int | None, explain: bool = True) -> Solution:
    """Too large for the exact DP: relaxation bound + its realised placement, then CP-SAT."""
    if warm is None:
        warm = heuristic(problem, time_limit_s=time_limit_s / 8, num_stages=num_stages)
    left = time_limit_s - (time.perf_counter() - start)
    bound, real = relaxed_bound(problem, seed=warm.stages if warm else None,
                                time_limit_s=RELAXATION_SHARE * left, num_stages=num_stages)
    if math.isinf(bound):
        raise _infeasible(problem, explain)
    hint = _better(warm, real)
    bound = max(bound, simple_lower_bound(problem))
    left = time_limit_s - (time.perf_counter() - start)
    # the Lagrangian bound prices memory without the offload lever: valid only where no stage may offload
    if hint is not None and hint.iteration_s > bound * (1 + GOOD_ENOUGH_GAP) and left > 0 and problem.offload == "never":
        bound = max(bound, lagrange_bound(problem, best_s=hint.iteration_s, floor_s=bottleneck_floor(problem),
                                          time_limit_s=LAGRANGE_SHARE * left, target_gap=LAGRANGE_GAP).bound_s)
    left = time_limit_s - (time.perf_counter() - start) - cpsat_build_s(problem)
    if hint is not None and (hint.iteration_s <= bound * (1 + GOOD_ENOUGH_GAP) or left < MIN_CPSAT_S):
        sol = _from_dp(problem, hint, name="relaxation", wall_s=time.perf_counter() - start, proved=False,
                       bound_s=bound)
    else:
        sol = _with_cpsat(problem, hint, lower_bound_s=bound, start=start, time_limit_s=time_limit_s, seed=seed,
                          num_stages=num_stages, hint_name="relaxation" if hint is real else "heuristic",
                          explain=explain)
    others = tuple(dict.fromkeys(r.stages for r in (warm, real) if r is not None and r.stages != sol.stages))
    return replace(sol, alternatives=others)


def _with_cpsat(problem: Problem, hint: DPResult | None, *, lower_bound_s: float, start: float,
                time_limit_s: float, seed: int, num_stages: int | None, hint_name: str = "dp",
                explain: bool = True) -> Solution:
    """Run CP-SAT from `hint` for the time left; the better of the two, with the best bound known."""
    left = max(MIN_CPSAT_S, time_limit_s - (time.perf_counter() - start) - cpsat_build_s(problem))
    res = solve_cpsat(problem, time_limit_s=left, seed=seed, hint=hint.stages if hint else None,
                      num_stages=num_stages)
    wall = time.perf_counter() - start
    if res.stages is None:
        if res.status == "INFEASIBLE" and hint is None:
            raise _infeasible(problem, explain)
        if hint is None:
            raise InfeasibleError(f"no plan found within the {time_limit_s:g} s limit (CP-SAT: {res.status}); "
                                  "raise --time-limit")
        proved = hint.exact and hint.bound_s >= hint.iteration_s * (1 - 1e-9) and lower_bound_s >= hint.iteration_s * (1 - 1e-9)
        return _from_dp(problem, hint, name="dp" if proved else hint_name, wall_s=wall, proved=proved,
                        bound_s=lower_bound_s)
    stages, value = res.stages, res.iteration_s
    if hint is not None and hint.iteration_s < value:
        stages, value = hint.stages, hint.iteration_s  # float re-evaluation can favour the hint by a tick
    # CP-SAT models every lever the DP prices (recompute prefix, selective level, offload): its bound is the problem's
    bound = min(max(res.bound_s, lower_bound_s), value)
    status = "OPTIMAL" if res.status == "OPTIMAL" or bound >= value * (1 - 1e-6) else "FEASIBLE"
    return Solution(stages, "cpsat", status, value, bound, wall, _unused(problem, stages))


def solve_fixed(problem: Problem, stages: tuple[Stage, ...]) -> Solution:
    """Wrap a hand-made placement as a Solution (for tools that take a given split)."""
    ev = evaluate(problem, stages)
    return Solution(stages, "given", "FEASIBLE" if ev.fits else "INFEASIBLE", ev.iteration_s, 0.0, 0.0,
                    _unused(problem, stages))

