"""`--time-limit` holds for every solve path (issue 12): `verify`'s limit is a hard deadline, and `solve` ends within
its limit plus the final pricing (the schedule replay of the answer it returns when no time is left).

The clocks here are fake and move only by what the test charges (deterministic, no wall sample): each schedule
pricing costs `RATE_S` per action (stages x micro-batches), and the searches stubbed out jump to the deadline they
were given (the worst case of a time-bound search).  The live figures (real clocks, under load) are
benchmarks/limit_trace.py's.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from types import SimpleNamespace

import pytest

from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage, evaluate
from hetpipe.partitioner.solvers import dp as dp_module
from hetpipe.partitioner.solvers import solve as solve_module
from hetpipe.partitioner.solvers import verify as verify_module
from hetpipe.partitioner.solvers.cap_walk import DeadlineReached
from hetpipe.partitioner.solvers.pricing import COMPILE_OVER_REPLAY, Pricer, price_in_order
from hetpipe.partitioner.solvers.window_starts import ORDERS, end_placements, groups, least_cap, starts
from tests.instances import random_problem

#: Fake seconds per action of a schedule pricing (a 10-stage pipeline of 32 micro-batches: 32 ms).
RATE_S = 1e-4


class PricingClock:
    """A clock only schedule pricings (`RATE_S` per action) and the stubs' jumps move; it records each pricing."""

    def __init__(self) -> None:
        self.now_s = 0.0
        self.pricings: list[tuple[float, float]] = []  # (start, end) of each schedule pricing

    def __call__(self) -> float:
        return self.now_s

    def jump(self, to_s: float) -> None:
        self.now_s = max(self.now_s, to_s)

    def evaluate(self, problem: Problem, stages, *, objective: str | None = None):
        ev = evaluate(problem, stages, objective=objective)
        if (objective or problem.objective) == "schedule":
            start = self.now_s
            self.now_s += RATE_S * len(stages) * problem.microbatches
            self.pricings.append((start, self.now_s))
        return ev


@pytest.fixture()
def clock(monkeypatch: pytest.MonkeyPatch) -> PricingClock:
    fake = PricingClock()
    monkeypatch.setattr(time, "perf_counter", fake)  # every module reads `time.perf_counter()` at call time
    monkeypatch.setattr(verify_module, "evaluate", fake.evaluate)
    monkeypatch.setattr(solve_module, "evaluate", fake.evaluate)
    return fake


def _sixteen_cards() -> Problem:
    """Ten units on 16 cards (`verify.WINDOW_STARTS_CARDS`: window starts and annealing apply)."""
    return random_problem(random.Random(3), units=10, devices=verify_module.WINDOW_STARTS_CARDS, microbatches=32,
                          objective="schedule")


def _stub_searches(monkeypatch: pytest.MonkeyPatch, clock: PricingClock, *, window_ends: str) -> list[tuple[Stage, ...]]:
    """`verify`'s searches replaced by ones that take all the time they are given: the bottleneck pass, the window
    starts (to their share's deadline, or to `verify`'s own with ``window_ends="hard"``: the first order may run on),
    the pace walks and the annealing (which returns a new placement, ten one-unit stages); the local search is real."""
    prob = _sixteen_cards()
    built = starts(verify_module._plain_view(prob))
    ten = tuple(Stage(d, d, d) for d in range(10))

    def window(problem: Problem, *, deadline: float, hard_deadline: float) -> list[tuple[Stage, ...]]:
        clock.jump(hard_deadline if window_ends == "hard" else deadline)
        return built

    def bound(problem: Problem, deadline: float = math.inf) -> tuple[float, None]:
        clock.jump(deadline)
        return 0.0, None

    def pace(problem: Problem, *, deadline: float, hints, enough_s: float) -> tuple[float, list]:
        clock.jump(deadline)
        return 0.0, []

    def anneal_passes(problem: Problem, starts, *, deadline: float, floor_s: float) -> tuple[Stage, ...]:
        clock.jump(deadline)
        return ten

    monkeypatch.setattr(verify_module, "window_starts", window)
    monkeypatch.setattr(verify_module, "_bound_and_placement", bound)
    monkeypatch.setattr(verify_module, "pace_bound", pace)
    monkeypatch.setattr(verify_module, "anneal_passes", anneal_passes)
    return built


