"""Issue 12 item 3: the pace walk against brute force on small instances.

* On the count DP (`schedule_bound.schedule_walk`), the walk's bound is at most the least R_0 + G over
  every placement and lever choice that fits, and when the walk ends (`exact`) its first placement
  reaches that least value: the walk's argmin is the pace optimum.
* On the node-run relaxation (`pace_runs.RunDP`, what `verify` uses beyond the count DP), the walk's
  bound plus the least first step is at most the enumerated schedule optimum, and its placements,
  realised on real cards, are valid placements.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage, evaluate
from hetpipe.partitioner.solvers.pace_runs import RunDP, run_terms
from hetpipe.partitioner.solvers.schedule_bound import BAND_TOLERANCE, pace_terms, pair_chain, schedule_walk, stage_pace
from hetpipe.partitioner.solvers.verify import first_step_floor
from hetpipe.schedule.builders import one_f_one_b
from hetpipe.schedule.replay import compile_actions, compile_one_f_one_b
from tests.instances import all_placements, random_problem, recompute_choices
from tests.test_contract_property import REL, schedule_instances

#: Passes enough for the walk to end on these instances (4 units, 3 cards).
PASSES = 200


def _pace_and_schedule_optima(prob: Problem) -> tuple[float, float]:
    """(least R_0 + G, least replayed T) over every placement and lever choice that fits."""
    pace, sched = math.inf, math.inf
    for placement in all_placements(prob):
        for choice in recompute_choices(prob, placement):
            ev = evaluate(prob, choice)
            if ev.fits:
                r0, g = pace_terms(prob, choice)
                pace, sched = min(pace, r0 + g), min(sched, ev.iteration_s)
    return pace, sched


def test_stage_pace_takes_the_longest_chain() -> None:
    """m = 8, k = 3 (q = 2 round trips, r = 1 single step); F = 1, B = 2."""
    assert stage_pace(8, 3, 1.0, 2.0, 10.0) == 2 * 10.0 + 3.0  # round trips
    assert stage_pace(8, 3, 1.0, 2.0, 6.0) == 5 * 3.0 + 2 * 2.0  # single steps: 5 steady, 2 cool-down
    assert stage_pace(8, 8, 1.0, 2.0, 3.0) == 8 * 3.0 - 3.0  # every micro-batch in flight: the work


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(prob=schedule_instances())
def test_pace_walk_argmin_is_the_pace_optimum(prob: Problem) -> None:
    best, _ = _pace_and_schedule_optima(prob)
    walk = schedule_walk(prob, max_passes=PASSES)
    if math.isinf(best):
        assert not walk.placements
        return
    assert walk.bound_s <= best * (1 + REL), (walk, best)
    assert walk.exact, walk
    r0, g = pace_terms(prob, walk.placements[0])
    assert evaluate(prob, walk.placements[0]).fits
    assert r0 + g <= best * (1 + REL), (walk.placements[0], r0 + g, best)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(prob=schedule_instances())
def test_node_run_walk_bounds_the_schedule_optimum(prob: Problem) -> None:
    _, best = _pace_and_schedule_optima(prob)
    runs = RunDP(prob)
    # as `verify._runs_walk` runs them: with the pair filter, then without it, stopping on narrow bands
    for pairs, tolerance in ((True, 0.0), (False, BAND_TOLERANCE)):
        walk = schedule_walk(prob, dp=runs, max_passes=PASSES, terms=lambda picks: run_terms(prob.microbatches, picks),
                             pairs=pairs, band_tolerance=tolerance)
        assert walk.bound_s + first_step_floor(prob) <= best * (1 + REL), (walk, best, pairs)
        for picks in walk.placements:
            real = runs.realise(picks)
            if real is not None:
                evaluate(prob, real)  # a valid placement (raises otherwise); memory is the verify's to check


def test_fast_one_f_one_b_program_is_the_action_walk() -> None:
    """`replay.compile_one_f_one_b` (integer lists, no actions) gives the generic walk's program exactly."""
    for p, m in [(1, 1), (1, 4), (2, 1), (2, 4), (3, 2), (3, 7), (5, 3), (6, 6), (8, 17), (13, 40)]:
        assert compile_one_f_one_b(p, m) == compile_actions(one_f_one_b(p, m), p), (p, m)


