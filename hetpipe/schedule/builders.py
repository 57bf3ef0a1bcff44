"""Pipeline schedules as data (the validator both executors trust is `hetpipe.schedule.validate`).

A `Schedule` maps a rank to its `Action`s in execution order; rank r runs
stage r (one stage per rank).  For each micro-batch, stage s of p does
``RECV_F`` (s > 0) before ``F``, ``SEND_F`` (s < p - 1) after it, ``RECV_B``
(s < p - 1) before ``B`` and ``SEND_B`` (s > 0) after it; each rank ends with
one ``STEP``.  Communication semantics (shared with the executor and
`hetpipe.schedule.simulate`): a SEND completes locally (asynchronous, no
buffering limit); a RECV blocks until the peer has issued the matching SEND;
each (src, dst, kind) pair is a FIFO channel.

Schedules:
    * GPipe (Huang et al., NeurIPS'19): all forwards, then all backwards.
    * 1F1B, the PipeDream-flush order (Narayanan et al., SC'21): stage s runs
      ``min(p - s - 1, m)`` warm-up forwards, then alternates one forward and
      one backward, then drains the remaining backwards, so at most
      ``min(p - s, m)`` micro-batches are in flight on stage s.

Example:
    >>> print(format_schedule(one_f_one_b(2, 2)))
    rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0STEP
    rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1STEP
    >>> validate_schedule(gpipe(3, 4), num_stages=3, num_microbatches=4)
    >>> make_schedule("zero-bubble", 2, 2)
    Traceback (most recent call last):
    ...
    hetpipe.errors.ScheduleError: unknown schedule 'zero-bubble'; choose one of: 'gpipe', '1f1b', 'zb-h1', 'zb-1f1b'
"""

from __future__ import annotations

from typing import Callable, Sequence

from hetpipe.errors import ScheduleError
from hetpipe.schedule.actions import Action, Op, Schedule
from hetpipe.schedule.interleaved import check_interleaved, interleaved_1f1b, interleaved_rank, parse_interleaved
from hetpipe.schedule.validate import check_actions, check_sizes, compute_slots, validate_schedule

# `Schedule`, `validate_schedule` and `check_actions` are re-exported: callers build and check here.
__all__ = ["SCHEDULES", "Schedule", "check_actions", "format_grid", "format_schedule", "gpipe", "make_schedule",
           "one_f_one_b", "parse_schedule", "rank_actions", "validate_schedule", "zb_1f1b", "zb_h1"]


def _forward_steps(stage: int, num_stages: int, mb: int) -> list[Action]:
    steps = [Action(stage, Op.RECV_F, mb)] if stage > 0 else []
    steps.append(Action(stage, Op.F, mb))
    if stage < num_stages - 1:
        steps.append(Action(stage, Op.SEND_F, mb))
    return steps


def _backward_steps(stage: int, num_stages: int, mb: int) -> list[Action]:
    steps = [Action(stage, Op.RECV_B, mb)] if stage < num_stages - 1 else []
    steps.append(Action(stage, Op.B, mb))
    if stage > 0:
        steps.append(Action(stage, Op.SEND_B, mb))
    return steps


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: every rank runs all forwards, then all backwards (in micro-batch order), then STEP.

    Example:
        >>> [str(a) for a in gpipe(2, 2)[1]]
        ['1RECV_F0', '1F0', '1RECV_F1', '1F1', '1B0', '1SEND_B0', '1B1', '1SEND_B1', '1STEP']
    """
    check_sizes(num_stages, num_microbatches)
    return {s: _gpipe_rank(s, num_stages, num_microbatches) for s in range(num_stages)}


def _gpipe_rank(s: int, num_stages: int, m: int) -> list[Action]:
    actions: list[Action] = []
    for mb in range(m):
        actions += _forward_steps(s, num_stages, mb)
    for mb in range(m):
        actions += _backward_steps(s, num_stages, mb)
    actions.append(Action(s, Op.STEP))
    return actions


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-flush): warm-up forwards, steady one-forward-one-backward, cool-down backwards.

    Stage s runs ``min(p - s - 1, m)`` warm-up forwards, so at most ``min(p - s, m)``
    micro-batches are in flight on it (Narayanan et al., SC'21).

    Example:
        >>> print(format_grid(one_f_one_b(3, 4)))
        rank 0: F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3
        rank 1: .  F0 F1 .  B0 F2 B1 F3 B2 .  B3
        rank 2: .  .  F0 B0 F1 B1 F2 B2 F3 B3
    """
    check_sizes(num_stages, num_microbatches)
    return {s: _one_f_one_b_rank(s, num_stages, num_microbatches) for s in range(num_stages)}


