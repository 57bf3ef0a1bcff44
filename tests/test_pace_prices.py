"""Issue 12 item 3 (session 14): card counts priced into the node-run pace walk (`pace_prices`) against brute force.

* `price_floor` at a cap gamma is at most the least R_0 of the real placements (every recompute choice that fits)
  whose G (`pace_terms`) is at most gamma: a valid floor of the walk's staircase point there.
* `tighten`'s bound plus the least first step is at most the enumerated schedule optimum, as `verify._runs_walk`
  adds it to the plan's bound, and on these instances (a fast kind with fewer cards than the stages it would
  take) it is above the plain walk's on some.
Instances: 3-5 units on 3-5 cards on two nodes, one card of a fast kind, the rest of 1-2 slower kinds; node links
slower than the PCIe inside a node; per kind and unit its own F (B = 2F) and step.
"""

from __future__ import annotations

import math
import random

import pytest

from hetpipe.partitioner.problem import DeviceSlot, Problem, evaluate
from hetpipe.partitioner.solvers.pace_prices import price_floor, tighten
from hetpipe.partitioner.solvers.pace_runs import RunDP, run_terms
from hetpipe.partitioner.solvers.schedule_bound import pace_terms, schedule_walk
from hetpipe.partitioner.solvers.verify import first_step_floor
from tests.instances import all_placements, recompute_choices, two_node_schedule_problem

#: Relative slack of float sums taken in another order (as tests/test_contract_property.py's REL).
REL = 1e-9
#: Passes enough for the walk to end on these instances.
PASSES = 200
SEEDS = range(40)


def _instance(seed: int) -> Problem:
    """One card of the fast kind "f" (F 0.2-0.5 per unit), 2-4 of slower kinds (F 0.6-2.0), on two nodes."""
    rng = random.Random(seed)
    units, n = rng.randint(3, 5), rng.randint(3, 5)
    kinds = ["f"] + [rng.choice(("s0", "s1")) for _ in range(n - 1)]
    devs = tuple(DeviceSlot(f"d{i}", k, rng.choice(("n0", "n1")), 10**6) for i, k in enumerate(kinds))
    fwd = {k: tuple(rng.uniform(0.2, 0.5) if k == "f" else rng.uniform(0.6, 2.0) for _ in range(units))
           for k in sorted(set(kinds))}
    return two_node_schedule_problem(rng, devs, fwd, max_microbatches=12)


def _paces_and_optimum(prob: Problem) -> tuple[list[tuple[float, float]], float]:
    """(R_0, G) of every placement and recompute choice that fits, and the least replayed T."""
    paces, best = [], math.inf
    for placement in all_placements(prob):
        for choice in recompute_choices(prob, placement):
            ev = evaluate(prob, choice)
            if ev.fits:
                paces.append(pace_terms(prob, choice))
                best = min(best, ev.iteration_s)
    return paces, best


@pytest.mark.parametrize("seed", SEEDS)
def test_price_floor_is_at_most_the_least_real_round_trip(seed: int) -> None:
    prob = _instance(seed)
    paces, _ = _paces_and_optimum(prob)
    dp = RunDP(prob)
    # caps just above placements' G (the DP's caps on a stage's F + B have no slack for sums in another order)
    for gamma in sorted({g * (1 + 1e-7) for _, g in paces})[:6]:
        least = min(r0 for r0, g in paces if g <= gamma)
        for pairs in (True, False):
            floor = price_floor(dp, prob, gamma, pairs)
            assert floor is not None and floor <= least * (1 + REL), (seed, gamma, pairs, floor, least)


def test_tightened_walk_bounds_the_schedule_optimum() -> None:
    raised = 0
    for seed in SEEDS:
        prob = _instance(seed)
        _, best = _paces_and_optimum(prob)
        dp = RunDP(prob)
        walk = schedule_walk(prob, dp=dp, max_passes=PASSES, terms=lambda picks: run_terms(prob.microbatches, picks))
        bound = tighten(walk, dp, prob)
        assert bound >= walk.bound_s
        assert bound + first_step_floor(prob) <= best * (1 + REL), (seed, bound, walk.bound_s, best)
        raised += bound > walk.bound_s * (1 + 1e-6)
    assert raised >= 3, raised  # the instances exercise the pricing