def test_pair_chain_binds_and_stays_below_the_replay() -> None:
    """Three one-unit stages of W = 3 s, a 3 s cut after the first and a free one after the second, m = 8:
    rank 0's pairs (W_0 + W_1 + 2 C_0 = 12 s per two micro-batches) outrun its round trips (R_0 = 15 s per
    three) and single steps; the pace with the pair chain is still at most the replayed T (brute force over
    every placement: test_contract_property)."""
    inf = float("inf")
    devs = tuple(DeviceSlot(f"d{i}", "a", "n", 99) for i in range(3))
    prob = Problem(fwd_s={"a": (1.0,) * 3}, bwd_s={"a": (2.0,) * 3}, state_bytes=(1,) * 3, activation_bytes=(1,) * 3,
                   boundary_bytes=(3, 0, 0), devices=devs,
                   bandwidth_bytes_s=tuple(tuple(inf if i == j else 1.0 for j in range(3)) for i in range(3)),
                   latency_s=((0.0,) * 3,) * 3, microbatches=8, objective="schedule")
    stages = (Stage(0, 0, 0), Stage(1, 1, 1), Stage(2, 2, 2))
    r0, g = pace_terms(prob, stages)
    without = max(stage_pace(8, 3 - s, 1.0, 2.0, r) for s, r in enumerate((15.0, 6.0, 3.0)))
    assert (r0, without) == (15.0, 33.0)  # 2 round trips of 15 s and a single step of 3 s
    assert g == pair_chain(8, 3, 3.0, 12.0, 15.0) == 2 * 12.0 + 15.0 > without
    assert r0 + g <= evaluate(prob, stages).iteration_s


def test_window_chain_binds_and_stays_below_the_replay() -> None:
    """Four one-unit stages of W = 3, 3, 3, 1 s (F = W / 3), cuts of 1, 1, 0 s, m = 16 (`window_pace`'s example):
    rank 0's three-rank window (13 s per three micro-batches) outruns its pairs and round trips, and the pace
    with it is still at most the replayed T."""
    devs = tuple(DeviceSlot(f"d{i}", "a", "n", 99) for i in range(4))
    prob = Problem(fwd_s={"a": (1.0, 1.0, 1.0, 1.0 / 3)}, bwd_s={"a": (2.0, 2.0, 2.0, 2.0 / 3)}, state_bytes=(1,) * 4,
                   activation_bytes=(1,) * 4, boundary_bytes=(1, 1, 0, 0), devices=devs,
                   bandwidth_bytes_s=tuple(tuple(math.inf if i == j else 1.0 for j in range(4)) for i in range(4)),
                   latency_s=((0.0,) * 4,) * 4, microbatches=16, objective="schedule")
    stages = tuple(Stage(i, i, i) for i in range(4))
    r0, plain = pace_terms(prob, stages)
    r0_w, windowed = pace_terms(prob, stages, windows=True)
    assert r0 == r0_w == pytest.approx(14.0) and plain == pytest.approx(57.0) and windowed == pytest.approx(59.0)
    assert r0 + windowed <= evaluate(prob, stages).iteration_s * (1 + REL)


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), units=st.integers(2, 9), m=st.integers(1, 24))
def test_window_pace_is_at_most_the_replay_of_long_pipelines(seed: int, units: int, m: int) -> None:
    """R_0 + G (windows included) + S_0 <= the replayed T for random pipelines of up to 9 stages (windows need
    4 or more: the brute-force instances above have 3 cards), and the windows only raise G."""
    rng = random.Random(seed)
    prob = random_problem(rng, units=units, devices=units, microbatches=m, objective="schedule")
    cuts = sorted(rng.sample(range(units - 1), rng.randint(0, units - 1)))
    bounds = list(zip([0] + [c + 1 for c in cuts], cuts + [units - 1]))
    order = rng.sample(range(units), len(bounds))
    stages = tuple(Stage(d, a, b) for d, (a, b) in zip(order, bounds))
    ev = evaluate(prob, stages)
    r0, plain = pace_terms(prob, stages)
    _, windowed = pace_terms(prob, stages, windows=True)
    assert windowed >= plain
    assert r0 + windowed + ev.stages[0].step_s <= ev.iteration_s * (1 + REL), (stages, r0, windowed, ev.iteration_s)
