"""Issue 14, the recomputation lever on the planner side: cost model, plan file (version 3), check.

The solvers against brute force over placements x recompute choices live in tests/test_solver.py
and tests/test_contract_property.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from hetpipe.cost_models.recompute import recompute_cost, recompute_order
from hetpipe.cost_models.stage_memory import HeldCounts, pipeline_stage_bytes
from hetpipe.errors import PlanError
from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage, evaluate
from hetpipe.partitioner.recompute import choose_recompute
from hetpipe.plan.build import capture_builtin, partition_graph
from hetpipe.plan.check import check_plan
from hetpipe.plan.schema import PLAN_VERSION_LEVERS, Plan
from hetpipe.cost_models.cluster import load_cluster
from tests.plan_docs import as_version_3

CLUSTER = "examples/clusters/homelab-mini.yaml"


def test_order_ranks_saved_bytes_per_second_and_leaves_out_units_that_save_nothing() -> None:
    act, bd = (8, 10, 3, 40), (2, 10, 1, 0)
    fwd = (1.0, 1.0, 1.0, 4.0)
    # first unit 0 saves 8 (its input is the stage's); unit 1 saves 10-2 = 8 at 1 s; unit 2 saves 3-10 < 0;
    # unit 3 saves 40-1 = 39 at 4 s = 9.75 B/s: best; 0 and 1 tie at 8 B/s: by index
    assert recompute_order(activation_bytes=act, boundary_bytes=bd, fwd_s=fwd, first_unit=0, last_unit=3) == (3, 0, 1)
    # as a stage starting at unit 1, unit 1 is the first unit and keeps nothing: 10 B/s
    assert recompute_order(activation_bytes=act, boundary_bytes=bd, fwd_s=fwd, first_unit=1, last_unit=3) == (1, 3)
    cost = recompute_cost((3, 0), activation_bytes=act, boundary_bytes=bd, fwd_s=fwd, first_unit=0)
    assert (cost.saved_bytes, cost.peak_bytes, cost.extra_s) == (39 + 8, 40, 5.0)


def test_stage_memory_is_the_readme_formula_with_recomputation() -> None:
    # M = state + max_t (k_t (sum_{not R} A + sum_{R} in_u + in + out) + frames_t [+ max_R A inside a backward])
    state, a, cut_in, cut_out = 100, (10, 20, 30), 4, 5
    inputs = (cut_in, 6, 7)  # in_u of units 1, 2 = the cuts inside the stage; unit 0 keeps nothing extra
    moments = (HeldCounts(1, 3, in_frames=1, out_frames=3), HeldCounts(1, 1, in_frames=3, out_frames=1),
               HeldCounts(1, 3, in_frames=1, backward=1))  # inside a backward: where a recompute adds its unit
    for chosen in ((), (1,), (1, 2), (0, 2)):
        kept = sum(x for i, x in enumerate(a) if i not in chosen) + sum(inputs[i] for i in chosen if i > 0)
        per_mb, again = kept + cut_in + cut_out, max((a[i] for i in chosen), default=0)
        inside = [3 * per_mb + cut_in + again] if chosen else []
        want = state + max([3 * per_mb + cut_in + 3 * cut_out, per_mb + 3 * cut_in + cut_out] + inside)
        saved = sum(a[i] - (inputs[i] if i > 0 else 0) for i in chosen)
        got = pipeline_stage_bytes(state_bytes=state, activation_bytes=sum(a), in_bytes=cut_in, out_bytes=cut_out,
                                   held=moments, recompute_saved_bytes=saved,
                                   recompute_peak_bytes=max((a[i] for i in chosen), default=0))
        assert got == want, chosen


def _problem(mode: str, usable: int) -> Problem:
    return Problem(fwd_s={"a": (1.0, 2.0, 1.0)}, bwd_s={"a": (2.0, 4.0, 2.0)}, state_bytes=(10, 10, 10),
                   activation_bytes=(30, 50, 5), boundary_bytes=(4, 6, 0),
                   devices=(DeviceSlot("d0", "a", "n", usable),), bandwidth_bytes_s=((1.0,),),
                   latency_s=((0.0,),), microbatches=2, recompute=mode)


def test_auto_takes_the_shortest_prefix_that_fits_and_evaluate_charges_it() -> None:
    plain = (Stage(0, 0, 2),)
    assert evaluate(_problem("none", 10**6), plain).stages[0].memory_bytes == 30 + 85  # k = 1: one stage
    # unit 1 saves 50-4 = 46 B at 2 s (23 B/s), unit 0 30 B at 1 s (30 B/s), unit 2 nothing (5-6 < 0)
    assert choose_recompute(_problem("auto", 115), plain, 0) == ()
    assert choose_recompute(_problem("all", 115), plain, 0) == (0, 1)
    # with k = 1 recomputing unit 0 saves 30 and adds its 30 back as the one-off peak: 115, no gain
    assert choose_recompute(_problem("auto", 114), plain, 0) == (0, 1)  # 30 + 5 + 4 + 50 = 89
    ev = evaluate(_problem("auto", 114), (Stage(0, 0, 2, (0, 1)),))
    assert ev.stages[0].memory_bytes == 30 + 9 + 50 and ev.stages[0].bwd_s == 8.0 + 3.0
    with pytest.raises(ValueError, match="recomputes units"):
        evaluate(_problem("auto", 114), (Stage(0, 0, 1, (2,)), Stage(0, 2, 2)))


@pytest.fixture(scope="module")
def tight_plan() -> Plan:
    """gpt-demo at its default micro-batch 8 fits the mini home lab only by recomputing."""
    graph = capture_builtin("gpt-demo", batch=8)
    return partition_graph(graph, load_cluster(CLUSTER), recompute="auto")


def test_recomputing_plan_is_version_3_round_trips_and_checks(tight_plan: Plan, tmp_path) -> None:
    assert tight_plan.version >= PLAN_VERSION_LEVERS and any(s.recompute_units for s in tight_plan.stages)
    path = tmp_path / "plan.json"
    tight_plan.save(path)
    assert Plan.load(path) == tight_plan and check_plan(Plan.load(path)).ok
    doc = as_version_3(json.loads(path.read_text()))  # the recompute lever's fields need version 3
    doc["version"] = 2
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match="uses fields of version 3"):
        Plan.load(path)


def test_check_refuses_edited_recompute_choices(tight_plan: Plan, tmp_path) -> None:
    s = next(i for i, st in enumerate(tight_plan.stages) if st.recompute_units)
    st = tight_plan.stages[s]

    def edited(units: tuple[int, ...]) -> Plan:
        stages = list(tight_plan.stages)
        stages[s] = dataclasses.replace(st, recompute_units=units)
        return dataclasses.replace(tight_plan, stages=tuple(stages))

    dropped = check_plan(edited(()))  # no recomputation: memory and time disagree, and it would not fit
    assert any("memory_bytes" in v for v in dropped.violations) and any("chooses" in v for v in dropped.violations)
    if len(st.recompute_units) < st.last_unit - st.first_unit + 1:  # a unit outside the prefix instead
        other = next(u for u in range(st.first_unit, st.last_unit + 1) if u not in st.recompute_units)
        swapped = check_plan(edited(tuple(sorted(st.recompute_units[1:] + (other,)))))
        assert any("not the first units" in v for v in swapped.violations), swapped.violations
    path = tmp_path / "bad.json"
    doc = tight_plan.to_dict()
    doc["stages"][s]["recompute_units"] = [st.last_unit + 1]
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=rf"stages\[{s}\]\.recompute_units"):
        Plan.load(path)


def test_plans_without_recomputation_carry_no_recompute_field() -> None:
    graph = capture_builtin("gpt-demo", batch=2)
    plan = partition_graph(graph, load_cluster(CLUSTER), global_batch=12)  # fits: auto recomputes nothing
    # version 3 only for the baselines' `best` placements (see README "Versions"), not for recomputation
    assert not any(s.recompute_units for s in plan.stages)
    assert "recompute_units" not in json.dumps(plan.to_dict()) and check_plan(plan).ok


@pytest.mark.parametrize("mode", ["auto", "all"])
def test_merged_kind_relaxation_stays_a_lower_bound_with_recomputation(mode: str) -> None:
    import random

    from hetpipe.partitioner.solvers.dp import solve_exact
    from hetpipe.partitioner.solvers.relax import aggregate_kinds, relaxed_problem
    from tests.instances import random_problem

    rng, partial = random.Random(5), 0
    for _ in range(150):
        prob = random_problem(rng, units=rng.randint(2, 5), devices=rng.randint(2, 5), tight_memory=True,
                              recompute=mode, activation_max=25)
        # per-unit speed ratios that differ by kind (memory- vs compute-bound units): kinds rank
        # units differently, so a merged kind's recompute order is no member's order
        prob = dataclasses.replace(prob, fwd_s={k: tuple(f * rng.choice((0.01, 1.0, 30.0)) for f in v)
                                               for k, v in prob.fwd_s.items()})
        exact = solve_exact(prob)
        for budget in (0, 20, 60, 200):  # everything merged, then fewer and fewer kinds
            merged, members = aggregate_kinds(relaxed_problem(prob), merge_above=0, state_budget=budget)
            partial += 1 < len(members) < len(prob.fwd_s)
            bound = solve_exact(merged)
            if exact is not None:
                assert bound is not None and bound.iteration_s <= exact.iteration_s * (1 + 1e-9), (budget, prob)
    assert partial >= 5


def test_free_forwards_and_tied_keys_dp_equals_brute_force() -> None:
    """Units with a 0 s forward (key +inf) and equal keys (ties by unit index) in the DP's walk."""
    import math
    import random

    from hetpipe.partitioner.solvers.cpsat import solve_cpsat
    from hetpipe.partitioner.solvers.dp import solve_exact
    from tests.instances import brute_force, random_problem

    rng = random.Random(77)
    for i in range(80):
        prob = random_problem(rng, units=rng.randint(2, 6), devices=rng.randint(1, 3), tight_memory=True,
                              recompute="auto", activation_max=20)
        zero = {u for u in range(prob.num_units) if rng.random() < 0.3}
        prob = dataclasses.replace(
            prob, fwd_s={k: tuple(0.0 if u in zero else 1.0 for u in range(prob.num_units)) for k in prob.fwd_s},
            activation_bytes=tuple(rng.choice((0, 6, 12, 20)) for _ in range(prob.num_units)))
        ref = brute_force(prob)
        res = solve_exact(prob)
        got = res.iteration_s if res else math.inf
        assert got == ref or math.isclose(got, ref, rel_tol=1e-9), (i, got, ref)
        if i % 4 == 0:
            cp = solve_cpsat(prob, time_limit_s=20.0, seed=0)
            assert (cp.status == "INFEASIBLE") if math.isinf(ref) else math.isclose(cp.iteration_s, ref, rel_tol=1e-5)


def test_replica_plans_recompute_where_a_replica_needs_it() -> None:
    """gpt-demo (micro-batch 3; 4 fits nowhere under memory model 2) as 2 replicas on the mini home lab
    fits only with recomputation."""
    from hetpipe.errors import ConfigError, InfeasibleError
    from hetpipe.plan.replica_count import plan_replicas

    graph, cluster = capture_builtin("gpt-demo", batch=3), load_cluster(CLUSTER)
    with pytest.raises((InfeasibleError, ConfigError), match="fits in memory"):
        plan_replicas(graph, cluster, 2, global_batch=36, recompute="none")
    plan = plan_replicas(graph, cluster, 2, global_batch=36, recompute="auto")
    assert len(plan.replicas) == 2 and plan.version >= PLAN_VERSION_LEVERS and check_plan(plan).ok
    assert any(st.recompute_units for st in plan.stages)
    stages = tuple(dataclasses.replace(st, recompute_units=()) for st in plan.stages)
    edited = dataclasses.replace(plan, stages=stages)  # the same layout without it: over memory, and caught
    assert any("memory_bytes" in v or "usable" in v for v in check_plan(edited).violations)
