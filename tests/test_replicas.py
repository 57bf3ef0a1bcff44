"""Mixed data-parallel replicas (issue #6, planning): sync model, solvers, plan v2 and its check."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from hetpipe.cost_models.stage_memory import MEMORY_MODEL
from hetpipe.cost_models.sync import (
    SYNC_BUDGET_FRACTION,
    Ring,
    backward_done_fraction,
    choose_policy,
    overlapped_sync_end_s,
    ring_allreduce_s,
    sync_groups,
)
from hetpipe.errors import ConfigError, InfeasibleError, PlanError
from hetpipe.plan.build import assemble_plan, build_problem
from hetpipe.plan.replicas import partition_replicas
from hetpipe.plan.check import check_plan
from hetpipe.plan.schema import PLAN_VERSION_OBJECTIVE, PLAN_VERSION_REPLICAS, Plan, SolverReport
from hetpipe.partitioner.problem import Stage, evaluate
from hetpipe.plan.replicas import build_replica_problem, ddp_equal
from hetpipe.partitioner.replicas import (
    PipelineCache,
    ReplicaProblem,
    _exact_groupings,
    compositions,
    replica_problem,
    solve_replicas,
    solve_replicas_exact,
    water_fill,
)
from tests.instances import all_placements, random_problem
from tests.plan_docs import as_version_3
from tests.synthetic import synthetic_cluster, synthetic_graph

HOME = (("n0", "fast", 40.0, 24.0), ("n0", "mid", 30.0, 24.0), ("n1", "slow", 10.0, 12.0))
ONE_BOX = (("n0", "fast", 40.0, 24.0), ("n0", "fast", 40.0, 24.0), ("n0", "mid", 30.0, 24.0))


def _random_rp(seed: int, *, units: tuple[int, int] = (4, 6), devices: tuple[int, int] = (3, 4),
               grad: int = 10) -> ReplicaProblem:
    rng = random.Random(seed)
    prob = random_problem(rng, units=rng.randint(*units), devices=rng.randint(*devices),
                          microbatches=rng.randint(2, 6), tight_memory=rng.random() < 0.5)
    return ReplicaProblem(prob, grad_bytes=tuple(rng.randint(0, grad) for _ in range(prob.num_units)))


# --- the sync cost model -------------------------------------------------------------------------------


def test_ring_allreduce_follows_the_formula():
    # 2(d-1) latency steps + 2(d-1)/d * S / bw  (cost_formulas.md §3.4)
    assert ring_allreduce_s(num_bytes=600, ranks=3, bandwidth_bytes_s=100.0, latency_s=0.5) == pytest.approx(
        4 * 0.5 + 4 / 3 * 6.0)
    assert ring_allreduce_s(num_bytes=600, ranks=1, bandwidth_bytes_s=100.0, latency_s=0.5) == 0.0


def test_each_bucket_pays_the_ring_latency_once():
    one = ring_allreduce_s(num_bytes=600, ranks=3, bandwidth_bytes_s=100.0, latency_s=0.5)
    assert ring_allreduce_s(num_bytes=600, ranks=3, bandwidth_bytes_s=100.0, latency_s=0.5, buckets=3) == \
        pytest.approx(one + 2 * 4 * 0.5)
    inf = math.inf
    bw = ((inf, 10.0), (10.0, inf))
    lat = ((0.0, 1.0), (1.0, 0.0))
    coarse, fine = (sync_groups([[(0, 0, 1)], [(1, 0, 1)]], grad_bytes=(60, 40), bandwidth_bytes_s=bw,
                                latency_s=lat, bucket_cap_bytes=cap)[0] for cap in (100, 30))
    assert fine.time_s - coarse.time_s == pytest.approx((4 - 1) * 2 * 1.0)  # ceil(100 / 30) = 4 buckets


@settings(max_examples=80, deadline=None)
@given(rings=st.lists(st.tuples(st.lists(st.sampled_from("abcd"), min_size=1, max_size=3, unique=True),
                                st.floats(0.0, 5.0), st.floats(0.0, 10.0)), min_size=1, max_size=8))
def test_overlapped_sync_ends_between_its_bounds(rings):
    """No ring ends before its holders are ready plus its own time; never later than starting every ring,
    one after the other, once the last holder is ready (T's serial charge, the ready times as compute)."""
    model = [Ring(tuple(h), s, tuple(r for _ in h)) for h, s, r in rings]
    end = overlapped_sync_end_s(model)
    assert end >= max(r + s for _, s, r in rings) - 1e-9
    assert end <= max(r for *_, r in rings) + sum(s for _, s, _ in rings) + 1e-9
    # rings on disjoint holders run at once; on one holder they queue
    assert overlapped_sync_end_s([Ring(("a",), 2.0, (0.0,)), Ring(("b",), 2.0, (0.0,))]) == 2.0
    assert overlapped_sync_end_s([Ring(("a",), 2.0, (0.0,)), Ring(("a", "b"), 2.0, (0.0, 0.0))]) == 4.0


def test_backward_reaches_the_first_units_last():
    assert backward_done_fraction([1.0, 2.0, 1.0], 2) == pytest.approx(0.25)  # the last unit goes first
    assert backward_done_fraction([1.0, 2.0, 1.0], 0) == 1.0
    assert backward_done_fraction([0.0, 0.0], 1) == 1.0


def test_sync_groups_are_stages_for_a_shared_layout_and_refined_otherwise():
    inf = math.inf
    bw = ((inf, 8.0, 2.0, 2.0), (8.0, inf, 2.0, 2.0), (2.0, 2.0, inf, 4.0), (2.0, 2.0, 4.0, inf))
    lat = tuple(tuple(0.0 for _ in range(4)) for _ in range(4))
    grads = (10, 20, 30)
    shared = sync_groups([[(0, 0, 0), (2, 1, 2)], [(1, 0, 0), (3, 1, 2)]], grad_bytes=grads,
                         bandwidth_bytes_s=bw, latency_s=lat)
    assert [(g.first_unit, g.last_unit, g.devices) for g in shared] == [(0, 0, (0, 1)), (1, 2, (2, 3))]
    assert [g.time_s for g in shared] == pytest.approx([10 / 8.0, 50 / 4.0])  # per-stage rings, own links
    mixed = sync_groups([[(0, 0, 2)], [(1, 0, 1), (3, 2, 2)]], grad_bytes=grads, bandwidth_bytes_s=bw,
                        latency_s=lat)
    assert [(g.first_unit, g.last_unit, g.devices) for g in mixed] == [(0, 1, (0, 1)), (2, 2, (0, 3))]
    assert mixed[1].bandwidth_bytes_s == 2.0  # the slowest link between the holders bounds the ring


def test_policy_keeps_sync_within_budget_and_picks_h_from_links():
    assert choose_policy(compute_s=10.0, sync_s=1.0).policy == "synchronous"
    p = choose_policy(compute_s=10.0, sync_s=25.0)
    assert p.policy == "diloco" and p.outer_steps == 25 and p.amortised_s <= SYNC_BUDGET_FRACTION * 10.0
    assert choose_policy(compute_s=10.0, sync_s=25.0, policy="diloco", outer_steps=8).amortised_s == 25.0 / 8
    assert choose_policy(compute_s=10.0, sync_s=25.0, policy="synchronous").amortised_s == 25.0
    with pytest.raises(ConfigError, match="policy"):
        choose_policy(compute_s=1.0, sync_s=1.0, policy="sometimes")
    with pytest.raises(ConfigError, match="diloco"):
        choose_policy(compute_s=1.0, sync_s=1.0, policy="synchronous", outer_steps=4)


# --- solvers ------------------------------------------------------------------------------------------


def _brute_force_compute(rp: ReplicaProblem) -> float:
    """min over groupings x splits x every placement per replica of max_r T_r (no sync)."""
    best = math.inf
    total = rp.base.microbatches
    for groups in _exact_groupings(len(rp.base.devices)):
        if not 0 < len(groups) <= total:
            continue
        for split in compositions(total, len(groups)):
            worst = 0.0
            for group, m in zip(groups, split):
                prob = replica_problem(rp.base, m)
                times = [evaluate(prob, p).iteration_s for p in all_placements(prob)
                         if {s.device for s in p} <= set(group) and evaluate(prob, p).fits]
                worst = max(worst, min(times, default=math.inf))
            best = min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_exact_reference_equals_brute_force_without_sync(seed):
    rp = _random_rp(seed, units=(3, 4), devices=(2, 3), grad=0)
    want = _brute_force_compute(rp)
    if math.isinf(want):
        with pytest.raises(InfeasibleError):
            solve_replicas_exact(rp)
        return
    got = solve_replicas_exact(rp)
    assert got.sync_s == 0.0 and got.iteration_s == pytest.approx(want, rel=1e-9)


def test_water_fill_is_the_best_split_for_the_slowest_replica():
    for seed in range(10):
        rp = _random_rp(100 + seed)
        cache = PipelineCache(rp.base, exact=True)
        n, total = len(rp.base.devices), rp.base.microbatches
        groups = ((0,), tuple(range(1, n)))
        best = min((max(cache.best(g, m)[1] for g, m in zip(groups, split))
                    for split in compositions(total, 2) if all(cache.best(g, m) for g, m in zip(groups, split))),
                   default=None)
        split = water_fill(cache, groups, total)
        if best is None:
            assert split is None
        else:
            assert max(cache.best(g, m)[1] for g, m in zip(groups, split)) == pytest.approx(best, rel=1e-12)


def test_search_matches_exact_reference_on_random_instances():
    gaps = []
    for seed in range(50):
        rp = _random_rp(seed)
        policy = ("synchronous", "auto")[seed % 2]
        try:
            exact = solve_replicas_exact(rp, policy=policy)
        except InfeasibleError:
            with pytest.raises(InfeasibleError):
                solve_replicas(rp, policy=policy)
            continue
        found = solve_replicas(rp, policy=policy, time_limit_s=20)
        # same search space (each replica's best pipeline): the search is never below the reference
        assert found.iteration_s >= exact.iteration_s * (1 - 1e-9)
        assert found.bound_s <= exact.iteration_s * (1 + 1e-9)  # the work bound is a true lower bound
        gaps.append(found.iteration_s / exact.iteration_s - 1)
    assert len(gaps) >= 40
    assert max(gaps) < 1e-9, f"search gaps vs exact: {sorted(gaps)[-5:]}"


def test_uneven_split_follows_replica_speed():
    rp = build_replica_problem(synthetic_graph(6), synthetic_cluster(ONE_BOX[1:]), global_batch=24)
    sol = solve_replicas_exact(rp, policy="synchronous")
    m = {rp.base.devices[r.stages[0].device].kind: r.microbatches for r in sol.replicas}
    assert [len(r.stages) for r in sol.replicas] == [1, 1] and sum(m.values()) == 12
    assert m["fast"] > m["mid"] > 0  # plain data parallelism with an uneven batch: the faster card takes more


# --- plans --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def home_plan() -> Plan:
    return partition_replicas(synthetic_graph(6), synthetic_cluster(HOME), global_batch=16, solver="exact")


def test_replica_plan_round_trips_and_checks(home_plan, tmp_path):
    path = tmp_path / "plan.json"
    home_plan.save(path)
    doc = json.loads(path.read_text())
    # version 4: the schedule objective (issue 17), beyond memory model 2's 3 and the replicas' 2
    assert doc["version"] == PLAN_VERSION_OBJECTIVE == 4 and doc["replicas"] and doc["sync"]["policy"] == "synchronous"
    loaded = Plan.load(path)
    assert loaded == home_plan
    report = check_plan(loaded)
    assert report.ok, report.violations
    # T = max_r T_r + T_sync / H, from the plan's own tables
    t_r = [r.iteration_s for r in loaded.replicas]
    assert report.iteration_s == pytest.approx(max(t_r) + loaded.sync.sync_s / loaded.sync.outer_steps, rel=1e-12)
    assert sum(r.grad_weight for r in loaded.replicas) == pytest.approx(1.0)
    assert sum(r.samples for r in loaded.replicas) == loaded.training.global_batch
    for d in loaded.left_out:  # a card in no replica says why
        assert d.reason and d.device not in {s.device for s in loaded.stages}


@pytest.mark.parametrize("edit, message", [
    (lambda p: dataclasses.replace(p, replicas=(
        dataclasses.replace(p.replicas[0], microbatches=p.replicas[0].microbatches + 1), *p.replicas[1:])),
     "micro-batches sum"),
    (lambda p: dataclasses.replace(p, stages=(dataclasses.replace(p.stages[0], memory_bytes=1),) + p.stages[1:]),
     "memory_bytes"),
    (lambda p: dataclasses.replace(p, sync=dataclasses.replace(p.sync, sync_s=p.sync.sync_s * 2)), "sync.sync_s"),
    (lambda p: dataclasses.replace(p, sync=dataclasses.replace(p.sync, groups=())), "sync.groups"),
    (lambda p: dataclasses.replace(p, devices=tuple(dataclasses.replace(d, usable_bytes=10**6) for d in p.devices),
                                   stages=tuple(dataclasses.replace(s, usable_bytes=10**6) for s in p.stages)),
     "usable"),
])
def test_check_catches_edited_replica_plans(home_plan, edit, message):
    report = check_plan(edit(home_plan))
    assert not report.ok and any(message in v for v in report.violations), report.violations


def test_v1_plans_still_load_and_check_names_their_memory_model(tmp_path):
    graph, cluster = synthetic_graph(6), synthetic_cluster(HOME)
    problem = build_problem(graph, cluster, microbatches=8)
    stages = (Stage(0, 0, 2), Stage(1, 3, 4), Stage(2, 5, 5))
    ev = evaluate(problem, stages)
    plan = assemble_plan(graph, cluster, problem=problem, stages=stages, global_batch=16,
                         solver=SolverReport("hand", "FEASIBLE", ev.iteration_s, 0.0, 0.0))
    doc = as_version_3(plan.to_dict())  # a file from before issue 17: T is the H-1F1B estimate
    assert doc["version"] == 3 and doc["memory_model"] == 2  # memory model 2's fields need version 3
    for key in ("replicas", "sync"):  # a file written before version 2 has neither field
        assert key not in doc or doc[key] in ((), [], None)
    # a version-1 file: no version-3 field, stage memory from memory model 1 (one more in-flight output)
    doc.update(version=1)
    del doc["memory_model"]
    for u in doc["units"]:
        u.pop("boundary_held_bytes", None), u.pop("grad_bytes", None)
    doc["stages"][0]["memory_bytes"] += 1000
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(doc))
    loaded = Plan.load(path)
    assert loaded.replicas == () and loaded.memory_model == 1 and loaded.version == 1
    report = check_plan(loaded)
    assert report.violations == (
        f"memory_model: this plan was made with memory model 1, this hetpipe uses memory model {MEMORY_MODEL} (each stage's "
        "memory_bytes is computed differently); re-plan with `hetpipe plan`",)
    assert report.iteration_s == pytest.approx(plan.predicted.t_1f1b_estimate_s, rel=1e-12)  # its own objective


