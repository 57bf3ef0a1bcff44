"""Which units a stage recomputes: the lever of `Problem.recompute`, chosen per stage.

A stage on units U, device kind kappa, at position s of p recomputes the first r units of
its order (`cost_models.recompute.recompute_order`: saved bytes per recompute second on
kappa, descending), r in 0..len(order):

* ``none``: r = 0;  ``all``: r = len(order) (Megatron-LM ``--recompute-granularity full``);
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
    >>> evaluate(prob, plain).stages[0].memory_bytes     # 20 + 2*(35 + 0 + 2) + 4*2 + 1*2
    104
    >>> stages = with_recompute(prob, plain)
    >>> stages[0].recompute_units, evaluate(prob, stages).stages[0].memory_bytes   # 20 + 2*(5+2) + 30 + 10
    ((0,), 74)
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from hetpipe.cost_models.recompute import recompute_order
from hetpipe.partitioner.problem import Problem, Stage, stage_memory_bytes


def stage_order(problem: Problem, stage: Stage) -> tuple[int, ...]:
    """The recompute order of `stage`'s units on its device's kind."""
    return recompute_order(activation_bytes=problem.activation_bytes, boundary_bytes=problem.boundary_bytes,
                           fwd_s=problem.fwd_s[problem.devices[stage.device].kind],
                           first_unit=stage.first_unit, last_unit=stage.last_unit)


def choose_recompute(problem: Problem, stages: Sequence[Stage], s: int, mode: str | None = None) -> tuple[int, ...]:
    """The units stage `s` of `stages` recomputes under `mode` (default `problem.recompute`), ascending."""
    mode = problem.recompute if mode is None else mode
    if mode == "none":
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
    """`stages` with every stage's recompute set chosen by `choose_recompute` (replacing any it had)."""
    plain = tuple(replace(st, recompute_units=()) for st in stages)
    return tuple(replace(st, recompute_units=choose_recompute(problem, plain, s, mode)) for s, st in enumerate(plain))


def is_prefix_choice(problem: Problem, stage: Stage) -> bool:
    """Whether `stage.recompute_units` is a prefix of the stage's order (what every solver writes)."""
    order = stage_order(problem, stage)
    return set(stage.recompute_units) == set(order[:len(stage.recompute_units)])
