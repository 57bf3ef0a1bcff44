"""Tensor-parallel groups across two nodes, when the link wins (issue 15).

1. The candidate set: `Problem.group_nodes` = 1 is the one-node set as before; 2 appends the sets of
   two nodes' cards; 3 is refused.  On tiny random two-node instances whose inter-node link is slower,
   as fast, or faster than the intra-node one, the group DP equals brute force over that set (every
   cut, group, lead and order), and a cross-node group is the optimum on some of them.
2. The solver decides: Llama-1B-like (sequence 2048, micro-batch 1, bf16) on two nodes of two NVLink
   A100s each, one micro-batch (no pipeline overlap: only a group uses more cards at once): at
   400 Gbit/s between the nodes a four-card group across both is chosen and lowers T below the best
   one-node plan; at 10 and 25 Gbit/s no group crosses the nodes and T is the one-node plan's; at two
   micro-batches two-node groups never make T worse.  The plan written at 400 Gbit/s loads, `check`
   re-prices it, its all-reduces priced on the nodes' link.
3. Plans: a group of two nodes' cards loads; of three it is refused naming the field.
4. The runtime: the rank layout per node (``--plan-node``) of a group spanning two nodes, and one
   emulated `hetpipe run` on 3 gloo ranks (a group of a node-a and a node-b card, then a node-a
   card): losses and gathered parameters equal a single-device loop (rtol 1e-5), each member
   stretched to its own prediction, whose all-reduces are priced on the 1 Gbit/s inter-node link.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import random
from dataclasses import replace

import pytest
import torch

from hetpipe.errors import ConfigError, PlanError
from hetpipe.partitioner.problem import Problem, evaluate
from hetpipe.partitioner.solvers.group_dp import candidate_groups, solve_groups
from hetpipe.partitioner.tp_tables import ring_of
from tests.instances import random_problem
from tests.test_tp_solver import brute_force_groups
from tests.machine_load import guard_s


def _spans(problem: Problem, group: tuple[int, ...]) -> int:
    return len({problem.devices[d].node for d in group})


def _two_node_instance(seed: int) -> Problem:
    """2-4 cards, half on node n0 and half on n1; intra links 10 B/s, the nodes' link 1, 10 or 40 B/s."""
    from tests.test_tp_solver import _with_splits  # noqa: PLC2701 -- the brute-force file's split tables

    rng = random.Random(5000 + seed)
    cards = rng.randint(2, 4)
    prob = random_problem(rng, units=rng.randint(4, 5), devices=cards, tight_memory=rng.random() < 0.5,
                          recompute=rng.choice(("none", "auto")), activation_max=rng.choice((3, 6)))
    devices = tuple(replace(d, node="n0" if i < (cards + 1) // 2 else "n1") for i, d in enumerate(prob.devices))
    inter = rng.choice((1.0, 10.0, 40.0))
    bw = tuple(tuple(math.inf if a is b else (10.0 if a.node == b.node else inter) for b in devices) for a in devices)
    lat = tuple(tuple(0.0 if a is b else (0.01 if a.node == b.node else 0.02) for b in devices) for a in devices)
    prob = replace(prob, devices=devices, bandwidth_bytes_s=bw, latency_s=lat)
    return replace(_with_splits(rng, prob, group_max=rng.choice((2, 4))), group_nodes=2)


# ----------------------------------------------------------------------------- 1. candidates, brute force


def test_one_node_candidates_are_unchanged_and_two_node_sets_come_after_them():
    prob = _two_node_instance(1)
    one, two = candidate_groups(replace(prob, group_nodes=1)), candidate_groups(prob)
    assert two[:len(one)] == one and len(two) > len(one)
    assert all(_spans(prob, g) == 1 for g in one) and all(_spans(prob, g) == 2 for g in two[len(one):])
    assert all(len(g) <= prob.group_max and g[1:] == tuple(sorted(g[1:])) for g in two)
    with pytest.raises(ConfigError, match="Problem.group_nodes is 3; a tensor-parallel group may span 1..2 nodes"):
        candidate_groups(replace(prob, group_nodes=3))


@pytest.mark.parametrize("seed", range(14))
def test_group_dp_over_two_node_groups_equals_brute_force(seed):
    prob = _two_node_instance(seed)
    want = brute_force_groups(prob)  # over `candidate_groups(prob)`: the two-node sets included
    got = solve_groups(prob)
    if math.isinf(want):
        assert got is None
        return
    assert got is not None and evaluate(prob, got.stages, objective="estimate").fits
    assert got.iteration_s == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_cross_node_groups_win_somewhere_and_only_on_a_link_not_slower_than_the_nodes_own():
    crossing = []
    for seed in range(14):
        prob = _two_node_instance(seed)
        res = solve_groups(prob)
        if res is not None and any(st.members and _spans(prob, st.members) == 2 for st in res.stages):
            crossing.append(prob.bandwidth_bytes_s[0][-1])
    assert len(crossing) >= 2, crossing  # not vacuous
    assert min(crossing) >= 10.0, crossing  # the 1 B/s link never carries a group here


# ----------------------------------------------------------------------------- 2. the solver decides


def _lab(gbit_s: float):
    from hetpipe.cost_models.cluster import cluster_from_dict

    net = {"bandwidth": f"{gbit_s:g}Gbit/s", "latency": "5us"}  # ~5 us: InfiniBand / RoCE small messages
    return cluster_from_dict({"name": f"2x2-a100-{gbit_s:g}", "nodes": [
        {"name": n, "intra": "nvlink", "network": net, "devices": [{"gpu": "a100-80gb", "count": 2}]}
        for n in ("a", "b")]})


@functools.lru_cache(maxsize=None)
def _llama():
    from hetpipe.plan.build import capture_builtin

    return capture_builtin("llama-1b", batch=1, seq=2048, precision="bf16-mixed")


@functools.lru_cache(maxsize=None)
def _decision(gbit_s: float, microbatches: int = 1):
    """(problem, solve_tp with two-node groups, solve_tp with one-node groups) on the 2x2 A100 lab."""
    from hetpipe.partitioner.solvers.tp_solve import solve_tp
    from hetpipe.plan.build import build_problem

    prob = build_problem(_llama(), _lab(gbit_s), microbatches=microbatches, tensor_parallel="auto")
    assert prob.group_nodes == 2  # what --tensor-parallel auto offers
    return prob, solve_tp(prob, time_limit_s=30.0), solve_tp(replace(prob, group_nodes=1), time_limit_s=30.0)


def test_on_a_400_gbit_link_a_group_across_the_nodes_is_chosen_and_lowers_t():
    prob, two, one = _decision(400.0)
    crossing = [st for st in two.stages if st.members and _spans(prob, st.members) == 2]
    assert crossing, two.stages
    assert two.iteration_s < one.iteration_s * (1 - 1e-3), (two.iteration_s, one.iteration_s)
    assert evaluate(prob, two.stages).iteration_s == pytest.approx(two.iteration_s, rel=1e-9)


def test_two_node_groups_never_make_t_worse_than_one_node_groups_under_the_schedule():
    """At two micro-batches T_est prefers the four-card group across the nodes, which the schedule
    replays 0.3% slower than two NVLink groups in a pipeline: the one-node answer is verified too."""
    _, two, one = _decision(400.0, 2)
    assert two.iteration_s <= one.iteration_s * (1 + 1e-9)


@pytest.mark.parametrize("gbit_s", [10.0, 25.0])
def test_on_a_slow_link_no_group_crosses_the_nodes(gbit_s):
    prob, two, one = _decision(gbit_s)
    assert not [st for st in two.stages if st.members and _spans(prob, st.members) == 2], two.stages
    assert two.iteration_s == pytest.approx(one.iteration_s, rel=1e-9)


def test_a_planned_cross_node_group_loads_and_check_reprices_it_on_the_nodes_link(tmp_path):
    from hetpipe.partitioner.problem import stage_position
    from hetpipe.partitioner.tp_tables import group_stage
    from hetpipe.plan.build import assemble_plan
    from hetpipe.plan.check import check_plan
    from hetpipe.plan.schema import Plan, SolverReport, problem_from_plan, stages_from_plan

    prob, two, _ = _decision(400.0)
    plan = assemble_plan(_llama(), _lab(400.0), problem=prob, stages=two.stages, global_batch=1,
                         solver=SolverReport("group-dp", two.status, two.iteration_s, two.bound_s, 0.0))
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded == plan and check_plan(loaded).ok, check_plan(loaded).violations
    problem, stages = problem_from_plan(loaded), stages_from_plan(loaded)
    s = next(i for i, st in enumerate(stages) if st.members and _spans(problem, st.members) == 2)
    link = _lab(400.0).link("a:0", "b:0")
    assert ring_of(problem, stages[s].members) == (link.bandwidth_bytes_s, link.latency_s)
    faster = replace(problem, bandwidth_bytes_s=tuple(tuple(300e9 for _ in row) for row in problem.bandwidth_bytes_s))
    at = {"first": stages[s].first_unit, "last": stages[s].last_unit, "members": stages[s].members,
          "position": stage_position(problem, stages, s)}
    assert group_stage(problem, **at).allreduce_s > group_stage(faster, **at).allreduce_s  # priced on the network


# ----------------------------------------------------------------------------- 3. plans


def test_a_group_of_two_nodes_loads_and_of_three_is_refused_naming_the_field():
    from hetpipe.plan.schema import Plan
    from tests.test_tensor_parallel import _grouped_plan  # noqa: PLC2701 -- the plan-format tests' builder

    doc = json.loads(json.dumps(_grouped_plan(("n0:0", "n1:2"), (0.5, 0.5)).to_dict()))
    doc["stages"][1]["device"], doc["stages"][1]["usable_bytes"] = "n0:1", doc["stages"][0]["usable_bytes"]
    assert Plan.from_dict(doc).stages[0].group_devices == ("n0:0", "n1:2")
    doc = json.loads(json.dumps(_grouped_plan(("n0:0", "n0:1", "n1:2"), (0.4, 0.3, 0.3)).to_dict()))
    doc["devices"][1]["node"] = "n2"
    with pytest.raises(PlanError, match=r"stages\[0\].group_devices: .* span nodes \['n0', 'n1', 'n2'\]; "
                                        "a tensor-parallel group is on at most 2 nodes"):
        Plan.from_dict(doc)


# ----------------------------------------------------------------------------- 4. the runtime

MODEL, MICRO_BATCH, SEQ, MICROBATCHES, STEPS = "gpt-tiny", 2, 16, 4, 3
SHARES = (0.7, 0.3)


@functools.lru_cache(maxsize=None)
def cross_plan():
    """Stage 0 (units 0-3) on the group a:0 (a 3060, lead) + b:0 (a 3090, the other node), stage 1 on a:1
    (a 4090); 1 Gbit/s between the nodes; shares 0.7 / 0.3 (the planner's are near even on this tiny model)."""
    from hetpipe.cost_models.cluster import cluster_from_dict
    from hetpipe.partitioner.problem import Stage
    from hetpipe.plan.build import assemble_plan, build_problem
    from hetpipe.plan.schema import SolverReport
    from tests.test_tp_runtime import tp_graph

    graph = tp_graph(MODEL)
    net = {"bandwidth": "1Gbit/s", "latency": "0.2ms"}
    cluster = cluster_from_dict({"nodes": [
        {"name": "a", "intra": "pcie-host", "network": net, "devices": [{"gpu": "rtx3060-12gb"}, {"gpu": "rtx4090"}]},
        {"name": "b", "network": net, "devices": [{"gpu": "rtx3090"}]}]})
    problem = build_problem(graph, cluster, microbatches=MICROBATCHES, tensor_parallel="auto")
    stages = (Stage(0, 0, 3, members=(0, 2)), Stage(1, 4, len(graph.units) - 1))
    ev = evaluate(problem, stages)
    plan = assemble_plan(graph, cluster, problem=problem, stages=stages, global_batch=MICRO_BATCH * MICROBATCHES,
                         solver=SolverReport("hand", "FEASIBLE", ev.iteration_s, 0.0, 0.0))
    return dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], group_shares=SHARES),
                                             *plan.stages[1:]))


