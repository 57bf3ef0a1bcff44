"""Which units a stage recomputes: the lever of `Problem.recompute`, chosen per stage.

A stage on units U, device kind kappa, at position s of p recomputes the first r units of
its order (`cost_models.recompute.recompute_order`: saved bytes per recompute second on
kappa, descending), r in 0..len(order):

* ``none`` and ``selective`` (the selective level alone): r = 0;  ``all``: r = len(order) (Megatron-LM
  ``--recompute-granularity full``);
* ``auto``: the smallest r whose M_s fits the device (no r fits: the least-memory r, and the
  placement is infeasible anyway).

Why the smallest fitting r is optimal, so that the DP stays exact: for a fixed stage (its
unit range, device and position, hence its in-flight count k_s and its cuts) T depends on
the stage only through F_s + B_s and C_s.  C_s does not depend on r; F_s + B_s = F_s + B_s(0)
+ sum of the first r units' F_u is non-decreasing in r (F_u >= 0); and T is non-decreasing in
every F_s + B_s (a sum plus (m - 1) times a max).  M_s depends on r but only constrains the
stage itself.  So among the r that fit, the smallest is never worse: the DP prices each
stage-table entry with it (`solvers/recompute_band.py`), CP-SAT's best prefix is at least as
slow, and `with_recompute` picks the same r after any solver.

Example:
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage, evaluate
    >>> prob = Problem(fwd_s={"a": (1.0, 1.0, 1.0)}, bwd_s={"a": (2.0, 2.0, 2.0)}, state_bytes=(10, 10, 10),
    ...                activation_bytes=(30, 5, 1), boundary_bytes=(4, 2, 0),
    ...                devices=(DeviceSlot("d0", "a", "n", 80), DeviceSlot("d1", "a", "n", 80)),
    ...                bandwidth_bytes_s=((1.0, 1.0), (1.0, 1.0)), latency_s=((0.0, 0.0), (0.0, 0.0)),
    ...                microbatches=2, recompute="auto")
    >>> plain = (Stage(0, 0, 1), Stage(1, 2, 2))
    >>> evaluate(prob, plain).stages[0].memory_bytes     # 20 + 2*(35 + 0 + 2) + 2*2 sends + 2*2 receives
    102
    >>> stages = with_recompute(prob, plain)
    >>> stages[0].recompute_units, evaluate(prob, stages).stages[0].memory_bytes   # 20 + 2*(5+2) + 2 + 30 in B
    ((0,), 66)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from hetpipe.cost_models.recompute import recompute_order
from hetpipe.cost_models.selective import selective_variant
from hetpipe.partitioner.problem import (Problem, Stage, can_offload, offload_if, stage_memory_bytes,
                                         stage_recompute_cost)


def stage_order(problem: Problem, stage: Stage) -> tuple[int, ...]:
    """The recompute order of `stage`'s units on its device's kind (on the selective variant for a selective stage)."""
    problem = selective_variant(problem) if stage.selective else problem
    return recompute_order(activation_bytes=problem.unit_recompute_bytes, boundary_bytes=problem.boundary_bytes,
                           fwd_s=problem.fwd_s[problem.devices[stage.device].kind],
                           first_unit=stage.first_unit, last_unit=stage.last_unit)


def choose_recompute(problem: Problem, stages: Sequence[Stage], s: int, mode: str | None = None) -> tuple[int, ...]:
    """The units stage `s` of `stages` recomputes under `mode` (default `problem.recompute`), ascending."""
    mode = problem.recompute if mode is None else mode
    if mode in ("none", "selective"):  # ``selective``: the level alone, no whole unit (`selective_choices`)
        return ()
    order = stage_order(problem, stages[s])
    if mode == "all":
        return tuple(sorted(order))
    trial = list(stages)
    usable = problem.devices[stages[s].device].usable_bytes
    best: tuple[int, tuple[int, ...]] | None = None
    for r in range(len(order) + 1):
        units = tuple(sorted(order[:r]))
        trial[s] = replace(stages[s], recompute_units=units)
        mem = stage_memory_bytes(problem, trial, s)
        if mem <= usable:
            return units
        if best is None or mem < best[0]:
            best = (mem, units)
    assert best is not None
    return best[1]


def with_recompute(problem: Problem, stages: Sequence[Stage], mode: str | None = None) -> tuple[Stage, ...]:
    """`stages` with every stage's levers chosen by `choose_levers` (replacing any it had)."""
    plain = tuple(replace(st, recompute_units=(), offload=False, selective=False) for st in stages)
    # a tensor-parallel group (`Stage.members`) has no levers (not priced for groups)
    return tuple(st if st.members else choose_levers(problem, plain, s, mode) for s, st in enumerate(plain))


