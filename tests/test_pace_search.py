"""Issue 12 item 3: the annealing on the windowed pace (`solvers/pace_search.py`).

* `FastPace` prices plain placements exactly as `pace_terms(..., windows=True)` (which tests/test_pace_walk.py
  checks against the replay), on random pipelines of up to 9 stages.
  From `VECTOR_STAGES` stages (numpy tables) on random pipelines of 16-30 stages.
* `anneal` returns a placement that fits, of the same units, whose pace is at most its start's; on the
  brute-force instances it is never below the enumerated pace optimum (a sanity check of the pricing).
* `anneal` and `anneal_chains` are functions of their seed and starts when time is left (session 15).
"""

from __future__ import annotations

import math
import random
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetpipe.partitioner.problem import Stage, evaluate
from hetpipe.partitioner.solvers import pace_search
from hetpipe.partitioner.solvers.pace_search import VECTOR_STAGES, FastPace, anneal, anneal_chains, applies
from hetpipe.partitioner.solvers.schedule_bound import pace_terms
from tests.instances import all_placements, random_problem

REL = 1e-9


def _random_pipeline(rng: random.Random, units: int) -> tuple[Stage, ...]:
    cuts = sorted(rng.sample(range(units - 1), rng.randint(0, units - 1)))
    bounds = list(zip([0] + [c + 1 for c in cuts], cuts + [units - 1]))
    return tuple(Stage(d, a, b) for d, (a, b) in zip(rng.sample(range(units), len(bounds)), bounds))


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), units=st.integers(1, 9), m=st.integers(1, 24))
def test_fast_pace_is_the_windowed_pace(seed: int, units: int, m: int) -> None:
    _check_fast_pace(seed, units, m, min_stages=1)


def _check_fast_pace(seed: int, units: int, m: int, *, min_stages: int) -> None:
    """`FastPace` of a random pipeline of at least `min_stages` stages equals `pace_terms` with windows."""
    rng = random.Random(seed)
    prob = random_problem(rng, units=units, devices=units, microbatches=m, objective="schedule")
    stages = _random_pipeline(rng, units)
    while len(stages) < min_stages:
        stages = _random_pipeline(rng, units)
    assert applies(prob)
    want = sum(pace_terms(prob, stages, windows=True))
    assert math.isclose(FastPace(prob).value(stages), want, rel_tol=REL), (stages, want)


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), units=st.integers(2, 5), devices=st.integers(2, 4), m=st.integers(1, 12))
def test_anneal_keeps_a_fitting_placement_no_slower_than_its_start(seed: int, units: int, devices: int,
                                                                    m: int) -> None:
    rng = random.Random(seed)
    prob = random_problem(rng, units=units, devices=devices, microbatches=m, objective="schedule")
    fitting = [p for p in all_placements(prob) if evaluate(prob, p).fits]
    if not fitting:
        return
    start = rng.choice(fitting)
    found = anneal(prob, start, deadline=time.perf_counter() + 0.05, seed=seed)
    pace = FastPace(prob)
    assert evaluate(prob, found).fits
    assert found[0].first_unit == 0 and found[-1].last_unit == units - 1
    assert all(a.last_unit + 1 == b.first_unit for a, b in zip(found, found[1:]))
    assert len({st_.device for st_ in found}) == len(found)
    assert pace.value(found) <= pace.value(start) * (1 + REL)
    assert pace.value(found) >= min(pace.value(p) for p in fitting) * (1 - REL)


def test_anneal_ends_by_its_deadline_and_at_its_floor() -> None:
    """Far from its floor the annealing improves on its start and never runs past its deadline; at a floor it
    has already met it returns its start at once."""
    rng = random.Random(3)
    prob = random_problem(rng, units=6, devices=6, microbatches=12, objective="schedule")
    fitting = [p for p in all_placements(prob) if evaluate(prob, p).fits]
    assert fitting
    pace = FastPace(prob)
    start = max(fitting, key=pace.value)
    began = time.perf_counter()
    found = anneal(prob, start, deadline=began + 0.3, seed=1, floor_s=0.0)
    assert time.perf_counter() - began < 0.3 + 5.0  # one move past the deadline at most (loaded machine: slack)
    assert pace.value(found) < pace.value(start)
    assert pace.value(found) >= min(pace.value(p) for p in fitting) * (1 - REL)
    began = time.perf_counter()
    assert anneal(prob, start, deadline=began + 60.0, floor_s=2 * pace.value(start)) == start
    assert time.perf_counter() - began < 30.0


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), units=st.integers(16, 30), m=st.integers(1, 60))
def test_fast_pace_of_long_pipelines_is_the_windowed_pace(seed: int, units: int, m: int) -> None:
    """From `VECTOR_STAGES` stages `FastPace` gathers W, F and 2 C from numpy tables (`_vector_value`)."""
    _check_fast_pace(seed, units, m, min_stages=VECTOR_STAGES)


def _long_instance():
    """A 20-unit, 20-card schedule instance with two starts that fit (a one-unit-a-stage pipeline and its
    reverse card order)."""
    rng = random.Random(11)
    prob = random_problem(rng, units=20, devices=20, microbatches=40, objective="schedule")
    first = tuple(Stage(i, i, i) for i in range(20))
    second = tuple(Stage(19 - i, i, i) for i in range(20))
    assert evaluate(prob, first).fits and evaluate(prob, second).fits
    return prob, first, second