def test_each_node_runs_its_own_members_and_the_emulation_prices_the_group_on_the_nodes_link():
    from hetpipe.plan.group_run import member_timings, rank_slots
    from hetpipe.plan.schema import problem_from_plan
    from hetpipe.runtime.tp_ranks import slot_for

    plan = cross_plan()
    assert [(s.stage, s.member, s.device) for s in rank_slots(plan)] == [(0, 0, "a:0"), (0, 1, "b:0"), (1, 0, "a:1")]
    per_node = {n: [slot_for(plan, node=n, rank=-1, local_rank=k) for k in range(cards)]
                for n, cards in (("a", 2), ("b", 1))}  # torchrun per node: --plan-node, --nproc-per-node
    assert [(s.stage, s.member) for s in per_node["a"]] == [(0, 0), (1, 0)]
    assert [(s.stage, s.member) for s in per_node["b"]] == [(0, 1)]
    with pytest.raises(ConfigError, match="use --nproc-per-node=1 on that node"):
        slot_for(plan, node="b", rank=-1, local_rank=1)
    problem = problem_from_plan(plan)
    assert ring_of(problem, (0, 2)) == (125e6, 2e-4)  # 1 Gbit/s, 0.2 ms: the nodes' link, not the PCIe one
    slow = member_timings(plan)
    fast_net = {"bandwidth_bytes_s": tuple(tuple(16e9 for _ in row) for row in problem.bandwidth_bytes_s)}
    assert slow[(0, 0)].fwd_s > _member_fwd_s(problem, plan, fast_net)  # the all-reduces are on the 1 Gbit/s link