@pytest.mark.parametrize("window_ends", ["share", "hard"])
@pytest.mark.parametrize("limit_s", [0.0, 0.05, 1.0])
def test_verify_starts_nothing_past_its_deadline_but_its_first_pricing(monkeypatch: pytest.MonkeyPatch,
                                                                       clock: PricingClock, window_ends: str,
                                                                       limit_s: float) -> None:
    """Every pricing but `verify`'s first ends by its deadline, and nothing else runs past it: the clock ends
    at the deadline or at the first pricing's end.  Before, the starts were all priced whatever the time (and the
    annealed placement, and the walks' placements after a check made before a compile)."""
    _stub_searches(monkeypatch, clock, window_ends=window_ends)
    prob = _sixteen_cards()
    one = (Stage(0, 0, prob.num_units - 1),)
    out = verify_module.verify(prob, [one], limit_s=limit_s)
    assert clock.pricings, "the answer is priced by the schedule"
    assert all(end <= limit_s for _, end in clock.pricings[1:]), clock.pricings
    assert clock.now_s <= max(limit_s, clock.pricings[0][1]) * (1 + 1e-12), (clock.now_s, clock.pricings)
    assert out.bound_s <= out.iteration_s == pytest.approx(evaluate(prob, out.stages).iteration_s, rel=1e-12)
    assert out.iteration_s <= evaluate(prob, one).iteration_s * (1 + 1e-12)  # at most the start it was given


def test_verify_with_time_prices_its_starts_and_searches(monkeypatch: pytest.MonkeyPatch, clock: PricingClock) -> None:
    """With time to spare (the stubs take their shares, the pricings a few ms each) the window start is priced and
    the annealed placement too: the deadline drops nothing that fits in time."""
    built = _stub_searches(monkeypatch, clock, window_ends="share")
    prob = _sixteen_cards()
    one = (Stage(0, 0, prob.num_units - 1),)
    out = verify_module.verify(prob, [one], limit_s=10.0)
    assert clock.now_s <= 10.0
    priced = [end - start for start, end in clock.pricings]
    assert len(priced) >= 3  # the candidate, the window start, the annealed placement (then the local search)
    assert out.iteration_s <= min(evaluate(prob, p).iteration_s for p in built if evaluate(prob, p).fits) * (1 + 1e-9)


def _two_cards(recompute: str) -> Problem:
    inf = float("inf")
    return Problem(fwd_s={"a": (1.0,) * 4}, bwd_s={"a": (2.0,) * 4}, state_bytes=(1,) * 4,
                   activation_bytes=(1,) * 4, boundary_bytes=(0,) * 4,
                   devices=(DeviceSlot("d0", "a", "n", 100), DeviceSlot("d1", "a", "n", 100)),
                   bandwidth_bytes_s=((inf, 1.0), (1.0, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)),
                   microbatches=4, recompute=recompute, objective="schedule")