def test_memory_model_2_fields_in_an_older_version_are_refused(home_plan, tmp_path):
    doc = as_version_3(home_plan.to_dict())  # only memory model 2's fields above version 2
    doc["version"] = 2
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match="plan.version is 2 but the plan uses fields of version 3"):
        Plan.load(path)


def test_replicas_in_a_version_1_file_are_refused(home_plan, tmp_path):
    doc = as_version_3(home_plan.to_dict())
    doc["version"] = 1
    doc.pop("memory_model")  # leave only the replicas above version 1 (memory model 2 needs version 3)
    for u in doc["units"]:
        for key in ("grad_bytes", "boundary_held_bytes", "boundary_grad_bytes"):
            u.pop(key, None)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(PlanError, match="version 2"):
        Plan.load(path)


# --- when replicas win and when they do not --------------------------------------------------------


def test_replicas_beat_the_single_pipeline_on_one_box():
    # Three cards on one PCIe host, a model every card holds: data parallelism has no bubble.
    plan = partition_replicas(synthetic_graph(6), synthetic_cluster(ONE_BOX), global_batch=24, solver="exact")
    single = plan.baselines["single-pipeline"]
    assert len(plan.replicas) >= 2 and single.fits
    assert plan.predicted.iteration_s < single.iteration_s * 0.95
    assert check_plan(plan).ok