def test_anneal_is_a_function_of_its_seed_and_starts(monkeypatch) -> None:
    """Rounds counted in moves, not seconds: with time to spare the same seed and starts give the same placement,
    on one chain and on two; the chains' answer is no slower than either start."""
    monkeypatch.setattr(pace_search, "MAX_ROUNDS", 4)
    monkeypatch.setattr(pace_search, "ROUND_MOVES", 300)
    monkeypatch.setattr(pace_search, "ROUND_MOVES_PER_STAGE", 15)
    prob, first, second = _long_instance()
    pace = FastPace(prob)
    runs = [anneal(prob, first, deadline=time.perf_counter() + 600.0, seed=7) for _ in range(2)]
    assert runs[0] == runs[1]
    assert pace.value(runs[0]) < pace.value(first)
    chained = [anneal_chains(prob, [first, second], deadline=time.perf_counter() + 600.0, seed=7) for _ in range(2)]
    assert chained[0] == chained[1]
    assert evaluate(prob, chained[0]).fits
    assert pace.value(chained[0]) <= min(pace.value(first), pace.value(second)) * (1 + REL)


class _PassClock:
    """A clock only the stubbed `anneal_chains` moves, by `pass_s` a call (the annealing passes' forecast reads it)."""

    def __init__(self, pass_s: float) -> None:
        self.now_s, self.pass_s = 0.0, pass_s

    def perf_counter(self) -> float:
        return self.now_s


def _stub_passes(monkeypatch, answers: list[tuple[Stage, ...]]) -> tuple[_PassClock, list[tuple[int, int]]]:
    """`pace_search`'s clock replaced by a `_PassClock` of one second a pass, and `anneal_chains` by a stub that
    returns `answers` in turn (the last one again once they run out); its calls recorded as (seed, chains)."""
    clock, calls = _PassClock(1.0), []

    def chains(problem, starts, *, deadline, seed=0, floor_s=0.0):
        calls.append((seed, len(starts)))
        clock.now_s += clock.pass_s
        return answers[min(len(calls), len(answers)) - 1]

    monkeypatch.setattr(pace_search, "time", clock)
    monkeypatch.setattr(pace_search, "anneal_chains", chains)
    return clock, calls


def _ladder(prob, count: int) -> list[tuple[Stage, ...]]:
    """`count` one-unit-a-stage pipelines of `prob` (a `_long_instance`) of strictly falling pace."""
    rng, pace = random.Random(2), FastPace(prob)
    found = {}
    while len(found) < 4 * count:
        order = rng.sample(range(prob.num_units), prob.num_units)
        pipeline = tuple(Stage(d, i, i) for i, d in enumerate(order))
        found[round(pace.value(pipeline), 9)] = pipeline
    paces = sorted(found, reverse=True)
    return [found[v] for v in paces[::len(paces) // count][:count]]


def test_anneal_passes_start_only_where_their_forecast_fits(monkeypatch) -> None:
    """Passes of one (fake) second, each with a new best, and a deadline of 3.5 s: three passes (the third starts
    at 2 s, forecast to end at 3 s), the later ones from the best so far alone, seeded apart; the best
    of them returned."""
    prob, first, second = _long_instance()
    answers = _ladder(prob, 5)
    clock, calls = _stub_passes(monkeypatch, answers)
    assert pace_search.anneal_passes(prob, [first, second], deadline=3.5, seed=5) == answers[2]
    assert calls == [(5, 2), (8, 1), (11, 1)], calls
    assert clock.now_s == 3.0


def test_anneal_passes_stop_without_a_new_best_or_at_the_floor(monkeypatch) -> None:
    """A pass without a new best ends the passes; a first pass within `RESTART_GAP` of the floor, without the time
    for another, or shorter than `RESTART_STAGES` stages, ends them at once."""
    prob, first, second = _long_instance()
    answers = _ladder(prob, 2)
    _, calls = _stub_passes(monkeypatch, answers)
    assert pace_search.anneal_passes(prob, [first, second], deadline=100.0) == answers[1]
    assert len(calls) == 3  # the second pass found a new best, the third none
    _, calls = _stub_passes(monkeypatch, answers)
    floor_s = FastPace(prob).value(answers[0])
    assert pace_search.anneal_passes(prob, [first, second], deadline=100.0, floor_s=floor_s) == answers[0]
    assert len(calls) == 1
    _, calls = _stub_passes(monkeypatch, answers)
    assert pace_search.anneal_passes(prob, [first, second], deadline=1.5) == answers[0]
    assert len(calls) == 1
    short = tuple(Stage(d, 2 * d, 2 * d + 1) for d in range(10))  # under `RESTART_STAGES` stages: one pass
    _, calls = _stub_passes(monkeypatch, [short])
    assert pace_search.anneal_passes(prob, [first, second], deadline=100.0) == short
    assert len(calls) == 1


def test_anneal_passes_are_a_function_of_their_seed_and_starts(monkeypatch) -> None:
    """With time to spare the passes end by themselves (a pass without a new best): the same seed and starts give
    the same placement, which fits and is no slower than the first pass's."""
    monkeypatch.setattr(pace_search, "MAX_ROUNDS", 2)
    monkeypatch.setattr(pace_search, "ROUND_MOVES", 200)
    monkeypatch.setattr(pace_search, "ROUND_MOVES_PER_STAGE", 10)
    prob, first, second = _long_instance()
    pace = FastPace(prob)
    runs = [pace_search.anneal_passes(prob, [first, second], deadline=time.perf_counter() + 600.0, seed=5)
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert evaluate(prob, runs[0]).fits
    one = anneal_chains(prob, [first, second], deadline=time.perf_counter() + 600.0, seed=5)
    assert pace.value(runs[0]) <= pace.value(one) * (1 + REL)
