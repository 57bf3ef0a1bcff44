"""May every rank of a pipeline wait for its earlier sends at each receive (``wait_sends_at_recv``)?

On gloo a rank that first waits for its sends at a RECV runs 3-8% faster and holds fewer send
frames (`hetpipe.runtime.execute.executor`), and the memory model prices exactly that rule
(`hetpipe.schedule.held.replay_held`).  It is safe when the ranks' lists *together* are
deadlock-free under it, which `validate_schedule` ``sends_wait_at_recv=True`` decides; one rank's
list alone does not (GPipe stages before a 1F1B last stage deadlock; ZB-H1's first stage is
ZB-1F1B's; a list with extra warm-up forwards is no built-in list at all, and some of them deadlock
under it: `zb-1f1b@3,2,2,0` on 4 stages).  `gathered_schedule`
all-gathers every rank's list once at start-up (each action as three integers) so that every
rank decides the same from the same lists.

Example (the decision itself, torch-free):
    >>> from hetpipe.schedule.builders import make_schedule
    >>> sends_may_wait_at_recv(make_schedule("zb-1f1b@2,1,0", 3, 6), num_stages=3, microbatches=6)
    True
    >>> mixed = {**make_schedule("gpipe", 2, 4), 1: make_schedule("1f1b", 2, 4)[1]}
    >>> sends_may_wait_at_recv(mixed, num_stages=2, microbatches=4)
    False
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from hetpipe.schedule.actions import Action, Op, Schedule
from hetpipe.schedule.validate import sends_may_wait_at_recv

__all__ = ["gathered_schedule", "sends_may_wait_at_recv"]

_OPS = tuple(Op)


def gathered_schedule(actions: Sequence[Action], *, num_stages: int, group: Any,
                      wait: Callable[[Any], None]) -> Schedule:
    """Every rank's list of the pipeline `group` of ``num_stages`` ranks (a collective: every rank calls
    it at start-up), keyed by rank.

    ``wait`` waits for a collective's work (bounded: a dead peer becomes the executor's failure).
    """
    codes = [(a.stage, _OPS.index(a.op), -1 if a.microbatch is None else a.microbatch) for a in actions]
    length = torch.tensor([len(codes)], dtype=torch.int64)
    wait(dist.all_reduce(length, op=dist.ReduceOp.MAX, group=group, async_op=True))
    mine = torch.full((int(length), 3), -2, dtype=torch.int64)  # -2 rows pad a shorter list
    mine[:len(codes)] = torch.tensor(codes, dtype=torch.int64)
    # one list per rank of the group: a tensor-parallel group's members share a stage and its list
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    wait(dist.all_gather(every, mine, group=group, async_op=True))
    out: Schedule = {}
    for rows in every:
        acts = [Action(int(s), _OPS[int(o)], None if int(mb) < 0 else int(mb)) for s, o, mb in rows.tolist() if s >= 0]
        if acts:
            out[acts[0].stage % num_stages] = acts  # an interleaved rank's first chunk is its rank
    return out
