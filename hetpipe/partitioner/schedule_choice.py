"""The schedule as a lever: 1F1B, ZB-1F1B, ZB-H1 or interleaved, whichever runs the plan fastest (issue 17, item 2).

The solvers find and verify a placement under 1F1B (`Problem.schedule` "1f1b").  With the
``auto`` option `choose_schedule` also verifies under each split schedule (`SPLIT_SCHEDULES`:
each backward split into B and W) -- from the 1F1B answer and the least-bottleneck placement,
each improved by `verify`'s local search with T and every M_s taken from that schedule's action
lists -- and keeps the fastest.  ZB-H1 holds up to min(p, m) micro-batches on every stage until
their W (more than 1F1B's min(p - s, m) on later stages, so a placement that fits under 1F1B may
not); ZB-1F1B holds 1F1B's.  Naming one schedule keeps that schedule's answer whatever it costs.
With ``auto`` each answer is also tried with extra warm-up forwards (`with_warmup`), the 1F1B
answer's cards and the fastest answer's cards are re-cut into interleaved virtual stages
(`AUTO_INTERLEAVE_CHUNKS` chunks per card, `interleave.price_interleaved`: T and every card's memory
from the interleaved lists the executor runs), and
`warmup_search` searches placements for them (deeper pipelines included) from every answer: its
plans sit at the memory limit, safe since M_s prices what a split backward keeps from B to W
(`HeldCounts.weight_grads`) and the runtime holds exactly M_s (tests/test_weight_grads.py).  The
search is a descent, not exhaustive: the plan's status is OPTIMAL only when the recorded bound
meets T, else FEASIBLE with the bound (the gap) beside it.

A split schedule is searched without recomputation: the executor splits a backward with
`torch.autograd.grad` and a checkpointed unit would recompute in both halves, so a problem that
needs recomputation to fit keeps 1F1B.

The bound: `verify`'s fill term charges the round trip through the stages before b with their
whole backward, but a split schedule sends the input gradient before W.  A valid bound over every
schedule is `schedule_bound` of the problem whose backwards are only their input part (every term
can only shrink), so a plan that may run a split schedule records the lesser of the two bounds.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from hetpipe.cost_models.backward_split import unit_bwd_weight_s
from hetpipe.errors import ConfigError, ScheduleError
from hetpipe.partitioner.interleave import (AUTO_INTERLEAVE_CHUNKS, choose_interleaved, interleave_candidates,
                                            work_bound_s)
from hetpipe.partitioner.problem import Problem
from hetpipe.partitioner.solvers.solve import Solution
from hetpipe.partitioner.solvers.verify import Verified, schedule_bound, verify
from hetpipe.partitioner.warmup_search import warmup_extras, warmup_search, with_warmup
from hetpipe.schedule.builders import SPLIT_SCHEDULES
from hetpipe.schedule.interleaved import parse_interleaved

log = logging.getLogger(__name__)

__all__ = ["SCHEDULE_OPTIONS", "check_schedule_option", "choose_schedule", "input_part_problem", "warmup_extras",
           "with_warmup"]

#: What `hetpipe plan --schedule` accepts: a schedule, or ``auto`` (the fastest for the plan).
SCHEDULE_OPTIONS = ("1f1b", *SPLIT_SCHEDULES, "auto")


def check_schedule_option(option: str) -> None:
    """Refuse an unknown `--schedule` before any work (``interleaved:V``, V >= 2, is one too).

    Example:
        >>> check_schedule_option("gpipe")
        Traceback (most recent call last):
        ...
        hetpipe.errors.ConfigError: --schedule is 'gpipe'; choose one of 1f1b, zb-h1, zb-1f1b, auto or interleaved:V with V >= 2 chunks per card (auto: the fastest for this plan)
    """
    try:
        chunks = parse_interleaved(option)
    except ScheduleError:  # no whole number of chunks (interleaved:0, interleaved:two): say what is accepted
        chunks = 0
    if (option not in SCHEDULE_OPTIONS and chunks is None) or (chunks is not None and chunks < 2):
        raise ConfigError(f"--schedule is {option!r}; choose one of {', '.join(SCHEDULE_OPTIONS)} "
                          "or interleaved:V with V >= 2 chunks per card (auto: the fastest for this plan)")


def input_part_problem(problem: Problem) -> Problem:
    """`problem` with every unit's backward reduced to its input-gradient part (B - W)."""
    trainable = problem.grad_bytes or problem.state_bytes
    bwd = {k: tuple(b - unit_bwd_weight_s(b, trainable=trainable[u] > 0) for u, b in enumerate(table))
           for k, table in problem.bwd_s.items()}
    return dataclasses.replace(problem, bwd_s=bwd)


