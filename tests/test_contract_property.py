"""Every solver path against brute-force enumeration of the README's contract, on >= 10,000 instances
(and 600 more with the optimizer-offload lever).

The instances are tiny (1-4 units, 1-3 devices) so that enumerating every ordered device
subset and every set of cuts is cheap, and varied where the solvers take shortcuts:
cards of one kind on one node (which the DP merges into a class) with links that differ
by direction, cuts that carry 0 bytes (which still pay the link latency), latencies of
0, memory tight enough to leave cards out, a tied parameter, and the activation-recomputation
lever (`Problem.recompute` none / auto / all: the brute force tries every prefix of every
stage's recompute order, written out here from the README, under ``auto``).

`contract_t` is written from the README's formulas, independently of `problem.evaluate`,
so the test also checks `evaluate` itself.  Paths: the exact DP (`solve_exact`), the
fixed-order DP given the optimum's device order, the node-free relaxation (a lower bound:
bound <= optimum, and what it realises is a real, correctly priced placement), and CP-SAT
on a smaller sample (it is slower per instance).  These solve the H-1F1B estimate
(``objective="estimate"``), the surrogate they search exactly; the planner's objective, the
simulated schedule, is checked through `solve` (bound and verify) in
`test_solve_brackets_the_enumerated_schedule_optimum`.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetpipe.cost_models.step_transient import NO_STEP_TRANSIENT
from hetpipe.errors import InfeasibleError
from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage, TiedCopy, evaluate
from hetpipe.partitioner.solvers.cpsat import solve_cpsat
from hetpipe.partitioner.solvers.dp import solve_exact
from hetpipe.partitioner.solvers.fixed_order import solve_fixed_order
from hetpipe.partitioner.solvers.lagrange import bottleneck_floor, lagrange_bound
from hetpipe.partitioner.solvers.offload_walk import tail_walk
from hetpipe.partitioner.solvers.relax import relaxed_bound
from hetpipe.partitioner.solvers.schedule_bound import pace_terms, schedule_walk
from hetpipe.partitioner.solvers.solve import solve
from hetpipe.partitioner.solvers.verify import first_step_floor
from hetpipe.schedule.builders import one_f_one_b
from hetpipe.schedule.held import stage_held_terms
from hetpipe.schedule.simulate import SimCosts, simulate
from tests.instances import TEST_RATES, all_placements, recompute_choices, with_random_step_transients

#: Relative tolerance between two float sums of the same terms in different orders.
REL = 1e-9
#: CP-SAT works in integer ticks of about 1e-7 T (cpsat.py), re-evaluated in floats.
REL_CPSAT = 1e-5
KIND_SPEED = {"fast": 1.0, "slow": 2.5}  # time multiplier per kind


@st.composite
def instances(draw: st.DrawFn) -> Problem:
    units = draw(st.integers(1, 4))
    n = draw(st.integers(1, 3))
    base = [draw(st.sampled_from((0.5, 1.0, 1.5, 2.0))) for _ in range(units)]
    tight = draw(st.booleans())
    devs = tuple(DeviceSlot(f"d{i}", draw(st.sampled_from(tuple(KIND_SPEED))), draw(st.sampled_from(("n0", "n1"))),
                            draw(st.integers(20, 90)) if tight else 10**6) for i in range(n))
    # every ordered pair drawn on its own: links are often equal (classes form) and sometimes
    # differ by direction (two same-kind cards that must not be merged)
    bw = tuple(tuple(math.inf if i == j else draw(st.sampled_from((1.0, 4.0, 10.0))) for j in range(n))
               for i in range(n))
    lat = tuple(tuple(0.0 if i == j else draw(st.sampled_from((0.0, 0.05, 0.3))) for j in range(n))
                for i in range(n))
    kinds = sorted({d.kind for d in devs})
    tied = ()
    recompute = draw(st.sampled_from(("none", "auto", "all")))
    heavy = recompute != "none" and draw(st.booleans())  # activations that only recomputation fits
    if units >= 2 and draw(st.booleans()):
        tied = (TiedCopy(0, (0, units - 1), draw(st.integers(1, 8))),)
    state = tuple(draw(st.integers(1, 10)) for _ in range(units))
    cuts = tuple(draw(st.sampled_from((0, 0, 1, 4, 8))) for _ in range(units))  # 0-byte cuts often
    return with_step_transients(Problem(
        fwd_s={k: tuple(b * KIND_SPEED[k] for b in base) for k in kinds},
        bwd_s={k: tuple(2 * b * KIND_SPEED[k] for b in base) for k in kinds},
        state_bytes=state,
        activation_bytes=tuple(draw(st.integers(0, 30 if heavy else 6)) for _ in range(units)),
        boundary_bytes=cuts,
        devices=devs, bandwidth_bytes_s=bw, latency_s=lat, microbatches=draw(st.integers(1, 6)), tied=tied,
        recompute=recompute,
        grad_bytes=tuple(draw(st.integers(0, s)) for s in state),  # gradients within the state
        boundary_held_bytes=tuple(draw(st.integers(0, b)) for b in cuts),  # the cut's held share
        boundary_grad_bytes=tuple(draw(st.integers(0, b)) for b in cuts),  # its gradient message
        # memory model 4: a backward's transient, often none, sometimes one that binds (a loss's 2 x logits)
        transient_bwd_bytes=tuple(draw(st.sampled_from((0, 0, 0, 2, 12))) for _ in range(units)),
        objective="estimate"))  # the surrogate the DP, CP-SAT and the relaxation solve exactly


def with_step_transients(prob: Problem) -> Problem:
    """`prob` with memory model 5's optimizer step transient (`instances.with_random_step_transients`: often none,
    else stepped bytes within each unit's gradients, a tied replica's, per kind foreach, per-tensor or SGD's),
    from a generator seeded by the drawn instance, not by hypothesis: the seeds' instances stay as they were."""
    seed = repr((prob.state_bytes, prob.grad_bytes, prob.activation_bytes, prob.boundary_bytes, prob.microbatches,
                 [(d.kind, d.usable_bytes) for d in prob.devices]))
    return with_random_step_transients(random.Random(seed), prob)


