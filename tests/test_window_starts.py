"""Issue 12 item 3: starts of least window cap for the annealing (`solvers/window_starts.py`).

* `least_cap` finds the least window cap over its family (groups in order, any skipped, consecutive cards of
  each group used) against enumeration of that family on small random instances, and its placement meets it.
  So does every placement of `end_placements`, the fill weighed or not.
* `starts` returns plain placements of every unit that fit; `verify` answers at most the best one's replay.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time

import pytest

from hetpipe.partitioner.problem import Problem, Stage, evaluate
from hetpipe.partitioner.solvers.window_starts import BISECTION_STEPS, FILL_WEIGHTS, ORDERS, end_placements, groups, least_cap, starts, window_cap
from hetpipe.partitioner.solvers import verify as verify_module
from hetpipe.partitioner.solvers.verify import WINDOW_STARTS_CARDS
from tests.instances import random_problem

INSTANCES = 40


def _uniform_links(prob: Problem) -> Problem:
    """`prob` with one link figure per node pair (the DP prices cuts by group: exact when links are uniform)."""
    devs = prob.devices
    bw = tuple(tuple(math.inf if i == j else (10.0 if a.node == b.node else 1.0) for j, b in enumerate(devs))
               for i, a in enumerate(devs))
    lat = tuple(tuple(0.0 if i == j else (0.01 if a.node == b.node else 0.1) for j, b in enumerate(devs))
                for i, a in enumerate(devs))
    return dataclasses.replace(prob, bandwidth_bytes_s=bw, latency_s=lat)


def _compositions(units: int, parts: int):
    for cuts in itertools.combinations(range(1, units), parts - 1):
        bounds = (0,) + cuts + (units,)
        yield [(bounds[i], bounds[i + 1] - 1) for i in range(parts)]


def _family(prob: Problem, order: str):
    """Every placement of the family: a subsequence of the groups, 1..size cards of each, in order."""
    cards = groups(prob, order).cards
    for chosen in itertools.product(*[range(len(c) + 1) for c in cards]):
        seq = [c[i] for c, used in zip(cards, chosen) for i in range(used)]
        if not seq or len(seq) > prob.num_units:
            continue
        for parts in _compositions(prob.num_units, len(seq)):
            yield tuple(Stage(d, a, b) for d, (a, b) in zip(seq, parts))


@pytest.mark.parametrize("order", ORDERS)
def test_least_cap_is_the_family_optimum(order: str) -> None:
    rng = random.Random(12)
    for _ in range(INSTANCES):
        units, devices = rng.randint(1, 6), rng.randint(1, 4)
        prob = _uniform_links(random_problem(rng, units=units, devices=devices, microbatches=8, objective="schedule"))
        cap_s, placed = least_cap(prob, order)
        want = min(window_cap(prob, p) for p in _family(prob, order))
        tol = float(groups(prob, order).prefix[:, -1].min()) / 2**BISECTION_STEPS  # the bisection's resolution
        assert want - 1e-9 <= cap_s <= want + tol, (cap_s, want)
        assert window_cap(prob, placed) <= cap_s + 1e-9
        ends = end_placements(prob, groups(prob, order), cap_s)
        assert placed in ends and all(window_cap(prob, p) <= cap_s + 1e-9 for p in ends)
        for weight in FILL_WEIGHTS:  # the fill weighed: placements of every unit that meet the cap (or none: a
            weighed = end_placements(prob, groups(prob, order), cap_s, weight)  # state of lower M may be dropped)
            assert all(window_cap(prob, p) <= cap_s + 1e-9 and p[-1].last_unit == units - 1 for p in weighed)
        assert [st.first_unit for st in placed] == [0] + [st.last_unit + 1 for st in placed[:-1]]
        assert placed[-1].last_unit == units - 1


def test_starts_are_plain_placements_that_fit() -> None:
    rng = random.Random(5)
    for _ in range(INSTANCES // 2):
        units = rng.randint(1, 7)
        prob = random_problem(rng, units=units, devices=rng.randint(1, 5), microbatches=rng.randint(1, 12),
                              tight_memory=True, objective="schedule")
        for placed in starts(prob):
            assert evaluate(prob, placed, objective="estimate").fits
            assert placed[0].first_unit == 0 and placed[-1].last_unit == units - 1
            assert len({st.device for st in placed}) == len(placed)
            assert not any(st.recompute_units or st.offload for st in placed)


def test_unknown_order_is_refused() -> None:
    prob = random_problem(random.Random(0), units=2, devices=2)
    with pytest.raises(ValueError, match="unknown group order"):
        groups(prob, "slowest")


def test_verify_answers_at_most_the_window_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """From `WINDOW_STARTS_CARDS` cards `verify` prices the best window start as a candidate: its answer is at
    most that start's replay and at least its bound, even from a single-stage candidate (16 cards, 2 nodes).
    The starts are built without their deadline here, before `verify`'s clock starts (a loaded machine may leave
    the share no time, and past `verify`'s deadline a start is not priced).  Its clock is this thread's CPU time:
    a full run beside a CPU burner (load ~4) left the 1 s of wall too little to price the start."""
    monkeypatch.setattr(time, "perf_counter", time.thread_time)  # every module reads it at call time
    rng = random.Random(3)
    prob = random_problem(rng, units=10, devices=WINDOW_STARTS_CARDS, microbatches=32, objective="schedule")
    built = starts(verify_module._plain_view(prob))
    monkeypatch.setattr(verify_module, "window_starts", lambda problem, **_: built)
    out = verify_module.verify(prob, [(Stage(0, 0, prob.num_units - 1),)], limit_s=1.0)
    assert built
    assert out.bound_s <= out.iteration_s <= min(evaluate(prob, p).iteration_s for p in built) * (1 + 1e-9)
    assert evaluate(prob, out.stages).iteration_s == pytest.approx(out.iteration_s, rel=1e-9)