def test_single_pipeline_wins_over_slow_links_with_every_step_sync():
    # Large gradients and 10 MB/s between the two boxes: a sync round costs more than the bubble saves.
    graph = synthetic_graph(6)
    cluster = synthetic_cluster((("n0", "fast", 40.0, 24.0), ("n1", "fast", 40.0, 24.0)), inter_bytes_s=10e6)
    plan = partition_replicas(graph, cluster, global_batch=16, policy="synchronous", solver="exact")
    assert len(plan.replicas) == 1 and plan.sync.sync_s == 0.0
    assert plan.predicted.iteration_s == pytest.approx(plan.baselines["single-pipeline"].iteration_s, rel=1e-9)
    # ... unless local steps are allowed: then DiLoCo replicas win, with H chosen from the link budget.
    auto = partition_replicas(graph, cluster, global_batch=16, policy="auto", solver="exact")
    assert auto.sync.policy == "diloco" and len(auto.replicas) == 2 and auto.sync.outer_steps > 1
    assert auto.sync.amortised_s <= SYNC_BUDGET_FRACTION * auto.sync.compute_s * (1 + 1e-9)
    assert "H =" in auto.sync.reason and check_plan(auto).ok
    forced = partition_replicas(graph, cluster, global_batch=16, policy="diloco", outer_steps=400, solver="exact")
    assert forced.sync.outer_steps == 400 and "forced" in forced.sync.reason and len(forced.replicas) == 2
    # H = 4 leaves 60 s of sync per step: then the single pipeline (no sync at all) is still best
    assert len(partition_replicas(graph, cluster, global_batch=16, policy="diloco", outer_steps=4,
                                  solver="exact").replicas) == 1


