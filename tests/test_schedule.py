"""Schedules as data: generators are valid, broken ones are rejected; the simulator matches known answers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetpipe.errors import ScheduleError
from hetpipe.schedule.actions import Action, Op
from hetpipe.schedule.builders import (
    format_grid,
    format_schedule,
    gpipe,
    make_schedule,
    one_f_one_b,
    parse_schedule,
    validate_schedule,
)
from hetpipe.schedule.simulate import SimCosts, simulate


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 24), name=st.sampled_from(["gpipe", "1f1b"]))
def test_generated_schedules_are_valid(p, m, name):
    sched = make_schedule(name, p, m)
    validate_schedule(sched, num_stages=p, num_microbatches=m)
    for rank, actions in sched.items():
        assert actions[-1] == Action(rank, Op.STEP)
        assert sum(a.op is Op.F for a in actions) == m


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 8), m=st.integers(1, 24), name=st.sampled_from(["gpipe", "1f1b"]))
def test_generated_schedules_survive_sends_that_wait_for_their_receiver(p, m, name):
    """The executor's gloo mode (each RECV first waits for the rank's earlier sends) is safe for both."""
    validate_schedule(make_schedule(name, p, m), num_stages=p, num_microbatches=m, sends_wait_at_recv=True)


def test_gpipe_stages_before_a_1f1b_last_stage_deadlock_only_when_sends_wait():
    """Valid with asynchronous sends, but rank 2 waits at 2RECV_F1 for 2SEND_B0 to be received while
    rank 1 (GPipe) waits at 1RECV_F3 for 1SEND_F2, which rank 2 has not reached: the executor must not
    turn the mode on for a mix, which is why it agrees on the schedule across ranks first."""
    sched = gpipe(3, 4)
    sched[2] = one_f_one_b(3, 4)[2]
    validate_schedule(sched, num_stages=3, num_microbatches=4)
    with pytest.raises(ScheduleError, match=r"deadlock when each RECV waits.*1RECV_F3.*2RECV_F1"):
        validate_schedule(sched, num_stages=3, num_microbatches=4, sends_wait_at_recv=True)


def test_swapped_backward_before_forward_is_rejected_with_rank():
    sched = one_f_one_b(2, 2)
    acts = sched[1]
    i, j = acts.index(Action(1, Op.F, 0)), acts.index(Action(1, Op.B, 0))
    acts[i], acts[j] = acts[j], acts[i]
    with pytest.raises(ScheduleError, match="rank 1"):
        validate_schedule(sched, num_stages=2, num_microbatches=2)


def test_many_problems_are_one_line_with_a_count():
    sched = gpipe(3, 8)
    for rank in (1, 2):
        sched[rank] = [a for a in sched[rank] if a.op != Op.RECV_F]
    with pytest.raises(ScheduleError) as err:
        validate_schedule(sched, num_stages=3, num_microbatches=8)
    assert "\n" not in str(err.value) and "more" in str(err.value), str(err.value)


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


def _edited(name: str, p: int, m: int, rank: int, text: str) -> dict[int, list[Action]]:
    """`name`'s (p, m) schedule with rank ``rank``'s list replaced by ``text`` (``format_schedule`` words)."""
    sched = make_schedule(name, p, m)
    sched[rank] = [Action.parse(w) for w in text.split()]
    return sched


# Hand-broken schedules (issue #4, acceptance 2): each must be rejected naming the offending rank and step.
BROKEN = {
    "deadlock": (_edited("1f1b", 3, 2, 0, "0F0 0F1 0SEND_F0 0RECV_B0 0SEND_F1 0B0 0RECV_B1 0B1 0STEP"),
                 3, 2, r"deadlock: rank 0, step 3 \(0RECV_B0\) waits for 1SEND_B0 from rank 1, which is blocked "
                       r"itself at rank 1, step 3 \(1RECV_F1\)"),
    "fifo order": (_edited("gpipe", 2, 2, 1, "1RECV_F1 1F1 1RECV_F0 1F0 1B0 1SEND_B0 1B1 1SEND_B1 1STEP"),
                   2, 2, r"link 0->1 \(activations\) .* message #0 is micro-batch 0 sent at rank 0, step 1 "
                         r"\(0SEND_F0\), but rank 1, step 0 \(1RECV_F1\) expects micro-batch 1"),
    "duplicate": (_edited("gpipe", 2, 2, 0, "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0F1 0STEP"),
                  2, 2, r"rank 0, step 8 \(0F1\): duplicate of step 2"),
    "step not last": (_edited("gpipe", 2, 1, 0, "0STEP 0F0 0SEND_F0 0RECV_B0 0B0"),
                      2, 1, r"rank 0, step 0 \(0STEP\): STEP must be the last action"),
    "wrong stage": (_edited("gpipe", 3, 1, 1, "1RECV_F0 1F0 2SEND_F0 1RECV_B0 1B0 1SEND_B0 1STEP"),
                    3, 1, r"rank 1, step 2 \(2SEND_F0\): names stage 2, but rank 1 runs stage 1 only"),
    "no peer": (_edited("gpipe", 2, 1, 1, "1RECV_F0 1F0 1SEND_F0 1B0 1SEND_B0 1STEP"),
                2, 1, r"rank 1, step 2 \(1SEND_F0\): stage 1 has no next stage"),
    "micro-batch range": (_edited("1f1b", 2, 2, 0, "0F0 0SEND_F0 0F7 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0STEP"),
                          2, 2, r"rank 0, step 2 \(0F7\): micro-batch 7 is outside 0..1"),
    "send before its forward": (_edited("1f1b", 2, 1, 0, "0SEND_F0 0F0 0RECV_B0 0B0 0STEP"),
                                2, 1, r"rank 0, step 0 \(0SEND_F0\) comes before 0F0 \(step 1\)"),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_hand_broken_schedules_name_rank_and_step(name):
    sched, p, m, message = BROKEN[name]
    with pytest.raises(ScheduleError, match=message):
        validate_schedule(sched, num_stages=p, num_microbatches=m)


def test_text_forms_round_trip_and_the_grid_shows_1f1b_in_flight_limit():
    for name in ("gpipe", "1f1b"):
        sched = make_schedule(name, 4, 6)
        assert parse_schedule(format_schedule(sched)) == sched
    # Stage s starts min(p - s, m) forwards before its first backward: p - s - 1 warm-up ones plus the
    # steady state's first forward (Narayanan et al., SC'21).
    for rank, row in enumerate(format_grid(one_f_one_b(4, 6)).splitlines()):
        cells = [c for c in row.split(":")[1].split() if c != "."]
        assert cells.index("B0") == min(4 - rank, 6), row
