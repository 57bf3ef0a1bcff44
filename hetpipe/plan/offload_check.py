"""`hetpipe check` for the optimizer-offload lever: each stage's choice against the plan's setting.

Under ``never`` no stage may offload; under ``all`` every stage that can (`can_offload`) must;
under ``auto`` the plan's levers must cost no more T than the best levers of the same placement
(`offload_walk.best_levers`, exact for a fixed placement), since the planner minimises T.

Example:
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage
    >>> p = Problem(fwd_s={"a": (1.0,)}, bwd_s={"a": (1.0,)}, state_bytes=(16,), activation_bytes=(0,),
    ...             boundary_bytes=(0,), devices=(DeviceSlot("d", "a", "n", 99),), bandwidth_bytes_s=((1.0,),),
    ...             latency_s=((0.0,),), microbatches=1)
    >>> offload_violations(p, (Stage(0, 0, 0, offload=True),))
    ["stage 0: offloads, but the plan's offload setting is 'never'"]
"""

from __future__ import annotations

from typing import Sequence

from hetpipe.partitioner.problem import Problem, Stage, can_offload, evaluate
from hetpipe.partitioner.solvers.offload_walk import best_levers
from hetpipe.plan.check_report import CHECK_RTOL

__all__ = ["offload_violations"]


def offload_violations(problem: Problem, stages: Sequence[Stage]) -> list[str]:
    """The stages whose offload choice the plan's setting would not make (module docstring)."""
    if problem.offload == "never":
        return [f"stage {s}: offloads, but the plan's offload setting is 'never'" for s, st in enumerate(stages)
                if st.offload]
    if problem.offload == "all":
        return [f"stage {s}: offload is {st.offload}, but setting 'all' makes every stage that can offload do so"
                for s, st in enumerate(stages) if not st.members and st.offload != can_offload(problem, st)]
    if any(st.offload and not can_offload(problem, st) for st in stages):
        return []  # evaluate() refuses such a stage: reported by the caller as a stages error
    have, best = evaluate(problem, stages), evaluate(problem, best_levers(problem, stages, problem.objective))
    if have.fits and have.iteration_s > best.iteration_s * (1 + CHECK_RTOL):
        return [f"levers: this placement's recompute/offload choice gives T = {have.iteration_s:.6g} s, but "
                f"offload 'auto' chooses levers with T = {best.iteration_s:.6g} s; re-plan with `hetpipe plan`"]
    return []
