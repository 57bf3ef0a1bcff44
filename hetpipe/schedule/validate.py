"""The pure schedule validator both executors trust (`validate_schedule`), and the check one
rank can run on its own action list (`check_actions`).

Semantics are `hetpipe.schedule.builders`': a SEND completes locally, a RECV blocks until
the peer has issued the matching SEND, each (src, dst, kind) pair is a FIFO channel.

Example:
    >>> from hetpipe.schedule.builders import gpipe
    >>> validate_schedule(gpipe(3, 4), num_stages=3, num_microbatches=4)
    >>> bad = gpipe(2, 1)
    >>> bad[1] = bad[1][::-1]
    >>> validate_schedule(bad, num_stages=2, num_microbatches=1)
    Traceback (most recent call last):
    ...
    hetpipe.errors.ScheduleError: invalid schedule: rank 1, step 0 (1STEP): STEP must be the last action; fix: move it to the end
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

from hetpipe.errors import ScheduleError
from hetpipe.schedule.actions import Action, Op, Schedule

# Key of one action on one rank: (op, stage, micro-batch); STEP has micro-batch None.  The stage is
# the virtual stage (`hetpipe.schedule.interleaved`): rank r runs stages r, r + p, ..., one per chunk.
_Key = tuple[Op, int, "int | None"]

_MAX_REPORTED = 6  # problems listed in one error message; the rest are counted
_RECV_OF_SEND = {Op.SEND_F: Op.RECV_F, Op.SEND_B: Op.RECV_B}
_COMPUTE = (Op.F, Op.B, Op.W)
# (earlier, later, why) orderings every rank must respect for each micro-batch.
_LOCAL_ORDER = (
    (Op.RECV_F, Op.F, "the forward needs the received activation"),
    (Op.F, Op.SEND_F, "the send carries the forward's output"),
    (Op.RECV_B, Op.B, "the backward needs the received gradient"),
    (Op.B, Op.SEND_B, "the send carries the backward's input gradient"),
    (Op.F, Op.B, "a backward needs its own forward"),
    (Op.B, Op.W, "the weight gradient follows its input gradient (B)"),
)


def check_sizes(num_stages: int, num_microbatches: int) -> None:
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{name} must be a positive integer, got {value!r}")


def _at(rank: int, step: int, action: object) -> str:
    return f"rank {rank}, step {step} ({action})"


def _raise_if(problems: list[str], what: str = "invalid schedule") -> None:
    if not problems:
        return
    if len(problems) == 1:
        raise ScheduleError(f"{what}: {problems[0]}")
    # One line, like every user error: the first problems joined, then how many more.
    shown = problems[:_MAX_REPORTED]
    more = len(problems) - len(shown)
    tail = f"; ... and {more} more" if more else ""
    raise ScheduleError(f"{what} ({len(problems)} problems): {'; '.join(shown)}{tail}")


def _allowed_ops(stage: int, num_stages: int) -> set[Op]:
    """The ops of (virtual) stage `stage` of `num_stages` (STEP is the rank's, on its first stage)."""
    ops = {Op.F, Op.B, Op.STEP, Op.W}
    if stage > 0:
        ops |= {Op.RECV_F, Op.SEND_B}
    if stage < num_stages - 1:
        ops |= {Op.SEND_F, Op.RECV_B}
    return ops


def _check_shape(schedule: Schedule, num_stages: int) -> list[str]:
    if not isinstance(schedule, dict):
        return [f"a schedule is a dict rank -> list of Action, got {type(schedule).__name__}"]
    problems = []
    missing = sorted(set(range(num_stages)) - set(schedule))
    extra = sorted(set(schedule) - set(range(num_stages)), key=repr)
    if missing:
        problems.append(f"ranks {missing} have no action list; a {num_stages}-stage schedule needs ranks 0..{num_stages - 1}")
    if extra:
        problems.append(f"ranks {extra} are not stages of a {num_stages}-stage pipeline; remove them")
    for rank in sorted(set(schedule) & set(range(num_stages))):
        for step, action in enumerate(schedule[rank]):
            if not isinstance(action, Action):
                problems.append(f"{_at(rank, step, repr(action))}: not an Action; build it with Action.parse('{rank}F0')")
    return problems


def _check_actions(schedule: Schedule, num_stages: int, num_microbatches: int,
                   ranks: Sequence[int] | None = None, chunks: int = 1) -> list[str]:
    problems = []
    virtual = num_stages * chunks
    for rank in range(num_stages) if ranks is None else ranks:
        mine = list(range(rank, virtual, num_stages))
        for step, a in enumerate(schedule[rank]):
            where = _at(rank, step, a)
            if a.stage not in mine or (a.op is Op.STEP and a.stage != rank):
                runs = f"stage {rank}" if chunks == 1 or a.op is Op.STEP else f"stages {mine}"
                problems.append(f"{where}: names stage {a.stage}, but rank {rank} runs {runs} only; fix: use {runs}")
            elif a.op not in _allowed_ops(a.stage, virtual):
                peer = "previous" if a.op in (Op.RECV_F, Op.SEND_B) else "next"
                problems.append(f"{where}: stage {rank} has no {peer} stage to talk to; fix: remove it")
            elif a.op is Op.STEP and a.microbatch is not None:
                problems.append(f"{where}: STEP takes no micro-batch; fix: use {rank}STEP")
            elif a.op is not Op.STEP and not (isinstance(a.microbatch, int) and 0 <= a.microbatch < num_microbatches):
                problems.append(f"{where}: micro-batch {a.microbatch!r} is outside 0..{num_microbatches - 1}; fix the index")
    return problems


def _positions(actions: list[Action]) -> dict[_Key, list[int]]:
    where: dict[_Key, list[int]] = {}
    for step, a in enumerate(actions):
        where.setdefault((a.op, a.stage, a.microbatch), []).append(step)
    return where


def _missing_hint(rank: int, key: _Key, pos: dict[_Key, list[int]]) -> str:
    op, stage, mb = key
    anchors = {Op.RECV_F: (Op.F, "before"), Op.SEND_F: (Op.F, "after"),
               Op.RECV_B: (Op.B, "before"), Op.SEND_B: (Op.B, "after"), Op.B: (Op.F, "after"),
               Op.W: (Op.B, "after")}
    if op in anchors:
        anchor, side = anchors[op]
        steps = pos.get((anchor, stage, mb))
        if steps:
            return f"add it {side} {Action(stage, anchor, mb)} (step {steps[0]})"
    return "add it"


def _check_coverage(schedule: Schedule, num_stages: int, num_microbatches: int,
                    positions: dict[int, dict[_Key, list[int]]], chunks: int = 1) -> list[str]:
    problems = []
    virtual = num_stages * chunks
    for rank in positions:
        pos, actions = positions[rank], schedule[rank]
        # W is optional, but then for every micro-batch: a rank splits all its backwards or none
        split = any(op is Op.W for op, _, _ in pos)
        required: list[_Key] = [(op, stage, mb) for stage in range(rank, virtual, num_stages)
                                for mb in range(num_microbatches)
                                for op in _allowed_ops(stage, virtual) - {Op.STEP, *(() if split else (Op.W,))}]
        for key in sorted(required, key=lambda k: (k[2], k[1], k[0].value)):
            if key not in pos:
                a = Action(key[1], key[0], key[2])
                problems.append(f"rank {rank} has no {a}; fix: {_missing_hint(rank, key, pos)}")
        for key, steps in pos.items():
            if len(steps) > 1:
                a = Action(key[1], key[0], key[2])
                problems.append(f"{_at(rank, steps[1], a)}: duplicate of step {steps[0]}; every action runs once, fix: remove one")
        step_at = pos.get((Op.STEP, rank, None), [])
        if not step_at:
            problems.append(f"rank {rank} has no {rank}STEP; fix: append it as the last action")
        elif step_at[0] != len(actions) - 1:
            problems.append(f"{_at(rank, step_at[0], actions[step_at[0]])}: STEP must be the last action; fix: move it to the end")
    return problems


def _check_local_order(num_stages: int, num_microbatches: int,
                       positions: dict[int, dict[_Key, list[int]]], chunks: int = 1) -> list[str]:
    problems = []
    for rank in positions:
        pos = positions[rank]
        for stage, mb in ((st, mb) for st in range(rank, num_stages * chunks, num_stages)
                          for mb in range(num_microbatches)):
            for first, later, why in _LOCAL_ORDER:
                a_steps, b_steps = pos.get((first, stage, mb)), pos.get((later, stage, mb))
                if a_steps and b_steps and b_steps[0] < a_steps[0]:
                    a, b = Action(stage, first, mb), Action(stage, later, mb)
                    problems.append(f"{_at(rank, b_steps[0], b)} comes before {a} (step {a_steps[0]}) but {why}; "
                                    f"fix: move {b} after {a}")
    return problems


def _channels(num_stages: int) -> list[tuple[int, int, Op, str]]:
    """Every FIFO channel: (src rank, dst rank, send op, what it carries)."""
    chans = [(s, s + 1, Op.SEND_F, "activations") for s in range(num_stages - 1)]
    return chans + [(s + 1, s, Op.SEND_B, "gradients") for s in range(num_stages - 1)]


def _check_link_order(schedule: Schedule, num_stages: int, chunks: int = 1) -> list[str]:
    """Each (stage, next stage, kind) is one FIFO channel (a chunk's messages carry its own tags)."""
    problems = []
    for src, dst, send_op, what in _channels(num_stages * chunks):
        recv_op = _RECV_OF_SEND[send_op]
        src_rank, dst_rank = src % num_stages, dst % num_stages
        sends = [(i, a) for i, a in enumerate(schedule[src_rank]) if a.op is send_op and a.stage == src]
        recvs = [(i, a) for i, a in enumerate(schedule[dst_rank]) if a.op is recv_op and a.stage == dst]
        for k, ((si, sa), (ri, ra)) in enumerate(zip(sends, recvs)):
            if sa.microbatch != ra.microbatch:
                problems.append(
                    f"link {src}->{dst} ({what}) is a FIFO channel: message #{k} is micro-batch {sa.microbatch} "
                    f"sent at {_at(src_rank, si, sa)}, but {_at(dst_rank, ri, ra)} expects micro-batch {ra.microbatch}; "
                    f"fix: receive in the order the peer sends (or reorder the sends)")
                break
    return problems


def _abstract_run(schedule: Schedule) -> tuple[dict[int, int], dict[int, list[tuple[int, Action]]]]:
    """Run every rank with unit-time F/B and instant messages.

    A rank advances while its next action is runnable; a RECV is runnable once
    the matching SEND has run.  Returns (steps completed per rank, (start slot,
    action) of every F/B per rank); a rank that did not finish is blocked.
    """
    sent: dict[tuple[Op, int, int | None], int] = {}  # (recv op, receiving rank, mb) -> slot sent
    waiting: dict[tuple[Op, int, int | None], int] = {}
    done = {r: 0 for r in schedule}
    clock = {r: 0 for r in schedule}
    slots: dict[int, list[tuple[int, Action]]] = {r: [] for r in schedule}
    ready = deque(sorted(schedule))
    while ready:
        rank = ready.popleft()
        actions, i, t = schedule[rank], done[rank], clock[rank]
        while i < len(actions):
            a = actions[i]
            if a.op is Op.RECV_F or a.op is Op.RECV_B:
                key = (a.op, a.stage, a.microbatch)
                if key not in sent:
                    waiting[key] = rank
                    break
                t = max(t, sent[key])
            elif a.op is Op.SEND_F or a.op is Op.SEND_B:
                key = _send_key(a)
                sent.setdefault(key, t)
                if key in waiting:
                    ready.append(waiting.pop(key))
            elif a.op in _COMPUTE:
                slots[rank].append((t, a))
                t += 1
            i += 1
        done[rank], clock[rank] = i, t
    return done, slots


def _send_key(a: Action) -> tuple[Op, int, int | None]:
    """The (recv op, receiving stage, micro-batch) a SEND action is received as."""
    return _RECV_OF_SEND[a.op], a.stage + 1 if a.op is Op.SEND_F else a.stage - 1, a.microbatch


def _rendezvous_run(schedule: Schedule, lag: int = 0) -> dict[int, int]:
    """Steps completed per rank when, at each RECV, a rank first waits for its own earlier sends.

    The executor's gloo mode (`PipelineExecutor` ``wait_sends_at_recv``): a rank posts
    the receive of a RECV action when it reaches it, then waits until every SEND it
    issued before was received -- a send completes once the peer has *reached* (posted)
    the matching RECV -- and then for the message itself.  With ``lag`` k > 0 it waits only
    for the sends issued before its k-th last completed RECV (interleaved lists: lag 1).
    A rank that did not finish is blocked.
    """
    sent: set[tuple[Op, int, int | None]] = set()
    posted: set[tuple[Op, int, int | None]] = set()
    # sends not yet received, each with the number of RECVs its rank had completed when it was issued
    pending: dict[int, list[tuple[tuple[Op, int, int | None], int]]] = {r: [] for r in schedule}
    recvs_done = {r: 0 for r in schedule}
    done = {r: 0 for r in schedule}
    ready, parked = deque(sorted(schedule)), set()
    while ready:
        rank = ready.popleft()
        actions, i = schedule[rank], done[rank]
        while i < len(actions):
            a = actions[i]
            if a.op is Op.RECV_F or a.op is Op.RECV_B:
                key = (a.op, a.stage, a.microbatch)
                if key not in posted:
                    posted.add(key)
                    ready.extend(sorted(parked))  # a blocked sender may now complete
                    parked.clear()
                pending[rank] = [(k, n) for k, n in pending[rank] if k not in posted]
                if any(n <= recvs_done[rank] - lag for _, n in pending[rank]) or key not in sent:
                    parked.add(rank)
                    break
                recvs_done[rank] += 1
            elif a.op is Op.SEND_F or a.op is Op.SEND_B:
                key = _send_key(a)
                sent.add(key)
                pending[rank].append((key, recvs_done[rank]))
                ready.extend(sorted(parked))  # a blocked receiver may now run
                parked.clear()
            i += 1
        done[rank] = i
    return done


def _deadlock_problems(schedule: Schedule, done: dict[int, int]) -> list[str]:
    blocked = {r: done[r] for r in sorted(schedule) if done[r] < len(schedule[r])}
    problems = []
    for rank, step in blocked.items():
        a = schedule[rank][step]
        peer_stage = a.stage - 1 if a.op is Op.RECV_F else a.stage + 1
        peer = peer_stage % len(schedule)
        send = Action(peer_stage, Op.SEND_F if a.op is Op.RECV_F else Op.SEND_B, a.microbatch)
        state = (f"blocked itself at {_at(peer, blocked[peer], schedule[peer][blocked[peer]])}"
                 if peer in blocked else "finished without sending it")
        problems.append(f"deadlock: {_at(rank, step, a)} waits for {send} from rank {peer}, which is {state}")
    if problems:
        problems.append("fix for the deadlock: issue each SEND before the RECV that waits on the peer "
                        "(see one_f_one_b() for a deadlock-free order)")
    return problems


def validate_schedule(schedule: Schedule, *, num_stages: int, num_microbatches: int,
                      sends_wait_at_recv: bool = False, send_wait_lag: int = 0, chunks: int | None = None) -> None:
    """Raise `ScheduleError` unless `schedule` is a complete, ordered, deadlock-free p-stage schedule.

    Checks, in order: ranks 0..p-1 present; each action on its rank's stage with
    a valid op and micro-batch; every required (op, mb) exactly once and STEP
    last (W, the split weight gradient, for every micro-batch of a rank or for none);
    RECV_F < F < SEND_F, RECV_B < B < SEND_B, F < B and B < W per micro-batch;
    the same message order on both ends of every FIFO link; no deadlock.  With
    ``sends_wait_at_recv`` also no deadlock when each RECV first waits for the
    rank's earlier sends to be received (`_rendezvous_run`); ``send_wait_lag`` k: only for those
    issued before its k-th last completed RECV (the executor's mode for interleaved lists, k = 1).

    `num_stages` is the number of ranks p; with ``chunks`` v > 1 rank r runs the virtual stages
    r, r + p, ..., (v - 1) p + r (`hetpipe.schedule.interleaved`), every check above per virtual
    stage, the links between consecutive virtual stages; None takes v from the actions' stages.

    Example:
        >>> bad = {0: [Action(0, Op.F, 0), Action(0, Op.B, 0)]}
        >>> validate_schedule(bad, num_stages=1, num_microbatches=1)
        Traceback (most recent call last):
        ...
        hetpipe.errors.ScheduleError: invalid schedule: rank 0 has no 0STEP; fix: append it as the last action
    """
    check_sizes(num_stages, num_microbatches)
    _raise_if(_check_shape(schedule, num_stages))
    chunks = _chunks(schedule, num_stages) if chunks is None else chunks
    check_sizes(chunks, num_microbatches)
    _raise_if(_check_actions(schedule, num_stages, num_microbatches, chunks=chunks))
    positions = {r: _positions(schedule[r]) for r in range(num_stages)}
    _raise_if(_check_coverage(schedule, num_stages, num_microbatches, positions, chunks))
    _raise_if(_check_local_order(num_stages, num_microbatches, positions, chunks))
    _raise_if(_check_link_order(schedule, num_stages, chunks))
    done, _ = _abstract_run(schedule)
    _raise_if(_deadlock_problems(schedule, done))
    if sends_wait_at_recv:
        done = _rendezvous_run(schedule, send_wait_lag)
        stuck = [f"{_at(r, done[r], schedule[r][done[r]])}" for r in sorted(schedule) if done[r] < len(schedule[r])]
        if stuck:
            raise ScheduleError("invalid schedule: deadlock when each RECV waits for the rank's earlier sends to be "
                                f"received: blocked at {', '.join(stuck)}; fix: run it with "
                                "wait_sends_at_recv=False, or post every SEND's peer RECV before it is awaited")


def _chunks(schedule: Schedule, num_ranks: int) -> int:
    """Chunks per rank the actions' stages imply: the highest virtual stage // p + 1."""
    return max((a.stage // num_ranks for acts in schedule.values() for a in acts if isinstance(a, Action)),
               default=0) + 1


def check_actions(actions: Sequence[Action], *, stage: int, num_stages: int, num_microbatches: int,
                  chunks: int = 1) -> None:
    """Raise `ScheduleError` unless ``actions`` is a complete, locally ordered list for ``stage``.

    The part of `validate_schedule` one rank can check alone (the same checks, on one
    rank): every action on this stage with a valid op and micro-batch, each exactly once,
    STEP last, RECV < F < SEND and F < B per micro-batch.  Links and deadlocks need
    every rank's list.  With `chunks` > 1, `stage` is the rank and the list covers its chunks.

    Example:
        >>> check_actions([Action(0, Op.F, 0), Action(0, Op.STEP)], stage=0, num_stages=1, num_microbatches=1)
        Traceback (most recent call last):
        ...
        hetpipe.errors.ScheduleError: stage 0's action list: rank 0 has no 0B0; fix: add it after 0F0 (step 0)
    """
    check_sizes(num_stages, num_microbatches)
    what = f"stage {stage}'s action list"
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < num_stages:
        raise ScheduleError(f"{what}: stage {stage!r} is not one of 0..{num_stages - 1}")
    one: Schedule = {stage: list(actions)}
    _raise_if([f"{_at(stage, i, repr(a))}: not an Action; build it with Action.parse('{stage}F0')"
               for i, a in enumerate(one[stage]) if not isinstance(a, Action)], what)
    _raise_if(_check_actions(one, num_stages, num_microbatches, ranks=(stage,), chunks=chunks), what)
    positions = {stage: _positions(one[stage])}
    _raise_if(_check_coverage(one, num_stages, num_microbatches, positions, chunks), what)
    _raise_if(_check_local_order(num_stages, num_microbatches, positions, chunks), what)


def compute_slots(schedule: Schedule) -> dict[int, list[tuple[int, Action]]]:
    """(start slot, action) of every F/B per rank with unit-time compute and instant messages.

    Raises `ScheduleError` if the schedule deadlocks.

    Example:
        >>> from hetpipe.schedule.builders import gpipe
        >>> [str(a) for _, a in compute_slots(gpipe(2, 1))[1]]
        ['1F0', '1B0']
    """
    done, slots = _abstract_run(schedule)
    _raise_if(_deadlock_problems(schedule, done))
    return slots


def sends_may_wait_at_recv(schedule: Schedule, *, num_stages: int, microbatches: int,
                           send_wait_lag: int = 0, chunks: int | None = None) -> bool:
    """Whether `schedule` is deadlock-free when each RECV first waits for the rank's earlier sends
    (`validate_schedule` ``sends_wait_at_recv=True``; with ``send_wait_lag`` k only for the sends issued
    before its k-th last RECV, and ``chunks`` v for interleaved lists): the runtime's gloo rule, and so
    the memory model's (`hetpipe.schedule.held`, `held_virtual`), exactly when this holds.

    Example:
        >>> from hetpipe.schedule.builders import make_schedule
        >>> sends_may_wait_at_recv(make_schedule("zb-1f1b@2,1,0", 3, 8), num_stages=3, microbatches=8)
        True
        >>> sends_may_wait_at_recv(make_schedule("zb-1f1b@3,2,2,0", 4, 8), num_stages=4, microbatches=8)
        False
    """
    try:
        validate_schedule(schedule, num_stages=num_stages, num_microbatches=microbatches, sends_wait_at_recv=True,
                          send_wait_lag=send_wait_lag, chunks=chunks)
    except ScheduleError:
        return False
    return True
