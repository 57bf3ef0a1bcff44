"""`solve` under ``recompute="auto"`` is never slower than under ``"none"`` (issue 14, Table 3 anomaly).

auto's choices contain none's, so its T must be <= none's; the schedule objective is searched locally from
starts that differ once recomputation lowers the estimate, so `solve` first runs `--recompute none`'s own search
with the same limit (`solve._none_floor`) and returns its answer where auto's is not better.  Checked on random
small instances against brute force (auto's answer is a placement: >= the enumerated optimum), on the benchmark
instance that showed the anomaly, and by construction: the none pass gets 1 - `LEVER_MIN_SHARE` of the limit (it got
half, and auto stayed above none at 96 layers on 16 and 32 cards) and its answer wins over a worse search of auto's
own.  And the limit holds (session 14): the none pass had the whole limit and auto's own search 10% more (10.0-12.5 s
of wall for 10 s, `benchmarks/memory_levers.py` table 3); now auto's search gets what the none pass leaves.
"""

from __future__ import annotations

import dataclasses
import math
import random
from types import SimpleNamespace

import pytest

from hetpipe.errors import InfeasibleError
from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage, evaluate
from hetpipe.partitioner.solvers import solve as solve_module
from hetpipe.partitioner.solvers.solve import solve
from hetpipe.partitioner.solvers.verify import Verified
from tests.instances import TEST_RATES, brute_force, random_problem
from tests.machine_load import LoadTimer


def _t(prob, mode: str) -> float:
    try:
        return solve(dataclasses.replace(prob, recompute=mode), time_limit_s=30.0, seed=0).iteration_s
    except InfeasibleError:
        return math.inf


def test_auto_never_slower_than_none_on_random_instances() -> None:
    rng = random.Random(14)
    checked = 0
    for _ in range(12):
        prob = random_problem(rng, units=rng.randint(3, 5), devices=rng.randint(2, 3), tight_memory=True,
                              recompute="auto", objective="schedule")
        auto, none = _t(prob, "auto"), _t(prob, "none")
        best = brute_force(prob)
        assert auto <= none * (1 + 1e-12), (prob, auto, none)
        assert best <= auto * (1 + 1e-12)  # a placement the enumeration also prices
        if math.isfinite(auto):
            checked += 1
    assert checked >= 5  # most draws fit with recomputation


@pytest.mark.slow
def test_auto_never_slower_than_none_at_96_layers_on_8_cards() -> None:
    """`benchmarks/memory_levers.py` table 3's instance: auto was 2.4554 s against none's 2.4507 s."""
    from benchmarks.planner_speed import PER_NODE
    from benchmarks.scenarios import gpt_graph, mixed_cluster
    from hetpipe.plan.build import build_problem

    graph, cluster = gpt_graph(layers=96), mixed_cluster(8, per_node=PER_NODE[8])
    prob = build_problem(graph, cluster, microbatches=16, recompute="auto")
    auto = solve(prob, time_limit_s=60.0, seed=0)
    none = solve(dataclasses.replace(prob, recompute="none"), time_limit_s=30.0, seed=0)
    assert evaluate(prob, auto.stages).fits
    assert auto.iteration_s <= none.iteration_s * (1 + 1e-12), (auto.iteration_s, none.iteration_s)



def _two_cards() -> Problem:
    """Four equal units, two equal cards with room for everything: two stages beat one (T 30 s against 48 s:
    (m + p - 1)(F + B) with F + B = 6 s per card-half and m = 4)."""
    inf = float("inf")
    return Problem(fwd_s={"a": (1.0,) * 4}, bwd_s={"a": (2.0,) * 4}, state_bytes=(1,) * 4,
                   activation_bytes=(1,) * 4, boundary_bytes=(0,) * 4,
                   devices=(DeviceSlot("d0", "a", "n", 100), DeviceSlot("d1", "a", "n", 100)),
                   bandwidth_bytes_s=((inf, 1.0), (1.0, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)),
                   microbatches=4, recompute="auto", objective="schedule")


