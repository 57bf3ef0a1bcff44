"""What running a plan's tensor-parallel groups needs from the plan (issue 15): the rank layout,
each member's own predicted times, and the refusals of what the runtime does not run (`refuse_unrunnable_groups`;
re-planning supervised runs: `refuse_group_supervision`).

`hetpipe run` starts one rank per card: the stages in order, each group stage's members in
``group_devices`` order (its lead, `PlanStage.device`, first).  `rank_slots` is that layout.
`member_timings` prices every group at its recorded shares from the plan's own tables (as `hetpipe
check` re-prices it) and returns each member's F, B and step: its integer parts of every block plus the group's
all-reduces and the lead's broadcast (`partitioner.tp_tables.group_stage`); the stage's F_s and
B_s are the largest of them.  `refuse_unrunnable_groups` names what cannot run yet.

Example:
    >>> from types import SimpleNamespace as NS
    >>> plan = NS(stages=[NS(index=0, device="a", group_devices=("a", "b")), NS(index=1, device="c",
    ...                                                                     group_devices=())])
    >>> [(s.stage, s.member, s.device) for s in rank_slots(plan)]
    [(0, 0, 'a'), (0, 1, 'b'), (1, 0, 'c')]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hetpipe.errors import ConfigError, PlanError
from hetpipe.partitioner.problem import stage_position
from hetpipe.partitioner.tp_tables import group_stage
from hetpipe.plan.schema import Plan, problem_from_plan, stages_from_plan
from hetpipe.schedule.builders import is_split


@dataclass(frozen=True)
class RankSlot:
    """One rank of a run: plan stage ``stage``, member ``member`` of its group (0: the lead), on ``device``."""

    stage: int
    member: int
    device: str


@dataclass(frozen=True)
class MemberTiming:
    """A group member's predicted seconds per micro-batch (F, B) and per step (S), and its M_s in bytes."""

    fwd_s: float
    bwd_s: float
    step_s: float
    memory_bytes: int


def rank_slots(plan: Any) -> tuple[RankSlot, ...]:
    """Every rank of a run of ``plan`` in global-rank order on one node (module docstring)."""
    return tuple(RankSlot(st.index, i, d) for st in plan.stages
                 for i, d in enumerate(tuple(st.group_devices) or (st.device,)))


def has_groups(plan: Any) -> bool:
    """Does any stage of ``plan`` run on a tensor-parallel group?"""
    return any(st.group_devices for st in plan.stages)


def member_timings(plan: Plan) -> dict[tuple[int, int], MemberTiming]:
    """(stage, member) -> `MemberTiming` of every member of every group stage (none for width-1 stages)."""
    if not has_groups(plan):
        return {}
    problem, stages = problem_from_plan(plan), stages_from_plan(plan)
    out = {}
    for s, st in enumerate(stages):
        if st.members:
            g = group_stage(problem, first=st.first_unit, last=st.last_unit, members=st.members,
                            position=stage_position(problem, stages, s), shares=plan.stages[s].group_shares)
            for i in range(len(st.members)):
                out[(s, i)] = MemberTiming(g.member_fwd_s[i], g.member_bwd_s[i], g.member_step_s[i],
                                           g.memory_bytes[i])
    return out


def refuse_unrunnable_groups(plan: Any, schedule: str) -> None:
    """Refuse, before launching, the group plans the runtime does not run (each error names the fix)."""
    grouped = [st.index for st in plan.stages if st.group_devices]
    if not grouped:
        return
    if getattr(plan, "replicas", None):
        raise PlanError(f"plan stages {grouped} are tensor-parallel groups inside a replica plan, which `hetpipe "
                        "run` does not run; re-plan with --replicas 1 or --tensor-parallel off")
    if is_split(schedule):
        raise ConfigError(f"--schedule {schedule}: plan stages {grouped} are tensor-parallel groups, which run "
                          "only an unsplit backward; use --schedule 1f1b or gpipe")
    levers = [st.index for st in plan.stages if st.group_devices and (st.recompute_units or st.offload)]
    if levers:
        raise PlanError(f"plan stages {levers} are tensor-parallel groups that recompute or offload, which groups "
                        "do not do (the levers are not priced for groups); re-create the plan with `hetpipe plan`")


def refuse_group_supervision(plan: Any) -> None:
    """Re-planning runs (``--adapt``, ``--wait-for-return``) of a grouped plan are refused: re-planning
    solves width-1 stages.  ``--max-restarts`` alone relaunches the same grouped plan from the newest
    checkpoint (`hetpipe.runtime.supervise`, ``same_plan``), as ``--resume`` of grouped plans does
    (`hetpipe.runtime.checkpoint.groups`).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> refuse_group_supervision(NS(stages=[NS(index=0, group_devices=())]))
    """
    if has_groups(plan):
        raise ConfigError(f"--adapt and --wait-for-return: plan stages "
                          f"{[st.index for st in plan.stages if st.group_devices]} are tensor-parallel groups, "
                          "which supervised runs do not re-plan yet; use --max-restarts N alone (a dead rank "
                          "relaunches this plan from the newest checkpoint), or continue with --resume DIR on a "
                          "re-made plan")
