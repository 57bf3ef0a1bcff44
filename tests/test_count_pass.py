"""Issue 12 item 3 (session 16): the count DP's threshold prune and dead-row skip (`solvers/count_pass.py`), and the
pace walk that passes its target down as the threshold (`schedule_bound.schedule_walk`).

The threshold drops states whose least value plus a floor on any prefix (`prefix_floor`) reaches theta, so a pass
must give the same least R_0 as the full pass whenever that is under theta and nothing otherwise (the walk then
records theta, a floor); the floor itself must be at most every real prefix.  Small random instances: 5-6 units on
4-5 cards of one or two kinds, two nodes, 8-24 micro-batches, caps from none to the pace optimum's neighbourhood,
windows of 2-4 ranks in the filters.
"""

from __future__ import annotations

import functools
import math
import random

import pytest

from hetpipe.partitioner.problem import DeviceSlot, Problem, evaluate
from hetpipe.partitioner.solvers.count_pass import prefix_floor
from hetpipe.partitioner.solvers.dp import CountDP
from hetpipe.partitioner.solvers.schedule_bound import level_caps, pace_terms, schedule_walk
from hetpipe.partitioner.solvers.verify import first_step_floor
from tests.instances import all_placements, two_node_schedule_problem

#: Relative slack of float sums taken in another order (as tests/test_contract_property.py's REL).
REL = 1e-9
#: Passes enough for the walks to end on these instances.
PASSES = 200


def _instance(seed: int) -> Problem:
    """5-6 units on 4-5 cards of one or two kinds on two nodes, 8-24 micro-batches (`two_node_schedule_problem`)."""
    rng = random.Random(1000 + seed)
    units, n = rng.randint(5, 6), rng.randint(4, 5)
    devs = tuple(DeviceSlot(f"d{i}", rng.choice(("k0", "k1")), rng.choice(("n0", "n1")), 10**6) for i in range(n))
    fwd = {k: tuple(rng.uniform(0.2, 2.0) for _ in range(units)) for k in sorted({d.kind for d in devs})}
    prob = two_node_schedule_problem(rng, devs, fwd, max_microbatches=8)
    return Problem(**{**prob.__dict__, "microbatches": rng.randint(8, 24)})


@functools.lru_cache(maxsize=None)
def _optima(seed: int) -> tuple[float, float, tuple[float, ...]]:
    """(least R_0 + G with every window, least replayed T, the G of every placement) of `_instance(seed)`."""
    prob = _instance(seed)
    pace, sched, paces = math.inf, math.inf, []
    for placement in all_placements(prob):
        r0, g = pace_terms(prob, placement, windows=True)
        pace, paces = min(pace, r0 + g), paces + [g]
        sched = min(sched, evaluate(prob, placement).iteration_s)
    return pace, sched, tuple(sorted(paces))


@pytest.mark.parametrize("seed", range(12))
def test_threshold_pass_gives_the_same_verdict(seed: int) -> None:
    """At any cap and theta: the full pass's least R_0 where it is under theta, else nothing."""
    prob = _instance(seed)
    dp = CountDP(prob)
    paces = _optima(seed)[2]
    cards = min(prob.num_units, len(prob.devices))
    checked = 0
    for gamma in (math.inf, paces[-1], paces[len(paces) // 2], paces[len(paces) // 8], paces[0]):
        for windows in (2, 3, 4):
            caps = level_caps(prob.microbatches, gamma, windows=windows)
            band = max(caps(k)[0] for k in range(1, cards + 1))
            full = dp.min_sum(band, level_caps=caps)
            thetas = [0.5, 1.0] if full is None else [full[0] * f for f in (0.9, 1.0, 1.0 + 1e-6, 1.05, 2.0)]
            for theta in thetas:
                cut = dp.min_sum(band, level_caps=caps, threshold=theta)
                if full is None or full[0] >= theta:
                    assert cut is None, (seed, gamma, windows, theta, full, cut)
                else:
                    checked += 1
                    assert cut is not None and cut[0] == pytest.approx(full[0], rel=REL), (seed, gamma, theta, full, cut)
    assert checked > 0  # some theta above a finite least R_0 was tried


@pytest.mark.parametrize("seed", range(12))
def test_prefix_floor_is_at_most_every_prefix(seed: int) -> None:
    """R_0 - R_s (every stage before s, with its cut, and the cut into s) >= `prefix_floor` at s's first unit."""
    prob = _instance(seed)
    floor = prefix_floor(CountDP(prob).tables)
    assert floor[0] == 0.0
    for placement in all_placements(prob):
        costs = evaluate(prob, placement, objective="estimate").stages
        before = 0.0
        for s, st in enumerate(placement):
            assert floor[st.first_unit] <= before * (1 + REL) + 1e-12, (seed, placement, s, floor, before)
            before += costs[s].fwd_s + costs[s].bwd_s + 2.0 * costs[s].send_s


@pytest.mark.parametrize("seed", range(12))
def test_walk_with_a_target_stays_a_bound_and_reaches_it(seed: int) -> None:
    """`schedule_walk` with `enough_s` (its passes pruned at enough_s less the band's low cap): at most the windowed
    pace and schedule optima, and at least the target where the full walk reaches it."""
    prob = _instance(seed)
    pace, sched, _ = _optima(seed)
    plain = schedule_walk(prob, max_passes=PASSES).bound_s
    for target in (0.9 * plain, 0.99 * plain, plain, 1.05 * plain):
        walk = schedule_walk(prob, max_passes=PASSES, enough_s=target)
        assert walk.bound_s <= pace * (1 + REL), (seed, target, walk.bound_s, pace)
        assert walk.bound_s + first_step_floor(prob) <= sched * (1 + REL), (seed, target, walk.bound_s, sched)
        assert walk.bound_s >= min(target, plain) * (1 - 1e-6), (seed, target, walk.bound_s, plain)
