"""What a rank holding several chunks (interleaved virtual stages) holds after each action, per chunk.

`hetpipe.schedule.held.replay_held` counts one stage's multiples; a rank of ``interleaved:V`` runs V
virtual stages whose sizes differ (each chunk has its own A, in, out), so each moment is one
`HeldCounts` per chunk and the rank's activation-and-message bytes at that moment are their sum.
The executor's rules are the same, over the rank's whole list: receives posted ``prefetch`` ahead,
the parameter gradients of a chunk exist from its first backward, and a receive first waits for the
rank's earlier sends (of every chunk) -- with ``send_lag`` 1 (`rank_held_terms`, the executor's mode
for interleaved lists, `hetpipe.runtime.execute.prefetch`) only for those posted before the rank's
previous receive, so the held send frames are every cut tensor sent and not yet waited on: those
sent since the last-but-one receive.  With one chunk and lag 0 it equals `replay_held`
(tests/test_interleaved.py).

Example (2 ranks, 2 chunks, 2 micro-batches; rank 0 runs virtual stages 0 and 2): at its peak
both micro-batches are in flight in both chunks, before any gradient exists (plain 1F1B's first
stage holds 2 micro-batches of a stage twice the size: the same activations, more frames):
    >>> terms = rank_held_terms(2, 0, 2, 2, prefetch=0)
    >>> [[(c.grads, c.microbatches) for c in t] for t in terms if sum(c.microbatches for c in t) == 4][-1]
    [(0, 2), (0, 2)]
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

from hetpipe.cost_models.stage_memory import RECV_PREFETCH, HeldCounts
from hetpipe.schedule.actions import Action, Op
from hetpipe.schedule.builders import rank_actions
from hetpipe.schedule.interleaved import interleaved_name

_RECVS = (Op.RECV_F, Op.RECV_B)
#: A RECV of an interleaved list waits for the sends posted before the rank's previous RECV (the
#: executor's mode, `hetpipe.runtime.execute.prefetch`; lag 0 deadlocks when m > p).
INTERLEAVED_SEND_LAG = 1
#: The message of each communication action: which cut of its stage, activations or gradients.
_FRAME = {Op.RECV_F: "in", Op.SEND_B: "in_grad", Op.SEND_F: "out", Op.RECV_B: "out_grad"}


@dataclasses.dataclass
class _Chunk:
    grads: int = 0  # 1 once the chunk's parameter gradients exist (its first backward)
    inflight: int = 0  # micro-batches forwarded, not yet through their (last) backward part
    grads_in: set[int] = dataclasses.field(default_factory=set)  # received gradients kept for a backward
    weight: int = 0  # split backward: micro-batches past their B, before their W (`HeldCounts.weight_grads`)


def replay_held_by_stage(actions: Sequence[Action], *, stages: Sequence[int],
                         prefetch: int, send_lag: int = 0) -> list[tuple[HeldCounts, ...]]:
    """Per action of one rank's list, one `HeldCounts` per stage of `stages` (its chunks, in order),
    plus, before it, the moment inside each backward (`replay_held`'s moments, chunk by chunk);
    ``send_lag`` k: a receive waits only for the sends posted before the rank's k-th last receive."""
    posted: dict[Action, tuple[str, int]] = {}
    sends: list[tuple[tuple[str, int], int]] = []  # (frame, receives done when it was posted)
    recvs = 0
    chunk = {s: _Chunk() for s in stages}
    last = Op.W if any(a.op is Op.W for a in actions) else Op.B
    recv_at = [i for i, a in enumerate(actions) if a.op in _RECVS]
    ahead, out = 0, []
    for i, a in enumerate(actions):
        while ahead < len(recv_at) and recv_at[ahead] < i:
            ahead += 1
        for j in recv_at[ahead:ahead + prefetch]:  # `PipelineExecutor._prefetch_plan` on gloo
            posted.setdefault(actions[j], (_FRAME[actions[j].op], actions[j].stage))
        if a.op in _RECVS:
            sends = [(f, n) for f, n in sends if n > recvs - send_lag]  # waits for the earlier sends
            recvs += 1
            posted.pop(a, None)
            if a.op is Op.RECV_B:
                chunk[a.stage].grads_in.add(a.microbatch)
        elif a.op is Op.F:
            chunk[a.stage].inflight += 1
        elif a.op is last:  # inside it: its received gradient taken, its parameter gradients live
            c = chunk[a.stage]
            c.grads_in.discard(a.microbatch)
            c.grads = 1
            out.append(_moment(stages, chunk, [*posted.values(), *(f for f, _ in sends)], inside=a.stage))
            c.inflight, c.weight = c.inflight - 1, c.weight - (last is Op.W)
        elif a.op is Op.B:  # the input half of a split backward: the graph and W's gradients stay for W
            out.append(_moment(stages, chunk, [*posted.values(), *(f for f, _ in sends)], inside=a.stage))
            if a.stage != 0:  # `replay_held`: W reads the received gradient through its own (stage 0: itself)
                chunk[a.stage].grads_in.discard(a.microbatch)
            chunk[a.stage].weight += 1
        elif a.op in (Op.SEND_F, Op.SEND_B):
            sends.append(((_FRAME[a.op], a.stage), recvs))
        elif a.op is Op.STEP:
            sends.clear()
        out.append(_moment(stages, chunk, [*posted.values(), *(f for f, _ in sends)]))
    return out


def _moment(stages: Sequence[int], chunk: dict[int, _Chunk], frames: list[tuple[str, int]],
            inside: int | None = None) -> tuple[HeldCounts, ...]:
    return tuple(HeldCounts(chunk[s].grads, chunk[s].inflight, frames.count(("in", s)),
                            frames.count(("in_grad", s)), frames.count(("out", s)),
                            frames.count(("out_grad", s)) + len(chunk[s].grads_in), int(s == inside), chunk[s].weight)
                 for s in stages)


@functools.lru_cache(maxsize=1024)
def rank_held_terms(num_ranks: int, rank: int, chunks: int, microbatches: int, *,
                    prefetch: int = RECV_PREFETCH) -> tuple[tuple[HeldCounts, ...], ...]:
    """The undominated moments of rank `rank` of ``interleaved:chunks``: per moment one `HeldCounts`
    per chunk (virtual stage rank, rank + p, ...), the first virtual stage's input frames and the
    last one's output frames dropped (they have no such cut).  A moment is dropped when another
    is at least as large in every chunk and count (inside the same backward)."""
    stages = tuple(range(rank, num_ranks * chunks, num_ranks))
    last = num_ranks * chunks - 1
    moments = replay_held_by_stage(rank_actions(interleaved_name(chunks), num_ranks, microbatches, rank),
                                   stages=stages, prefetch=prefetch, send_lag=INTERLEAVED_SEND_LAG if chunks > 1 else 0)
    trimmed = {tuple(_trim(c, s, last) for c, s in zip(moment, stages)) for moment in moments}
    ordered = sorted(trimmed, key=lambda m: [dataclasses.astuple(c) for c in m], reverse=True)
    kept: list[tuple[HeldCounts, ...]] = []
    for moment in ordered:
        if not any(all(c.dominated_by(k) for c, k in zip(moment, other)) for other in kept):
            kept.append(moment)
    return tuple(kept)


def _trim(counts: HeldCounts, stage: int, last: int) -> HeldCounts:
    if stage == 0:
        counts = dataclasses.replace(counts, in_frames=0, in_grad_frames=0)
    if stage == last:
        counts = dataclasses.replace(counts, out_frames=0, out_grad_frames=0)
    return counts
