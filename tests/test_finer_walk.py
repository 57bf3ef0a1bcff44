"""Issue 12 item 3: the finer kind cut's walk that runs after `verify`'s answer is final (`solvers/finer_walk.py`).

The finer cut's merged problem is a relaxation, so whatever the target (T / 1.02 of any answer), the raised bound
must stay at most the enumerated schedule optimum; and the step is a time-limited step like `verify`'s others: with
a fake clock it starts only when its forecast fits the time left, and no DP pass of it starts past the deadline.
The instances: 5 units on 4-5 cards of three kinds on two nodes; the default cut's budget (`state_budget`) is made
small so that `relax.pace_relaxation` merges kinds and a finer cut exists.
"""

from __future__ import annotations

import functools
import math
import random
import time

import pytest

from hetpipe.partitioner.problem import DeviceSlot, Problem, evaluate
from hetpipe.partitioner.solvers import finer_walk
from hetpipe.partitioner.solvers.dp import CountDP
from hetpipe.partitioner.solvers.finer_walk import finer_groups, raise_bound
from hetpipe.partitioner.solvers.relax import dp_rows, relaxed_problem
from hetpipe.partitioner.solvers.verify import first_step_floor
from tests.instances import all_placements, two_node_schedule_problem

#: Relative slack of float sums taken in another order (as tests/test_pace_windows.py's REL).
REL = 1e-9
KINDS = ("k0", "k1", "k2")


def _instance(seed: int) -> Problem:
    """5 units on 4-5 cards of three kinds (every kind present) on two nodes, 8-24 micro-batches."""
    rng = random.Random(seed)
    n = rng.randint(4, 5)
    kinds = list(KINDS) + [rng.choice(KINDS) for _ in range(n - len(KINDS))]
    devs = tuple(DeviceSlot(f"d{i}", kinds[i], rng.choice(("n0", "n1")), 10**6) for i in range(n))
    fwd = {k: tuple(rng.uniform(0.2, 2.0) for _ in range(5)) for k in KINDS}
    prob = two_node_schedule_problem(rng, devs, fwd, max_microbatches=8)
    return Problem(**{**prob.__dict__, "microbatches": rng.randint(8, 24)})


def _coarse_budget(prob: Problem) -> int:
    """A default-cut budget that fits only one group of all three kinds: the finer cut splits it."""
    return dp_rows(relaxed_problem(prob), [list(KINDS)])


@functools.lru_cache(maxsize=None)
def _optimum(seed: int) -> tuple[float, tuple]:
    """(least replayed T, its placement) over every placement of `_instance(seed)`."""
    prob = _instance(seed)
    return min(((evaluate(prob, p).iteration_s, p) for p in all_placements(prob)), key=lambda tp: tp[0])


@pytest.mark.parametrize("seed", range(16))
def test_raised_bound_stays_under_the_schedule_optimum(seed: int) -> None:
    """From a zero bound, for answers at and above the optimum (targets below and above it): the raised bound is
    positive (the walk ran) and at most the enumerated schedule optimum."""
    prob = _instance(seed)
    best_s, best = _optimum(seed)
    budget = _coarse_budget(prob)
    assert finer_groups(prob, stages=len(best), state_budget=budget) is not None
    for answer_s in (best_s, 1.05 * best_s, 1.5 * best_s):
        raised = raise_bound(prob, best, iteration_s=answer_s, bound_s=0.0, step_s=first_step_floor(prob),
                             deadline=math.inf, state_budget=budget)
        assert 0.0 < raised <= best_s * (1 + REL), (seed, answer_s, raised, best_s)


def test_finer_cut_splits_where_the_merge_loses_most() -> None:
    """Three kinds of whole-model work 1, 1.1 and 3: merged in one group, the split keeps the two close ones."""
    devs = tuple(DeviceSlot(f"d{i}", k, "n0", 99) for i, k in enumerate(("a", "b", "c")))
    prob = Problem(fwd_s={"a": (1.0,) * 3, "b": (1.1,) * 3, "c": (3.0,) * 3}, bwd_s={k: (0.0,) * 3 for k in "abc"},
                   state_bytes=(1,) * 3, activation_bytes=(1,) * 3, boundary_bytes=(0,) * 3, devices=devs,
                   bandwidth_bytes_s=((1.0,) * 3,) * 3, latency_s=((0.0,) * 3,) * 3, microbatches=4,
                   objective="schedule")
    budget = dp_rows(relaxed_problem(prob), [["a", "b", "c"]])
    assert finer_groups(prob, stages=3, state_budget=budget) == [["a", "b"], ["c"]]


class _Clock:
    """A clock that only the finer walk's DP passes move, by `pass_s` each; it records when each pass starts."""

    def __init__(self, pass_s: float) -> None:
        self.now_s, self.pass_s, self.starts = 0.0, pass_s, []

    def __call__(self) -> float:
        return self.now_s


def _clocked(monkeypatch: pytest.MonkeyPatch, pass_s: float) -> _Clock:
    clock = _Clock(pass_s)
    monkeypatch.setattr(time, "perf_counter", clock)
    real = CountDP.min_sum

    def min_sum(self, *args, **kwargs):
        clock.starts.append(clock.now_s)
        try:
            return real(self, *args, **kwargs)
        finally:
            clock.now_s += clock.pass_s

    monkeypatch.setattr(CountDP, "min_sum", min_sum)
    return clock


@pytest.mark.parametrize("seed", range(4))
def test_finer_walk_starts_only_when_its_forecast_fits(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """A deadline just under the forecast: no pass, the bound unchanged; just over it: the walk runs."""
    prob = _instance(seed)
    best_s, best = _optimum(seed)
    budget = _coarse_budget(prob)
    clock = _clocked(monkeypatch, 0.0)
    need_s = finer_walk.forecast_s(prob, finer_groups(prob, stages=len(best), state_budget=budget))
    kw = dict(iteration_s=1.5 * best_s, bound_s=0.0, step_s=first_step_floor(prob), state_budget=budget)
    assert raise_bound(prob, best, deadline=0.99 * need_s, **kw) == 0.0
    assert clock.starts == []
    assert raise_bound(prob, best, deadline=1.01 * need_s, **kw) > 0.0
    assert clock.starts


@pytest.mark.parametrize("seed", range(4))
def test_finer_walk_starts_no_pass_past_its_deadline(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Passes of one fake second, a deadline of 2.5 s (the forecast made free): at most three passes start, all by
    the deadline, and the bound kept is still under the optimum."""
    monkeypatch.setattr(finer_walk, "SECONDS_PER_ROW_PASS", 0.0)
    prob = _instance(seed)
    best_s, best = _optimum(seed)
    clock = _clocked(monkeypatch, 1.0)
    raised = raise_bound(prob, best, iteration_s=1.5 * best_s, bound_s=0.0, step_s=first_step_floor(prob),
                         deadline=2.5, state_budget=_coarse_budget(prob))
    assert clock.starts and max(clock.starts) <= 2.5, clock.starts
    assert raised <= best_s * (1 + REL)