@pytest.mark.parametrize("recompute", ["none", "auto"])
def test_solve_ends_within_its_limit_plus_the_final_pricing(monkeypatch: pytest.MonkeyPatch, clock: PricingClock,
                                                            recompute: str) -> None:
    """The estimate's search uses the whole limit (its share and `verify`'s): `verify` gets nothing and prices its
    first start only; under ``auto`` the none pass's answer is priced once more (`_at_most_floor`).  So `solve` ends
    at the limit plus those pricings (before: `verify` had a quarter of its share on top, 1.1x the limit)."""
    real_estimate = solve_module.solve_estimate

    def estimate(problem: Problem, **kw: object) -> object:
        found = real_estimate(problem, **{**kw, "time_limit_s": 30.0})  # the fake clock stands still meanwhile
        clock.jump(clock.now_s + max(float(kw["time_limit_s"]), 0.0) / (1.0 - solve_module.SCHEDULE_SHARE))
        return found

    monkeypatch.setattr(solve_module, "solve_estimate", estimate)
    limit_s = 10.0
    sol = solve_module.solve(_two_cards(recompute), time_limit_s=limit_s)
    late = [(start, end) for start, end in clock.pricings if end > limit_s]
    assert len(late) <= (2 if recompute == "auto" else 1), clock.pricings
    assert clock.now_s <= limit_s + sum(end - start for start, end in late) + 1e-9, (clock.now_s, clock.pricings)
    assert sol.bound_s <= sol.iteration_s == pytest.approx(evaluate(_two_cards(recompute), sol.stages).iteration_s)


def test_pricer_forecasts_a_new_length_as_a_compile() -> None:
    """Until it has seen a compile the pricer forecasts one at `COMPILE_OVER_REPLAY` replays; a known length at
    one replay; nothing before its first pricing."""
    prob = _two_cards("none")
    now = SimpleNamespace(s=0.0)

    def priced(problem: Problem, stages, *, objective: str) -> object:
        now.s += 1.0
        return evaluate(problem, stages, objective=objective)

    pricer = Pricer(prob, deadline=100.0, clock=lambda: now.s, price_fn=priced)
    one, two = (Stage(0, 0, 3),), (Stage(0, 0, 1), Stage(1, 2, 3))
    assert pricer.forecast_s(one) == 0.0
    pricer.price(one)
    assert pricer.forecast_s(one) == pytest.approx(max(pricer.replay_rate_s, 0.0) * 4)
    rate = max(pricer.compile_rate_s, COMPILE_OVER_REPLAY * pricer.replay_rate_s)
    assert pricer.forecast_s(two) == pytest.approx(rate * 8) and pricer.forecast_s(one, new=True) == pytest.approx(rate * 4)
    assert pricer.forecast_s(two) >= 8 * 1.0 / 4  # at least the one rate seen, per action
    pricer.deadline = now.s + 0.5
    assert not pricer.fits(two) and price_in_order(pricer, [two, one]) == {two: evaluate(prob, two)}


def test_the_window_starts_stop_at_the_hard_deadline() -> None:
    """Past the caller's deadline no window start is built, the first order's included (it used to run to its end
    whatever the time); past the share's deadline alone the first order still answers."""
    prob = verify_module._plain_view(_sixteen_cards())
    assert starts(prob, deadline=-math.inf, hard_deadline=-math.inf) == []
    assert starts(prob, deadline=-math.inf)  # the first order, as before
    grp = groups(prob, ORDERS[0])
    cap_s, _ = least_cap(prob, ORDERS[0])
    assert end_placements(prob, grp, cap_s) and end_placements(prob, grp, cap_s, deadline=-math.inf) == []


def test_the_pace_walks_build_no_lattice_past_their_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The count DP's lattice (Python over every count vector: 0.9 s of CPU on `_sixteen_cards`) checks the deadline:
    the bottleneck pass and the pace walks give up in it, `pace_bound` past its deadline before building anything."""
    prob = _sixteen_cards()
    with pytest.raises(DeadlineReached):
        dp_module.CountDP(prob, deadline=-math.inf)
    with pytest.raises(DeadlineReached):
        dp_module.least_bottleneck(prob, deadline=-math.inf)
    built: list[int] = []
    real = dp_module._Lattice.build
    monkeypatch.setattr(dp_module._Lattice, "build", classmethod(lambda cls, *a: built.append(1) or real(*a)))
    assert verify_module.pace_bound(prob, deadline=-math.inf, hints=[(Stage(0, 0, 9),)]) == (0.0, [])
    bound, least = verify_module._bound_and_placement(prob, -math.inf)
    assert not built and least is None and 0.0 < bound
    assert bound == verify_module._bound_and_placement(dataclasses.replace(prob), -math.inf)[0]
