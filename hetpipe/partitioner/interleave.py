"""Interleaved virtual stages as a schedule the planner prices (issue 17 item 2; Narayanan et al. 2021).

Given a placement's devices in pipeline order (p ranks), `interleave_stages` cuts the model into
v p virtual stages, stage k on rank k % p, each as close as possible to the same seconds on its own
card (the least, over cuts, of the largest virtual stage's F + B: every rank then carries v pieces
of about equal time, "equal-ish layers per rank" weighted by each card's speed), then moves single
cuts while `evaluate` -- the contract, with ``Problem.schedule = "interleaved:v"`` -- finds a lower T
that fits.  `price_interleaved` returns that placement and its evaluation, or None where it cannot
run: m % p != 0 (Megatron-LM's rule), fewer units than virtual stages, a tensor-parallel group in
the placement, or no cut that fits every card (interleaving is searched without recomputation or
offload).  This prices one device order, the one the 1F1B search chose; it is not a joint search
over orders, cuts and chunks.

Example:
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage, evaluate
    >>> devs = (DeviceSlot("d0", "a", "n0", 10**6), DeviceSlot("d1", "a", "n0", 10**6))
    >>> prob = Problem(fwd_s={"a": (1.0,) * 8}, bwd_s={"a": (2.0,) * 8}, state_bytes=(1,) * 8,
    ...                activation_bytes=(1,) * 8, boundary_bytes=(0,) * 8, devices=devs,
    ...                bandwidth_bytes_s=((1.0, 1.0), (1.0, 1.0)), latency_s=((0.0, 0.0), (0.0, 0.0)),
    ...                microbatches=4)
    >>> plain = evaluate(prob, (Stage(0, 0, 3), Stage(1, 4, 7))).iteration_s
    >>> found = price_interleaved(prob, (Stage(0, 0, 3), Stage(1, 4, 7)), chunks=2)
    >>> plain, found.evaluation.iteration_s, [(s.device, s.first_unit, s.last_unit) for s in found.stages]
    (60.0, 54.0, [(0, 0, 1), (1, 2, 3), (0, 4, 5), (1, 6, 7)])
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Sequence

from hetpipe.errors import ConfigError
from hetpipe.partitioner.problem import Evaluation, Problem, Stage, evaluate
from hetpipe.partitioner.solvers.solve import Solution
from hetpipe.schedule.interleaved import interleaved_name

log = logging.getLogger(__name__)

#: Bisection steps on the largest virtual stage's seconds (2**-60 of the range: below float noise).
_BISECT_STEPS = 60


@dataclasses.dataclass(frozen=True)
class Interleaved:
    """A priced interleaved placement: the problem (its schedule ``interleaved:v``), the v p virtual
    stages in model order and their evaluation under the contract."""

    problem: Problem
    stages: tuple[Stage, ...]
    evaluation: Evaluation


def _piece_s(problem: Problem, device: int) -> list[float]:
    kind = problem.devices[device].kind
    return [f + b for f, b in zip(problem.fwd_s[kind], problem.bwd_s[kind])]


def _greedy_cuts(times: Sequence[Sequence[float]], limit_s: float, num_units: int) -> list[int] | None:
    """Last unit of each virtual stage when each takes as many units as fit in `limit_s` on its card
    (optimal for the least largest piece: a longer earlier piece never hurts a later one); None if
    the units do not fit in ``len(times)`` pieces of at least one unit each."""
    cuts, u = [], 0
    for k, table in enumerate(times):
        left = len(times) - k - 1  # later pieces need a unit each
        if u >= num_units - left:
            return None
        total, end = table[u], u  # a piece holds at least one unit
        while end + 1 < num_units - left and total + table[end + 1] <= limit_s:
            end += 1
            total += table[end]
        cuts.append(end)
        u = end + 1
    return cuts if u == num_units else None


def balanced_cuts(problem: Problem, devices: Sequence[int], chunks: int) -> list[int] | None:
    """Last unit of each of the v p virtual stages (stage k on ``devices[k % p]``) minimising the
    largest virtual stage's F + B on its card; None with fewer units than virtual stages."""
    virtual = len(devices) * chunks
    times = [_piece_s(problem, devices[k % len(devices)]) for k in range(virtual)]
    if problem.num_units < virtual:
        return None
    lo, hi = 0.0, max(sum(t) for t in times)
    for _ in range(_BISECT_STEPS):
        mid = (lo + hi) / 2
        if _greedy_cuts(times, mid, problem.num_units) is None:
            lo = mid
        else:
            hi = mid
    return _greedy_cuts(times, hi, problem.num_units)


def _stages(devices: Sequence[int], cuts: Sequence[int]) -> tuple[Stage, ...]:
    starts = [0, *(c + 1 for c in cuts[:-1])]
    return tuple(Stage(devices[k % len(devices)], a, b) for k, (a, b) in enumerate(zip(starts, cuts)))


def _score(ev: Evaluation) -> tuple[bool, int, float]:
    """Fitting first; until it fits, the fullest card's overflow (how a start moves toward fitting); then T."""
    return (not ev.fits, 0 if ev.fits else max(c.memory_bytes - c.usable_bytes for c in ev.stages), ev.iteration_s)