@st.composite
def schedule_instances(draw: st.DrawFn) -> Problem:
    """`instances` under the planner's objective (the simulated 1F1B schedule), with optimizer steps
    (0-3 s per unit on the slowest kind, a launch share per kind) and links up to 10x slower."""
    prob = draw(instances())
    slow = draw(st.sampled_from((1.0, 1.0, 10.0)))
    steps = {k: tuple(draw(st.sampled_from((0.0, 0.5, 1.0))) * KIND_SPEED[k] for _ in range(prob.num_units))
             for k in prob.fwd_s}
    return replace(prob, objective="schedule", step_s=steps,
                   step_launch_s={k: draw(st.sampled_from((0.0, 0.1))) for k in prob.fwd_s},
                   bandwidth_bytes_s=tuple(tuple(b / slow for b in row) for row in prob.bandwidth_bytes_s))


def contract_t(prob: Problem, stages: tuple[Stage, ...]) -> tuple[float, bool]:
    """(T, fits) straight from the README: C_s = latency + bytes / bandwidth for every cut, M_s over the
    moments of the stage's action list (`stage_held_terms`, checked against the runtime's ledger in
    tests/test_memory_truth.py)."""
    p, m = len(stages), prob.microbatches
    work, comm2, fits = [], [], True
    for s, st_ in enumerate(stages):
        dev = prob.devices[st_.device]
        held = range(st_.first_unit, st_.last_unit + 1)
        rc = st_.recompute_units  # each keeps its input (none for the stage's first unit), re-runs its forward
        work.append(sum(prob.fwd_s[dev.kind][u] + prob.bwd_s[dev.kind][u] for u in held)
                    + sum(prob.fwd_s[dev.kind][u] for u in rc))
        if s < p - 1:
            nxt = stages[s + 1].device
            comm2.append(2 * (prob.latency_s[st_.device][nxt]
                              + prob.boundary_bytes[st_.last_unit] / prob.bandwidth_bytes_s[st_.device][nxt]))
        cut_in = prob.boundary_bytes[st_.first_unit - 1] if s > 0 else 0
        cut_out = prob.boundary_bytes[st_.last_unit] if s < p - 1 else 0
        grad_in = prob.boundary_grad_bytes[st_.first_unit - 1] if s > 0 else 0
        grad_out = prob.boundary_grad_bytes[st_.last_unit] if s < p - 1 else 0
        grads = sum(prob.grad_bytes[u] for u in held)
        act = sum(prob.activation_bytes[u] for u in held) - (prob.boundary_held_bytes[st_.last_unit] if s < p - 1 else 0)
        # a recomputed unit keeps only its input (none for the stage's first unit) per micro-batch
        kept = act - sum(prob.activation_bytes[u] - (prob.boundary_bytes[u - 1] if u != st_.first_unit else 0)
                         for u in rc)
        # the moments of this very stage's 1F1B list (p, s, m), not the solvers' position shortcut
        again = max((prob.activation_bytes[u] for u in rc), default=0)  # one unit live again in a backward
        # plus the largest transient of a unit's backward (memory model 4), both only inside a backward
        again += max(prob.transient_bwd_bytes[u] for u in held) if prob.transient_bwd_bytes else 0
        peak = max(c.grads * grads + c.microbatches * (kept + cut_in + cut_out) + c.in_frames * cut_in
                   + c.in_grad_frames * grad_in + c.out_frames * cut_out + c.out_grad_frames * grad_out
                   + (again if c.backward else 0)
                   for c in stage_held_terms(p, s, m) if not c.backward or again > 0)
        mem = sum(prob.state_bytes[u] for u in held) - grads + peak
        replicas = [t for t in prob.tied
                    if t.owner_unit not in held and any(u in held for u in t.user_units if u != t.owner_unit)]
        mem += sum(t.state_bytes for t in replicas)
        # the optimizer step (memory model 5): state, gradients and its kind's transient, nothing else
        rule = prob.step_transient.get(dev.kind, NO_STEP_TRANSIENT)
        step_all = sum(prob.step_param_bytes[u] for u in held) if prob.step_param_bytes else 0
        largest = max(prob.step_tensor_bytes[u] for u in held) if prob.step_tensor_bytes else 0
        step = (sum(prob.state_bytes[u] for u in held) + sum(t.state_bytes for t in replicas)
                + rule.list_multiple * (step_all + sum(t.step_bytes for t in replicas))
                + rule.tensor_multiple * max([largest] + [t.step_bytes for t in replicas]))
        fits = fits and max(mem, step) <= dev.usable_bytes
    return sum(work) + sum(comm2) + (m - 1) * max(work + comm2), fits


