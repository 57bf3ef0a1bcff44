"""CP-SAT chooses tensor-parallel groups (issue 15): CP-SAT == brute force == the group DP.

The instances are `tests/test_tp_solver.py`'s (2-4 cards on 1-2 nodes, 4-6 units, random splits,
memory and links; and its lever instances with offload ``all`` / ``auto``).  CP-SAT runs without a
hint (an independent answer) and must equal the enumeration of every cut, group, lead and order
within the 1e-5 the pipeline CP-SAT tests allow (`cpsat_groups.TICKS_PER_ENTRY`), and report
OPTIMAL; `solve_tp` uses it under ``solver="cpsat"`` and under ``auto`` where the group DP declines.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from hetpipe.partitioner.problem import DeviceSlot, evaluate
from hetpipe.partitioner.solvers import cpsat_groups, group_dp, tp_solve
from hetpipe.partitioner.solvers.cpsat_groups import position_tables, solve_cpsat_groups
from hetpipe.partitioner.solvers.group_dp import GroupSpaceTooLarge, solve_groups
from hetpipe.partitioner.solvers.offload_walk import tail_walk
from hetpipe.partitioner.solvers.solve import solve
from hetpipe.partitioner.solvers.tp_solve import cpsat_pass, solve_tp
from tests.instances import close, random_problem
from tests.test_tp_solver import _instance, _lever_instance, _with_splits, brute_force_groups, brute_force_levers

#: CP-SAT's times are ticks rounded down (module docstring of `cpsat_groups`).
REL = 1e-5


def test_cpsat_equals_brute_force_and_the_group_dp_on_40_instances():
    grouped = mismatches = 0
    for seed in range(40):
        prob = _instance(seed)
        want = brute_force_groups(prob)
        got = solve_cpsat_groups(prob, time_limit_s=20.0, seed=0)  # no hint: an independent answer
        dp = solve_groups(prob)
        if math.isinf(want):
            assert got.stages is None and got.status == "INFEASIBLE" and dp is None, seed
            continue
        assert got.status == "OPTIMAL", (seed, got.status)
        ev = evaluate(prob, got.stages, objective="estimate")
        assert ev.fits and close(ev.iteration_s, got.iteration_s, 1e-12), seed  # what it reports, its stages cost
        mismatches += not (close(got.iteration_s, want, REL) and close(got.iteration_s, dp.iteration_s, REL))
        assert got.bound_s <= want * (1 + 1e-12), seed  # ticks rounded down: a valid bound
        grouped += any(st.members for st in got.stages)
    assert mismatches == 0
    assert grouped >= 5  # not vacuous: CP-SAT's optimum uses a group on some instances


@pytest.mark.parametrize("mode", ["all", "auto"])
def test_cpsat_with_the_recompute_and_offload_levers_equals_brute_force(mode):
    """Width-1 stages keep their levers (the DP's tables), inside the offload walk as for the DP."""
    grouped = 0
    for seed in range(24):
        prob = _lever_instance(seed, mode)
        want = brute_force_levers(prob)
        got = tail_walk(prob, lambda p, _: cpsat_pass(p, hint=None, seed=0, cost_cache={}, deadline=math.inf))
        if math.isinf(want):
            assert got is None, seed
            continue
        assert got is not None and got.exact and evaluate(prob, got.stages, objective="estimate").fits, seed
        assert close(got.iteration_s, want, REL), (seed, got.iteration_s, want)
        grouped += any(st.members for st in got.stages)
    assert grouped >= 2


def test_the_dp_hint_caps_the_tables_and_cpsat_proves_it_optimal():
    for seed in range(12):
        prob = _instance(seed)
        dp = solve_groups(prob)
        if dp is None:
            continue
        got = solve_cpsat_groups(prob, time_limit_s=20.0, seed=0, hint=dp.stages)
        assert got.status == "OPTIMAL" and close(got.iteration_s, dp.iteration_s, REL), seed
        capped = position_tables(prob, cap=cpsat_groups.hint_cap_s(prob, dp.stages))
        assert capped.terms() <= position_tables(prob).terms()


@pytest.mark.parametrize("seed", range(70, 76))
def test_solve_tp_with_cpsat_names_it_is_never_slower_than_pipeline_only_and_its_bound_holds(seed):
    rng = random.Random(seed)
    prob = _with_splits(rng, random_problem(rng, units=rng.randint(4, 5), devices=rng.randint(2, 3),
                                            objective="schedule"), group_max=3)
    pipe = solve(replace(prob, group_max=1), time_limit_s=5.0)
    got = solve_tp(prob, solver="cpsat", time_limit_s=5.0)
    dp = solve_tp(prob, time_limit_s=5.0)
    assert got.solver == "cpsat" and dp.solver == "group-dp"
    assert got.iteration_s <= pipe.iteration_s * (1 + 1e-9)
    assert close(got.iteration_s, dp.iteration_s, REL)
    assert evaluate(prob, got.stages).iteration_s == pytest.approx(got.iteration_s, rel=1e-9)
    assert got.bound_s <= got.iteration_s * (1 + 1e-9)


def test_auto_runs_cpsat_where_the_group_dp_declines_and_it_still_equals_brute_force(monkeypatch):
    """With the DP's card limit lowered below the instances' cards, ``auto`` answers with CP-SAT
    (hinted by the pipeline-only plan) and its bound comes from CP-SAT's bottleneck model."""
    monkeypatch.setattr(group_dp, "MAX_GROUP_CARDS", 1)
    monkeypatch.setattr(tp_solve, "MAX_GROUP_CARDS", 1)
    used = 0
    for seed in range(8):
        prob = replace(_instance(seed), objective="estimate")
        want = brute_force_groups(prob)
        if math.isinf(want):
            continue
        with pytest.raises(GroupSpaceTooLarge):
            solve_groups(prob)
        got = solve_tp(prob, time_limit_s=10.0)
        assert got.solver == "cpsat", seed
        assert got.iteration_s <= want * (1 + REL), (seed, got.iteration_s, want)  # verify may only improve it
        assert got.bound_s <= want * (1 + 1e-9), seed
        used += any(st.members for st in got.stages)
    assert used >= 1


def test_a_model_over_its_size_limit_declines_and_solve_tp_keeps_the_group_dp(monkeypatch, caplog):
    prob = _instance(9)  # its optimum uses a group
    monkeypatch.setattr(cpsat_groups, "MAX_MODEL_TERMS", 1)
    with pytest.raises(GroupSpaceTooLarge, match="terms"):
        solve_cpsat_groups(prob, time_limit_s=5.0, seed=0)
    got = solve_tp(replace(prob, objective="schedule"), solver="cpsat", time_limit_s=5.0)
    assert got.solver == "group-dp" and "not searched by CP-SAT" in caplog.text


def test_nine_cards_beyond_the_group_dp_get_groups_from_cpsat():
    """9 equal cards on one node (the DP stops at 8): the plan groups, and is no slower than pipeline-only."""
    rng = random.Random(5)
    base = random_problem(rng, units=6, devices=9, objective="schedule")
    devices = tuple(DeviceSlot(f"d{i}", base.devices[0].kind, "n0", 10**6) for i in range(9))
    inf = math.inf
    prob = _with_splits(rng, replace(base, devices=devices, tied=(),
                                     bandwidth_bytes_s=tuple(tuple(inf if a == b else 10.0 for b in range(9))
                                                             for a in range(9)),
                                     latency_s=tuple(tuple(0.0 if a == b else 0.01 for b in range(9))
                                                     for a in range(9))), group_max=2)
    pipe = solve(replace(prob, group_max=1), time_limit_s=5.0)
    got = solve_tp(prob, time_limit_s=10.0)
    assert got.solver == "cpsat" and got.iteration_s < pipe.iteration_s and any(st.members for st in got.stages)
    assert evaluate(prob, got.stages).fits and 0.0 < got.bound_s <= got.iteration_s * (1 + 1e-9)


def test_a_plan_solved_with_cpsat_records_it_and_passes_check(tmp_path):
    """gpt-tiny on three cards of one node, ``--solver cpsat --tensor-parallel auto``: the plan's solver is
    cpsat, its groups are re-derived by `check`, and it is no slower than the group DP's plan."""
    from hetpipe.cost_models.cluster import cluster_from_dict
    from hetpipe.plan.build import capture_builtin, partition_graph
    from hetpipe.plan.check import check_plan
    from hetpipe.plan.schema import Plan

    graph = capture_builtin("gpt-tiny", batch=4, seq=64)
    cluster = cluster_from_dict({"nodes": [{"name": "box", "intra": "pcie-host", "devices": [
        {"gpu": "rtx3090"}, {"gpu": "rtx3060-12gb"}, {"gpu": "rtx4090"}]}]})
    plan = partition_graph(graph, cluster, solver="cpsat", tensor_parallel="auto", time_limit_s=4.0)
    dp = partition_graph(graph, cluster, tensor_parallel="auto", time_limit_s=4.0)
    assert plan.solver.name == "cpsat" and dp.solver.name == "group-dp"
    assert plan.predicted.iteration_s <= dp.predicted.iteration_s * (1 + REL)
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded == plan and check_plan(loaded).ok, check_plan(loaded).violations


def test_cpsat_over_groups_across_two_nodes_equals_brute_force():
    """`tests/test_tp_cross_node.py`'s 14 instances (``group_nodes=2``): the model takes its member sets from
    `candidate_groups`, so the two-node sets are variables like any other."""
    from tests.test_tp_cross_node import _two_node_instance

    crossed = 0
    for seed in range(14):
        prob = _two_node_instance(seed)
        want = brute_force_groups(prob)
        got = solve_cpsat_groups(prob, time_limit_s=20.0, seed=0)
        if math.isinf(want):
            assert got.stages is None, seed
            continue
        assert got.status == "OPTIMAL" and close(got.iteration_s, want, REL), (seed, got.iteration_s, want)
        crossed += any(len({prob.devices[d].node for d in st.members}) == 2 for st in got.stages)
    assert crossed >= 1  # not vacuous: some optimum crosses the nodes
