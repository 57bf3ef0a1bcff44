"""Interleaved lists wait for their sends one RECV behind (issue 17 item 2): deadlock-free, and the
memory model holds a send frame until that wait, not until STEP."""

from __future__ import annotations

import pytest

from hetpipe.errors import ScheduleError
from hetpipe.schedule.builders import make_schedule, rank_actions
from hetpipe.schedule.held_virtual import INTERLEAVED_SEND_LAG, replay_held_by_stage
from hetpipe.schedule.interleaved import interleaved_name
from hetpipe.schedule.validate import validate_schedule

CASES = [(p, v, m) for p in (2, 3, 4) for v in (2, 3, 4) for m in (p, 2 * p, 4 * p)]


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (3, 2, 6), (2, 3, 4)])
def test_waiting_at_every_recv_deadlocks_one_behind_does_not(p: int, v: int, m: int) -> None:
    sched = make_schedule(interleaved_name(v), p, m)
    with pytest.raises(ScheduleError, match="deadlock when each RECV waits"):
        validate_schedule(sched, num_stages=p, num_microbatches=m, sends_wait_at_recv=True)
    validate_schedule(sched, num_stages=p, num_microbatches=m, sends_wait_at_recv=True,
                      send_wait_lag=INTERLEAVED_SEND_LAG)


def test_one_behind_is_deadlock_free_up_to_four_ranks_and_chunks() -> None:
    for p, v, m in CASES:
        validate_schedule(make_schedule(interleaved_name(v), p, m), num_stages=p, num_microbatches=m,
                          sends_wait_at_recv=True, send_wait_lag=INTERLEAVED_SEND_LAG)


def _send_frames(counts: tuple) -> int:
    return sum(c.in_grad_frames + c.out_frames for c in counts)


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (2, 3)])
def test_held_send_frames_are_bounded_by_the_lag_not_the_step(p: int, v: int) -> None:
    """Lag 1 holds the sends posted since the last-but-one receive: as many at 8p micro-batches as at
    2p; waiting only at STEP (a lag past every receive) holds every frame sent so far."""
    def peaks(m: int) -> tuple[int, int, int]:
        acts = rank_actions(interleaved_name(v), p, m, 0)
        stages = tuple(range(0, p * v, p))
        lagged = replay_held_by_stage(acts, stages=stages, prefetch=0, send_lag=INTERLEAVED_SEND_LAG)
        at_step = replay_held_by_stage(acts, stages=stages, prefetch=0, send_lag=len(acts))
        sends = sum(1 for a in acts if a.op.name.startswith("SEND"))
        return max(map(_send_frames, lagged)), max(map(_send_frames, at_step)), sends

    few, all_few, sends_few = peaks(2 * p)
    many, all_many, sends_many = peaks(8 * p)
    assert (all_few, all_many) == (sends_few, sends_many)  # every send held until STEP
    assert few == many < all_few


def test_the_start_up_agreement_lets_interleaved_lists_wait_only_with_their_lag() -> None:
    from hetpipe.runtime.execute.agreement import sends_may_wait_at_recv

    sched = make_schedule(interleaved_name(2), 2, 4)
    lag = INTERLEAVED_SEND_LAG
    assert sends_may_wait_at_recv(sched, num_stages=2, microbatches=4, chunks=2, send_wait_lag=lag)
    assert not sends_may_wait_at_recv(sched, num_stages=2, microbatches=4, chunks=2)  # m > p: deadlock at lag 0
    broken = {**sched, 1: sched[1][::-1]}
    assert not sends_may_wait_at_recv(broken, num_stages=2, microbatches=4, chunks=2, send_wait_lag=lag)
