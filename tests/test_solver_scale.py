"""Issue 12, item 3: the relaxation stays a valid bound when it aggregates kinds, the DP's
count vectors are exactly the reachable ones, and the built-in models keep a small gap on
hundreds of cards (benchmarks/planner_scale.py has the table up to 1,024 cards)."""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import pytest

from hetpipe.partitioner.solvers.counts import count_vectors, vectors
from hetpipe.partitioner.solvers.dp import device_classes, solve_exact
from hetpipe.partitioner.solvers.relax import aggregate_kinds, realise, relaxed_problem
from hetpipe.partitioner.solvers.fixed_order import solve_fixed_order
from hetpipe.partitioner.solvers.offload_walk import tail_walk
from tests.instances import random_problem, with_offload

REL = 1e-9


@pytest.mark.parametrize("counts,max_total", [((2, 2), 2), ((3, 0, 5), 4), ((1, 1, 1, 1), 9), ((6, 2, 4), 5)])
def test_count_vectors_are_exactly_the_reachable_ones(counts: tuple[int, ...], max_total: int) -> None:
    brute = [v for v in itertools.product(*(range(c + 1) for c in counts)) if 0 < sum(v) <= max_total]
    assert sorted(vectors(counts, max_total)) == sorted(brute)
    assert count_vectors(counts, max_total) == len(brute)
    assert list(vectors(counts, max_total)) == brute  # the same (lexicographic) order as a product


def test_aggregated_relaxation_is_a_lower_bound_and_realises_to_real_cards() -> None:
    rng = random.Random(12)
    for _ in range(60):
        prob = random_problem(rng, units=rng.randint(2, 5), devices=rng.randint(2, 5),
                              tight_memory=rng.random() < 0.5)
        if rng.random() < 0.3:  # hosts per node: the relaxation gives each kind its best host figures
            prob = with_offload(rng, prob, "auto")
        exact = tail_walk(prob, lambda p, _: solve_exact(p))
        merged, members = aggregate_kinds(relaxed_problem(prob), merge_above=0, state_budget=0)
        assert len(members) == 1  # everything merged: the weakest relaxation there is
        relaxed = tail_walk(merged, lambda p, _: solve_exact(p))
        if exact is None:
            continue
        assert relaxed is not None and relaxed.iteration_s <= exact.iteration_s * (1 + REL)
        kinds = [members[merged.devices[st.device].kind] for st in relaxed.stages]
        order = realise(prob, kinds)
        assert len(set(order)) == len(order) and all(prob.devices[d].kind in k for d, k in zip(order, kinds))
        real = solve_fixed_order(prob, order, time_limit_s=5.0)
        assert real is None or real.iteration_s >= exact.iteration_s * (1 - REL)


def test_relaxation_keeps_one_class_per_kind_whatever_the_hosts() -> None:
    """The regression of gpt2-xl on 256 cards (estimate 14.26 s instead of 7.65 s): the DP's classes
    split on host figures since the offload lever, so a merged kind whose members sit behind different
    host links (the V100's PCIe 3) stayed two classes, the relaxation's DP outgrew its budget and
    `relaxed_bound` gave up (bound 0, no placement).  Relaxed and merged kinds take their best host
    figures: one class each."""
    rng = random.Random(7)
    for _ in range(20):
        prob = with_offload(rng, random_problem(rng, units=3, devices=rng.randint(2, 6)), "never")
        relaxed = relaxed_problem(prob)
        assert len(device_classes(relaxed)) == len({d.kind for d in prob.devices})
        merged, members = aggregate_kinds(relaxed, merge_above=0, state_budget=0)
        assert len(device_classes(merged)) == len(members) == 1


@pytest.mark.slow
@pytest.mark.parametrize("model_name,batch,devices", [("llama-7b", 1, 64), ("llama-7b", 1, 256),
                                                      ("gpt2-xl", 4, 64), ("gpt2-xl", 4, 256)])
def test_built_in_models_on_hundreds_of_cards_of_eight_kinds_have_a_small_gap(model_name: str, batch: int,
                                                                              devices: int) -> None:
    """gpt2-xl on 64 cards is the case the merged relaxation alone bounds badly (one block per card:
    the slowest kind used sets the bottleneck); the Lagrangian bound (`solvers/lagrange.py`) closes it.
    The gap is the estimate's, which the solvers search exactly; the schedule objective's own bound
    (`verify`) is weaker at this size (benchmarks/planner_scale.py reports both)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.planner_scale import eight_kind_cluster
    from hetpipe.models import build
    from hetpipe.partitioner.capture.capture import capture
    from hetpipe.partitioner.solvers.solve import solve_estimate
    from hetpipe.plan.build import build_problem

    model, inputs = build(model_name, device="meta", batch=batch)
    graph = capture(model, inputs, name=model_name, precision="bf16-mixed")
    problem = build_problem(graph, eight_kind_cluster(devices), microbatches=2 * devices)
    # A generous limit: the claim is the gap the search proves, not its speed (a loaded
    # machine only slows it down); the benchmark reports the default 10 s limit.
    sol = solve_estimate(problem, time_limit_s=60.0, seed=0)
    assert sol.gap <= 0.02, (sol.solver, sol.status, sol.iteration_s, sol.bound_s)
