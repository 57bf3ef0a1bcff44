"""Simulator vs the analytic estimate (issue #5, acceptance 1; since issue 17 the objective is the schedule
itself, and these document the estimate, `Evaluation.estimate_s`, kept for comparison).

`problem.evaluate`'s T_est is the H-1F1B formula ``sum(F+B) + sum 2C + (m-1) max(max(F+B), max 2C)``.
The simulator replays the 1F1B action lists.  They must agree within 2% wherever the formula's
assumptions hold (`hetpipe.plan.analysis.formula_regime`):

* "balanced": every stage's F+B within 5% of the others, every cut's 2C <= 1% of the smallest
  F+B, m >= 4p;
* "dominant": one stage's F+B at least 8x the rest of a round trip (the other stages' F+B plus
  2 sum C), m >= 4p.

Random plans are built as `Problem` tables (units, one device kind per device, links) and go
through `evaluate` and `costs_from_problem` as a saved plan would.  Hand-made cases check the
values worked out in the comments, including where the two diverge and in which direction.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetpipe.plan.analysis import (
    AGREEMENT_RTOL,
    BALANCED_MAX_RATIO,
    CHEAP_COMM_SHARE,
    DOMINANCE_RATIO,
    MIN_MICROBATCHES_PER_STAGE,
    formula_regime,
)
from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage, evaluate
from hetpipe.schedule.builders import gpipe, make_schedule, one_f_one_b
from hetpipe.partitioner.placement import costs_from_problem
from hetpipe.schedule.simulate import simulate

BOUNDARY_BYTES = 10**6
BIG_BYTES = 10**15
#: Generated cases stay this far inside each bound, so float rounding of the sums cannot cross it.
INSIDE = 1 - 1e-6


def build_problem(fwd: list[list[float]], bwd: list[list[float]], comm_s: list[float], *, microbatches: int,
                  latency_share: float = 0.5) -> tuple[Problem, tuple[Stage, ...]]:
    """A `Problem` whose stage s (on device s, of its own kind) holds units with the given F/B times.

    ``fwd[s]`` / ``bwd[s]`` list stage s's units; cut s takes ``comm_s[s]`` one way, split
    between latency and bytes / bandwidth.
    """
    p = len(fwd)
    stages, first = [], 0
    for s in range(p):
        stages.append(Stage(s, first, first + len(fwd[s]) - 1))
        first += len(fwd[s])
    flat_f = tuple(t for unit_times in fwd for t in unit_times)
    flat_b = tuple(t for unit_times in bwd for t in unit_times)
    # Every kind gets the same unit times: only the stage's own device kind is ever read.
    boundary = tuple(0 if u == first - 1 else BOUNDARY_BYTES for u in range(first))
    bandwidth = [[math.inf] * p for _ in range(p)]
    latency = [[0.0] * p for _ in range(p)]
    for s, c in enumerate(comm_s):
        for a, b in ((s, s + 1), (s + 1, s)):
            latency[a][b] = latency_share * c
            wire = (1.0 - latency_share) * c
            bandwidth[a][b] = BOUNDARY_BYTES / wire if wire > 0 else math.inf
    kinds = [f"k{s}" for s in range(p)]
    problem = Problem(
        fwd_s={k: flat_f for k in kinds}, bwd_s={k: flat_b for k in kinds},
        state_bytes=(1,) * first, activation_bytes=(1,) * first, boundary_bytes=boundary,
        devices=tuple(DeviceSlot(f"d{s}", kinds[s], "n0", BIG_BYTES) for s in range(p)),
        bandwidth_bytes_s=tuple(tuple(r) for r in bandwidth), latency_s=tuple(tuple(r) for r in latency),
        microbatches=microbatches)
    return problem, tuple(stages)


def one_unit_per_stage(f: list[float], b: list[float], c: list[float], m: int) -> tuple[Problem, tuple[Stage, ...]]:
    return build_problem([[x] for x in f], [[x] for x in b], c, microbatches=m)


def analytic_and_simulated(problem: Problem, stages: tuple[Stage, ...], schedule: str = "1f1b") -> tuple[float, float]:
    sim = simulate(make_schedule(schedule, len(stages), problem.microbatches), costs_from_problem(problem, stages))
    return evaluate(problem, stages).estimate_s, sim.iteration_s


def _split(total: float, weights: list[float]) -> list[float]:
    return [total * w / sum(weights) for w in weights]


@st.composite
def stage_units(draw: st.DrawFn, work_s: float) -> tuple[list[float], list[float]]:
    """One stage of total F+B `work_s`: 1-3 units, forward share anywhere in [0.02, 0.98]."""
    fwd_share = draw(st.floats(0.02, 0.98))
    weights = draw(st.lists(st.floats(0.1, 1.0), min_size=1, max_size=3))
    return _split(work_s * fwd_share, weights), _split(work_s * (1 - fwd_share), weights)


@st.composite
def balanced_plans(draw: st.DrawFn) -> tuple[Problem, tuple[Stage, ...]]:
    p = draw(st.integers(2, 10))
    m = draw(st.integers(MIN_MICROBATCHES_PER_STAGE * p, 2 * MIN_MICROBATCHES_PER_STAGE * p))
    base = draw(st.floats(1e-3, 10.0))
    work = [base * draw(st.floats(1.0, BALANCED_MAX_RATIO * INSIDE)) for _ in range(p)]
    units = [draw(stage_units(w)) for w in work]
    comm = [draw(st.floats(0.0, INSIDE)) * CHEAP_COMM_SHARE * min(work) / 2 for _ in range(p - 1)]
    return build_problem([u[0] for u in units], [u[1] for u in units], comm, microbatches=m,
                         latency_share=draw(st.floats(0.0, 1.0)))


@st.composite
def dominant_plans(draw: st.DrawFn) -> tuple[Problem, tuple[Stage, ...]]:
    p = draw(st.integers(2, 10))
    m = draw(st.integers(MIN_MICROBATCHES_PER_STAGE * p, 2 * MIN_MICROBATCHES_PER_STAGE * p))
    k = draw(st.integers(0, p - 1))
    big = draw(st.floats(1e-3, 10.0))
    # The rest of a round trip (other stages' F+B, 2C per cut) shares a budget of big / DOMINANCE_RATIO.
    shares = [draw(st.floats(0.01, 1.0)) for _ in range(2 * p - 2)]
    rest = _split(big / DOMINANCE_RATIO * draw(st.floats(0.05, INSIDE)), shares)
    others, comm = iter(rest[: p - 1]), [r / 2 for r in rest[p - 1:]]
    units = [draw(stage_units(big if s == k else next(others))) for s in range(p)]
    return build_problem([u[0] for u in units], [u[1] for u in units], comm, microbatches=m,
                         latency_share=draw(st.floats(0.0, 1.0)))


def _regime(problem: Problem, stages: tuple[Stage, ...]) -> str:
    ev = evaluate(problem, stages)
    return formula_regime([c.fwd_s + c.bwd_s for c in ev.stages], [c.send_s for c in ev.stages[:-1]],
                          problem.microbatches)


@settings(max_examples=80, deadline=None)
@given(balanced_plans())
def test_balanced_stages_with_cheap_comm_agree_within_2_percent(case):
    problem, stages = case
    assert _regime(problem, stages) == "balanced"  # the generator meets the stated assumptions
    analytic, simulated = analytic_and_simulated(problem, stages)
    assert simulated == pytest.approx(analytic, rel=AGREEMENT_RTOL)


@settings(max_examples=80, deadline=None)
@given(dominant_plans())
def test_a_dominant_stage_agrees_within_2_percent_and_bounds_both(case):
    problem, stages = case
    assert _regime(problem, stages) == "dominant"
    analytic, simulated = analytic_and_simulated(problem, stages)
    assert simulated == pytest.approx(analytic, rel=AGREEMENT_RTOL)
    # By hand: the dominant stage is busy m (F+B)_k, so the simulator takes at least that; the
    # formula is exactly m (F+B)_k plus the rest of one round trip.
    ev = evaluate(problem, stages)
    work = [c.fwd_s + c.bwd_s for c in ev.stages]
    assert simulated >= problem.microbatches * max(work) * (1 - 1e-12)
    rest = sum(work) - max(work) + 2 * sum(c.send_s for c in ev.stages)
    assert analytic == pytest.approx(problem.microbatches * max(work) + rest, rel=1e-12)


# ------------------------------------------------------------------ hand-made cases, values by hand


def test_one_stage_is_m_times_f_plus_b():
    problem, stages = one_unit_per_stage([1.0], [2.0], [], 5)
    assert analytic_and_simulated(problem, stages) == (15.0, 15.0)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_uniform_stages_without_comm_take_m_plus_p_minus_1_slots(schedule):
    # p=4, m=8, F+B=3: (m + p - 1) * 3 = 33 for both schedules and for the formula (4*3 + 7*3).
    problem, stages = one_unit_per_stage([1.0] * 4, [2.0] * 4, [0.0] * 3, 8)
    assert analytic_and_simulated(problem, stages, schedule) == (33.0, 33.0)


def test_bottleneck_on_the_last_stage_with_comm_is_exact():
    # F=B=(1, 1, 3), C=0.5 per cut, m=4.  Micro-batch 0 reaches stage 2 at 1+0.5+1+0.5 = 3 s; inputs then
    # arrive every 1 s, so stage 2 works 4*6 = 24 s without a gap; the last gradient returns through
    # 0.5+1+0.5+1 = 3 s: 30 s.  Formula: (2+2+6) + 2*(0.5+0.5) + 3*6 = 30 s.
    problem, stages = one_unit_per_stage([1.0, 1.0, 3.0], [1.0, 1.0, 3.0], [0.5, 0.5], 4)
    assert analytic_and_simulated(problem, stages) == (30.0, 30.0)


def test_1f1b_hides_the_stages_after_the_bottleneck():
    # F=B=(1, 3, 1, 1), no comm, m=8.  Stage 1 starts at 1 s and is busy 8*6 = 48 s without a gap
    # (stages 2-3 need 4 s per round trip, less than stage 1's 6 s between its backwards); stage 0's
    # last backward adds 1 s: 50 s.  The formula charges stages 2-3's F+B once more: 12 + 7*6 = 54 s,
    # which is what GPipe takes (all forwards, then all backwards: no overlap to hide them).
    problem, stages = one_unit_per_stage([1.0, 3.0, 1.0, 1.0], [1.0, 3.0, 1.0, 1.0], [0.0] * 3, 8)
    assert analytic_and_simulated(problem, stages, "1f1b") == (54.0, 50.0)
    assert analytic_and_simulated(problem, stages, "gpipe") == (54.0, 54.0)


def _period(f: list[float], b: list[float], c: list[float], m: int) -> float:
    """Simulated seconds per extra micro-batch in the steady state: (T(2m) - T(m)) / m.

    (A cycle may advance several micro-batches, so T(m+1) - T(m) alternates; m is a multiple of it.)
    """
    p = len(f)
    costs = costs_from_problem(*one_unit_per_stage(f, b, c, m))
    return (simulate(one_f_one_b(p, 2 * m), costs).iteration_s - simulate(one_f_one_b(p, m), costs).iteration_s) / m


# Neighbouring stages s, s+1 of 1F1B form a cycle: F_s -> C -> F_{s+1} -> B_{s+1} -> C -> B_s -> F_s of the
# micro-batch two later (stage s keeps one more micro-batch in flight than s+1).  So the steady state needs
# at least (W_s + W_{s+1} + 2 C_s) / 2 per micro-batch (W = F+B), where the formula charges max(W, 2C).
MIDDLE_LINK = [
    # C on the middle cut of p=4, F=B=0.5 (W=1), m=32: analytic, simulated, analytic and simulated periods.
    (1.5, 4 + 3 + 31 * 3.0, 84.0, 3.0, (1 + 1 + 3) / 2),  # slow link: the formula is pessimistic (-16%)
    (0.5, 4 + 1 + 31 * 1.0, 51.0, 1.0, (1 + 1 + 1) / 2),  # 2C = W: the formula is optimistic (+42%)
]


@pytest.mark.parametrize("comm, analytic_s, simulated_s, analytic_period, simulated_period", MIDDLE_LINK)
def test_a_link_in_the_middle_diverges_in_the_predicted_direction(comm, analytic_s, simulated_s,
                                                                    analytic_period, simulated_period):
    f = b = [0.5] * 4
    problem, stages = one_unit_per_stage(f, b, [0.0, comm, 0.0], 32)
    assert analytic_and_simulated(problem, stages) == pytest.approx((analytic_s, simulated_s))
    assert _period(f, b, [0.0, comm, 0.0], 32) == pytest.approx(simulated_period)
    assert evaluate(*one_unit_per_stage(f, b, [0.0, comm, 0.0], 33)).estimate_s - analytic_s == \
        pytest.approx(analytic_period)
    assert formula_regime([1.0] * 4, [0.0, comm, 0.0], 32) == ""  # outside the formula's assumptions


def test_comm_on_every_cut_makes_the_whole_round_trip_the_period():
    # C=0.5 on all three cuts, p=4, F=B=0.5: stage 0 keeps 4 micro-batches in flight, and one round trip
    # is 4*1 + 2*3*0.5 = 7 s, so 7/4 = 1.75 s per micro-batch; the formula says max(1, 1) = 1 s.
    f = b = [0.5] * 4
    problem, stages = one_unit_per_stage(f, b, [0.5] * 3, 32)
    analytic, simulated = analytic_and_simulated(problem, stages)
    assert analytic == 38.0 and simulated > analytic * 1.5
    assert _period(f, b, [0.5] * 3, 32) == pytest.approx(7 / 4)
