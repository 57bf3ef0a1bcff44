"""Extra warm-ups searched together with the placement (issue 17, item 2: slow links hidden by
more micro-batches in flight, memory priced).

`schedule_choice.with_warmup` adds extra warm-up forwards to the placement the solvers found for
1F1B (or for a split schedule).  Where the links are slow, that placement is often the wrong one:
its stages are full, so the extra micro-batches that would cover the round trip do not fit, while
a deeper pipeline -- more cards, each holding fewer units -- has room for them.  On the bundled
``slow-ring-mini`` (gpt-demo on four mini 3090s over 10 Mbit/s) the best 1F1B plan uses 2 cards
and T = 2124 ms; no warm-up fits it, but 4 stages with ``zb-1f1b@3,2,2,0`` fit every card and take
1798 ms (this search, with the loss's saved tensors and what W keeps priced: benchmarks/results/schedules.md).

`warmup_search` prices a placement by its best schedule with warm-ups (`with_warmup`; the plain
schedule when no warm-up helps or fits) and improves it by first-improvement descent over moves
that keep the number of stages (a cut moved, two neighbouring stages' cards swapped, a stage moved
to an unused card), from each start: the given placements and the estimate-optimal placements
one and two stages deeper (`solve_estimate` with ``num_stages``).  Every schedule name carries one
extra count per stage, so the descent never changes the depth.  Memory is every card's usable
memory, as for every plan; stages run without recomputation (split schedules cannot recompute).

Example (six equal units, a slow link on every cut; on two stages no warm-up fits or helps, the
search moves to three cards, where one more micro-batch fits on the first two stages):
    >>> import math
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage, evaluate
    >>> n = 6
    >>> prob = Problem(fwd_s={"a": (1.0,) * n}, bwd_s={"a": (2.0,) * n}, state_bytes=(10,) * n,
    ...                activation_bytes=(4,) * n, boundary_bytes=(4.0,) * n,
    ...                devices=tuple(DeviceSlot(f"d{i}", "a", f"n{i}", 100) for i in range(3)),
    ...                bandwidth_bytes_s=tuple(tuple(math.inf if i == j else 1.0 for j in range(3)) for i in range(3)),
    ...                latency_s=((0.0,) * 3,) * 3, microbatches=8)
    >>> two = (Stage(0, 0, 2), Stage(1, 3, 5))
    >>> evaluate(prob, two).iteration_s, with_warmup(prob, two)
    (113.0, None)
    >>> t, chosen, stages = warmup_search(prob, [two], limit_s=5.0)
    >>> t, chosen.schedule.partition("@")[2], len(stages)  # ZB-H1 and ZB-1F1B tie here
    (84.0, '1,1,0', 3)
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Iterator, Sequence

from hetpipe.errors import HetpipeError
from hetpipe.partitioner.problem import Problem, Stage, evaluate
from hetpipe.partitioner.recompute import with_recompute
from hetpipe.partitioner.solvers.solve import solve_estimate
from hetpipe.schedule.builders import SPLIT_SCHEDULES, is_split, warmup_name

log = logging.getLogger(__name__)

#: Pipelines this many stages deeper than the given placements are searched too.
DEEPER_STAGES = 2
#: Placements priced per start (each pricing tries a few warm-up counts).
MAX_MOVES = 400

Found = tuple[float, Problem, tuple[Stage, ...]]


def warmup_extras(problem: Problem, stages: Sequence[Stage]) -> tuple[int, ...]:
    """Extra warm-up forwards per stage so that its in-flight micro-batches cover its round trip.

    Stage s of 1F1B holds p - s micro-batches; one micro-batch's round trip from its forward on s
    to its backward back on s takes ``R_s = sum_{j>=s} (F_j + B_j) + 2 sum_{j>=s, j<p-1} C_j``, so
    s idles unless ``k_s >= R_s / X`` micro-batches are in flight, X the slowest stage's F + B (its
    period).  Extra = max(0, ceil(R_s / X) - (p - s)), made non-increasing along the pipeline
    (deadlock-free, `hetpipe.schedule.builders.warmup_name`); memory is checked by the caller.
    """
    ev = evaluate(problem, stages)
    costs = ev.stages
    period = max(c.fwd_s + c.bwd_s for c in costs)
    p, extra = len(costs), []
    for s in range(p):
        trip = sum(c.fwd_s + c.bwd_s for c in costs[s:]) + 2 * sum(c.send_s for c in costs[s:-1])
        extra.append(max(0, min(problem.microbatches, math.ceil(trip / period - 1e-9) - (p - s))) if period > 0 else 0)
    for s in range(p - 2, -1, -1):
        extra[s] = max(extra[s], extra[s + 1])
    return tuple(extra)


def recomputes(problem: Problem) -> bool:
    """Whether extra warm-ups may pay for their memory by recomputation: the plan's lever is ``auto`` and
    the schedule runs a recomputing stage (1F1B; a split backward cannot, `schedule_choice`)."""
    return problem.recompute == "auto" and not is_split(problem.schedule)


def with_levers(problem: Problem, stages: Sequence[Stage], *, recompute: bool) -> tuple[Stage, ...]:
    """`stages` with each stage's recompute prefix chosen under `problem`'s schedule (the smallest that fits,
    `with_recompute`: the one `hetpipe check` re-derives) when `recompute`, else without recomputation."""
    if recompute:
        return with_recompute(problem, stages)
    return tuple(dataclasses.replace(st, recompute_units=()) for st in stages)


def with_warmup(problem: Problem, stages: Sequence[Stage]) -> tuple[float, Problem, Sequence[Stage]] | None:
    """`problem` under its schedule with extra warm-up forwards, if that is faster; None otherwise (issue 17:
    "extra warm-up micro-batches in flight on chosen stages, memory priced").

    Tries `warmup_extras` and 3/4, 1/2, 1/4 of it; each is cut back on the stages that overflow their card
    (a stage's moments depend on its own count only; later stages are capped to keep the counts
    non-increasing) until every stage fits; the fastest that beats the plain schedule wins.  None when
    `stages` do not fit without them (more micro-batches in flight only hold more).  Where the plan
    recomputes (`recomputes`), each count is also tried with every stage recomputing the least that fits
    it: on a link-bound pipeline the compute it adds is idle time anyway, and the memory it frees holds
    the micro-batches that cover the round trip.
    """
    first = evaluate(problem, stages)
    if not first.fits:
        return None
    best: tuple[float, Problem, Sequence[Stage]] | None = None
    for lever in (False, True) if recomputes(problem) else (False,):
        found = _warmup_counts(problem, stages, plain_s=first.iteration_s, recompute=lever)
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    return best


def _warmup_counts(problem: Problem, stages: Sequence[Stage], *, plain_s: float,
                   recompute: bool) -> tuple[float, Problem, Sequence[Stage]] | None:
    """`with_warmup`'s walk over the extra counts, the stages' recomputation chosen per count or none."""
    base = problem.schedule.partition("@")[0]
    full = warmup_extras(problem, stages)
    best: tuple[float, Problem, Sequence[Stage]] | None = None
    for share in (1.0, 0.75, 0.5, 0.25):
        extra = [int(k * share) for k in full]
        while any(extra):
            cand = dataclasses.replace(problem, schedule=warmup_name(base, extra))
            placed = with_levers(cand, stages, recompute=recompute)
            ev = evaluate(cand, placed)
            if ev.fits:
                if ev.iteration_s < plain_s * (1 - 1e-9) and (best is None or ev.iteration_s < best[0]):
                    best = (ev.iteration_s, cand, placed)
                break
            before = list(extra)
            for s, c in enumerate(ev.stages):
                if not c.fits:
                    extra[s] = max(0, extra[s] - 1)
                    extra[s + 1:] = [min(k, extra[s]) for k in extra[s + 1:]]
            if extra == before:  # the overflowing stage has no extra of its own (it holds others' send frames):
                extra[max(k for k, v in enumerate(extra) if v)] -= 1  # the last one, keeping the counts non-increasing
    return best


def priced(problem: Problem, stages: tuple[Stage, ...]) -> Found | None:
    """The fastest of ``problem.schedule`` and it with extra warm-ups on `stages` that fits, or None."""
    stages = with_levers(problem, stages, recompute=recomputes(problem))
    ev = evaluate(problem, stages)
    if not ev.fits:  # extra warm-ups only add micro-batches in flight
        return None
    best = (ev.iteration_s, problem, stages)
    warm = with_warmup(problem, stages)
    if warm is not None and warm[0] < best[0]:
        best = (warm[0], warm[1], tuple(warm[2]))
    return best


def _moves(problem: Problem, stages: tuple[Stage, ...]) -> Iterator[tuple[Stage, ...]]:
    """Placements one move away with as many stages: a cut moved, neighbours' cards swapped, a stage
    moved to an unused card (one per kind and node: the others are the same to the schedule)."""
    for s in range(len(stages) - 1):
        a, b = stages[s], stages[s + 1]
        for cut in range(a.first_unit, b.last_unit):
            if cut != a.last_unit:
                yield stages[:s] + (dataclasses.replace(a, last_unit=cut),
                                    dataclasses.replace(b, first_unit=cut + 1)) + stages[s + 2:]
        yield stages[:s] + (dataclasses.replace(a, device=b.device), dataclasses.replace(b, device=a.device)) + stages[s + 2:]
    used = {st.device for st in stages}
    spare = {(d.kind, d.node): i for i, d in reversed(list(enumerate(problem.devices))) if i not in used}
    for s, st in enumerate(stages):
        for dev in spare.values():
            yield stages[:s] + (dataclasses.replace(st, device=dev),) + stages[s + 1:]


def _descend(problem: Problem, start: tuple[Stage, ...], deadline: float) -> Found | None:
    """First-improvement descent from `start` under `priced` (at most `MAX_MOVES` placements)."""
    best = priced(problem, start)
    current, moves, better = start, 0, True
    while better and moves < MAX_MOVES and time.perf_counter() < deadline:
        better = False
        for cand in _moves(problem, current):
            moves += 1
            if moves >= MAX_MOVES or time.perf_counter() > deadline:
                break
            found = priced(problem, cand)
            if found is not None and (best is None or found[0] < best[0] * (1 - 1e-12)):
                best, current, better = found, cand, True
                break
    return best


def deeper_starts(problem: Problem, depth: int, *, limit_s: float) -> list[tuple[Stage, ...]]:
    """The estimate-optimal placements with ``depth + 1`` .. ``depth + DEEPER_STAGES`` stages that exist."""
    out = []
    top = min(len(problem.devices), problem.num_units)
    deeper = range(depth + 1, min(top, depth + DEEPER_STAGES) + 1)
    for q in deeper:
        try:
            sol = solve_estimate(problem, time_limit_s=max(0.1, limit_s / max(1, len(deeper))), num_stages=q)
        except HetpipeError:  # nothing of that depth fits
            continue
        out.append(tuple(dataclasses.replace(st, recompute_units=()) for st in sol.stages))
    return out


def warmup_search(problem: Problem, starts: Sequence[Sequence[Stage]], *, limit_s: float) -> Found | None:
    """The fastest placement and schedule (1F1B or split, with extra warm-ups or not) the descent
    finds from `starts` and the deeper estimate-optimal placements (module docstring), or None.

    Offloading and tensor-parallel stages are not searched (their levers are priced elsewhere).
    """
    if problem.objective != "schedule" or any(st.offload or st.members for s in starts for st in s):
        return None
    start_s = time.perf_counter()
    plain = [tuple(dataclasses.replace(st, recompute_units=()) for st in s) for s in starts]
    depths = sorted({len(s) for s in plain})
    plain += deeper_starts(problem, max(depths, default=0), limit_s=limit_s / 4)
    unique = list(dict.fromkeys(plain))
    bases = ("1f1b", *SPLIT_SCHEDULES)
    share = max(0.0, limit_s - (time.perf_counter() - start_s)) / max(1, len(unique) * len(bases))
    best: Found | None = None
    for start in unique:
        for base in bases:  # split schedules run no recomputation; 1F1B keeps the plan's lever
            prob = dataclasses.replace(problem, schedule=base,
                                       recompute="none" if is_split(base) else problem.recompute)
            found = _descend(prob, start, time.perf_counter() + share)
            if found is not None and (best is None or found[0] < best[0]):
                best = found
    if best is not None:
        log.info("warm-up search: T = %.6g s with %s on %d stages", best[0], best[1].schedule, len(best[2]))
    return best if best is None or math.isfinite(best[0]) else None