def _verified(problem: Problem, sol: Solution, schedule: str, limit_s: float) -> tuple[Problem, Verified | None]:
    """The split `schedule`'s problem and its verified answer, or None when no candidate fits."""
    split = dataclasses.replace(problem, schedule=schedule, recompute="none")
    start = tuple(dataclasses.replace(st, recompute_units=()) for st in sol.stages)
    try:
        return split, verify(split, [start], limit_s=limit_s)
    except ValueError:  # no candidate fits under this schedule's memory
        return split, None


def choose_schedule(problem: Problem, sol: Solution, *, option: str, limit_s: float) -> tuple[Problem, Solution]:
    """The problem (its `schedule` chosen) and solution a plan records; see the module docstring."""
    check_schedule_option(option)
    if option == "1f1b" or problem.objective != "schedule":
        return problem, sol
    if parse_interleaved(option) is not None:
        return choose_interleaved(problem, sol, chunks=parse_interleaved(option) or 2, limit_s=limit_s)
    if problem.recompute == "all":
        if option == "auto":
            return problem, sol
        raise ConfigError(f"--schedule {option} runs no recomputation (each backward is split in two); "
                          "use --recompute auto or none with it, or --schedule 1f1b")
    names = SPLIT_SCHEDULES if option == "auto" else (option,)
    tried = {name: _verified(problem, sol, name, limit_s / len(names)) for name in names}
    log.info("schedule choice: 1F1B T = %.6g s; %s", sol.iteration_s,
             ", ".join(f"{n} T = {v.iteration_s:.6g} s" if v else f"{n}: nothing fits" for n, (_, v) in tried.items()))
    # (T, problem, stages): the split schedules recorded with the original lever (every stage fits
    # without recomputing, which is auto's choice too)
    found = [(v.iteration_s, dataclasses.replace(p, recompute=problem.recompute), v.stages)
             for p, v in tried.values() if v is not None]
    if not found and option != "auto":
        raise ConfigError(f"--schedule {option}: no placement the search tried fits every card under its "
                          "in-flight micro-batches without recomputation; use --schedule auto or 1f1b")
    if option == "auto":
        found.append((sol.iteration_s, problem, sol.stages))
        found += [w for t, p, st in list(found) if (w := with_warmup(p, st)) is not None]
        searched = warmup_search(problem, [st for _, _, st in found], limit_s=limit_s / 2)
        if searched is not None:  # recorded with the original lever, like the split answers
            found.append((searched[0], dataclasses.replace(searched[1], recompute=problem.recompute), searched[2]))
        # interleaving re-cuts a placement's cards in their order: the 1F1B answer's and the fastest so far's
        fastest = min(found, key=lambda f: f[0])[2]
        orders = {tuple(st.device for st in s): s for s in (sol.stages, fastest)}
        for stages_in_order in orders.values():
            found += interleave_candidates(problem, stages_in_order, AUTO_INTERLEAVE_CHUNKS,
                                           limit_s=limit_s / len(orders))
    best_s, chosen, stages = min(found, key=lambda f: f[0])
    zb_bound = schedule_bound(input_part_problem(problem))
    if chosen is problem:
        return problem, dataclasses.replace(sol, bound_s=min(sol.bound_s, zb_bound))
    bound = min(sol.bound_s if option == "auto" else zb_bound, zb_bound, best_s,
                work_bound_s(problem) if parse_interleaved(chosen.schedule) else math.inf)
    status = "OPTIMAL" if bound >= best_s * (1 - 1e-9) else "FEASIBLE"
    used = {st.device for st in stages}
    return chosen, dataclasses.replace(sol, stages=tuple(stages), iteration_s=best_s, bound_s=bound, status=status,
                                       unused_devices=tuple(i for i in range(len(problem.devices)) if i not in used))
