"""The iteration time of a schedule without its events: `simulate`'s recurrence, compiled once per shape.

`hetpipe.schedule.simulate` advances ranks in an order fixed by the schedule alone: a rank runs
until it reaches a RECV whose SEND has not been issued yet, so which action is evaluated next
never depends on the costs.  `compile_schedule` records that order once per (schedule, p, m) as
a flat program; `replay_iteration_s` evaluates the same max-plus recurrence on it
(F, B and STEP occupy their rank; a SEND starts when it is reached and its link direction is
free, FIFO, and lasts ``send_s[cut]``; a RECV waits for the transfer's end), with no event
records, labels or dictionaries.  It equals ``simulate(...).iteration_s`` exactly (the same
float operations in the same order; tests/test_objective.py) and is what `problem.evaluate`
calls for every placement it prices.

Example:
    >>> replay_iteration_s("1f1b", 2, 4, fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), send_s=(0.0,), step_s=(0.5, 0.0))
    15.5
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache
from typing import Sequence

from hetpipe.schedule.actions import Op
from hetpipe.schedule.builders import make_schedule
from hetpipe.schedule.interleaved import chunks_of

#: Instruction codes of a compiled program (rank, code, a, b).
_COMPUTE_F, _COMPUTE_B, _COMPUTE_STEP, _SEND, _RECV, _COMPUTE_W = 0, 1, 2, 3, 4, 5
#: Action codes of `compile_one_f_one_b`'s lists (not in programs).
_RECV_F, _SEND_F, _RECV_B, _SEND_B = 10, 11, 12, 13


@lru_cache(maxsize=256)
def compile_schedule(name: str, num_stages: int, num_microbatches: int) -> tuple[tuple[int, int, int, int], ...]:
    """The program of schedule `name`: (rank, code, a, b) in the simulator's evaluation order.

    For a SEND, ``a`` is the link direction (2 * cut, + 1 for the gradient direction) and ``b``
    the message slot; for a RECV, ``a`` is the slot it waits for.  Slots number the messages.
    """
    if name == "1f1b":
        return compile_one_f_one_b(num_stages, num_microbatches)
    return compile_actions(make_schedule(name, num_stages, num_microbatches), num_stages)


def compile_actions(schedule: dict, num_stages: int) -> tuple[tuple[int, int, int, int], ...]:
    """`compile_schedule`'s walk over the action lists of `schedule` (rank -> actions).

    Messages are keyed by the (virtual) stage, so interleaved lists compile too: a SEND's ``a`` is
    then 2 * virtual cut (+ 1 for gradients), and a compute instruction's ``a`` is its stage - rank
    (c p for chunk c; 0 in every one-stage-per-rank list, as `compile_one_f_one_b` writes it).
    """
    slots: dict[tuple[Op, int, int | None], int] = {}
    done, waiting, program = [0] * num_stages, {}, []
    ready = list(range(num_stages))
    while ready:
        rank = ready.pop(0)
        actions, i = schedule[rank], done[rank]
        while i < len(actions):
            a = actions[i]
            if a.op is Op.RECV_F or a.op is Op.RECV_B:
                key = (a.op, a.stage, a.microbatch)
                if key not in slots:
                    waiting[key] = rank
                    break
                program.append((rank, _RECV, slots[key], 0))
            elif a.op is Op.SEND_F or a.op is Op.SEND_B:
                forward = a.op is Op.SEND_F
                dst = a.stage + 1 if forward else a.stage - 1
                key = (Op.RECV_F if forward else Op.RECV_B, dst, a.microbatch)
                slots[key] = len(slots)
                cut = a.stage if forward else dst
                program.append((rank, _SEND, 2 * cut + (0 if forward else 1), slots[key]))
                if key in waiting:
                    ready.append(waiting.pop(key))
            else:
                code = {Op.F: _COMPUTE_F, Op.B: _COMPUTE_B, Op.STEP: _COMPUTE_STEP, Op.W: _COMPUTE_W}[a.op]
                program.append((rank, code, a.stage - rank, 0))  # 0 but for an interleaved chunk: c p
            i += 1
        done[rank] = i
    assert all(done[r] == len(schedule[r]) for r in range(num_stages)), "schedule deadlocks"
    return tuple(program)


def _one_f_one_b_codes(s: int, p: int, m: int) -> list[tuple[int, int]]:
    """Rank s's 1F1B list as (code, micro-batch), codes of `compile_one_f_one_b`, in `builders.one_f_one_b`'s order."""
    fwd = [c for c, on in ((_RECV_F, s > 0), (_COMPUTE_F, True), (_SEND_F, s < p - 1)) if on]
    bwd = [c for c, on in ((_RECV_B, s < p - 1), (_COMPUTE_B, True), (_SEND_B, s > 0)) if on]
    warmup = min(p - s - 1, m)
    out = [(c, mb) for mb in range(warmup) for c in fwd]
    for i in range(m - warmup):
        out += [(c, warmup + i) for c in fwd] + [(c, i) for c in bwd]
    out += [(c, mb) for mb in range(m - warmup, m) for c in bwd]
    return out + [(_COMPUTE_STEP, 0)]


def compile_one_f_one_b(p: int, m: int) -> tuple[tuple[int, int, int, int], ...]:
    """`compile_schedule` for 1F1B without building its actions: the same walk over the same lists with
    integer keys (seconds -> a fraction of one at 1,024 cards; tests/test_objective.py checks they agree)."""
    lists = [_one_f_one_b_codes(s, p, m) for s in range(p)]
    slot = [-1] * (2 * p * m)  # (destination rank, gradient?, micro-batch) -> message slot
    waiting = [-1] * (2 * p * m)
    done, program, ready, count = [0] * p, [], deque(range(p)), 0
    while ready:
        rank = ready.popleft()
        actions, i = lists[rank], done[rank]
        while i < len(actions):
            code, mb = actions[i]
            if code == _RECV_F or code == _RECV_B:
                key = (2 * rank + (code == _RECV_B)) * m + mb
                if slot[key] < 0:
                    waiting[key] = rank
                    break
                program.append((rank, _RECV, slot[key], 0))
            elif code == _SEND_F or code == _SEND_B:
                forward = code == _SEND_F
                dst = rank + 1 if forward else rank - 1
                key = (2 * dst + (not forward)) * m + mb
                slot[key], count = count, count + 1
                program.append((rank, _SEND, 2 * (rank if forward else dst) + (not forward), slot[key]))
                if waiting[key] >= 0:
                    ready.append(waiting[key])
                    waiting[key] = -1
            else:
                program.append((rank, code, 0, 0))
            i += 1
        done[rank] = i
    assert all(done[r] == len(lists[r]) for r in range(p)), "schedule deadlocks"
    return tuple(program)


def replay_iteration_s(name: str, num_stages: int, num_microbatches: int, *, fwd_s: Sequence[float],
                       bwd_s: Sequence[float], send_s: Sequence[float], step_s: Sequence[float] = (),
                       bwd_weight_s: Sequence[float] = ()) -> float:
    """Seconds from the first action to the last rank's step (module docstring); `step_s` () = 0.

    `bwd_weight_s` is the W part of `bwd_s` on ranks whose list splits the backward (`SimCosts`).
    """
    name = name.strip().lower()
    program = compile_schedule(name, num_stages, num_microbatches)
    if chunks_of(name) > 1:
        return replay_virtual_s(program, num_stages, num_microbatches, fwd_s=fwd_s, bwd_s=bwd_s, send_s=send_s,
                                step_s=step_s, bwd_weight_s=bwd_weight_s)
    steps = tuple(step_s) or (0.0,) * num_stages
    weights = tuple(bwd_weight_s) or (0.0,) * num_stages
    split = _split_ranks(name, num_stages, num_microbatches)
    # indexed by code: F, B (the input part where split), STEP, -, -, W
    dur = [(float(f), float(b) - float(w) if cut else float(b), float(s), 0.0, 0.0, float(w))
           for f, b, s, w, cut in zip(fwd_s, bwd_s, steps, weights, split)]
    one_way = [float(c) for c in send_s]
    clock = [0.0] * num_stages
    link_free = [0.0] * (2 * max(num_stages - 1, 1))
    arrival = [0.0] * (2 * num_stages * num_microbatches)
    for rank, code, a, b in program:
        if code == _RECV:
            if arrival[a] > clock[rank]:
                clock[rank] = arrival[a]
        elif code == _SEND:
            start = clock[rank] if clock[rank] > link_free[a] else link_free[a]
            end = start + one_way[a >> 1]
            link_free[a] = end
            arrival[b] = end
        else:
            clock[rank] += dur[rank][code]
    return max(clock)



@lru_cache(maxsize=256)
def _split_ranks(name: str, num_stages: int, num_microbatches: int) -> tuple[bool, ...]:
    """Per rank: does its list of schedule `name` split the backward into B and W?"""
    ranks = {rank for rank, code, _, _ in compile_schedule(name, num_stages, num_microbatches) if code == _COMPUTE_W}
    return tuple(r in ranks for r in range(num_stages))


def replay_virtual_s(program: Sequence[tuple[int, int, int, int]], num_ranks: int, num_microbatches: int, *,
                     fwd_s: Sequence[float], bwd_s: Sequence[float], send_s: Sequence[float],
                     step_s: Sequence[float] = (), bwd_weight_s: Sequence[float] = ()) -> float:
    """`replay_iteration_s` of an interleaved program: costs per virtual stage (v p) and virtual cut
    (v p - 1); a rank's STEP lasts its chunks' steps together; the cuts c and c + p share the
    physical link direction they cross (rank c % p -> (c + 1) % p, the wrap-around p-1 -> 0 included),
    one transfer at a time, as in `hetpipe.schedule.simulate`.
    """
    virtual = len(fwd_s)
    steps = tuple(step_s) or (0.0,) * virtual
    weights = tuple(bwd_weight_s) or (0.0,) * virtual
    split = {rank for rank, code, _, _ in program if code == _COMPUTE_W}
    dur = [(float(f), float(b) - float(w) if s % num_ranks in split else float(b), 0.0, 0.0, 0.0, float(w))
           for s, (f, b, w) in enumerate(zip(fwd_s, bwd_s, weights))]
    step_of_rank = [sum(float(steps[s]) for s in range(r, virtual, num_ranks)) for r in range(num_ranks)]
    one_way = [float(c) for c in send_s]

    def direction(a: int) -> int:  # physical (src rank, dst rank) of message direction a, as one index
        cut, grad = a >> 1, a & 1
        src, dst = cut % num_ranks, (cut + 1) % num_ranks
        return dst * num_ranks + src if grad else src * num_ranks + dst

    phys = [direction(a) for a in range(2 * max(virtual - 1, 1))]
    clock = [0.0] * num_ranks
    link_free = [0.0] * (num_ranks * num_ranks)
    arrival = [0.0] * (2 * virtual * num_microbatches)
    for rank, code, a, b in program:
        if code == _RECV:
            if arrival[a] > clock[rank]:
                clock[rank] = arrival[a]
        elif code == _SEND:
            d = phys[a]
            start = clock[rank] if clock[rank] > link_free[d] else link_free[d]
            link_free[d] = arrival[b] = start + one_way[a >> 1]
        elif code == _COMPUTE_STEP:
            clock[rank] += step_of_rank[rank]
        else:
            clock[rank] += dur[rank + a][code]
    return max(clock)
