"""The run report of an interleaved run, per virtual stage (issue 17 item 2).

A rank of ``interleaved:V`` runs V chunks; its recorded F / B durations (`RankResult.fwd_s` ...)
are every F / B of every step in the order of its action list, so the i-th F of a step belongs
to the virtual stage of the i-th F action of ``rank_actions(interleaved:V, p, m, rank)`` (the
list the plan records and the executor runs).  Each chunk
gets a row (`chunk_rows`): its units, its median F / B beside the plan's `PlanChunk` figures;
the card's optimizer step and peak memory are the rank's (its chunks share one ledger and one STEP).
The stage row then reports the card's work per micro-batch, the sum over its chunks
(`card_totals`), not a median of F / B mixed across chunks.

Example (2 ranks, 2 chunks, 2 micro-batches: rank 0 runs F of virtual stages 0, 0, 2, 2):
    >>> split_by_stage([1.0, 1.1, 5.0, 5.2, 1.2, 1.3, 5.4, 5.6], (0, 0, 2, 2))
    {0: [1.0, 1.1, 1.2, 1.3], 2: [5.0, 5.2, 5.4, 5.6]}
"""

from __future__ import annotations

import dataclasses
import math
from statistics import median
from typing import Any, Sequence

from hetpipe.schedule.actions import Op
from hetpipe.schedule.builders import rank_actions
from hetpipe.schedule.interleaved import interleaved_name


def split_by_stage(values: Sequence[float], order: Sequence[int]) -> dict[int, list[float]]:
    """Virtual stage -> its entries of ``values`` (steps of ``len(order)`` entries, in ``order``)."""
    out: dict[int, list[float]] = {k: [] for k in dict.fromkeys(order)}
    for i, value in enumerate(values):
        out[order[i % len(order)]].append(value)
    return out


def after_warm_up(values: Sequence[float], per_step: int) -> float:
    """Median of ``values`` past step 0's ``per_step`` (the warm-up; all of them with one step); NaN if none."""
    kept = list(values[per_step:]) if len(values) > per_step else list(values)
    return median(kept) if kept else math.nan


def chunk_rows(plan: Any, results: Sequence[Any], stage_rows: Sequence[Any]) -> tuple[Any, ...]:
    """One row (a ``StageRecord``, ``stage`` = the virtual stage) per chunk of every rank, in virtual-stage
    order; () for a plan without chunks.  ``results`` / ``stage_rows``: the ranks' `RankResult`s and
    their stage rows, by stage."""
    p, v = len(plan.stages), len(plan.stages[0].chunks) if plan.stages else 0
    if v < 2:
        return ()
    m, rows = plan.training.microbatches, []
    for r, row in zip(results, stage_rows):
        acts = rank_actions(interleaved_name(v), p, m, r.stage)
        split = {name: split_by_stage(getattr(r, name), [a.stage for a in acts if a.op is op])
                 for name, op in (("fwd_s", Op.F), ("bwd_s", Op.B), ("fwd_compute_s", Op.F),
                                  ("bwd_compute_s", Op.B))}
        card_step_s = sum(ch.step_s for ch in plan.stages[r.stage].chunks)  # one STEP steps every chunk
        for c, ch in enumerate(plan.stages[r.stage].chunks):
            k = c * p + r.stage
            got = {name: after_warm_up(by[k], m) for name, by in split.items()}
            rows.append(dataclasses.replace(
                row, stage=k, first_unit=ch.first_unit, last_unit=ch.last_unit,
                fwd_compute_s=got["fwd_compute_s"], bwd_compute_s=got["bwd_compute_s"],
                fwd_emulated_s=got["fwd_s"] / r.time_scale, bwd_emulated_s=got["bwd_s"] / r.time_scale,
                predicted_fwd_s=ch.fwd_s, predicted_bwd_s=ch.bwd_s, predicted_step_s=card_step_s,
                predicted_transfer_s=ch.send_s, transfer_s=None, transfer_messages=0, step_ratios=(),
                fwd_cpu_s=None, bwd_cpu_s=None))  # the rank's CPU seconds are not split by chunk
    return tuple(sorted(rows, key=lambda row: row.stage))


def card_totals(stage_rows: Sequence[Any], chunks: Sequence[Any]) -> tuple[Any, ...]:
    """Each stage row with F / B (measured, compute, predicted) the sum over its chunks' rows: the
    card's work per micro-batch, and the plan's S the card's whole step (the chunk rows carry it too:
    one STEP steps every chunk); the rows unchanged without chunks."""
    if not chunks:
        return tuple(stage_rows)
    p = len(stage_rows)
    fields = ("fwd_compute_s", "bwd_compute_s", "fwd_emulated_s", "bwd_emulated_s", "predicted_fwd_s",
              "predicted_bwd_s")
    return tuple(dataclasses.replace(row, predicted_step_s=next(c.predicted_step_s for c in chunks
                                                                if c.stage == row.stage),
                                     fwd_cpu_s=None, bwd_cpu_s=None,  # a median over every chunk's F, not a sum
                                     **{f: sum(getattr(c, f) for c in chunks if c.stage % p == row.stage)
                                        for f in fields})
                 for row in stage_rows)
