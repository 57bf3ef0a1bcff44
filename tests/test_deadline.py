"""Issue 12: every solver path honours its time limit.  A deadline already past (a negative limit,
so nothing here depends on how fast the machine is) must stop every DP pass that has an answer to
fall back on before its first level, and the solvers answer with their best placement so far:
``FEASIBLE``, fitting, with a valid lower bound recorded."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from hetpipe.partitioner.problem import Problem, evaluate
from hetpipe.partitioner.solvers import dp, fixed_order
from hetpipe.partitioner.solvers.relax import relaxed_bound
from hetpipe.partitioner.solvers.solve import heuristic, solve, solve_estimate


def _gpt(cards: int) -> Problem:
    """The 24-layer GPT of benchmarks/planner_speed.py on `cards` cards of 4 kinds, 2 micro-batches per card."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.scenarios import gpt_graph, mixed_cluster
    from hetpipe.plan.build import build_problem

    return build_problem(gpt_graph(layers=24), mixed_cluster(cards, per_node=min(8, cards // 4)),
                         microbatches=2 * cards)


@pytest.fixture(scope="module")
def gpt_on_64_cards() -> Problem:
    return _gpt(cards=64)  # beyond the exact DP: heuristic, relaxation, Lagrangian bound, CP-SAT


@pytest.fixture()
def levels_past_deadline(monkeypatch):
    """Counts DP levels run by passes with a finite deadline (under a deadline already past: none)."""
    ran: list[int] = []
    for module in (dp, fixed_order):
        real = module.check_deadline

        def counting(deadline: float, real=real) -> None:
            real(deadline)  # raises past the deadline: reaching the next line means the level runs
            if math.isfinite(deadline):
                ran.append(1)
        monkeypatch.setattr(module, "check_deadline", counting)
    return ran


def test_a_past_deadline_stops_the_large_path_with_its_best_so_far(gpt_on_64_cards, levels_past_deadline) -> None:
    problem = gpt_on_64_cards
    sol = solve_estimate(problem, time_limit_s=-1.0, seed=0)
    assert sol.status == "FEASIBLE" and evaluate(problem, sol.stages).fits
    assert 0 < sol.bound_s < sol.iteration_s and sol.iteration_s == evaluate(problem, sol.stages, objective="estimate").iteration_s
    assert not levels_past_deadline  # no pass with a deadline ran a level
    full = solve(problem, time_limit_s=-1.0, seed=0)  # and through verify (the schedule objective)
    assert full.status == "FEASIBLE" and 0 < full.bound_s < full.iteration_s and evaluate(problem, full.stages).fits


def test_a_past_deadline_stops_the_relaxation_and_the_exact_dp(gpt_on_64_cards, levels_past_deadline) -> None:
    problem = gpt_on_64_cards
    warm = heuristic(problem, time_limit_s=-1.0)
    assert warm is not None
    assert relaxed_bound(problem, seed=warm.stages, time_limit_s=-1.0) == (0.0, None)  # nothing proved, nothing made
    sub = _gpt(cards=16)  # within the exact DP's budget
    seed = heuristic(sub, time_limit_s=1.0)
    levels_past_deadline.clear()  # the heuristic had a second
    res = dp.solve_exact(sub, time_limit_s=-1.0, seed=seed.stages)
    assert not res.exact and res.stages == seed.stages and 0 < res.bound_s <= res.iteration_s
    assert not levels_past_deadline
