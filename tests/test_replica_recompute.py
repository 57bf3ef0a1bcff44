"""Recomputation re-chosen after optimizer-state sharding (`partitioner.replica_recompute`, issue 14).

For fixed replica pipelines (cuts and cards), a brute force written here tries every recompute
prefix of every stage x every subset of shardable sync groups, priced by `evaluate_sharding`
(the contract), and keeps the least T that fits.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from hetpipe.cost_models.offload import OffloadRates
from hetpipe.partitioner.recompute import stage_order, with_recompute
from hetpipe.partitioner.replica_recompute import shard_then_recompute
from hetpipe.partitioner.replica_shard import choose_sharding, evaluate_sharding, shardable
from hetpipe.partitioner.replica_types import ReplicaProblem, replica_problem
from hetpipe.partitioner.problem import Stage
from tests.instances import best_shard_subset_s, random_problem

#: Per parameter: weight 1 + gradient 1 + 2 optimizer bytes (the fp32-Adam ratio 4:4:8, scaled down).
RATES = OffloadRates(state_bytes_per_param=4, grad_bytes_per_param=1, host_bytes_per_param=2,
                     link_bytes_per_param=2, step_bytes_per_param=7)


def _instance(seed: int) -> tuple[ReplicaProblem, list[tuple[tuple[Stage, ...], int]]]:
    """Two or three replicas of 1-2 stages each over one shared unit range, recompute auto, memory tight."""
    rng = random.Random(seed)
    replicas, per = rng.randint(2, 3), rng.randint(1, 2)
    prob = random_problem(rng, units=rng.randint(2, 4), devices=replicas * per, microbatches=rng.randint(2, 4),
                          tight_memory=True, objective="schedule")
    params = tuple(rng.randint(1, 8) for _ in range(prob.num_units))
    prob = dataclasses.replace(prob, state_bytes=tuple(4 * p for p in params), grad_bytes=params, tied=(),
                               offload_rates=RATES, recompute="auto", offload="never")
    cut = rng.randint(0, prob.num_units - 2)
    bounds = [(0, prob.num_units - 1)] if per == 1 else [(0, cut), (cut + 1, prob.num_units - 1)]
    m = prob.microbatches
    pipes = [(with_recompute(replica_problem(prob, m), tuple(Stage(r * per + k, lo, hi) for k, (lo, hi)
                                                                in enumerate(bounds))), m) for r in range(replicas)]
    # memory between what the state alone and the state with every activation need, so prefixes matter
    need = max(evaluate_sharding(ReplicaProblem(prob, params), pipes, ()).evaluations[0].stages[0].memory_bytes, 1)
    prob = dataclasses.replace(prob, devices=tuple(dataclasses.replace(d, usable_bytes=int(need * rng.uniform(0.7, 1.0)))
                                                   for d in prob.devices))
    rp = ReplicaProblem(prob, grad_bytes=params, sharding="auto")
    return rp, [(with_recompute(replica_problem(prob, m), tuple(dataclasses.replace(st, recompute_units=())
                                                                 for st in stages)), m) for stages, m in pipes]


def _brute(rp: ReplicaProblem, pipes: list[tuple[tuple[Stage, ...], int]]) -> float:
    """Least T that fits over every prefix of every stage x every shardable subset (module docstring)."""
    stages = [st for s, _ in pipes for st in s]
    orders = [stage_order(rp.base, st) for st in stages]
    cands = shardable(rp, evaluate_sharding(rp, pipes, ()).sync)
    best = math.inf
    for prefixes in itertools.product(*(range(len(o) + 1) for o in orders)):
        chosen = iter(dataclasses.replace(st, recompute_units=tuple(sorted(o[:r])))
                      for st, o, r in zip(stages, orders, prefixes))
        trial = [(tuple(next(chosen) for _ in s), m) for s, m in pipes]
        best = min(best, best_shard_subset_s(rp, trial, cands))
    return best


def test_shorter_prefixes_after_sharding_against_brute_force():
    shrunk = 0
    for seed in range(40):
        rp, pipes = _instance(seed)
        want = _brute(rp, pipes)
        alone = choose_sharding(rp, pipes)
        after, got = shard_then_recompute(rp, pipes)
        assert got.fits == math.isfinite(want), seed  # it fits whenever some prefixes and shards do
        if not got.fits:
            continue
        assert want * (1 - 1e-12) <= got.iteration_s, seed  # within the brute force's space
        assert not alone.fits or got.iteration_s <= alone.iteration_s * (1 + 1e-12), seed  # never worse
        # what it records re-evaluates to the same T (`hetpipe check` re-derives the fractions from the plan)
        assert evaluate_sharding(rp, after, [s.group for s in got.shards]).iteration_s == pytest.approx(
            got.iteration_s, rel=1e-12)
        shrunk += sum(len(a.recompute_units) for s, _ in after for a in s) < sum(
            len(b.recompute_units) for s, _ in pipes for b in s)
        # the brute force's optimum, or, where it needs a prefix longer than the one solved before
        # sharding (more free memory, a larger shard), exactly what sharding alone gives
        assert got.iteration_s == pytest.approx(want, rel=1e-12) or got.iteration_s == pytest.approx(
            alone.iteration_s, rel=1e-12), seed
    assert shrunk >= 3, shrunk
