"""The plan record of a rank's chunks under interleaved 1F1B (`PlanStage.chunks`, version 6; issue 17 item 2).

A plan solved with ``--schedule interleaved:V`` (or chosen by ``auto``) lists one `PlanStage` per
rank (card), as every plan does; its ``chunks`` list the V pieces of the model that rank runs, in
chunk order: chunk c of stage r is virtual stage ``c p + r`` (`hetpipe.schedule.interleaved`).  The
stage's own first/last unit, fwd_s, bwd_s, send_s and step_s are its chunk 0's; its memory_bytes
is the rank's (every chunk's, `hetpipe.cost_models.chunk_memory`).  `hetpipe check` rebuilds the
virtual stages from them and re-derives every chunk's figures.

Example:
    >>> from hetpipe.partitioner.problem import Stage, StageCost
    >>> a = (PlanChunk(0, 1, 1.0, 2.0, 0.1), PlanChunk(4, 5, 1.0, 2.0, 0.1))
    >>> b = (PlanChunk(2, 3, 1.0, 2.0, 0.1), PlanChunk(6, 7, 1.0, 2.0, 0.0))
    >>> virtual_stages([(0, a), (1, b)])
    (Stage(device=0, first_unit=0, last_unit=1, recompute_units=(), offload=False, members=(), selective=False), Stage(device=1, first_unit=2, last_unit=3, recompute_units=(), offload=False, members=(), selective=False), Stage(device=0, first_unit=4, last_unit=5, recompute_units=(), offload=False, members=(), selective=False), Stage(device=1, first_unit=6, last_unit=7, recompute_units=(), offload=False, members=(), selective=False))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from hetpipe.errors import PlanError
from hetpipe.plan.check_report import close_to_recorded
from hetpipe.partitioner.problem import Stage, StageCost


@dataclass(frozen=True)
class PlanChunk:
    """One chunk of a rank: its units and its costs as evaluated (seconds per micro-batch; C one way)."""

    first_unit: int
    last_unit: int
    fwd_s: float
    bwd_s: float
    send_s: float  # C to the next virtual stage (the next rank; rank p-1's goes back to rank 0); 0 for the last
    step_s: float = 0.0  # this chunk's share of its rank's optimizer step


def virtual_stages(ranks: Sequence[tuple[int, Sequence[PlanChunk]]]) -> tuple[Stage, ...]:
    """The v p virtual stages, in model order, of ranks given as (device index, chunks)."""
    counts = {len(chunks) for _, chunks in ranks}
    if len(counts) != 1 or 0 in counts:
        raise PlanError(f"stages list {sorted(counts)} chunks; an interleaved plan gives every stage the same "
                        "number (>= 1) of chunks; re-plan it")
    v = counts.pop()
    return tuple(Stage(device, ch.first_unit, ch.last_unit) for c in range(v) for device, chunks in ranks
                 for ch in (chunks[c],))


def plan_chunks(stages: Sequence[Stage], costs: Sequence[StageCost], rank: int, ranks: int) -> tuple[PlanChunk, ...]:
    """Rank `rank`'s chunks of an evaluated interleaved placement (`ranks` p; () when it has one stage)."""
    if len(stages) == ranks:
        return ()
    return tuple(PlanChunk(stages[k].first_unit, stages[k].last_unit, costs[k].fwd_s, costs[k].bwd_s, costs[k].send_s,
                           costs[k].step_s) for k in range(rank, len(stages), ranks))


def chunk_violations(stages: Sequence[Any], costs: Sequence[StageCost]) -> list[str]:
    """Each recorded chunk's figures (of the plan's `PlanStage`s) against the re-evaluated virtual stages."""
    out, p = [], len(stages)
    for r, st in enumerate(stages):
        for c, ch in enumerate(st.chunks):
            k = c * p + r
            if k >= len(costs):
                out.append(f"stage {st.index}: chunk {c} has no virtual stage {k}; re-plan it")
                continue
            for name in ("fwd_s", "bwd_s", "send_s", "step_s"):
                recorded, actual = getattr(ch, name), getattr(costs[k], name)
                if not close_to_recorded(recorded, actual):
                    out.append(f"stage {st.index} chunk {c}: recorded {name} {recorded!r} != recomputed {actual!r}")
    return out
