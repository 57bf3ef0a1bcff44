"""Issue 12 item 3: the pace walk's count relaxation (`relax.pace_relaxation`) against brute force.

The kinds, fastest first, are cut into consecutive groups, each merged at its fastest member's speed
(`relax.merge_groups`), the cut of least `relax.merge_loss` whose DP fits the budget.  Whatever the cut,
the walk on the merged problem plus the least first step must stay at most the enumerated schedule optimum
(what `verify._merged_walk` adds to the plan's bound); small budgets force merges on these instances.
Kinds here have per-unit times of their own (not one speed factor), so merging changes the relative costs.
"""

from __future__ import annotations

import random

import pytest

from hetpipe.partitioner.problem import DeviceSlot, Problem, evaluate
from hetpipe.partitioner.solvers.relax import merge_loss, pace_relaxation, relaxed_problem
from hetpipe.partitioner.solvers.schedule_bound import BAND_TOLERANCE, schedule_walk
from hetpipe.partitioner.solvers.verify import first_step_floor
from tests.instances import all_placements, two_node_schedule_problem

#: Relative slack of float sums taken in another order (as tests/test_contract_property.py's REL).
REL = 1e-9
#: Passes enough for the walk to end on these instances (3-5 units, 3-4 cards).
PASSES = 200
KINDS = ("k0", "k1", "k2", "k3")


def _instance(seed: int) -> Problem:
    """3-5 units, 3-4 cards of 2-4 kinds on two nodes (slower links between them), per kind and unit its own
    F (B = 2F) and optimizer step, 2-8 micro-batches."""
    rng = random.Random(seed)
    units, n = rng.randint(3, 5), rng.randint(3, 4)
    kinds = KINDS[:rng.randint(2, 4)]
    devs = tuple(DeviceSlot(f"d{i}", rng.choice(kinds), rng.choice(("n0", "n1")), 10**6) for i in range(n))
    used = sorted({d.kind for d in devs})
    fwd = {k: tuple(rng.uniform(0.2, 2.0) for _ in range(units)) for k in used}
    return two_node_schedule_problem(rng, devs, fwd, max_microbatches=8)


def _schedule_optimum(prob: Problem) -> float:
    return min(evaluate(prob, placement).iteration_s for placement in all_placements(prob))


@pytest.mark.parametrize("seed", range(60))
def test_merged_pace_walk_bounds_the_schedule_optimum(seed: int) -> None:
    prob = _instance(seed)
    best = _schedule_optimum(prob)
    for budget in (1, 12, 40, 10**9):  # 1: everything merges; 10**9: the node-free problem itself
        relaxed, members = pace_relaxation(prob, state_budget=budget)
        assert sorted(k for g in members.values() for k in g) == sorted(prob.fwd_s)
        walk = schedule_walk(relaxed, max_passes=PASSES, band_tolerance=BAND_TOLERANCE)
        assert walk.bound_s + first_step_floor(prob) <= best * (1 + REL), (seed, budget, members, walk, best)


def test_cut_is_consecutive_and_loses_least() -> None:
    """Four kinds of two cards (model F + B 1, 1.1, 3, 3.2 per unit) and a budget that fits two groups
    (rows: 72 for a + b | c + d, 64 for a | b + c + d and a + b + c | d, 204 for three groups).  Pipelines of
    four stages use the a and b cards: a | b + c + d keeps both exact; of six stages they use two c cards too,
    which that cut would run at b's speed (loss 4 x 0.63 + 6 x 0.63), a + b | c + d only speeds b up by a tenth;
    of two stages only the a cards: no cut loses anything and the finer one is kept."""
    devs = tuple(DeviceSlot(f"{k}{i}", k, "n", 9) for k in "abcd" for i in range(2))
    speed = {"a": 1.0, "b": 1.1, "c": 3.0, "d": 3.2}
    prob = Problem({k: (s / 3,) * 3 for k, s in speed.items()}, {k: (2 * s / 3,) * 3 for k, s in speed.items()},
                   (1,) * 3, (1,) * 3, (0,) * 3, devs, ((1.0,) * 8,) * 8, ((0.0,) * 8,) * 8, 4)
    plain = relaxed_problem(prob)
    for stages, want in ((4, [("a",), ("b", "c", "d")]), (6, [("a", "b"), ("c", "d")]), (2, [("a", "b"), ("c", "d")])):
        _, members = pace_relaxation(prob, stages=stages, state_budget=80)
        assert sorted(members.values()) == want, stages
        assert merge_loss(plain, [list(g) for g in want], stages) == min(
            merge_loss(plain, cut, stages) for cut in ([["a", "b"], ["c", "d"]], [["a"], ["b", "c", "d"]],
                                                       [["a", "b", "c"], ["d"]]))
