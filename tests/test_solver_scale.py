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
from hetpipe.partitioner.solvers.dp import solve_exact
from hetpipe.partitioner.solvers.relax import aggregate_kinds, realise, relaxed_problem
from hetpipe.partitioner.solvers.fixed_order import solve_fixed_order
from tests.instances import random_problem

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
        exact = solve_exact(prob)
        merged, members = aggregate_kinds(relaxed_problem(prob), merge_above=0, state_budget=0)
        assert len(members) == 1  # everything merged: the weakest relaxation there is
        relaxed = solve_exact(merged)
        if exact is None:
            continue
        assert relaxed is not None and relaxed.iteration_s <= exact.iteration_s * (1 + REL)
        kinds = [members[merged.devices[st.device].kind] for st in relaxed.stages]
        order = realise(prob, kinds)
        assert len(set(order)) == len(order) and all(prob.devices[d].kind in k for d, k in zip(order, kinds))
        real = solve_fixed_order(prob, order, time_limit_s=5.0)
        assert real is None or real.iteration_s >= exact.iteration_s * (1 - REL)


@pytest.mark.slow
@pytest.mark.parametrize("model_name,batch,devices", [("llama-7b", 1, 64), ("llama-7b", 1, 256),
                                                      ("gpt2-xl", 4, 64),
                                                      pytest.param("gpt2-xl", 4, 256, marks=pytest.mark.xfail(
                                                          reason="open bug after the session-6 merges: with this 60 s "
                                                          "limit the answer is 7.810 s (cpsat, gap 2.3%) while the "
                                                          "10 s benchmark gets 7.647 s (0.23%): more time, a worse "
                                                          "placement", strict=False))])
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
