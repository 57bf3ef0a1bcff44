"""`check`'s re-derivation of the selective recompute level (issue 14, plan version 7).

Each stage's `PlanStage.selective` must be what the planner chooses from the plan's own tables: under
``--recompute auto``, with the stage's offload setting as recorded, the level on or off with its shortest
fitting whole-unit prefix, whichever fits and adds fewer backward seconds, off on a tie
(`partitioner.recompute.choose_levers`); never under ``none`` or ``all``.  The recorded level itself must
name nodes of its units and free no more than it re-allocates (freed <= peak).  Its bytes and seconds are
the model's only `check --model` can say (`plan.selective_plan.selective_mismatch`).

Example:
    >>> from hetpipe.cost_models.selective import SelectiveTables
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage
    >>> prob = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (2.0, 2.0)}, state_bytes=(10, 10),
    ...                activation_bytes=(30, 30), boundary_bytes=(4, 0), devices=(DeviceSlot("d0", "a", "n", 75),),
    ...                bandwidth_bytes_s=((1.0,),), latency_s=((0.0,),), microbatches=2, recompute="auto",
    ...                selective=SelectiveTables((12, 12), 15, {"a": (0.25, 0.25)}))
    >>> selective_violations(prob, (Stage(0, 0, 1, selective=True),))
    []
    >>> selective_violations(prob, (Stage(0, 0, 1, recompute_units=(0,)),))[0][:60]
    'stage 0: selective is False, but recompute auto chooses True'
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from hetpipe.partitioner.problem import Problem, Stage, stage_memory_bytes
from hetpipe.partitioner.recompute import added_backward_s, choose_recompute, selective_choices


def chosen_level(problem: Problem, stages: Sequence[Stage], s: int) -> bool:
    """Whether the planner runs the level on stage `s` (its offload setting kept), as `choose_levers` does."""
    trial, ranked = list(stages), []
    for sel in selective_choices(problem, stages[s]):
        trial[s] = replace(stages[s], recompute_units=(), selective=sel)
        trial[s] = replace(trial[s], recompute_units=choose_recompute(problem, trial, s))
        mem = stage_memory_bytes(problem, trial, s)
        fits = mem <= problem.devices[stages[s].device].usable_bytes
        ranked.append(((0, added_backward_s(problem, trial[s])) if fits else (1, float(mem)), sel))
    return min(ranked, key=lambda r: r[0])[1]  # min keeps the first of equals: the level off on a tie


def selective_violations(problem: Problem, stages: Sequence[Stage]) -> list[str]:
    """Each stage's level against the plan's setting and tables (module docstring); [] when all agree."""
    out = []
    for s, st in enumerate(stages):
        if st.members:  # a group runs no lever
            continue
        if st.selective and problem.selective is None:
            out.append(f"stage {s}: selective is True, but the plan records no selective level (plan.selective); "
                       "re-create the plan with `hetpipe plan --recompute auto`")
            continue
        want = chosen_level(problem, stages, s)
        if want != st.selective:
            out.append(f"stage {s}: selective is {st.selective}, but recompute {problem.recompute} chooses {want} "
                       "(the least added backward seconds that fit); re-create the plan with `hetpipe plan`")
    return out


def record_violations(plan: Any) -> list[str]:
    """The recorded level (`Plan.selective`) against the plan's units: nodes of the unit, freed <= peak."""
    sel = plan.selective
    if sel is None:
        return []
    out = []
    for u in sel.units:
        if not 0 <= u.index < len(plan.units):
            out.append(f"selective.units: unit {u.index} is not one of the plan's {len(plan.units)} units")
            continue
        foreign = [n for n in u.nodes if n not in set(plan.units[u.index].node_names)]
        if foreign or not u.nodes:
            out.append(f"selective unit {u.index}: drops {list(u.nodes)}, "
                       f"{'none' if not u.nodes else repr(foreign[0])} not a node of the unit")
        if not 0 < u.freed_bytes <= sel.peak_bytes:
            out.append(f"selective unit {u.index}: freed_bytes {u.freed_bytes} is not in (0, peak_bytes "
                       f"{sel.peak_bytes}]")
    return out