def recompute_sets(prob: Problem, st_: Stage) -> list[tuple[int, ...]]:
    """The README's choices for one stage: prefixes of its units ordered by saved bytes per forward second."""
    fwd = prob.fwd_s[prob.devices[st_.device].kind]
    ranked = []
    for u in range(st_.first_unit, st_.last_unit + 1):
        saved = prob.activation_bytes[u] - (prob.boundary_bytes[u - 1] if u > st_.first_unit else 0)
        if saved > 0:
            ranked.append((-(saved / fwd[u]) if fwd[u] > 0 else -math.inf, u))
    order = [u for _, u in sorted(ranked)]
    rs = {"none": [0], "all": [len(order)], "auto": range(len(order) + 1)}[prob.recompute]
    return [tuple(sorted(order[:r])) for r in rs]


def brute(prob: Problem) -> tuple[float, dict[tuple[int, ...], float]]:
    """(least T over fitting placements, least T per device order), checking `evaluate` on each."""
    L, n = prob.num_units, len(prob.devices)
    best, per_order = math.inf, {}
    for p in range(1, min(n, L) + 1):
        for cuts in itertools.combinations(range(1, L), p - 1):
            bounds = (0, *cuts, L)
            for order in itertools.permutations(range(n), p):
                plain = tuple(Stage(order[s], bounds[s], bounds[s + 1] - 1) for s in range(p))
                for sets in itertools.product(*(recompute_sets(prob, x) for x in plain)):
                    stages = tuple(Stage(x.device, x.first_unit, x.last_unit, r) for x, r in zip(plain, sets))
                    t, fits = contract_t(prob, stages)
                    ev = evaluate(prob, stages)
                    assert ev.fits == fits and math.isclose(ev.iteration_s, t, rel_tol=REL), (stages, ev, t)
                    if fits:
                        best = min(best, t)
                        per_order[order] = min(per_order.get(order, math.inf), t)
    return best, per_order


def _same(a: float, b: float, rel: float = REL) -> bool:
    return a == b or math.isclose(a, b, rel_tol=rel)


def _check_result(prob: Problem, res: object, want: float, rel: float = REL) -> None:
    got_t = res.iteration_s if res is not None else math.inf  # type: ignore[attr-defined]
    assert _same(got_t, want, rel), (got_t, want)
    if res is not None:  # what the solver reports is what its stages cost under the contract
        t, fits = contract_t(prob, tuple(res.stages))  # type: ignore[attr-defined]
        assert fits and _same(t, got_t, rel), (t, got_t)