def offload_choices(problem: Problem, stage: Stage) -> tuple[bool, ...]:
    """The offload settings `stage` may take under `Problem.offload` and `Problem.offload_cap_s`.

    ``never``: no;  ``all``: yes wherever it can (`can_offload`);  ``auto``: no, or yes where it
    can and its tail O_s is within the cap (the solvers' outer walk, `solvers/offload_walk.py`).
    """
    able = problem.offload != "never" and can_offload(problem, stage)
    if problem.offload == "all":
        return (able,)
    return (False, True) if able and offload_if(problem, stage).tail_s <= problem.offload_cap_s else (False,)


def choose_levers(problem: Problem, stages: Sequence[Stage], s: int, mode: str | None = None) -> Stage:
    """Stage `s` of `stages` with its offload setting and recompute prefix chosen.

    Per offload choice (`offload_choices`) the smallest fitting recompute prefix
    (`choose_recompute` under that setting); of those that fit, the one whose recompute adds the
    fewest seconds to B_s, no offload on a tie.  Why that is exact under a cap Theta on every
    stage's tail (the solvers' outer walk): for a fixed stage T depends on the stage through
    F_s + B_s (non-decreasing in the recompute seconds) and max_s O_s <= Theta, so among the
    choices whose tail is within Theta the least recompute time is never worse.  Nothing fits:
    the choice with the least M_s (the placement is infeasible anyway).
    """
    trial = list(stages)
    ranked: list[tuple[tuple[int, float], Stage]] = []  # (0, seconds) when it fits, else (1, M_s)
    for off in offload_choices(problem, stages[s]):
        for sel in selective_choices(problem, stages[s], mode):
            trial[s] = replace(stages[s], offload=off, recompute_units=(), selective=sel)
            trial[s] = replace(trial[s], recompute_units=choose_recompute(problem, trial, s, mode))
            mem = stage_memory_bytes(problem, trial, s)
            if mem <= problem.devices[stages[s].device].usable_bytes:
                ranked.append(((0, added_backward_s(problem, trial[s])), trial[s]))
            else:
                ranked.append(((1, float(mem)), trial[s]))
    return min(ranked, key=lambda r: r[0])[1]  # min keeps the first of equals: no offload, no selective on a tie


def selective_choices(problem: Problem, stage: Stage, mode: str | None = None) -> tuple[bool, ...]:
    """Whether `stage` may run the selective level: under ``auto`` where the problem offers it
    (`Problem.selective`) and it frees something on the stage's units; never in a group.  Under
    ``selective`` it must, on every stage, wherever the problem offers it (`partitioner.selective_mode`)."""
    tab, mode = problem.selective, problem.recompute if mode is None else mode
    if mode == "selective":
        return (tab is not None and not stage.members,)
    able = tab is not None and mode == "auto" and not stage.members and tab.any_freed(stage.first_unit, stage.last_unit)
    return (False, True) if able else (False,)


def added_backward_s(problem: Problem, stage: Stage) -> float:
    """Seconds `stage`'s recompute choice adds to B_s: its recomputed units' forwards, plus the selective
    level's dropped nodes when it runs it (both on its device's kind; `evaluate` prices the same)."""
    if not stage.selective or problem.selective is None:
        return stage_recompute_cost(problem, stage).extra_s
    kind = problem.devices[stage.device].kind
    return (stage_recompute_cost(selective_variant(problem), stage).extra_s
            + problem.selective.stage_extra_s(kind, stage.first_unit, stage.last_unit))


def is_prefix_choice(problem: Problem, stage: Stage) -> bool:
    """Whether `stage.recompute_units` is a prefix of the stage's order (what every solver writes)."""
    order = stage_order(problem, stage)
    return set(stage.recompute_units) == set(order[:len(stage.recompute_units)])
