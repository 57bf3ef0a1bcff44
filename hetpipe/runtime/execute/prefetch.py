"""When a rank posts its receives, and whether a RECV first waits for the rank's earlier sends.

On gloo the stages' compute and gloo's I/O threads share the CPU cores, and two defaults follow
measurements (benchmarks/runtime_vs_torch.py, 2-core VM): receives are posted at their own action
while every local rank has a core of its own (posting early cost 15-40% there: the I/O thread that
completes an early receive must preempt a busy stage), and `PREFETCH_DEPTH` ahead when ranks
outnumber cores (ranks then block often and data should flow meanwhile).  Off gloo (NCCL matches
point-to-point operations in issue order per peer) a receive is never posted ahead of a send to
the same peer.

Where every rank's list together is deadlock-free with it (`agreement`: `validate_schedule`
``sends_wait_at_recv=True`` on the lists all-gathered at start-up), a RECV first waits for this
rank's earlier sends (``wait_sends_at_recv``; 3-8% faster).  Interleaved 1F1B deadlocks in that
mode with m > p (rank 0's RECV_B would wait for a send to rank 1 that rank 1 receives only after its
own RECV_B, which waits for a send to rank 0); its RECVs wait one RECV behind instead
(`INTERLEAVED_SEND_LAG`: the sends posted before the rank's previous RECV), deadlock-free for every
p <= 4, v <= 4, m <= 4p (`validate_schedule` ``send_wait_lag=1``, tests/test_interleaved_sends.py,
and checked on the gathered lists at start-up), so a send frame is held at most until the second
RECV after it (the memory model's rule, `hetpipe.schedule.held_virtual`), not until STEP.

Example:
    >>> from hetpipe.schedule.actions import Action, Op
    >>> acts = [Action(1, Op.RECV_F, 0), Action(1, Op.F, 0), Action(1, Op.RECV_F, 1), Action(1, Op.F, 1)]
    >>> [[str(a) for a in at] for at in prefetch_plan(acts, depth=1, gloo=True, peer=lambda a: 0)]
    [['1RECV_F0'], ['1RECV_F1'], ['1RECV_F1'], []]
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import torch.distributed as dist

from hetpipe.cost_models.stage_memory import RECV_PREFETCH
from hetpipe.schedule.actions import Action, Op
from hetpipe.schedule.held_virtual import INTERLEAVED_SEND_LAG

RECVS = (Op.RECV_F, Op.RECV_B)
SENDS = (Op.SEND_F, Op.SEND_B)
# Receives posted ahead off gloo (the next one and two more: covers a 1F1B F-B-F window); the
# memory model counts a buffer for each (`hetpipe.cost_models.stage_memory.RECV_PREFETCH`).
PREFETCH_DEPTH = RECV_PREFETCH


def default_prefetch(gloo: bool) -> int:
    """`PREFETCH_DEPTH`, or 0 on gloo while every local rank has a CPU core (module docstring)."""
    if not gloo:
        return PREFETCH_DEPTH
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return PREFETCH_DEPTH if local_ranks > cores else 0


def prefetch_plan(actions: Sequence[Action], *, depth: int, gloo: bool,
                  peer: Callable[[Action], int]) -> tuple[tuple[Action, ...], ...]:
    """Per action index: the next ``depth`` receives, in order (none at depth 0: each posts itself).

    Off gloo a receive is never posted ahead of a send to the same peer (module docstring).  The
    list depends only on the action list, so it is computed once.
    """
    plan = []
    for index in range(len(actions)):
        found, blocked, post = 0, set(), []
        for a in actions[index:]:
            if a.op in SENDS:
                blocked.add(peer(a))
            elif a.op in RECVS:
                if found >= depth:
                    break
                found += 1
                if gloo or peer(a) not in blocked:
                    post.append(a)
        plan.append(tuple(post))
    return tuple(plan)