@pytest.mark.slow  # ~175 s of CPU (14.6 ms per instance + 2.8 ms to draw it): CI runs it, the quick loop does not
@settings(max_examples=10_000, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(prob=instances())
def test_dp_fixed_order_and_relaxation_agree_with_brute_force(prob: Problem) -> None:
    best, per_order = brute(prob)
    _check_result(prob, solve_exact(prob), best)
    if per_order:
        order = min(per_order, key=per_order.get)  # the optimum's device order
        _check_result(prob, solve_fixed_order(prob, list(order)), best)
        other = sorted(per_order)[0]  # and one more order, against its own best
        _check_result(prob, solve_fixed_order(prob, list(other)), per_order[other])
    bound, realised = relaxed_bound(prob, seed=None, time_limit_s=5.0)
    assert bound <= best * (1 + REL), (bound, best)  # a lower bound (inf only when nothing fits)
    if realised is not None:
        t, fits = contract_t(prob, tuple(realised.stages))
        assert fits and _same(t, realised.iteration_s) and t >= best * (1 - REL), (t, best)


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(prob=instances())
def test_cpsat_agrees_with_brute_force(prob: Problem) -> None:
    best, _ = brute(prob)
    res = solve_cpsat(prob, time_limit_s=20.0, seed=0)  # no hint: an independent answer
    if math.isinf(best):
        assert res.status == "INFEASIBLE", res
        return
    assert res.status == "OPTIMAL", res
    _check_result(prob, res, best, REL_CPSAT)


def simulated_t(prob: Problem, stages: tuple[Stage, ...]) -> float:
    """The event simulator (`schedule.simulate`, not `evaluate`'s replay) over the contract's stage costs."""
    ev = evaluate(prob, stages, objective="estimate")  # F, B, C and S as `contract_t` checks them
    costs = SimCosts(fwd_s=tuple(c.fwd_s for c in ev.stages), bwd_s=tuple(c.bwd_s for c in ev.stages),
                     send_s=tuple(c.send_s for c in ev.stages[:-1]), step_s=tuple(c.step_s for c in ev.stages))
    return simulate(one_f_one_b(len(stages), prob.microbatches), costs).iteration_s


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(prob=schedule_instances())
def test_solve_brackets_the_enumerated_schedule_optimum(prob: Problem) -> None:
    """Issue 17: under the schedule objective `solve` answers T = the simulation of its stages, and
    its bound <= the enumerated optimum <= its T (bound and verify; exact only when they meet)."""
    best = math.inf
    for stages in all_placements(prob):
        for choice in recompute_choices(prob, stages):
            ev = evaluate(prob, choice)
            assert _same(ev.iteration_s, simulated_t(prob, choice)), (choice, ev)
            if ev.fits:
                best = min(best, ev.iteration_s)
    if math.isinf(best):
        with pytest.raises(InfeasibleError):
            solve(prob)
        return
    sol = solve(prob)
    assert _same(sol.iteration_s, simulated_t(prob, sol.stages)) and evaluate(prob, sol.stages).fits
    assert sol.bound_s <= best * (1 + REL) and best <= sol.iteration_s * (1 + REL), (sol, best)
    assert (sol.status == "OPTIMAL") == (sol.bound_s >= sol.iteration_s * (1 - 1e-9)), sol


@settings(max_examples=500, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(prob=instances(), slack=st.sampled_from((1.0, 1.3)), gap=st.sampled_from((0.0, 0.01, 0.1)))
def test_lagrangian_bound_is_a_lower_bound(prob: Problem, slack: float, gap: float) -> None:
    """`lagrange_bound` never exceeds the brute-force optimum, from the optimum or a worse T."""
    best, _ = brute(prob)
    if math.isinf(best):
        return
    res = lagrange_bound(prob, best_s=best * slack, floor_s=bottleneck_floor(prob), time_limit_s=0.5,
                         target_gap=gap)
    assert res.bound_s <= best * (1 + REL), (res, best)
    assert bottleneck_floor(prob) * (prob.microbatches - 1) <= best * (1 + REL)


@st.composite
def offload_instances(draw: st.DrawFn) -> Problem:
    """`instances` with the optimizer-offload lever (never / auto / all): host figures per card, some
    cards without any (they cannot offload), state large enough that moving it matters."""
    prob = draw(instances())
    devs = tuple(replace(d, host_link_bytes_s=link, host_memory_bytes_s=link and draw(st.sampled_from((2.0, 50.0))))
                 for d in prob.devices for link in [draw(st.sampled_from((0.0, 1.0, 4.0, 20.0)))])
    state = tuple(6 * s for s in prob.state_bytes)
    return replace(prob, devices=devs, state_bytes=state, grad_bytes=tuple(draw(st.integers(0, s // 3)) for s in state),
                   tied=tuple(replace(t, state_bytes=4 * t.state_bytes) for t in prob.tied), offload_rates=TEST_RATES,
                   offload=draw(st.sampled_from(("auto", "auto", "all"))))


def brute_levers(prob: Problem) -> tuple[float, dict[tuple[int, ...], float]]:
    """(least T_est, least per device order) over placements x recompute x offload choices (`evaluate`)."""
    best, per_order = math.inf, {}
    for placement in all_placements(prob):
        order = tuple(s.device for s in placement)
        for choice in recompute_choices(prob, placement):
            ev = evaluate(prob, choice)
            if ev.fits:
                best = min(best, ev.iteration_s)
                per_order[order] = min(per_order.get(order, math.inf), ev.iteration_s)
    return best, per_order


@settings(max_examples=600, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(prob=offload_instances())
def test_offload_walk_and_relaxation_agree_with_brute_force(prob: Problem) -> None:
    """Issue 12 item 3 with the offload lever: the DP and the fixed-order DP inside the tail walk
    (`offload_walk`) equal the enumeration, the relaxation stays a lower bound.  Before the fix the
    cap walk ranked by T_est (tail included) and skipped a tail-free optimum, and the relaxation's
    bound exceeded the optimum (its DP priced tails without the walk; ``all`` forced a tail on
    cards the relaxation had made able)."""
    best, per_order = brute_levers(prob)
    exact = tail_walk(prob, lambda p, _: solve_exact(p))
    assert _same(exact.iteration_s if exact else math.inf, best), (exact, best)
    if exact is not None:
        assert _same(evaluate(prob, exact.stages).iteration_s, exact.iteration_s) and evaluate(prob, exact.stages).fits
        other = sorted(per_order)[0]
        fixed = tail_walk(prob, lambda p, _: solve_fixed_order(p, list(other)))
        assert _same(fixed.iteration_s if fixed else math.inf, per_order[other]), (fixed, per_order[other])
    bound, realised = relaxed_bound(prob, seed=None, time_limit_s=5.0)
    assert bound <= best * (1 + REL), (bound, best)
    if realised is not None:
        ev = evaluate(prob, realised.stages)
        assert ev.fits and _same(ev.iteration_s, realised.iteration_s) and ev.iteration_s >= best * (1 - REL)


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(prob=schedule_instances(), offload=st.sampled_from(("never", "never", "auto", "all")))
def test_pace_bound_holds_for_every_placement_and_the_walk_bounds_the_optimum(prob: Problem, offload: str) -> None:
    """Issue 12 item 3 (`solvers/schedule_bound.py`): the replayed schedule T >= R_0 + G + S_0 for every
    placement and lever choice, and the walk's bound plus the least first step <= the enumerated optimum."""
    if offload != "never":
        prob = replace(  # every card may offload: 2 of the 6x state bytes per gradient byte leave it
            prob, devices=tuple(replace(d, host_link_bytes_s=4.0, host_memory_bytes_s=8.0) for d in prob.devices),
            offload=offload, offload_rates=TEST_RATES, state_bytes=tuple(6 * s for s in prob.state_bytes),
            grad_bytes=tuple(s * 2 for s in prob.state_bytes))
    best = math.inf
    for placement in all_placements(prob):
        for choice in recompute_choices(prob, placement):
            ev = evaluate(prob, choice)
            r0, g = pace_terms(prob, choice)
            assert r0 + g + ev.stages[0].step_s <= ev.iteration_s * (1 + REL), (choice, r0, g, ev)
            if ev.fits:
                best = min(best, ev.iteration_s)
    if math.isinf(best):
        return
    walk = schedule_walk(prob)
    first_step = first_step_floor(prob)
    assert walk.bound_s + first_step <= best * (1 + REL), (walk, first_step, best)