def _member_fwd_s(problem: Problem, plan, links: dict) -> float:
    from hetpipe.partitioner.problem import stage_position
    from hetpipe.partitioner.tp_tables import group_stage
    from hetpipe.plan.schema import stages_from_plan

    stages, fast = stages_from_plan(plan), replace(problem, **links)
    return group_stage(fast, first=0, last=3, members=(0, 2), position=stage_position(fast, stages, 0),
                       shares=plan.stages[0].group_shares).member_fwd_s[0]


@pytest.fixture(scope="module")
def cross_run(tmp_path_factory):
    from hetpipe import models
    from hetpipe.runtime.run import run
    from tests.test_tp_runtime import group_reference

    out = tmp_path_factory.mktemp("tp_cross_run")
    torch.manual_seed(0)
    resolved = models.resolve(MODEL, device="cpu", batch=MICRO_BATCH, seq=SEQ)
    torch.save(resolved.model.state_dict(), out / "weights.pt")
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(STEPS):
        x = torch.randint(0, models.input_vocab(MODEL) or 64, (MICRO_BATCH * MICROBATCHES, SEQ), generator=gen)
        batches.append(((x,), models.example_targets(MODEL, (x,))))
    reference = copy.deepcopy(resolved.model)
    ref_losses = group_reference(reference, batches)
    report = run(cross_plan(), model=MODEL, steps=STEPS, seq=SEQ, data=batches, weights=out / "weights.pt",
                 save_weights=out / "saved", emulate=True, run_dir=out / "run", timeout_s=guard_s(120.0))
    return report, ref_losses, reference, out / "saved"


