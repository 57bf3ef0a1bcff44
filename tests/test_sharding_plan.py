"""Optimizer-state sharding across replicas (issue 14, third lever): the planner's choice and the plan.

The exact replica reference with ``sharding="auto"`` is compared with an enumeration written
here: every grouping x split x each replica's pipeline options x every subset of shardable sync
groups, priced by `evaluate_sharding` (the contract), the least T among those that fit.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random

import pytest

from hetpipe.cost_models.offload import OffloadRates
from hetpipe.errors import ConfigError, InfeasibleError
from hetpipe.partitioner.replica_shard import choose_sharding, evaluate_sharding, shardable
from hetpipe.partitioner.replicas import PipelineCache, ReplicaProblem, _exact_groupings, compositions, \
    solve_replicas, solve_replicas_exact
from hetpipe.plan.check import check_plan
from hetpipe.plan.replica_count import plan_replicas
from hetpipe.plan.replicas import partition_replicas
from hetpipe.plan.schema import Plan
from tests.instances import TEST_RATES, best_shard_subset_s, random_problem, with_offload
from tests.synthetic import synthetic_cluster, synthetic_graph

#: Per parameter: weight 1 + gradient 1 + 2 optimizer bytes (the fp32-Adam ratio 4:4:8, scaled down).
RATES = OffloadRates(state_bytes_per_param=4, grad_bytes_per_param=1, host_bytes_per_param=2,
                     link_bytes_per_param=2, step_bytes_per_param=7)


def _sharded_rp(seed: int) -> ReplicaProblem:
    rng = random.Random(seed)
    prob = random_problem(rng, units=rng.choice((1, 1, 2, 3)), devices=rng.randint(2, 3), microbatches=rng.randint(2, 4),
                          tight_memory=True, objective="schedule")
    params = tuple(rng.randint(1, 8) for _ in range(prob.num_units))
    if rng.random() < 0.5:  # the whole state just above the largest card: only sharding (or cuts) can fit it
        scale = max(d.usable_bytes for d in prob.devices) / (4 * sum(params)) * rng.uniform(1.0, 1.4)
        params = tuple(max(1, round(p * scale)) for p in params)
    # no backward transients (memory model 4): the state sits just above the cards here, a transient on top
    # would leave too few instances that sharding or offload fits (tests/test_contract_property.py covers them)
    prob = dataclasses.replace(prob, state_bytes=tuple(4 * p for p in params), grad_bytes=params, tied=(),
                               offload_rates=RATES, recompute=rng.choice(("none", "auto")), transient_bwd_bytes=())
    return ReplicaProblem(prob, grad_bytes=params, sharding="auto")


def _enumerate(rp: ReplicaProblem) -> float:
    """Least synchronous T over the whole space, written out (module docstring)."""
    cache = PipelineCache(rp.base, exact=True, sharding=True)
    best, total = math.inf, rp.base.microbatches
    for groups in _exact_groupings(len(rp.base.devices)):
        if not 0 < len(groups) <= total:
            continue
        for split in compositions(total, len(groups)):
            if len(groups) == 1:
                one = cache.fitting(groups[0], split[0])
                best = min(best, one[1] if one else math.inf)
                continue
            for pick in itertools.product(*(cache.options(g, m) for g, m in zip(groups, split))):
                pipes = [(stages, m) for (stages, _), m in zip(pick, split)]
                offloading = [st.device for stages, _ in pipes for st in stages if st.offload]
                cands = shardable(rp, evaluate_sharding(rp, pipes, ()).sync, offloading)
                best = min(best, best_shard_subset_s(rp, pipes, cands))
    return best


def test_exact_reference_with_sharding_equals_enumeration():
    fit_only_sharded = faster = 0
    for seed in range(40):
        rp = _sharded_rp(seed)
        want = _enumerate(rp)
        plain = dataclasses.replace(rp, sharding="never")
        try:
            without = solve_replicas_exact(plain, policy="synchronous").iteration_s
        except InfeasibleError:
            without = math.inf
        if math.isinf(want):
            with pytest.raises(InfeasibleError):
                solve_replicas_exact(rp, policy="synchronous")
            continue
        got = solve_replicas_exact(rp, policy="synchronous")
        assert got.iteration_s == pytest.approx(want, rel=1e-9), seed
        assert got.iteration_s <= without * (1 + 1e-9)  # sharding is a choice: never worse
        fit_only_sharded += math.isinf(without)
        faster += got.iteration_s < without * (1 - 1e-9) and not math.isinf(without)
        if got.shards:  # the chosen layout re-evaluates to the same T with the recorded groups
            pipes = [(r.stages, r.microbatches) for r in got.replicas]
            assert evaluate_sharding(rp, pipes, [s.group for s in got.shards]).iteration_s == pytest.approx(
                got.iteration_s, rel=1e-12)
    assert fit_only_sharded >= 2 and faster >= 1, (fit_only_sharded, faster)


def test_offload_inside_replica_plans_with_sharding_equals_enumeration():
    """Offload in replica plans (each replica's pipeline chooses it, `Problem.offload`): the exact reference
    still equals the enumeration, is never slower than without offload, and never shards a group whose
    holder offloads."""
    only_with = used = 0
    for seed in range(30):
        rng = random.Random(1000 + seed)
        rp = _sharded_rp(seed)
        base = with_offload(rng, dataclasses.replace(rp.base, tied=()), "auto")
        params = tuple(g // TEST_RATES.grad_bytes_per_param for g in base.grad_bytes)
        rp = ReplicaProblem(base, grad_bytes=params, sharding="auto")
        want = _enumerate(rp)
        try:
            without = solve_replicas_exact(dataclasses.replace(rp, base=dataclasses.replace(base, offload="never")),
                                           policy="synchronous").iteration_s
        except InfeasibleError:
            without = math.inf
        if math.isinf(want):
            continue
        got = solve_replicas_exact(rp, policy="synchronous")
        assert got.iteration_s == pytest.approx(want, rel=1e-9) and got.iteration_s <= without * (1 + 1e-9), seed
        offloading = {st.device for r in got.replicas for st in r.stages if st.offload}
        assert not any(set(got.sync[s.group].devices) & offloading for s in got.shards)
        used += bool(offloading)
        only_with += math.isinf(without)
    assert used >= 3 and only_with >= 1, (used, only_with)


def test_choose_sharding_is_the_best_subset_and_never_shards_for_nothing():
    for seed in range(40, 60):
        rp = _sharded_rp(seed)
        cache = PipelineCache(rp.base, exact=True, sharding=True)
        alone = [cache.best((d,), 1) for d in range(len(rp.base.devices))]  # one-card replicas, m = 1
        if not all(alone):
            continue
        pipes = [(stages, 1) for stages, _ in alone]
        got = choose_sharding(rp, pipes)
        cands = shardable(rp, got.sync)
        evs = [evaluate_sharding(rp, pipes, s) for k in range(len(cands) + 1) for s in itertools.combinations(cands, k)]
        fitting = [e for e in evs if e.fits]
        if not fitting:
            assert not got.fits
            continue
        least = min(e.iteration_s for e in fitting)
        assert got.fits and got.iteration_s == pytest.approx(least, rel=1e-12)
        assert len(got.shards) == min(len(e.shards) for e in fitting if e.iteration_s <= least * (1 + 1e-12))


def test_search_with_sharding_is_never_below_the_reference():
    for seed in range(8):
        rp = _sharded_rp(seed)
        try:
            exact = solve_replicas_exact(rp, policy="synchronous")
        except InfeasibleError:
            continue
        found = solve_replicas(rp, policy="synchronous", time_limit_s=5)
        assert found.iteration_s >= exact.iteration_s * (1 - 1e-9)


# --- plans: recorded, re-checked, round-tripped -----------------------------------------------------------

TWO_SMALL = (("n0", "fast", 40.0, 6.0), ("n0", "fast", 40.0, 5.5))  # 5.0 and 4.5 GB usable


def _graph():
    """3 units of 10^8 fp32 parameters: 4.8 GB of Adam state (2.4 GB of it moments), no card holds it alone."""
    graph = synthetic_graph(3)
    return dataclasses.replace(graph, units=tuple(dataclasses.replace(u, grad_bytes=u.param_bytes)
                                                  for u in graph.units))


@pytest.fixture(scope="module")
def sharded_plan():
    return partition_replicas(_graph(), synthetic_cluster(TWO_SMALL), global_batch=8, solver="exact",
                              policy="synchronous", sharding="auto")


def test_replicas_that_fit_only_sharded_are_planned_recorded_and_checked(sharded_plan, tmp_path):
    plan = sharded_plan
    assert plan.version == 5 and [r.num_stages for r in plan.replicas] == [1, 1]
    (group,) = plan.sync.groups
    shard = group.shard
    assert shard is not None and shard.optimizer_bytes == 3 * 8 * 10**8
    assert math.isclose(sum(shard.fractions), 1.0) and shard.fractions[0] > shard.fractions[1]  # more room
    assert [st.memory_bytes <= st.usable_bytes for st in plan.stages] == [True, True]
    assert group.time_s > shard.allreduce_s  # uneven shards pay on the wire: max f (G+W) / BW
    assert check_plan(plan).ok, check_plan(plan).violations
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan and check_plan(Plan.load(path)).ok


def test_show_prints_what_each_sharded_group_saves_and_pays(sharded_plan, tmp_path, capsys):
    from hetpipe.cli import app

    path = tmp_path / "plan.json"
    sharded_plan.save(path)
    capsys.readouterr()
    assert app.main(["show", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "optimizer state sharded: units 0-2 n0:0" in out and "MiB)" in out and "sync" in out, out


def test_check_catches_an_edited_shard(sharded_plan, tmp_path):
    path = tmp_path / "plan.json"
    sharded_plan.save(path)
    doc = json.loads(path.read_text())
    doc["sync"]["groups"][0]["shard"]["fractions"] = [0.5, 0.5]
    path.write_text(json.dumps(doc))
    report = check_plan(Plan.load(path))
    assert not report.ok and any("shard" in v for v in report.violations)


def test_without_sharding_the_same_cards_take_a_pipeline(sharded_plan):
    plan = partition_replicas(_graph(), synthetic_cluster(TWO_SMALL), global_batch=8, solver="exact",
                              policy="synchronous", sharding="never")
    assert len(plan.replicas) == 1 and plan.version == 4
    assert plan.predicted.iteration_s > sharded_plan.predicted.iteration_s


def test_a_bad_sharding_setting_is_one_error_line(tmp_path, capsys):
    from hetpipe.cli import app

    capsys.readouterr()
    rc = app.main(["plan", "mlp-tiny", "--cluster", "examples/clusters/homelab.yaml", "--replicas", "auto",
                   "--sharding", "even", "-o", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: sharding (--sharding): 'even'") and err.count("\n") == 1, err


@pytest.mark.parametrize("mode", ["auto", "all"])
def test_sharding_without_replicas_is_one_error_line_before_the_capture(tmp_path, capsys, monkeypatch, mode):
    """One pipeline has no replicas to shard over: --sharding auto alone would silently do nothing."""
    from hetpipe.cli import app, model_cmds

    def no_capture(*args, **kwargs):
        raise AssertionError("captured before refusing the options")

    monkeypatch.setattr(model_cmds, "capture_args", no_capture)
    capsys.readouterr()
    rc = app.main(["plan", "mlp-tiny", "--cluster", "examples/clusters/homelab.yaml", "--sharding", mode,
                   "-o", str(tmp_path / "p.json")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"error: --sharding {mode} shards optimizer state across data-parallel replicas, but "
                          "--replicas is 1") and "add --replicas auto" in err and "drop --sharding" in err, err
    assert not (tmp_path / "p.json").exists()
    with pytest.raises(ConfigError, match=f"--sharding {mode} .* --replicas is 1"):  # the library entry too
        plan_replicas(_graph(), synthetic_cluster(TWO_SMALL), 1, global_batch=8, sharding=mode)
