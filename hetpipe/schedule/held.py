"""What a pipeline rank holds after each of its actions, in multiples of its stage's sizes (torch-free).

The runtime's memory ledger (`hetpipe.runtime.execute.held.HeldBytes`) looks after every
action; what it sees besides the model state is a sum of a few per-stage sizes:

* every in-flight micro-batch (forward done, backward not yet) holds what its backward
  needs: the saved activations ``A``, its input frame ``in`` and its output ``out``;
* a receive posted ahead holds a buffer of its cut (``in`` for activations, ``out`` for
  gradients), a received gradient is held until its backward, and a send holds a copy of
  its frame until the rank waits for it (at its next receive, and at the optimizer step).

`replay_held` walks one rank's action list the way `PipelineExecutor` does -- receives
posted ``prefetch`` ahead of their action (gloo's rule: regardless of sends to the same
peer, which posts at least as many as NCCL's), a receive first waits for the rank's
earlier sends -- and returns, per action, the multiples `HeldCounts` (and, inside each
backward, the moment a recomputation adds its unit's activations to).  `stage_held_terms`
keeps the ones no other one of their kind dominates: a stage's activation-and-message peak
is the largest of their sums, which is how `hetpipe.cost_models.stage_memory` prices M_s.  The
gradient messages of a cut carry only its tensors that require grad
(`hetpipe.partitioner.capture.graph.Unit.boundary_grad_bytes`), so they are counted apart.

Example (1F1B, 3 stages, 4 micro-batches): the first stage holds 3 micro-batches either
after its warm-up (3 sends not yet waited for and 3 gradient receives posted ahead, no
parameter gradients yet) or after its 4th forward (gradients, 1 send, 3 receives); the fields
in order: grads, microbatches, in_frames, in_grad_frames, out_frames, out_grad_frames,
backward, weight_grads (split schedules only):
    >>> for c in stage_held_terms(3, 0, 4):
    ...     print(dataclasses.astuple(c))
    (1, 3, 0, 0, 1, 3, 0, 0)
    (1, 3, 0, 0, 0, 3, 1, 0)
    (0, 3, 0, 0, 3, 3, 0, 0)

A middle stage of ZB-1F1B keeps a micro-batch's W gradients (and no longer its received
gradient, which W reads through them) from its B to its W:
    >>> max(c.weight_grads for c in stage_held_terms(3, 1, 4, schedule="zb-1f1b"))
    1
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

from hetpipe.cost_models.stage_memory import RECV_PREFETCH, HeldCounts
from hetpipe.schedule.actions import Action, Op
from hetpipe.schedule.builders import make_schedule, rank_actions
from hetpipe.schedule.validate import sends_may_wait_at_recv

_RECVS = (Op.RECV_F, Op.RECV_B)


#: The message of each communication action: which cut, activations or gradients.
_FRAME = {Op.RECV_F: "in", Op.SEND_B: "in_grad", Op.SEND_F: "out", Op.RECV_B: "out_grad"}


def replay_held(actions: Sequence[Action], *, prefetch: int, waits_sends: bool = True) -> list[HeldCounts]:
    """`HeldCounts` after each action of one rank's list (see the module docstring); ``waits_sends``:
    a receive first waits for the rank's earlier sends (the runtime's rule where the whole schedule is
    deadlock-free with it, `sends_may_wait_at_recv`; else sends are waited at the step only)."""
    posted: dict[Action, str] = {}
    sends: list[str] = []
    grads_in: set[int] = set()
    inflight, grads, out = 0, 0, []
    # A split backward (ZB-H1): B computes only the input gradient and keeps the micro-batch's
    # graph (its A + in + out) and the gradients W reads (`weight_grads`, which include the
    # received gradient where W reads a view of it) for W, which adds the parameter gradients and
    # frees them (`hetpipe.runtime.execute.split_backward`).  The first stage's B computes
    # nothing: it keeps the received gradient itself for W, its whole backward.
    last = Op.W if any(a.op is Op.W for a in actions) else Op.B
    keeps_received = not actions or actions[0].stage == 0
    weight = 0  # micro-batches past their B, before their W
    recv_at = [i for i, a in enumerate(actions) if a.op in _RECVS]
    ahead = 0  # recv_at[ahead] is the first receive at or after action i: one pass, not one scan per action
    for i, a in enumerate(actions):
        while ahead < len(recv_at) and recv_at[ahead] < i:
            ahead += 1
        for j in recv_at[ahead:ahead + prefetch]:  # `PipelineExecutor._prefetch_plan` on gloo
            posted.setdefault(actions[j], _FRAME[actions[j].op])
        if a.op in _RECVS:
            if waits_sends:
                sends.clear()  # a receive first waits for the rank's earlier sends
            posted.pop(a, None)
            if a.op is Op.RECV_B:
                grads_in.add(a.microbatch)
        elif a.op is Op.F:
            inflight += 1
        elif a.op is last:  # inside it (its received gradient already taken): what a recompute adds to
            grads_in.discard(a.microbatch)
            frames = [*posted.values(), *sends]
            out.append(_counts(1, inflight, frames, len(grads_in), weight, backward=1))
            inflight, grads, weight = inflight - 1, 1, weight - (last is Op.W)
        elif a.op is Op.B:  # the input half of a split backward: the graph and W's gradients stay for W
            out.append(_counts(grads, inflight, [*posted.values(), *sends], len(grads_in), weight, backward=1))
            if not keeps_received:
                grads_in.discard(a.microbatch)
            weight += 1
        elif a.op in (Op.SEND_F, Op.SEND_B):
            sends.append(_FRAME[a.op])
        elif a.op is Op.STEP:
            sends.clear()
        out.append(_counts(grads, inflight, [*posted.values(), *sends], len(grads_in), weight))
    return out


def _counts(grads: int, inflight: int, frames: list[str], grads_held: int, weight: int = 0,
            backward: int = 0) -> HeldCounts:
    return HeldCounts(grads, inflight, frames.count("in"), frames.count("in_grad"), frames.count("out"),
                      frames.count("out_grad") + grads_held, backward, weight)


def stage_held_terms(num_stages: int, stage: int, microbatches: int, *, schedule: str = "1f1b",
                     prefetch: int = RECV_PREFETCH) -> tuple[HeldCounts, ...]:
    """The undominated `HeldCounts` of stage ``stage`` over one step, largest first.

    The first stage has no input cut and the last no output cut: their frames are dropped.

    1F1B with many micro-batches is replayed with fewer (`steady_microbatches`): its steady
    state repeats one forward and one backward, and once a repetition is past the first
    backward and its receives posted ahead lie inside the steady state, it holds exactly
    what the one before held, so more repetitions add no new moment.  The solvers ask for
    every pipeline length at thousands of micro-batches (1,024 cards, m = 2,048).
    """
    if str(schedule).strip().lower() == "1f1b":
        microbatches = steady_microbatches(num_stages - stage, microbatches, prefetch)
    return _held_terms(num_stages, stage, microbatches, schedule, prefetch)


def steady_microbatches(in_flight: int, microbatches: int, prefetch: int) -> int:
    """Micro-batches whose 1F1B list has every moment of the list with `microbatches` (see
    `stage_held_terms`): the warm-up (in_flight - 1 forwards), a first steady repetition, enough
    repetitions for `prefetch` receives (two per repetition) to look ahead, and one spare.
    tests/test_memory_truth.py checks the moments equal the full replay's.

    Example:
        >>> steady_microbatches(4, 2048, 3), steady_microbatches(4, 5, 3)
        (9, 5)
    """
    return min(microbatches, in_flight + prefetch + 2)


@functools.lru_cache(maxsize=1024)
def _waits_sends(schedule: str, num_stages: int, microbatches: int) -> bool:
    """Does the runtime wait for a rank's sends at its receives under `schedule` (`sends_may_wait_at_recv`)?
    The built-in 1F1B and GPipe lists always may (tests/test_schedule.py)."""
    if str(schedule).strip().lower() in ("1f1b", "gpipe"):
        return True
    return sends_may_wait_at_recv(make_schedule(schedule, num_stages, microbatches), num_stages=num_stages,
                                  microbatches=microbatches)


@functools.lru_cache(maxsize=4096)
def _held_terms(num_stages: int, stage: int, microbatches: int, schedule: str,
                prefetch: int) -> tuple[HeldCounts, ...]:
    counts = replay_held(rank_actions(schedule, num_stages, microbatches, stage), prefetch=prefetch,
                         waits_sends=_waits_sends(schedule, num_stages, microbatches))
    if stage == 0:
        counts = [dataclasses.replace(c, in_frames=0, in_grad_frames=0) for c in counts]
    if stage == num_stages - 1:
        counts = [dataclasses.replace(c, out_frames=0, out_grad_frames=0) for c in counts]
    unique = sorted(set(counts), reverse=True)
    # `HeldCounts.dominated_by`, each tuple made once; a dominating term sorts before the one it
    # dominates, and domination is transitive, so checking the terms kept so far is enough
    kept: list[tuple[int, ...]] = []
    names = [f.name for f in dataclasses.fields(HeldCounts) if f.name != "backward"] + ["backward"]  # `backward` last
    for a in (tuple(getattr(c, n) for n in names) for c in unique):
        if not any(a[-1] == b[-1] and all(x <= y for x, y in zip(a, b)) for b in kept):
            kept.append(a)
    return tuple(HeldCounts(**dict(zip(names, a))) for a in kept)


def position_held_terms(stages_after: int, *, first: bool, microbatches: int) -> tuple[HeldCounts, ...]:
    """`stage_held_terms` of a stage with ``stages_after`` stages after it, the first or not.

    A 1F1B or GPipe rank's list depends only on those (tests/test_memory_truth.py checks it),
    which is all the solvers know about a stage's position.

    Example:
        >>> position_held_terms(2, first=False, microbatches=4) == stage_held_terms(5, 2, 4)
        True
    """
    if first:
        return stage_held_terms(stages_after + 1, 0, microbatches)
    return stage_held_terms(stages_after + 2, 1, microbatches)
