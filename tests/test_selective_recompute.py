"""The selective recompute level (issue 14): contract, per-stage choice and the exact DP against brute force.

A stage with `Stage.selective` is priced on `cost_models.selective.selective_variant` (activation bytes less the
level's freed bytes, its dropped nodes' seconds in the backward) with the level's peak added to M_s once.
"""

from __future__ import annotations

import dataclasses
import math
import random

from hetpipe.cost_models.selective import SelectiveTables
from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage, evaluate
from hetpipe.partitioner.recompute import with_recompute
from hetpipe.partitioner.solvers.dp import solve_exact
from hetpipe.partitioner.solvers.offload_walk import tail_walk
from hetpipe.partitioner.solvers.cpsat import solve_cpsat
from tests.instances import brute_force, close, random_problem, selective_instance, with_offload, with_selective


def _two_units(usable: int) -> Problem:
    return Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (2.0, 2.0)}, state_bytes=(10, 10),
                   activation_bytes=(30, 30), boundary_bytes=(4, 0),
                   devices=(DeviceSlot("d0", "a", "n", usable),), bandwidth_bytes_s=((math.inf,),),
                   latency_s=((0.0,),), microbatches=2, recompute="auto",
                   selective=SelectiveTables(freed_bytes=(12, 12), peak_bytes=15, extra_s={"a": (0.25, 0.25)}))


def test_a_selective_stage_is_its_variant_plus_the_peak_once() -> None:
    prob = _two_units(10**6)
    plain, sel = (Stage(0, 0, 1),), (Stage(0, 0, 1, selective=True),)
    a, b = evaluate(prob, plain).stages[0], evaluate(prob, sel).stages[0]
    # one stage, one micro-batch in flight: 20 state + 60 activations; selective: 20 + (60 - 24) + the 15 peak
    assert (a.memory_bytes, b.memory_bytes) == (80, 20 + 36 + 15)
    assert (a.bwd_s, b.bwd_s) == (4.0, 4.5) and a.fwd_s == b.fwd_s == 2.0


def test_auto_takes_the_level_when_it_fits_and_costs_less_than_whole_units() -> None:
    # 75 bytes: the level fits (71, +0.5 s); whole units: one keeps 80 or 84 with its peak, both 54 (+2 s)
    stages = with_recompute(_two_units(75), (Stage(0, 0, 1),))
    assert stages[0].selective and stages[0].recompute_units == ()
    assert evaluate(_two_units(75), stages).fits
    none = dataclasses.replace(_two_units(75), selective=None)
    assert with_recompute(none, (Stage(0, 0, 1),))[0].recompute_units != ()  # without it: a whole unit
    assert not with_recompute(_two_units(10**6), (Stage(0, 0, 1),))[0].selective  # free memory: nothing


def test_dp_with_the_level_equals_brute_force() -> None:
    rng = random.Random(1414)
    fitted = used = 0
    for i in range(60):
        prob = selective_instance(rng, i)
        ref = brute_force(prob)
        res = tail_walk(prob, lambda p, _: solve_exact(p))  # the offload lever's outer walk, as `solve` runs it
        got = res.iteration_s if res else math.inf
        assert got == ref or math.isclose(got, ref, rel_tol=1e-9), (i, got, ref)
        if res is not None:
            fitted += 1
            used += any(st.selective for st in res.stages)
            ev = evaluate(prob, res.stages)
            assert ev.fits and math.isclose(ev.iteration_s, got, rel_tol=1e-9)
    assert fitted >= 20 and used >= 2  # answers that need the level (the test fails without the DP's variant tables)


def _worth_it(rng: random.Random, problem: Problem) -> Problem:
    """`problem` offering a level that frees a third to three quarters of each unit's activations for up to a tenth
    of its forward (GPT-2 XL's: 125 of 400 MiB a block for 0.03 of its forward): answers often need it."""
    freed = tuple(rng.randint(a // 3, 3 * a // 4) for a in problem.activation_bytes)
    extra = {k: tuple(rng.uniform(0.0, 0.1) * f for f in problem.fwd_s[k]) for k in problem.fwd_s}
    return dataclasses.replace(problem, selective=SelectiveTables(freed, max(freed), extra))


def test_cpsat_with_the_level_equals_brute_force() -> None:
    """CP-SAT models the level (`solvers/cpsat_selective.py`): OPTIMAL, equal to enumeration over placements x
    level x prefix x offload, and its bound a real lower bound (a model without the level proves a T above the
    optimum where only the level reaches it: the last assertion fails without `cpsat_selective`)."""
    rng = random.Random(1415)
    fitted = needed = 0
    for i in range(40):
        prob = random_problem(rng, units=rng.randint(2, 5), devices=rng.randint(1, 3), tight_memory=True,
                              recompute="auto", activation_max=20)
        prob = _worth_it(rng, prob) if i % 2 else with_selective(rng, prob)
        if i % 3 == 0:
            prob = with_offload(rng, prob, "auto")
        ref = brute_force(prob)
        got = solve_cpsat(prob, time_limit_s=20.0, seed=0)  # no hint: an independent answer
        if math.isinf(ref):
            assert got.status == "INFEASIBLE", (i, got)
            continue
        assert got.status == "OPTIMAL" and close(got.iteration_s, ref, 1e-5), (i, got, ref)
        assert got.bound_s <= ref * (1 + 1e-9), (i, got.bound_s, ref)  # the proof holds
        fitted += 1
        needed += brute_force(dataclasses.replace(prob, selective=None)) > ref * (1 + 1e-6)
    assert fitted >= 20 and needed >= 3, (fitted, needed)  # optima only the level reaches


def test_merged_kinds_of_the_relaxation_price_the_level() -> None:
    """`relax.aggregate_kinds` merges slow kinds into one: the level's seconds merge too (its fastest member's),
    so the relaxation's DP tables build (a KeyError on the merged kind before)."""
    from hetpipe.partitioner.solvers.dp import StageTables, device_classes
    from hetpipe.partitioner.solvers.relax import aggregate_kinds, relaxed_problem

    rng = random.Random(5)
    prob = with_selective(rng, random_problem(rng, units=4, devices=6, recompute="auto", activation_max=20))
    merged, members = aggregate_kinds(relaxed_problem(prob), merge_above=0, state_budget=1)
    assert any(len(m) > 1 for m in members.values())
    assert set(merged.selective.extra_s) == set(merged.fwd_s)
    StageTables(merged, device_classes(merged))


def test_the_level_only_adds_plans() -> None:
    """With the level offered, T is never above T without it (the same DP; auto's choices grow)."""
    rng = random.Random(7)
    for _ in range(30):
        prob = with_selective(rng, random_problem(rng, units=rng.randint(2, 6), devices=rng.randint(1, 3),
                                                  tight_memory=True, recompute="auto", activation_max=20))
        with_level, without = solve_exact(prob), solve_exact(dataclasses.replace(prob, selective=None))
        a = with_level.iteration_s if with_level else math.inf
        b = without.iteration_s if without else math.inf
        assert a <= b * (1 + 1e-12)


def test_plans_record_the_level_per_stage() -> None:
    """Plan version 7 records each stage's level (`PlanStage.selective`; tests/test_selective_runtime.py runs it)."""
    from hetpipe.plan.build import plan_stages

    prob = _two_units(75)
    stages = with_recompute(prob, (Stage(0, 0, 1),))
    assert [st.selective for st in plan_stages(prob, stages, evaluate(prob, stages))] == [True]
