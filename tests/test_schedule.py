"""Schedules as data: generators are valid, broken ones are rejected; the simulator matches known answers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetpipe.errors import ScheduleError
from hetpipe.runtime.actions import Action, Op
from hetpipe.runtime.schedule import gpipe, make_schedule, one_f_one_b, validate_schedule
from hetpipe.runtime.simulate import SimCosts, simulate


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 24), name=st.sampled_from(["gpipe", "1f1b"]))
def test_generated_schedules_are_valid(p, m, name):
    sched = make_schedule(name, p, m)
    validate_schedule(sched, num_stages=p, num_microbatches=m)
    for rank, actions in sched.items():
        assert actions[-1] == Action(rank, Op.STEP)
        assert sum(a.op is Op.F for a in actions) == m


def test_swapped_backward_before_forward_is_rejected_with_rank():
    sched = one_f_one_b(2, 2)
    acts = sched[1]
    i, j = acts.index(Action(1, Op.F, 0)), acts.index(Action(1, Op.B, 0))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ScheduleError, match="rank 1"):
        validate_schedule(sched, num_stages=2, num_microbatches=2)


def test_missing_receive_is_rejected():
    sched = gpipe(2, 2)
    sched[1].remove(Action(1, Op.RECV_F, 1))
    with pytest.raises(ScheduleError, match="rank 1"):
        validate_schedule(sched, num_stages=2, num_microbatches=2)


@pytest.mark.parametrize("p, m", [(1, 4), (2, 4), (4, 8), (3, 3)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_uniform_stages_zero_comm_take_m_plus_p_minus_1_slots(name, p, m):
    f, b = 1.0, 2.0
    res = simulate(make_schedule(name, p, m), SimCosts(fwd_s=(f,) * p, bwd_s=(b,) * p, send_s=(0.0,) * (p - 1)))
    assert res.iteration_s == pytest.approx((m + p - 1) * (f + b))
    assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    expect = [min(p - s, m) for s in range(p)] if name == "1f1b" else [m] * p
    assert list(res.peak_in_flight_microbatches) == expect