def test_ddp_equal_is_flagged_oom_where_the_small_card_cannot_hold_it():
    graph = synthetic_graph(8)  # 8 x 1.6 GB of state: fits 24 GB cards, not the 12 GB one
    rp = build_replica_problem(graph, synthetic_cluster(HOME), global_batch=12)
    report = ddp_equal(rp)
    assert not report.fits and "n1:2" in report.note


# --- bad input ----------------------------------------------------------------------------------------


def test_bad_input_is_one_clear_error():
    graph, cluster = synthetic_graph(6), synthetic_cluster(HOME)
    with pytest.raises(ConfigError, match="multiple of the micro-batch size"):
        partition_replicas(graph, cluster, global_batch=15)
    with pytest.raises(ConfigError, match="sync policy"):
        partition_replicas(graph, cluster, global_batch=16, policy="never")
    with pytest.raises(ConfigError, match="replica solver"):
        partition_replicas(graph, cluster, global_batch=16, solver="magic")
    tiny = synthetic_cluster((("n0", "small", 10.0, 2.0), ("n0", "small", 10.0, 2.0)))
    with pytest.raises(InfeasibleError):
        partition_replicas(graph, tiny, global_batch=16, solver="exact")


def test_show_displays_replicas_batch_shares_and_sync_policy(tmp_path, capsys):
    from hetpipe.cli import app as cli

    plan = partition_replicas(synthetic_graph(6), synthetic_cluster(ONE_BOX), global_batch=24, solver="exact")
    path = tmp_path / "replicas.json"
    plan.save(path)
    assert cli.main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{len(plan.replicas)} replicas; sync {plan.sync.policy}" in out
    for r in plan.replicas:  # every replica's micro-batch count and gradient weight is listed
        assert f"{r.grad_weight:.3f}" in out and str(r.samples) in out
    assert "sync policy:" in out and plan.sync.reason.split(",")[0] in out.replace("\n", " ")


def test_single_pipeline_trainer_refuses_replica_plans_before_any_collective(home_plan):
    from hetpipe.errors import ConfigError
    from hetpipe.runtime.trainer import Trainer

    with pytest.raises(ConfigError, match="replicas; use hetpipe.runtime.replicas.trainer.ReplicaTrainer"):
        Trainer(home_plan, model="gpt-tiny")