def _one_f_one_b_rank(s: int, num_stages: int, m: int, extra: int = 0) -> list[Action]:
    warmup = min(num_stages - s - 1 + extra, m)  # `extra` warm-up forwards: see `warmup_name`
    actions: list[Action] = []
    for mb in range(warmup):
        actions += _forward_steps(s, num_stages, mb)
    for i in range(m - warmup):  # steady state: F of mb warmup+i, then B of mb i
        actions += _forward_steps(s, num_stages, warmup + i)
        actions += _backward_steps(s, num_stages, i)
    for mb in range(m - warmup, m):  # cool-down
        actions += _backward_steps(s, num_stages, mb)
    actions.append(Action(s, Op.STEP))
    return actions


def zb_h1(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1 (zero-bubble 1F1B, Qi et al. 2023, arXiv 2311.11015 §3.1): each backward is split into B
    (input gradient, sent upstream at once) and W (weight gradient).

    The order is 1F1B's with B in place of the whole backward; stage s then runs the W of the
    micro-batch it finished ``s`` backwards earlier (none deferred on stage 0), and the deferred
    W's fill its cool-down bubble.  A micro-batch is in flight from its F to its W, so stage s
    holds at most ``min(p - s, m) + min(s, ...)`` -- never more than ``min(p, m)``: the pipeline's
    peak (stage 0's, ``p``) is 1F1B's (`hetpipe.schedule.held` prices each stage's own).

    Example:
        >>> print(format_grid(zb_h1(3, 4)))
        rank 0: F0 F1 F2 .  .  B0 W0 F3 B1 W1 B2 W2 B3 W3
        rank 1: .  F0 F1 .  B0 F2 B1 W0 F3 B2 W1 B3 W2 W3
        rank 2: .  .  F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3
    """
    check_sizes(num_stages, num_microbatches)
    return {s: _zb_h1_rank(s, num_stages, num_microbatches) for s in range(num_stages)}


def zb_1f1b(num_stages: int, num_microbatches: int) -> Schedule:
    """ZB-H1's split backward with 1F1B's memory on every stage: no W is deferred in the steady state
    (F, B, W), so stage s holds at most ``min(p - s, m)`` micro-batches, like 1F1B; each B's input
    gradient still leaves before its W, so the round trip through later stages is shorter by their W.

    Example:
        >>> print(format_grid(zb_1f1b(3, 3)))
        rank 0: F0 F1 F2 .  .  B0 W0 .  B1 W1 .  B2 W2
        rank 1: .  F0 F1 .  B0 W0 F2 B1 W1 .  B2 W2
        rank 2: .  .  F0 B0 W0 F1 B1 W1 F2 B2 W2
    """
    check_sizes(num_stages, num_microbatches)
    return {s: _zb_1f1b_rank(s, num_stages, num_microbatches) for s in range(num_stages)}


def _zb_1f1b_rank(s: int, num_stages: int, m: int, extra: int = 0) -> list[Action]:
    return _zb_h1_rank(s, num_stages, m, extra, defer=0)


def _zb_h1_rank(s: int, num_stages: int, m: int, extra: int = 0, defer: int | None = None) -> list[Action]:
    """Stage s's split list with `defer` W's held back in the steady state (ZB-H1: s)."""
    defer = s if defer is None else defer
    warmup = min(num_stages - s - 1 + extra, m)
    actions: list[Action] = []
    weights = iter(range(m))  # W's run in micro-batch order

    def weight() -> None:
        actions.append(Action(s, Op.W, next(weights)))

    for mb in range(warmup):
        actions += _forward_steps(s, num_stages, mb)
    for i in range(m - warmup):  # steady state: F, B, and the W deferred `defer` backwards
        actions += _forward_steps(s, num_stages, warmup + i)
        actions += _backward_steps(s, num_stages, i)
        if i >= defer:
            weight()
    for mb in range(m - warmup, m):  # cool-down: a B, then a deferred W while the next gradient travels
        actions += _backward_steps(s, num_stages, mb)
        weight()
    actions += [Action(s, Op.W, mb) for mb in weights]
    actions.append(Action(s, Op.STEP))
    return actions


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1,
                                                        "zb-1f1b": zb_1f1b}
_RANKS: dict[str, Callable[..., list[Action]]] = {"gpipe": _gpipe_rank, "1f1b": _one_f_one_b_rank,
                                                              "zb-h1": _zb_h1_rank, "zb-1f1b": _zb_1f1b_rank}
#: The schedules whose lists split each backward into B and W (`Op.W`).
SPLIT_SCHEDULES = ("zb-h1", "zb-1f1b")


def is_split(name: str) -> bool:
    """Whether schedule `name` (extra warm-ups or not, `warmup_name`) splits each backward into B and W.

    Example:
        >>> is_split("zb-1f1b@1,0"), is_split("1f1b")
        (True, False)
    """
    return str(name).strip().lower().partition("@")[0] in SPLIT_SCHEDULES


def make_schedule(name: str, num_stages: int, num_microbatches: int) -> Schedule:
    """The schedule called `name` ("gpipe" or "1f1b", case-insensitive; ``interleaved:V`` over
    `num_stages` ranks of V chunks each, `hetpipe.schedule.interleaved`).

    Example:
        >>> make_schedule("1F1B", 2, 4) == one_f_one_b(2, 4)
        True
    """
    chunks = parse_interleaved(name)
    if chunks is not None:
        return interleaved_1f1b(num_stages, chunks, num_microbatches)
    base, extra = split_name(name, num_stages)
    if not any(extra):
        return SCHEDULES[base](num_stages, num_microbatches)
    check_sizes(num_stages, num_microbatches)
    return {s: _RANKS[base](s, num_stages, num_microbatches, extra[s]) for s in range(num_stages)}


def warmup_name(base: str, extra: Sequence[int]) -> str:
    """The name of schedule `base` with ``extra[s]`` more warm-up forwards on stage s: more
    micro-batches in flight (``min(p - s + extra[s], m)``), so a slow round trip through later
    stages stalls it less (issue 17).  Deadlock-free when `extra` does not increase along the
    pipeline (`validate_schedule` checks any list).

    Example:
        >>> warmup_name("zb-1f1b", (2, 1, 0)), split_name("zb-1f1b@2,1,0", 3)
        ('zb-1f1b@2,1,0', ('zb-1f1b', (2, 1, 0)))
        >>> print(format_grid(make_schedule("1f1b@1,0", 2, 3)))
        rank 0: F0 F1 F2 B0 .  B1 .  B2
        rank 1: .  F0 B0 F1 B1 F2 B2
    """
    return base if not any(extra) else f"{base}@{','.join(str(int(k)) for k in extra)}"


def split_name(name: str, num_stages: int) -> tuple[str, tuple[int, ...]]:
    """(base schedule, extra warm-up forwards per stage) of a schedule name (`warmup_name`)."""
    base, _, tail = str(name).strip().lower().partition("@")
    if base not in SCHEDULES:
        names = ", ".join(repr(n) for n in SCHEDULES)
        raise ScheduleError(f"unknown schedule {name!r}; choose one of: {names}")
    if not tail:
        return base, (0,) * num_stages
    words = tail.split(",")
    if base == "gpipe" or len(words) != num_stages or not all(w.isdigit() for w in words):
        raise ScheduleError(f"schedule {name!r}: after '@' give one extra warm-up count >= 0 per stage "
                            f"({num_stages}) of 1f1b, zb-1f1b or zb-h1, e.g. {base}@{','.join(['0'] * num_stages)}")
    return base, tuple(int(w) for w in words)


def rank_actions(name: str, num_stages: int, num_microbatches: int, stage: int) -> list[Action]:
    """``make_schedule(name, num_stages, num_microbatches)[stage]`` without building the other ranks
    (the memory model replays one rank's list for every pipeline length the solvers try).

    Example:
        >>> rank_actions("1f1b", 3, 4, 1) == one_f_one_b(3, 4)[1]
        True
    """
    chunks = parse_interleaved(name)
    base, extra = split_name(name, num_stages) if chunks is None else ("", ())
    check_sizes(num_stages, num_microbatches)
    if not 0 <= stage < num_stages:
        raise ScheduleError(f"stage {stage} is outside a pipeline of {num_stages} stages; use 0..{num_stages - 1}")
    if chunks is not None:
        check_interleaved(num_stages, chunks, num_microbatches)
        return interleaved_rank(stage, num_stages, chunks, num_microbatches)
    if not any(extra):
        return _RANKS[base](stage, num_stages, num_microbatches)
    return _RANKS[base](stage, num_stages, num_microbatches, extra[stage])


# ----------------------------------------------------------------------------- text forms


def format_schedule(schedule: Schedule) -> str:
    """One line per rank, actions in order; `parse_schedule` reads it back.

    Example:
        >>> print(format_schedule(gpipe(2, 1)))
        rank 0: 0F0 0SEND_F0 0RECV_B0 0B0 0STEP
        rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1STEP
    """
    return "\n".join(f"rank {r}: " + " ".join(str(a) for a in schedule[r]) for r in sorted(schedule))


def parse_schedule(text: str) -> Schedule:
    """Inverse of `format_schedule` (blank lines ignored).

    Example:
        >>> parse_schedule("rank 0: 0F0 0B0 0STEP") == {0: [Action(0, Op.F, 0), Action(0, Op.B, 0), Action(0, Op.STEP)]}
        True
    """
    schedule: Schedule = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        head, sep, body = line.partition(":")
        words = head.split()
        if not sep or len(words) != 2 or words[0] != "rank" or not words[1].isdigit():
            raise ScheduleError(f"line {lineno}: expected 'rank <n>: <actions>', got {line.strip()!r}")
        try:
            schedule[int(words[1])] = [Action.parse(w) for w in body.split()]
        except ValueError as err:
            raise ScheduleError(f"line {lineno}: {err}") from None
    return schedule


def format_grid(schedule: Schedule) -> str:
    """Compute-only picture: a column per unit time slot (F and B take one slot, messages none).

    Idle slots before a rank's last F/B show ``.``; raises `ScheduleError` if the schedule deadlocks.

    Example:
        >>> print(format_grid(gpipe(2, 2)))
        rank 0: F0 F1 .  .  B0 B1
        rank 1: .  F0 F1 B0 B1
    """
    slots = compute_slots(schedule)
    labels = {r: [(t, f"{a.op.value}{a.microbatch}") for t, a in slots[r]] for r in slots}
    width = max((len(text) for cells in labels.values() for _, text in cells), default=1)
    num_slots = max((t + 1 for cells in labels.values() for t, _ in cells), default=0)
    digits = len(str(max(schedule, default=0)))
    lines = []
    for rank in sorted(schedule):
        row = ["."] * num_slots
        for t, text in labels[rank]:
            row[t] = text
        while row and row[-1] == ".":  # idle after a rank's last compute is not drawn
            row.pop()
        lines.append(f"rank {rank:>{digits}}: " + " ".join(cell.ljust(width) for cell in row).rstrip())
    return "\n".join(lines)