def test_none_pass_is_none_search_within_most_of_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto's none pass is `--recompute none`'s own call with 1 - `LEVER_MIN_SHARE` of the limit (it had half: cut
    short where the search is time-bound, auto above none at 96 layers on 16 and 32 cards; then the whole limit, and
    auto's wall exceeded it)."""
    calls: list[tuple[str, float]] = []
    real = solve_module.solve

    def spy(problem: Problem, **kw: object) -> object:
        calls.append((problem.recompute, kw["time_limit_s"]))
        return real(problem, **kw)

    monkeypatch.setattr(solve_module, "solve", spy)
    real(_two_cards(), time_limit_s=7.0)
    assert calls == [("none", pytest.approx(7.0 * (1.0 - solve_module.LEVER_MIN_SHARE), rel=1e-12))]


def _offloading(prob: Problem) -> Problem:
    """`prob` with ``offload="auto"`` (every card with host figures): auto's search also runs the offload-never one."""
    devices = tuple(dataclasses.replace(d, host_link_bytes_s=4.0, host_memory_bytes_s=8.0) for d in prob.devices)
    return dataclasses.replace(prob, devices=devices, offload="auto", offload_rates=TEST_RATES, grad_bytes=(1,) * 4)


@pytest.mark.parametrize("offload", ["never", "auto"])
def test_the_limit_holds_when_every_search_takes_all_its_time(monkeypatch: pytest.MonkeyPatch, offload: str) -> None:
    """On a clock that only the searches move, each by the whole time it was given (the worst case of a time-bound
    search; the real searches run beside it with time to spare): auto with its none pass ends within the limit
    (before: 1.1x, the none pass took the limit and auto's own search 10% more)."""
    clock = SimpleNamespace(now_s=0.0)
    real_estimate, real_verify = solve_module.solve_estimate, solve_module.verify

    def estimate(problem: Problem, **kw: object) -> object:
        found = real_estimate(problem, **{**kw, "time_limit_s": 30.0})
        clock.now_s += max(float(kw["time_limit_s"]), 0.0)
        return found

    def verify(problem: Problem, starts: object, **kw: object) -> Verified:
        checked = real_verify(problem, starts, **{**kw, "limit_s": 5.0})
        clock.now_s += max(float(kw["limit_s"]), 0.0)
        return checked

    monkeypatch.setattr(solve_module, "time", SimpleNamespace(perf_counter=lambda: clock.now_s))
    monkeypatch.setattr(solve_module, "solve_estimate", estimate)
    monkeypatch.setattr(solve_module, "verify", verify)
    prob = _two_cards() if offload == "never" else _offloading(_two_cards())
    auto = solve(prob, time_limit_s=10.0)
    assert clock.now_s <= 10.0 * (1 + 1e-12), clock.now_s
    none = solve(dataclasses.replace(prob, recompute="none"), time_limit_s=10.0)
    assert auto.iteration_s <= none.iteration_s * (1 + 1e-12)


#: The overrun of the limit `solve` may show on a real search: its searches check the clock between steps (a DP level,
#: a window start's DP row; ~0.2 s of CPU at 48 layers on 16 cards before session 15, when the window starts ran
#: their first order to its end), and the final pricing (tests/test_time_limit.py; at 16 cards a few ms).
OVERRUN_SHARE = 0.05


@pytest.mark.slow
def test_auto_keeps_to_its_limit_on_a_time_bound_instance() -> None:
    """48 layers on 16 mixed cards (`benchmarks/memory_levers.py` table 3: a time-bound search, 11.0 s of wall for
    a 10 s limit before): `solve` under auto within the limit plus `OVERRUN_SHARE`, scaled by the load per core
    (`tests/machine_load.py`), and never above none's T from the same none pass."""
    from benchmarks.planner_speed import PER_NODE
    from benchmarks.scenarios import gpt_graph, mixed_cluster
    from hetpipe.plan.build import build_problem

    prob = build_problem(gpt_graph(layers=48), mixed_cluster(16, per_node=PER_NODE[16]), microbatches=32,
                         recompute="auto")
    limit_s = 4.0
    timer = LoadTimer(base_limit_s=limit_s * (1 + OVERRUN_SHARE))
    auto = solve(prob, time_limit_s=limit_s, seed=0)
    assert timer.within_limit(), timer.why()
    assert evaluate(prob, auto.stages).fits and auto.bound_s <= auto.iteration_s


def test_auto_returns_the_none_answer_when_its_own_search_is_worse(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever auto's schedule search returns (here: a worse placement, as a time-bound search cut short can),
    the answer is at most the none pass's: the better of the two is returned."""
    prob, real = _two_cards(), solve_module.verify
    single = (Stage(0, 0, 3),)

    def worse(problem: Problem, starts: object, **kw: object) -> Verified:
        if problem.recompute != "auto":
            return real(problem, starts, **kw)
        return Verified(single, evaluate(problem, single).iteration_s, 0.0, False)

    monkeypatch.setattr(solve_module, "verify", worse)
    auto = solve(prob, time_limit_s=5.0)
    none = solve(dataclasses.replace(prob, recompute="none"), time_limit_s=5.0)
    assert evaluate(prob, single).iteration_s > none.iteration_s
    assert auto.iteration_s == none.iteration_s and auto.stages == none.stages
    assert auto.bound_s <= auto.iteration_s
