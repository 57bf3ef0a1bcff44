"""Issue 17 item 2: ZB-H1 (backward split into B and W) as data, simulated, replayed and held.

* the builder's lists are valid (also when each RECV first waits for the rank's sends), every
  micro-batch's W comes after its B, and a list without some W or with W before B is refused;
* uniform stages, free links, m >= p: ``T = m (F + B) + (p - 1)(F + B_in - W)`` with B = B_in + W
  (Qi et al. 2023, §3.1: the bubble shrinks from 1F1B's (p-1)(F+B)), and every stage holds at most
  min(p, m) micro-batches: the pipeline's peak is 1F1B's;
* the compiled replay equals the event simulator on random stages with weight shares;
* the held moments: micro-batches stay in flight until their W;
* `evaluate` under ``Problem.schedule = "zb-h1"`` replays the split lists.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetpipe.cost_models.backward_split import WEIGHT_GRAD_SHARE
from hetpipe.errors import ScheduleError
from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage, evaluate
from hetpipe.schedule.actions import Action, Op
from hetpipe.schedule.builders import make_schedule, one_f_one_b, validate_schedule, zb_h1
from hetpipe.schedule.held import replay_held, stage_held_terms
from hetpipe.schedule.replay import replay_iteration_s
from hetpipe.schedule.simulate import SimCosts, simulate


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 24))
def test_zb_h1_lists_are_valid_and_split_every_backward(p, m):
    sched = zb_h1(p, m)
    validate_schedule(sched, num_stages=p, num_microbatches=m, sends_wait_at_recv=True)
    for rank, actions in sched.items():
        order = [a.op for a in actions if a.op in (Op.F, Op.B, Op.W)]
        assert order.count(Op.W) == order.count(Op.B) == order.count(Op.F) == m
        # stage s defers at most s W's behind its B's (none on stage 0)
        pending = 0
        for op in order:
            pending += (op is Op.B) - (op is Op.W)
            assert pending <= rank + 1 and (op is not Op.F or pending <= rank)


def test_a_missing_or_early_w_is_refused_naming_rank_and_step():
    sched = zb_h1(2, 2)
    sched[1].remove(Action(1, Op.W, 1))
    with pytest.raises(ScheduleError, match=r"rank 1 has no 1W1; fix: add it after 1B1"):
        validate_schedule(sched, num_stages=2, num_microbatches=2)
    sched = zb_h1(2, 2)
    acts = sched[0]
    i, j = acts.index(Action(0, Op.B, 0)), acts.index(Action(0, Op.W, 0))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ScheduleError, match=r"rank 0, step \d+ \(0W0\) comes before 0B0"):
        validate_schedule(sched, num_stages=2, num_microbatches=2)


@pytest.mark.parametrize("p, m", [(2, 2), (3, 4), (4, 8), (4, 16), (6, 6)])
def test_uniform_stages_lose_only_f_plus_b_minus_w_per_stage(p, m):
    f, b, w = 1.0, 2.0, 1.0
    costs = SimCosts(fwd_s=(f,) * p, bwd_s=(b,) * p, send_s=(0.0,) * (p - 1), bwd_weight_s=(w,) * p)
    zb, base = simulate(zb_h1(p, m), costs), simulate(one_f_one_b(p, m), costs)
    assert zb.iteration_s == pytest.approx(m * (f + b) + (p - 1) * (f + (b - w) - w))
    assert base.iteration_s == pytest.approx((m + p - 1) * (f + b))
    assert max(zb.peak_in_flight_microbatches) == max(base.peak_in_flight_microbatches) == min(p, m)


def test_a_list_without_w_ignores_the_weight_share():
    costs = SimCosts(fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), send_s=(0.5,), bwd_weight_s=(1.0, 1.0))
    plain = SimCosts(fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), send_s=(0.5,))
    assert simulate(one_f_one_b(2, 4), costs).iteration_s == simulate(one_f_one_b(2, 4), plain).iteration_s


def test_replay_equals_the_event_simulator_with_split_backwards() -> None:
    rng = random.Random(2311)
    for _ in range(300):
        p, m = rng.randint(1, 6), rng.randint(1, 12)
        f = [rng.uniform(0.0, 1.0) for _ in range(p)]
        b = [rng.uniform(0.0, 2.0) for _ in range(p)]
        w = [x * rng.uniform(0.0, 1.0) for x in b]
        c = [rng.choice((0.0, rng.uniform(0.0, 3.0))) for _ in range(p - 1)]
        s = [rng.uniform(0.0, 1.0) for _ in range(p)]
        for name in ("zb-h1", "1f1b"):
            want = simulate(make_schedule(name, p, m), SimCosts(tuple(f), tuple(b), tuple(c), tuple(s), tuple(w)))
            got = replay_iteration_s(name, p, m, fwd_s=f, bwd_s=b, send_s=c, step_s=s, bwd_weight_s=w)
            assert got == want.iteration_s


def test_a_micro_batch_is_held_until_its_w():
    for p in range(1, 6):
        for s in range(p):
            for m in range(1, 9):
                actions = zb_h1(p, m)[s]
                counts = [c for c in replay_held(actions, prefetch=0) if not c.backward]  # after each action
                inflight = 0
                for a, c in zip(actions, counts):
                    inflight += (a.op is Op.F) - (a.op is Op.W)
                    assert c.microbatches == inflight
                # the pipeline's peak stays 1F1B's: min(p, m) micro-batches
                assert max(t.microbatches for t in stage_held_terms(p, s, m, schedule="zb-h1")) <= min(p, m)


def _two_stage_problem(schedule: str) -> Problem:
    inf = float("inf")
    return Problem(fwd_s={"a": (1.0, 1.0, 1.0)}, bwd_s={"a": (2.0, 2.0, 2.0)}, state_bytes=(10, 0, 10),
                   activation_bytes=(1, 1, 1), boundary_bytes=(0, 0, 0),
                   devices=(DeviceSlot("d0", "a", "n", 1000), DeviceSlot("d1", "a", "n", 1000)),
                   bandwidth_bytes_s=((inf, inf), (inf, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)),
                   microbatches=4, schedule=schedule)


def test_evaluate_replays_the_problems_schedule_with_the_weight_share():
    stages = (Stage(0, 0, 1), Stage(1, 2, 2))  # unit 1 has no parameters: no W
    zb = evaluate(_two_stage_problem("zb-h1"), stages)
    assert [c.bwd_weight_s for c in zb.stages] == [WEIGHT_GRAD_SHARE * 2.0, WEIGHT_GRAD_SHARE * 2.0]
    want = replay_iteration_s("zb-h1", 2, 4, fwd_s=(2.0, 1.0), bwd_s=(4.0, 2.0), send_s=(0.0,),
                              bwd_weight_s=(1.0, 1.0))
    assert zb.iteration_s == want
    assert zb.iteration_s < evaluate(_two_stage_problem("1f1b"), stages).iteration_s
    with pytest.raises(ValueError, match="Problem.schedule is 'zb'"):
        _two_stage_problem("zb")
