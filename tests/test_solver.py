"""Solvers against each other and against brute force; plan invariants; bad input.

Tier 2 of the test plan: the exact DP equals brute-force enumeration, and CP-SAT
(without any hint) proves the same optimum on 200 random small instances with free
device order, left-out devices and tight memory.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetpipe.errors import ConfigError, InfeasibleError
from hetpipe.partitioner.baselines import BASELINES, baseline
from hetpipe.partitioner.solvers.cpsat import solve_cpsat
from hetpipe.partitioner.solvers.dp import device_classes, solve_exact
from hetpipe.partitioner.solvers.fixed_order import solve_fixed_order
from hetpipe.partitioner.problem import Problem, evaluate
from hetpipe.partitioner.solvers.solve import heuristic, solve
from tests.instances import all_placements, assert_solvers_match_brute_force, brute_force, random_problem

REL = 1e-6  # float re-evaluation of integer-tick CP-SAT solutions (ticks are 1e-7 of T)


def _close(a: float, b: float, rel: float = REL) -> bool:
    return a == b or abs(a - b) <= rel * max(abs(a), abs(b))


@pytest.mark.parametrize("seed", range(3))
def test_exact_dp_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for i in range(50):
        prob = random_problem(rng, units=rng.randint(1, 6), devices=rng.randint(1, 4), tight_memory=i % 2 == 0)
        ref = brute_force(prob)
        res = solve_exact(prob)
        assert _close(res.iteration_s if res else math.inf, ref), (seed, i, ref, res)


def test_cpsat_equals_exact_on_200_random_instances() -> None:
    rng = random.Random(12345)
    left_out = 0
    for i in range(200):
        prob = random_problem(rng, units=rng.randint(1, 8), devices=rng.randint(1, 5), tight_memory=i % 2 == 0)
        exact = solve_exact(prob)
        got = solve_cpsat(prob, time_limit_s=20.0, seed=0)  # no hint: an independent answer
        if exact is None:
            assert got.status == "INFEASIBLE", (i, got)
            continue
        assert got.status == "OPTIMAL", (i, got)
        assert _close(got.iteration_s, exact.iteration_s, 1e-5), (i, got.iteration_s, exact.iteration_s)
        left_out += len(exact.stages) < len(prob.devices)
    assert left_out >= 20  # the instances really exercise leaving devices out


@pytest.mark.parametrize("mode", ["auto", "all"])
def test_recompute_lever_dp_and_cpsat_equal_brute_force(mode: str) -> None:
    """Placements x recompute choices: DP == CP-SAT == brute force, incl. instances only recomputation fits."""
    rng = random.Random(2024)
    only_with, used = 0, 0
    for i in range(60):
        prob = random_problem(rng, units=rng.randint(1, 6), devices=rng.randint(1, 3), tight_memory=True,
                              recompute=mode, activation_max=25)
        exact = solve_exact(prob)
        if not assert_solvers_match_brute_force(prob, exact, i):
            continue
        used += any(st.recompute_units for st in exact.stages)
        only_with += math.isinf(brute_force(replace(prob, recompute="none")))
    assert used >= 15 and (mode == "all" or only_with >= 5), (used, only_with)


def test_recompute_auto_is_never_slower_than_none_or_all() -> None:
    rng = random.Random(99)
    for _ in range(40):
        prob = random_problem(rng, units=rng.randint(2, 7), devices=rng.randint(1, 4), tight_memory=True,
                              recompute="auto", activation_max=25)
        auto = solve_exact(prob)
        for mode in ("none", "all"):
            other = solve_exact(replace(prob, recompute=mode))
            if other is not None:  # auto may pick every choice those make, so it is never worse
                assert auto is not None and auto.iteration_s <= other.iteration_s * (1 + 1e-9)


def test_fixed_order_is_best_for_its_order() -> None:
    rng = random.Random(7)
    for _ in range(40):
        prob = random_problem(rng, units=rng.randint(2, 6), devices=rng.randint(2, 3))
        order = rng.sample(range(len(prob.devices)), rng.randint(1, min(len(prob.devices), prob.num_units)))
        ref = min((evaluate(prob, pl).iteration_s for pl in all_placements(prob, stages=len(order))
                   if [s.device for s in pl] == order and evaluate(prob, pl).fits), default=math.inf)
        res = solve_fixed_order(prob, order)
        assert _close(res.iteration_s if res else math.inf, ref)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), units=st.integers(1, 12), devices=st.integers(1, 6), tight=st.booleans())
def test_solution_invariants(seed: int, units: int, devices: int, tight: bool) -> None:
    prob = random_problem(random.Random(seed), units=units, devices=devices, tight_memory=tight)
    try:
        sol = solve(prob)
    except InfeasibleError as err:
        assert "missing" in str(err) and "try" in str(err)
        assert solve_exact(prob) is None
        return
    covered = [u for s in sol.stages for u in range(s.first_unit, s.last_unit + 1)]
    assert covered == list(range(units))  # every unit once, in order
    ev = evaluate(prob, sol.stages)
    assert ev.fits  # memory holds on every stage
    assert _close(ev.iteration_s, sol.iteration_s)  # reported objective = T recomputed
    assert sol.status == "OPTIMAL" and sol.bound_s <= sol.iteration_s * (1 + REL)
    assert set(sol.unused_devices) == set(range(devices)) - {s.device for s in sol.stages}
    for name in BASELINES:  # the optimum is never worse than a baseline that fits
        b = baseline(prob, name)
        assert not b.fits or sol.iteration_s <= b.iteration_s * (1 + REL)


def test_forced_cpsat_and_heuristic_agree_with_dp_on_medium_instance() -> None:
    prob = random_problem(random.Random(99), units=24, devices=6, microbatches=12)
    dp = solve(prob, solver="dp")
    cp = solve(prob, solver="cpsat", time_limit_s=20.0)
    h = heuristic(prob)
    assert dp.status == "OPTIMAL" and cp.status == "OPTIMAL"
    assert _close(dp.iteration_s, cp.iteration_s, 1e-5)
    assert h.iteration_s >= dp.iteration_s * (1 - REL)


def test_num_stages_forces_the_pipeline_depth() -> None:
    prob = random_problem(random.Random(3), units=6, devices=4, microbatches=4)
    for p in range(1, 5):
        sol = solve(prob, num_stages=p)
        assert len(sol.stages) == p
        assert _close(sol.iteration_s, brute_force(prob, stages=p))


def test_identical_cards_form_one_class() -> None:
    prob = random_problem(random.Random(5), units=4, devices=4)
    classes = device_classes(prob)
    assert sorted(d for c in classes for d in c.members) == list(range(4))
    for c in classes:
        assert len({(prob.devices[d].kind, prob.devices[d].node) for d in c.members}) == 1


def test_infeasible_says_what_is_missing_and_how_to_fix() -> None:
    prob = random_problem(random.Random(1), units=4, devices=2, tight_memory=True)
    tiny = Problem(**{**prob.__dict__, "devices": tuple(d.__class__(d.id, d.kind, d.node, 5) for d in prob.devices)})
    with pytest.raises(InfeasibleError) as err:
        solve(tiny)
    msg = str(err.value)
    assert "missing" in msg and "stage" in msg and "micro-batch" in msg and "more devices" in msg


def test_bad_solver_and_zero_devices() -> None:
    prob = random_problem(random.Random(1), units=3, devices=2)
    with pytest.raises(ConfigError, match="unknown solver"):
        solve(prob, solver="magic")
    empty = Problem(**{**prob.__dict__, "devices": (), "bandwidth_bytes_s": (), "latency_s": ()})
    with pytest.raises(ConfigError, match="no devices"):
        solve(empty)
    with pytest.raises(ConfigError, match="unknown baseline"):
        baseline(prob, "random")


def test_seeded_exact_dp_is_still_exact() -> None:
    rng = random.Random(11)
    for i in range(60):
        prob = random_problem(rng, units=rng.randint(2, 6), devices=rng.randint(1, 4), tight_memory=i % 3 == 0)
        feasible = [pl for pl in all_placements(prob) if evaluate(prob, pl).fits]
        if not feasible:
            continue
        seed = rng.choice(feasible)
        res = solve_exact(prob, seed=seed)
        assert _close(res.iteration_s, brute_force(prob)), (i, seed)


def test_relaxation_is_a_valid_lower_bound_and_realises_feasible_plans() -> None:
    from hetpipe.partitioner.solvers.relax import relaxed_bound, relaxed_problem

    rng = random.Random(21)
    checked = 0
    for i in range(60):
        prob = random_problem(rng, units=rng.randint(2, 7), devices=rng.randint(2, 5), tight_memory=i % 2 == 0)
        exact = solve_exact(prob)
        relaxed = solve_exact(relaxed_problem(prob))
        if exact is None:
            continue
        checked += 1
        assert relaxed.iteration_s <= exact.iteration_s * (1 + REL)  # never above the real optimum
        bound, real = relaxed_bound(prob, seed=exact.stages, time_limit_s=5.0)
        assert bound <= exact.iteration_s * (1 + REL)
        if real is not None:
            assert evaluate(prob, real.stages).fits and real.iteration_s >= exact.iteration_s * (1 - REL)
    assert checked >= 30


def test_beyond_the_dp_budget_solve_reports_a_sound_bound(monkeypatch) -> None:
    import hetpipe.partitioner.solvers.dp as dp_mod

    prob = random_problem(random.Random(8), units=10, devices=5, microbatches=6)
    exact = solve_exact(prob)
    monkeypatch.setattr(dp_mod, "DEFAULT_STATE_BUDGET", 1)  # the exact DP declines ...
    monkeypatch.setattr(dp_mod.solve_exact, "__kwdefaults__", {**dp_mod.solve_exact.__kwdefaults__,
                                                               "state_budget": 1})
    sol = solve(prob, time_limit_s=5.0)  # ... so the relaxation / CP-SAT path answers
    assert sol.solver in ("cpsat", "relaxation", "heuristic")
    assert sol.bound_s <= exact.iteration_s * (1 + 1e-5) <= sol.iteration_s * (1 + 1e-5)
    assert evaluate(prob, sol.stages).fits
