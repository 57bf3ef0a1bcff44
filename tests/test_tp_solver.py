"""The solver chooses tensor-parallel groups (issue 15): the group DP against brute force.

Tiny random instances (2-4 cards on 1-2 nodes, 4-6 units, random splits, memory and links):
`solve_groups` must equal the enumeration of every ordered sequence of disjoint groups (each
card alone, or 2..group_max cards of one node with any lead), every cut, priced by
`problem.evaluate` under the estimate it searches; it is never worse than the pipeline-only DP;
the table-level pricing equals `tp_groups.price_group` / `rounded_member_s` on a captured GPT.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from dataclasses import replace

import pytest

from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage, evaluate
from hetpipe.partitioner.recompute import with_recompute
from hetpipe.partitioner.solvers.dp import solve_exact
from hetpipe.partitioner.solvers.group_dp import candidate_groups, solve_groups
from hetpipe.partitioner.solvers.solve import solve
from hetpipe.partitioner.solvers.tp_solve import solve_tp
from hetpipe.partitioner.tp_tables import BlockSplit, UnitSplit
from tests.instances import random_problem


def _with_splits(rng: random.Random, prob: Problem, *, group_max: int = 4) -> Problem:
    """`prob` with random tensor-parallel tables: some units split (attention/MLP-like blocks), some not."""
    splits = []
    for u in range(prob.num_units):
        if rng.random() < 0.25:
            splits.append(UnitSplit(flops=10, flops_fraction=0.0, param_fraction=0.0))
            continue
        blocks = tuple(BlockSplit(parts=rng.choice((2, 3, 4, 8, 16)), fwd_flops=rng.randint(1, 5),
                                  allreduce_bytes=rng.randint(0, 6), activation_bytes=rng.randint(0, 2))
                       for _ in range(rng.randint(1, 2)))
        splits.append(UnitSplit(flops=10, flops_fraction=rng.uniform(0.5, 0.95),
                                param_fraction=rng.uniform(0.3, 0.9), blocks=blocks))
    return replace(prob, tensor_parallel=tuple(splits), group_max=group_max)


def _compositions(units: int, parts: int):
    for cuts in itertools.combinations(range(1, units), parts - 1):
        bounds = (0, *cuts, units)
        yield [(bounds[i], bounds[i + 1] - 1) for i in range(parts)]


def brute_force_groups(problem: Problem) -> float:
    """Least T_est over every ordered sequence of disjoint candidate groups and every cut."""
    groups = candidate_groups(problem)
    best = math.inf
    for p in range(1, min(problem.num_units, len(problem.devices)) + 1):
        for seq in itertools.permutations(groups, p):
            cards = [d for g in seq for d in g]
            if len(set(cards)) != len(cards) or any(seq[i][1:] != tuple(sorted(seq[i][1:])) for i in range(p)):
                continue
            for spans in _compositions(problem.num_units, p):
                plain = tuple(Stage(g[0], lo, hi, members=g if len(g) > 1 else ()) for g, (lo, hi) in zip(seq, spans))
                ev = evaluate(problem, with_recompute(problem, plain), objective="estimate")
                if ev.fits:
                    best = min(best, ev.iteration_s)
    return best


def _instance(seed: int) -> Problem:
    rng = random.Random(seed)
    prob = random_problem(rng, units=rng.randint(4, 6), devices=rng.randint(2, 4), tight_memory=rng.random() < 0.5,
                          recompute=rng.choice(("none", "auto")), activation_max=rng.choice((3, 6)))
    return _with_splits(rng, prob, group_max=rng.choice((2, 4)))


@pytest.mark.parametrize("seed", range(40))
def test_group_dp_equals_brute_force_over_cuts_groups_leads_and_orders(seed):
    prob = _instance(seed)
    want = brute_force_groups(prob)
    got = solve_groups(prob)
    if math.isinf(want):
        assert got is None
        return
    assert got is not None
    ev = evaluate(prob, got.stages, objective="estimate")
    assert ev.fits
    assert ev.iteration_s == pytest.approx(got.iteration_s, rel=1e-9)
    assert got.iteration_s == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_groups_win_somewhere_in_the_random_instances():
    """The brute-force test is not vacuous: on some instances the optimum uses a group."""
    grouped = 0
    for seed in range(40):
        res = solve_groups(_instance(seed))
        grouped += res is not None and any(st.members for st in res.stages)
    assert grouped >= 5


def test_a_group_walk_stopped_at_its_deadline_claims_no_bound_above_the_optimum():
    """One card per stage bounds T below by the fastest card; a group beats it, so a walk
    stopped before its first cap pass must not report that bound (it did, until session 13)."""
    hits = 0
    for seed in range(40):
        prob = _instance(seed)
        want = brute_force_groups(prob)
        got = solve_groups(prob, time_limit_s=-1.0)  # the deadline has passed before the walk starts
        if got is None or math.isinf(want):
            continue
        assert got.bound_s <= want * (1 + 1e-9)
        hits += not got.exact
    assert hits >= 5  # the test is not vacuous: walks did stop at the deadline


@pytest.mark.parametrize("seed", range(40, 70))
def test_width_one_is_a_choice_so_groups_are_never_worse_than_pipeline_only(seed):
    prob = _instance(seed)
    pipe = solve_exact(replace(prob, group_max=1))
    grp = solve_groups(prob)
    if pipe is None:
        return
    assert grp is not None and grp.iteration_s <= pipe.iteration_s * (1 + 1e-9)
    assert solve_groups(replace(prob, group_max=1)).iteration_s == pytest.approx(pipe.iteration_s, rel=1e-9)


def test_a_layer_wider_than_any_card_fits_only_on_a_group():
    """One unit whose split state needs more than either card: no pipeline fits, a 2-card group does."""
    inf = float("inf")
    blk = BlockSplit(parts=16, fwd_flops=1, allreduce_bytes=4, activation_bytes=0)
    prob = Problem(fwd_s={"a": (1.0,)}, bwd_s={"a": (2.0,)}, state_bytes=(160,), activation_bytes=(4,),
                   boundary_bytes=(0,), devices=(DeviceSlot("d0", "a", "n", 100), DeviceSlot("d1", "a", "n", 100)),
                   bandwidth_bytes_s=((inf, 10.0), (10.0, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)),
                   microbatches=2, tensor_parallel=(UnitSplit(3, 1.0, 1.0, (blk,)),), group_max=2)
    assert solve_exact(replace(prob, group_max=1)) is None
    res = solve_groups(prob)
    assert res is not None and res.stages[0].members == (0, 1)
    ev = evaluate(prob, res.stages)
    assert ev.fits and ev.stages[0].shares == (0.5, 0.5) and ev.stages[0].memory_bytes <= 100


@pytest.mark.parametrize("seed", range(70, 82))
def test_solve_tp_is_never_slower_than_pipeline_only_under_the_schedule_and_its_bound_holds(seed):
    rng = random.Random(seed)
    prob = _with_splits(rng, random_problem(rng, units=rng.randint(4, 5), devices=rng.randint(2, 3),
                                            objective="schedule"), group_max=3)
    pipe = solve(replace(prob, group_max=1), time_limit_s=5.0)
    got = solve_tp(prob, time_limit_s=5.0)
    assert got.iteration_s <= pipe.iteration_s * (1 + 1e-9)
    assert evaluate(prob, got.stages).iteration_s == pytest.approx(got.iteration_s, rel=1e-9)
    best = min(evaluate(prob, with_recompute(prob, plain)).iteration_s for plain in _all_placements(prob)
               if evaluate(prob, with_recompute(prob, plain)).fits)
    assert got.bound_s <= best * (1 + 1e-9) <= got.iteration_s * (1 + 1e-9)


def _all_placements(problem: Problem):
    groups = candidate_groups(problem)
    for p in range(1, min(problem.num_units, len(problem.devices)) + 1):
        for seq in itertools.permutations(groups, p):
            cards = [d for g in seq for d in g]
            if len(set(cards)) == len(cards):
                for spans in _compositions(problem.num_units, p):
                    yield tuple(Stage(g[0], lo, hi, members=g if len(g) > 1 else ()) for g, (lo, hi) in zip(seq, spans))


@pytest.fixture(scope="module")
def gpt_problem():
    from hetpipe.cost_models.cluster import cluster_from_dict
    from hetpipe.plan.build import build_problem, capture_builtin

    graph = capture_builtin("gpt-tiny", batch=4, seq=64)
    cluster = cluster_from_dict({"nodes": [{"name": "box", "intra": "pcie-host", "devices": [
        {"gpu": "rtx3090"}, {"gpu": "rtx3060-12gb"}, {"gpu": "rtx4090"}]}]})
    return graph, cluster, build_problem(graph, cluster, microbatches=4, tensor_parallel="auto")


def test_table_pricing_is_price_group_shares_and_rounded_member_times_on_a_captured_gpt(gpt_problem):
    from hetpipe.partitioner.tp_groups import price_group, rounded_member_s
    from hetpipe.partitioner.tp_tables import group_shares, member_fractions

    graph, cluster, prob = gpt_problem
    units, members = range(1, 5), (0, 1, 2)
    devices = [cluster.devices[i] for i in members]
    for in_flight in (1, 3):
        shares, _ = price_group(graph.units[1:5], devices, cluster, precision=graph.precision, in_flight=in_flight)
        mine = group_shares(prob, units, members, in_flight=in_flight)
        assert mine.weights == pytest.approx(shares.weights, rel=1e-12)
    want = rounded_member_s(graph.units[1:5], shares, devices, precision=graph.precision)
    for i, d in enumerate(members):
        kind = prob.devices[d].kind
        got = sum((prob.fwd_s[kind][u] + prob.bwd_s[kind][u]) * f
                  for u, f in zip(units, member_fractions(prob, units, shares, i)))
        assert got == pytest.approx(want[i], rel=1e-12)


@pytest.fixture(scope="module")
def demo_plan():
    """gpt-demo on the mini home lab with --tensor-parallel auto (its 3090 + 4090 share a node)."""
    from hetpipe.cost_models.cluster import load_cluster
    from hetpipe.plan.build import build_problem, capture_builtin, partition_graph

    graph = capture_builtin("gpt-demo", batch=2, seq=128)
    cluster = load_cluster("examples/clusters/homelab-mini.yaml")
    plan = partition_graph(graph, cluster, tensor_parallel="auto", time_limit_s=4.0)
    pipe = solve(build_problem(graph, cluster, microbatches=plan.training.microbatches, recompute="auto"),
                 time_limit_s=4.0)
    return plan, pipe


def test_a_planned_group_is_written_checked_and_edits_to_it_are_caught(demo_plan, tmp_path):
    from hetpipe.plan.check import check_plan
    from hetpipe.plan.schema import Plan

    plan, pipe = demo_plan
    grouped = [st for st in plan.stages if st.group_devices]
    assert grouped and plan.solver.name == "group-dp" and plan.cost_model["tensor_parallel"].startswith("auto")
    assert plan.predicted.iteration_s <= pipe.iteration_s * (1 + 1e-9)  # never worse than pipeline-only
    assert plan.solver.bound_s <= plan.predicted.iteration_s
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded == plan and loaded.version == 9  # groups: 4; the loss's backward transient: 8; the step's tables: 9
    assert check_plan(loaded).ok, check_plan(loaded).violations
    from hetpipe.plan.schema import problem_from_plan, stages_from_plan
    from hetpipe.plan.tp_plan import member_memory

    per_card = member_memory(problem_from_plan(plan), stages_from_plan(plan))  # `hetpipe show`'s memory rows
    for st in grouped:
        rows = [per_card[d] for d in st.group_devices]
        assert all(s == st.index and used <= usable for s, used, usable in rows)
        assert max(used - usable for _, used, usable in rows) == st.memory_bytes - st.usable_bytes
    i = grouped[0].index
    w = grouped[0].group_shares
    edited = dataclasses.replace(plan, stages=tuple(
        dataclasses.replace(st, group_shares=(w[0] + 0.01, w[1] - 0.01, *w[2:])) if st.index == i else st
        for st in plan.stages))
    assert any("group_shares" in v for v in check_plan(edited).violations)
    units = list(plan.units)
    units[grouped[0].first_unit] = dataclasses.replace(units[grouped[0].first_unit], tp_flops_fraction=0.5)
    assert not check_plan(dataclasses.replace(plan, units=tuple(units))).ok  # times and shares re-derived


def test_an_unknown_tensor_parallel_setting_is_one_config_error_naming_the_flag():
    from hetpipe.errors import ConfigError
    from hetpipe.plan.tp_plan import check_tensor_parallel_option

    with pytest.raises(ConfigError, match="--tensor-parallel 'on' is not one of off, auto"):
        check_tensor_parallel_option("on")


def _lever_choices(problem: Problem, st: Stage) -> list[Stage]:
    """Every recompute prefix x offload setting a width-1 stage may take (none for a group)."""
    from hetpipe.partitioner.problem import can_offload
    from hetpipe.partitioner.recompute import stage_order

    if st.members:
        return [st]
    offs = {"never": [False], "all": [can_offload(problem, st)], "auto": [False, True] if can_offload(problem, st)
            else [False]}[problem.offload]
    order = stage_order(problem, st)
    cuts = {"none": [0], "all": [len(order)], "auto": range(len(order) + 1)}[problem.recompute]
    return [replace(st, offload=o, recompute_units=tuple(sorted(order[:r]))) for o in offs for r in cuts]


def brute_force_levers(problem: Problem) -> float:
    """Least T_est over every placement with groups and every lever choice of every width-1 stage
    (each recompute prefix, each offload setting: not the solvers' per-stage rule)."""
    best = math.inf
    for plain in _all_placements(problem):
        for stages in itertools.product(*(_lever_choices(problem, st) for st in plain)):
            ev = evaluate(problem, stages, objective="estimate")
            if ev.fits:
                best = min(best, ev.iteration_s)
    return best


def _lever_instance(seed: int, mode: str) -> Problem:
    from tests.instances import with_offload

    rng = random.Random(1000 + seed)
    base = random_problem(rng, units=rng.randint(3, 4), devices=rng.randint(2, 3), tight_memory=rng.random() < 0.5,
                          recompute=rng.choice(("none", "auto")), activation_max=20)
    rng.random()  # the draw that once chose the mode: the instances stay the same for both modes
    return _with_splits(rng, with_offload(rng, base, mode), group_max=3)


@pytest.mark.parametrize("mode", ["all", "auto"])
def test_group_dp_with_the_recompute_and_offload_levers_equals_brute_force(mode):
    """Every recompute prefix and offload setting of every width-1 stage, against brute force (seed 17
    under ``auto``: an offloading placement tied on S + (m-1) b with its non-offloading twin, which
    the offload walk missed before it ranked by S + (m-1) b: `cap_walk.walk_value_s`)."""
    from hetpipe.partitioner.solvers.offload_walk import tail_walk

    grouped = offloaded = 0
    for seed in range(24):
        prob = _lever_instance(seed, mode)
        want = brute_force_levers(prob)
        got = tail_walk(prob, lambda p, _: solve_groups(p))
        if math.isinf(want):
            assert got is None, seed
            continue
        assert got is not None and evaluate(prob, got.stages, objective="estimate").fits, seed
        assert got.iteration_s == pytest.approx(want, rel=1e-9, abs=1e-12), seed
        grouped += any(st.members for st in got.stages)
        offloaded += any(st.offload for st in got.stages)
    assert grouped >= 2 and offloaded >= 2, (grouped, offloaded)  # not vacuous: both levers and groups win somewhere


def test_group_pricing_past_its_deadline_gives_up_and_solve_tp_keeps_the_pipeline_answer(monkeypatch):
    from hetpipe.partitioner.solvers import group_dp, tp_solve
    from hetpipe.partitioner.solvers.group_dp import GroupSpaceTooLarge

    prob = _instance(3)
    with pytest.raises(GroupSpaceTooLarge, match="time limit"):
        solve_groups(prob, deadline=0.0)
    real = group_dp.solve_groups
    monkeypatch.setattr(tp_solve, "solve_groups", lambda p, **kw: real(p, **{**kw, "deadline": 0.0}))
    sched = replace(prob, objective="schedule")
    assert solve_tp(sched, time_limit_s=10.0).stages == solve(replace(sched, group_max=1), time_limit_s=5.0).stages