def improve_cuts(problem: Problem, devices: Sequence[int], cuts: list[int], *,
                 limit_s: float) -> tuple[tuple[Stage, ...], Evaluation]:
    """Move one cut by one unit at a time while T (or, until it fits, the overflow) drops; `limit_s` wall."""
    best_stages = _stages(devices, cuts)
    best = evaluate(problem, best_stages)
    deadline, improved = time.monotonic() + limit_s, True
    while improved and time.monotonic() < deadline:
        improved = False
        for k in range(len(cuts) - 1):  # the last cut is the model's end
            for step in (-1, 1):
                trial = list(cuts)
                trial[k] += step
                low = trial[k - 1] if k else -1
                if not low < trial[k] < trial[k + 1]:
                    continue
                stages = _stages(devices, trial)
                ev = evaluate(problem, stages)
                if _score(ev) < _score(best):
                    cuts, best_stages, best, improved = trial, stages, ev, True
    return best_stages, best


def price_interleaved(problem: Problem, stages: Sequence[Stage], *, chunks: int,
                      limit_s: float = 5.0) -> Interleaved | None:
    """Interleaved 1F1B with `chunks` chunks per rank on the devices of `stages`, in their order
    (module docstring); None where it cannot run or nothing tried fits."""
    p = len(stages)
    if chunks < 2 or p < 2 or problem.microbatches % p or any(st.members for st in stages):
        return None
    devices = [st.device for st in stages]
    inter = dataclasses.replace(problem, schedule=interleaved_name(chunks), recompute="none", offload="never")
    cuts = balanced_cuts(inter, devices, chunks)
    if cuts is None:
        return None
    found, ev = improve_cuts(inter, devices, cuts, limit_s=limit_s)
    log.info("interleaved:%d on %d ranks: T = %.6g s, fits: %s", chunks, p, ev.iteration_s, ev.fits)
    return Interleaved(inter, found, ev) if ev.fits else None


#: Chunks per card `--schedule auto` also prices (`hetpipe run` executes them, runtime/interleaved_run.py).
#: Only 2: the runtime is tested at 2 chunks per rank (tests/test_interleaved_runtime.py), and every extra
#: chunk adds p cut crossings per micro-batch (V p - 1 in all), which slow links pay for.
AUTO_INTERLEAVE_CHUNKS: tuple[int, ...] = (2,)


def work_bound_s(problem: Problem) -> float:
    """A lower bound on T under any schedule and placement: every micro-batch's forward and backward
    of every unit runs somewhere, at best on the fastest kind for that unit, and the cards share the
    work at best evenly: ``m sum_u min_kind (F_u + B_u) / number of cards`` (optimizer steps, links and
    bubbles only add to it)."""
    best = [min(problem.fwd_s[k][u] + problem.bwd_s[k][u] for k in problem.fwd_s) for u in range(problem.num_units)]
    return problem.microbatches * sum(best) / len(problem.devices)


def interleave_candidates(problem: Problem, stages: Sequence[Stage], chunk_options: Sequence[int], *,
                          limit_s: float) -> list[tuple[float, Problem, tuple[Stage, ...]]]:
    """(T, problem, virtual stages) of each chunk count in `chunk_options` that runs and fits on `stages`' cards."""
    found = [price_interleaved(problem, stages, chunks=v, limit_s=limit_s / max(len(chunk_options), 1))
             for v in chunk_options]
    return [(f.evaluation.iteration_s, recorded(problem, f), f.stages) for f in found if f is not None]


def recorded(problem: Problem, found: Interleaved) -> Problem:
    """The problem a plan records for `found`: its schedule, with `problem`'s recompute lever (the virtual
    stages are searched without recomputing, and every one of them fits so: the lever chooses none for
    them), so that `hetpipe check` prices the baselines with the lever they were planned with."""
    return dataclasses.replace(found.problem, recompute=problem.recompute)


def choose_interleaved(problem: Problem, sol: Solution, *, chunks: int, limit_s: float) -> tuple[Problem, Solution]:
    """`--schedule interleaved:V`: the solved placement's cards, in its order, re-cut into V chunks each
    (`price_interleaved`); a `ConfigError` saying why when it cannot run or fit."""
    if problem.recompute == "all":
        raise ConfigError(f"--schedule interleaved:{chunks} runs no recomputation; use --recompute auto or none "
                          "with it, or --schedule 1f1b")
    p = len(sol.stages)
    if p < 2:  # one rank has no pipeline to interleave (and its run would send to itself)
        raise ConfigError(f"--schedule interleaved:{chunks}: the best placement uses one card, and interleaving "
                          "needs a pipeline of at least 2; use --schedule 1f1b, or more micro-batches "
                          "(--global-batch) so that more cards pay")
    if problem.microbatches % p:
        raise ConfigError(f"--schedule interleaved:{chunks}: the {problem.microbatches} micro-batches are not a "
                          f"multiple of the plan's {p} cards (Megatron-LM's rule); choose --global-batch so they are")
    found = price_interleaved(problem, sol.stages, chunks=chunks, limit_s=limit_s)
    if found is None:
        raise ConfigError(f"--schedule interleaved:{chunks}: no cut of the model into {chunks * p} chunks on the plan's "
                          f"{p} cards fits every card (or the model has fewer units); use fewer chunks or 1f1b")
    t = found.evaluation.iteration_s
    bound = min(work_bound_s(problem), t)
    log.info("interleaved:%d: T = %.6g s (1F1B %.6g s)", chunks, t, sol.iteration_s)
    return recorded(problem, found), dataclasses.replace(sol, stages=found.stages, iteration_s=t, bound_s=bound,
                                              status="OPTIMAL" if bound >= t * (1 - 1e-9) else "FEASIBLE")
