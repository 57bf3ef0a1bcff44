"""Why nothing fits: the memory a plan is missing, where, and what would help.

`explain_infeasible` searches the smallest factor f by which every device's usable
memory would have to grow for some placement to fit (bisection on f, each step a
feasibility solve), takes that placement, and names its fullest stage with a
breakdown (state = params + grads + optimizer, activations x in-flight micro-batches,
communication buffers) and the remedies that attack the biggest share.

Example:
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem
    >>> prob = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (1.0, 1.0)}, state_bytes=(60, 60),
    ...                activation_bytes=(1, 1), boundary_bytes=(4, 0),
    ...                devices=(DeviceSlot("d0", "a", "n", 50),), bandwidth_bytes_s=((float("inf"),),),
    ...                latency_s=((0.0,),), microbatches=2)
    >>> print(explain_infeasible(prob))  # doctest: +ELLIPSIS
    no plan fits in memory: at best, stage 0 on d0 (a) needs 122 B but has 50 B usable (72 B missing; ...
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from hetpipe.cost_models.quantities import human_bytes
from hetpipe.errors import InfeasibleError
from hetpipe.partitioner.solvers.dp import StateSpaceTooLarge, solve_exact
from hetpipe.partitioner.solvers.fixed_order import solve_fixed_order
from hetpipe.partitioner.problem import (
    Problem, Stage, evaluate, stage_activation_bytes, stage_memory_bytes, stage_memory_terms, stage_recompute_cost,
    stage_step_transient, stage_transient_bytes)

#: Bisection steps on the memory factor: 2^-30 relative precision, plenty for a message.
BISECTION_STEPS = 30


def _scaled(problem: Problem, factor: float) -> Problem:
    devs = tuple(replace(d, usable_bytes=int(d.usable_bytes * factor)) for d in problem.devices)
    return replace(problem, devices=devs)


def _finder(problem: Problem) -> Callable[[Problem], tuple[Stage, ...] | None]:
    """A fast feasibility solve: the exact DP where tractable, else the all-devices fixed order."""
    def exact(p: Problem) -> tuple[Stage, ...] | None:
        res = solve_exact(p, time_limit_s=0.0)  # one pass of the cap walk: feasibility only
        return res.stages if res else None

    try:
        exact(_scaled(problem, 1e30))
        return exact
    except StateSpaceTooLarge:
        order = list(range(min(len(problem.devices), problem.num_units)))

        def fixed(p: Problem) -> tuple[Stage, ...] | None:
            res = solve_fixed_order(p, order, time_limit_s=0.0)
            return res.stages if res else None

        return fixed


def _least_memory_plan(problem: Problem) -> tuple[float, tuple[Stage, ...]] | None:
    """(smallest memory factor f, a placement that fits at f) by bisection."""
    find = _finder(problem)
    hi = 2.0
    while find(_scaled(problem, hi)) is None:
        hi *= 2.0
        if hi > 1e12:
            return None
    lo = 1.0
    for _ in range(BISECTION_STEPS):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if find(_scaled(problem, mid)) is not None else (mid, hi)
    stages = find(_scaled(problem, hi))
    return (hi, stages) if stages else None


@dataclass(frozen=True)
class MemoryFit:
    """The least-memory placement of a problem: how full its fullest stage is.

    Attributes:
        factor: the smallest factor on every device's usable memory at which some placement fits
            (<= 1: it fits as it is; within 2^-30 relative).
        stage, device: the fullest stage (largest memory / usable) of that placement and its device id.
        memory_bytes, usable_bytes: that stage's M_s and its device's usable memory.
    """

    factor: float
    stage: int
    device: str
    memory_bytes: int
    usable_bytes: int

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.usable_bytes


def least_memory_fit(problem: Problem) -> MemoryFit | None:
    """`MemoryFit` of the placement that needs the least memory (feasibility solves only), or None.

    Example:
        >>> from hetpipe.partitioner.problem import DeviceSlot
        >>> prob = Problem(fwd_s={"a": (1.0,)}, bwd_s={"a": (1.0,)}, state_bytes=(60,), activation_bytes=(1,),
        ...                boundary_bytes=(0,), devices=(DeviceSlot("d0", "a", "n", 100),),
        ...                bandwidth_bytes_s=((float("inf"),),), latency_s=((0.0,),), microbatches=1)
        >>> fit = least_memory_fit(prob); fit.fits, fit.memory_bytes, fit.usable_bytes
        (True, 61, 100)
    """
    find = _finder(problem)
    lo, hi = 1.0, 1.0
    while find(_scaled(problem, hi)) is None:  # grow until something fits
        lo, hi = hi, hi * 2.0
        if hi > 1e12:
            return None
    if lo == hi:  # fits as it is: shrink until nothing does
        while find(_scaled(problem, lo)) is not None and lo > 1e-12:
            hi, lo = lo, lo / 2.0
    for _ in range(BISECTION_STEPS):
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if find(_scaled(problem, mid)) is not None else (mid, hi)
    stages = find(_scaled(problem, hi))
    if not stages:
        return None
    ev = evaluate(problem, stages)
    s = max(range(len(stages)), key=lambda i: ev.stages[i].memory_bytes / max(1, ev.stages[i].usable_bytes))
    return MemoryFit(hi, s, problem.devices[stages[s].device].id, ev.stages[s].memory_bytes, ev.stages[s].usable_bytes)


def _recompute_tip(problem: Problem) -> str:
    """What activation recomputation would do: the fullest stage `--recompute all` reaches, or that it is on."""
    if problem.recompute != "none":
        return f" (activation recomputation is already on: --recompute {problem.recompute})"
    fit = least_memory_fit(replace(problem, recompute="all"))
    if fit is None:
        return " or --recompute all (it does not fit either)"
    return (f" or --recompute all (fullest stage {human_bytes(fit.memory_bytes)} of {human_bytes(fit.usable_bytes)} "
            f"on {fit.device}; --recompute auto recomputes only what each stage needs)")


def explain_infeasible(problem: Problem) -> InfeasibleError:
    """An `InfeasibleError` that says how much memory is missing, where, and what would help."""
    found = _least_memory_plan(problem)
    if found is None:
        return InfeasibleError("no plan fits in memory on any number of devices; add devices with more memory")
    _, stages = found
    ev = evaluate(problem, stages)
    s = max(range(len(stages)), key=lambda i: ev.stages[i].memory_bytes - ev.stages[i].usable_bytes)
    st, cost = stages[s], ev.stages[s]
    dev = problem.devices[st.device]
    units = range(st.first_unit, st.last_unit + 1)
    state = sum(problem.state_bytes[u] for u in units)
    inflight = min(len(stages) - s, problem.microbatches)
    rc = stage_recompute_cost(problem, st)  # what the stage keeps per micro-batch, after recomputation
    # ... plus, inside a backward, a recompute's peak and the backward's transient (memory model 4: the loss's logits)
    act = inflight * (stage_activation_bytes(problem, st) - rc.saved_bytes) + rc.peak_bytes + stage_transient_bytes(problem, st)
    buffers = stage_memory_bytes(problem, stages, s) - state - act
    missing = cost.memory_bytes - cost.usable_bytes
    step = sum(stage_step_transient(problem, st).values())  # memory model 5: U_s at the step's moment
    if step > 0 and stage_memory_terms(problem, stages, s).state_bytes + step >= cost.memory_bytes:
        return InfeasibleError(
            f"no plan fits in memory: at best, stage {s} on {dev.id} ({dev.kind}) needs {human_bytes(cost.memory_bytes)} "
            f"at its optimizer step but has {human_bytes(cost.usable_bytes)} usable ({human_bytes(missing)} missing; "
            f"units {st.first_unit}-{st.last_unit}: state {human_bytes(cost.memory_bytes - step)}, the step's transient "
            f"{human_bytes(step)}); try sgd/momentum (no step transient){_offload_tip(problem)}; more devices or "
            "devices with more memory")
    tips = []
    if act >= state:
        tips.append(f"a smaller micro-batch (activations are the larger share){_recompute_tip(problem)}")
        tips.append("a lighter optimizer or mixed precision")
    else:
        tips.append("a lighter optimizer (sgd/momentum) or mixed precision (model state is the larger share)")
        tips.append(f"a smaller micro-batch{_recompute_tip(problem)}")
    tips.append("more devices or devices with more memory")
    return InfeasibleError(
        f"no plan fits in memory: at best, stage {s} on {dev.id} ({dev.kind}) needs {human_bytes(cost.memory_bytes)} "
        f"but has {human_bytes(cost.usable_bytes)} usable ({human_bytes(missing)} missing; units {st.first_unit}-{st.last_unit}: "
        f"state {human_bytes(state)}, activations {human_bytes(act)} for {inflight} in-flight micro-batches, buffers "
        f"{human_bytes(buffers)}); try {'; '.join(tips)}"
    )


def _offload_tip(problem: Problem) -> str:
    """``, --offload auto`` unless the problem already offers it (an offloading stage steps on its host)."""
    return "" if problem.offload != "never" else ", --offload auto (the step then runs on the host)"
