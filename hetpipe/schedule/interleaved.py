"""Interleaved 1F1B over virtual stages (Narayanan et al., SC'21, §2.2; Megatron-LM's interleaved schedule).

Each of the p ranks holds v **chunks** (model pieces); chunk c of rank r is **virtual stage**
``c * p + r``, so the model runs through ranks 0..p-1 v times and the activation leaving rank
p - 1's chunk c reaches rank 0's chunk c + 1 over the link p-1 -> 0 (the wrap-around).  Actions
name the virtual stage: ``Action(3, Op.F, 0)`` on rank 1 of 2 is chunk 1's forward of
micro-batch 0.  A rank's single ``STEP`` names its chunk 0 (virtual stage r) and steps every
chunk.

Order (Megatron-LM): forwards run in groups of p micro-batches per chunk -- the k-th forward of a
rank is chunk ``(k // p) % v`` of micro-batch ``(k // (p v)) p + k % p`` -- backwards the same with
the chunks reversed; rank r runs ``2 (p - r - 1) + (v - 1) p`` warm-up forwards (capped at its
m v), then one forward and one backward alternately, then the remaining backwards.  Rule:
**m % p == 0** (Megatron's; a partial group of micro-batches would stall the wrap-around).

With equal virtual stages and free links the bubble is (p - 1) (F + B) of one **chunk** per rank,
i.e. 1/v of plain 1F1B's (p - 1) (f + b) (Narayanan's (p - 1) / (v m) bubble fraction); each
micro-batch crosses v p - 1 cuts instead of p - 1, so p2p traffic grows by v.

Example:
    >>> from hetpipe.schedule.builders import format_grid
    >>> print(format_grid(interleaved_1f1b(2, 2, 2)))
    rank 0: F0 F1 F0 F1 .  B0 .  B1 B0 B1
    rank 1: .  F0 F1 F0 B0 F1 B1 B0 B1
    >>> parse_interleaved("interleaved:2"), interleaved_name(3)
    (2, 'interleaved:3')
"""

from __future__ import annotations

from hetpipe.errors import ScheduleError
from hetpipe.schedule.actions import Action, Op, Schedule
from hetpipe.schedule.validate import check_sizes

#: ``interleaved:V`` is interleaved 1F1B with V chunks per rank.
INTERLEAVED = "interleaved"


def interleaved_name(chunks: int) -> str:
    """The schedule name of interleaved 1F1B with `chunks` chunks per rank."""
    return f"{INTERLEAVED}:{int(chunks)}"


def parse_interleaved(name: str) -> int | None:
    """Chunks per rank of an ``interleaved:V`` name (V >= 1), or None for any other schedule name.

    Example:
        >>> parse_interleaved("1f1b") is None, parse_interleaved("Interleaved:4")
        (True, 4)
    """
    base, sep, tail = str(name).strip().lower().partition(":")
    if base != INTERLEAVED:
        return None
    if not sep or not tail.isdigit() or int(tail) < 1:
        raise ScheduleError(f"schedule {name!r}: give the chunks per rank after ':', an integer >= 1, "
                            "e.g. interleaved:2")
    return int(tail)


def chunks_of(name: str) -> int:
    """Chunks per rank of schedule `name`: V for ``interleaved:V``, 1 for every other schedule."""
    return parse_interleaved(name) or 1


def rank_of_stage(stage: int, num_ranks: int) -> int:
    """The rank that runs virtual stage `stage` (chunk ``stage // num_ranks``)."""
    return stage % num_ranks


def check_interleaved(num_ranks: int, chunks: int, num_microbatches: int) -> None:
    """Raise `ScheduleError` unless interleaved 1F1B can run these sizes (m % p == 0)."""
    check_sizes(num_ranks, num_microbatches)
    check_sizes(chunks, 1)
    if num_microbatches % num_ranks:
        lower = num_microbatches - num_microbatches % num_ranks
        fix = f"use {lower} or {lower + num_ranks}" if lower else f"use {num_ranks}"
        raise ScheduleError(f"interleaved:{chunks} needs micro-batches (num_microbatches = {num_microbatches}) to be a "
                            f"multiple of the {num_ranks} ranks (Megatron-LM's rule); fix: {fix} micro-batches")


def _forward(stage: int, last: int, mb: int) -> list[Action]:
    steps = [Action(stage, Op.RECV_F, mb)] if stage > 0 else []
    steps.append(Action(stage, Op.F, mb))
    return steps + ([Action(stage, Op.SEND_F, mb)] if stage < last else [])


def _backward(stage: int, last: int, mb: int) -> list[Action]:
    steps = [Action(stage, Op.RECV_B, mb)] if stage < last else []
    steps.append(Action(stage, Op.B, mb))
    return steps + ([Action(stage, Op.SEND_B, mb)] if stage > 0 else [])


def interleaved_rank(rank: int, num_ranks: int, chunks: int, num_microbatches: int) -> list[Action]:
    """Rank `rank`'s list of interleaved 1F1B (module docstring); the sizes must pass `check_interleaved`."""
    p, v, m = num_ranks, chunks, num_microbatches
    last = p * v - 1
    total = m * v

    def slot(k: int, backward: bool) -> tuple[int, int]:  # (virtual stage, micro-batch) of its k-th F or B
        chunk = (k // p) % v
        return ((v - 1 - chunk) if backward else chunk) * p + rank, (k // (p * v)) * p + k % p

    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    actions: list[Action] = []
    for k in range(warmup):
        stage, mb = slot(k, False)
        actions += _forward(stage, last, mb)
    for k in range(total - warmup):
        stage, mb = slot(warmup + k, False)
        actions += _forward(stage, last, mb)
        stage, mb = slot(k, True)
        actions += _backward(stage, last, mb)
    for k in range(total - warmup, total):
        stage, mb = slot(k, True)
        actions += _backward(stage, last, mb)
    actions.append(Action(rank, Op.STEP))
    return actions


def interleaved_1f1b(num_ranks: int, chunks: int, num_microbatches: int) -> Schedule:
    """Interleaved 1F1B: rank -> actions over its `chunks` virtual stages (module docstring).

    Example:
        >>> [str(a) for a in interleaved_1f1b(2, 2, 2)[1]][:6]
        ['1RECV_F0', '1F0', '1SEND_F0', '1RECV_F1', '1F1', '1SEND_F1']
    """
    check_interleaved(num_ranks, chunks, num_microbatches)
    return {r: interleaved_rank(r, num_ranks, chunks, num_microbatches) for r in range(num_ranks)}