@pytest.mark.slow
def test_a_group_across_two_nodes_trains_like_one_device_each_member_at_its_own_prediction(cross_run):
    from hetpipe.plan.group_run import member_timings
    from tests.test_tp_runtime import assert_gathered_equal
    from tests.zoo_harness import saved_state

    report, ref_losses, reference, saved = cross_run
    assert report.world_size == 3
    torch.testing.assert_close(list(report.losses), ref_losses, rtol=1e-5, atol=0)
    assert_gathered_equal(saved_state(saved), reference)  # the shards of both nodes' members gathered back
    mine, rows = member_timings(cross_plan()), {(r.stage, r.member): r for r in report.members}
    assert set(rows) == set(mine) and [rows[k].device for k in sorted(rows)] == ["a:0", "b:0"]
    for key, row in rows.items():  # stretched to at least its own F / B, the 1 Gbit/s all-reduces included
        assert (row.predicted_fwd_s, row.predicted_bwd_s) == (mine[key].fwd_s, mine[key].bwd_s)
        assert row.fwd_emulated_s >= 0.99 * row.predicted_fwd_s and row.bwd_emulated_s >= 0.99 * row.predicted_bwd_s


@pytest.mark.slow
def test_a_group_across_two_network_namespaces_trains_like_one_device(tmp_path):
    """The plan's two nodes as network namespaces joined by a tc-shaped veth (`runtime/faults/netns.py`): one
    torchrun per node (``--plan-node``), the group's process group spanning them, so its all-reduces and the
    lead's broadcast cross the shaped link.  Default data and seeded weights, as a plain loop draws them."""
    from safetensors.torch import load_file

    from hetpipe import models
    from hetpipe.runtime.data import synthetic_batch
    from hetpipe.runtime.faults.netns import netns_support, run_on_netns
    from hetpipe.runtime.stage.initial import write_initial_weights
    from tests.test_tp_runtime import group_reference

    reason = netns_support()
    if reason:  # the refusal is what is tested where namespaces cannot be made
        with pytest.raises(ConfigError, match=f"cannot run on network namespaces here: {reason}"):
            run_on_netns(cross_plan(), model=MODEL, seq=SEQ, steps=STEPS, run_dir=tmp_path / "run")
        return
    rep = run_on_netns(cross_plan(), model=MODEL, seq=SEQ, steps=STEPS, run_dir=tmp_path / "run",
                       timeout_s=guard_s(60.0))
    assert rep.world_size == 3 and any("links a <-> b ran over a veth pair" in n for n in rep.notes), rep.notes
    model = models.resolve(MODEL, device="cpu", batch=MICRO_BATCH, seq=SEQ).model
    model.load_state_dict(load_file(str(write_initial_weights(MODEL, tmp_path / "init", seed=0, batch=MICRO_BATCH,
                                                              seq=SEQ))), strict=False)
    example = models.resolve(MODEL, device="meta", batch=MICRO_BATCH, seq=SEQ).example_inputs
    vocab = next(m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding))  # the worker's
    batches = [synthetic_batch(MODEL, example, global_batch=MICRO_BATCH * MICROBATCHES, vocab=vocab, seed=0, step=k)
               for k in range(STEPS)]
    torch.testing.assert_close(list(rep.losses), group_reference(model, batches), rtol=1e-5, atol=0)
