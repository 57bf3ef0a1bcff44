"""Tensor-parallel groups in plans (issue 15): the setting, the unit tables, and `check`'s re-derivation.

``--tensor-parallel auto`` (`partition_graph(tensor_parallel=...)`) gives the solver every
unit's split (`tp_tables.unit_splits`) and groups of up to `DEFAULT_GROUP_MAX` cards of one
node or of two (`MAX_GROUP_NODES`: a group across two nodes has its ring priced on their link, and
the solver takes it only where that lowers T).  The plan then records the setting
(`Plan.cost_model["tensor_parallel"]`), each unit's ``tp_flops_fraction``, ``tp_param_fraction`` and ``tp_blocks`` (version 4), and each group
stage's ``group_devices`` and ``group_shares``; `with_plan_groups` rebuilds the solver's view
from those alone, so `hetpipe check` re-prices every group (its shares, F_s, B_s, S_s and
every member's M_s) like any stage, and `share_violations` compares the recorded shares.

Example:
    >>> tensor_parallel_note_mode({"tensor_parallel": "auto: ..."}), tensor_parallel_note_mode({})
    ('auto', 'off')
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from hetpipe.errors import ConfigError, PlanError
from hetpipe.partitioner.problem import Evaluation, Problem, Stage, stage_position
from hetpipe.partitioner.tp_tables import (
    DEFAULT_GROUP_MAX, MAX_GROUP_NODES, TENSOR_PARALLEL_MODES, UnitSplit, block_split, group_stage, unit_splits)
from hetpipe.plan.tp_schema import PlanBlock

#: `Plan.cost_model` key of the setting.
TP_NOTE = "tensor_parallel"
#: Relative tolerance on a recorded share against the re-derived one (the same formula twice).
SHARE_RTOL = 1e-9

_WHY = (f"a stage may run on a group of up to {DEFAULT_GROUP_MAX} cards of one node or of {MAX_GROUP_NODES} "
        "splitting each tensor-parallel block unevenly (equal finish, capped by memory); time = the slowest member's "
        "integer parts + one ring all-reduce per block forward and backward + the group's broadcast of each "
        "received message, over the group's slowest link (across nodes: theirs); groups neither recompute nor "
        "offload")


def check_tensor_parallel_option(mode: str) -> None:
    """Refuse an unknown ``--tensor-parallel`` value before any work."""
    if mode not in TENSOR_PARALLEL_MODES:
        raise ConfigError(f"--tensor-parallel {mode!r} is not one of {', '.join(TENSOR_PARALLEL_MODES)}; "
                          "use auto to let the solver choose groups, off for a pipeline only")


def tensor_parallel_fields(graph: Any, mode: str) -> dict[str, Any]:
    """`Problem` keyword arguments for the setting: none for ``off``."""
    check_tensor_parallel_option(mode)
    return {} if mode == "off" else {"tensor_parallel": unit_splits(graph.units), "group_max": DEFAULT_GROUP_MAX,
                                     "group_nodes": MAX_GROUP_NODES}


def tensor_parallel_note(problem: Problem) -> dict[str, str]:
    """The cost-model note of the setting (nothing for ``off``)."""
    return {TP_NOTE: f"auto: {_WHY}"} if problem.group_max > 1 and problem.tensor_parallel else {}


def tensor_parallel_note_mode(cost_model: Mapping[str, Any]) -> str:
    """The setting a plan's cost-model notes record (``off`` when absent)."""
    word = str(cost_model.get(TP_NOTE, "off")).split(":")[0].strip()
    if word not in TENSOR_PARALLEL_MODES:
        raise PlanError(f"plan.cost_model.{TP_NOTE}: {word!r} is not one of {', '.join(TENSOR_PARALLEL_MODES)}; "
                        "fix the field or re-create the plan with `hetpipe plan`")
    return word


def plan_unit_fields(problem: Problem, index: int) -> dict[str, Any]:
    """`PlanUnit` keyword arguments of unit `index`'s split (none unless the problem has groups)."""
    if problem.group_max < 2 or not problem.tensor_parallel:
        return {}
    s = problem.tensor_parallel[index]
    return {"tp_flops_fraction": s.flops_fraction, "tp_param_fraction": s.param_fraction,
            "tp_blocks": tuple(PlanBlock(b.parts, b.fwd_flops, b.allreduce_bytes, b.activation_bytes, kind=b.kind,
                                         loss_allreduce_bytes=b.loss_allreduce_bytes) for b in s.blocks)}


def plan_group_fields(problem: Problem, stage: Stage, shares: tuple[float, ...]) -> dict[str, Any]:
    """`PlanStage` keyword arguments of a group stage (none for a stage of one card)."""
    if not stage.members:
        return {}
    return {"group_devices": tuple(problem.devices[d].id for d in stage.members), "group_shares": shares}


def with_plan_splits(plan: Any, problem: Problem) -> Problem:
    """`problem_from_plan`'s problem with the plan's unit splits, group size and nodes (`stages_from_plan`
    gives each stage its `group_devices` as `Stage.members`; plans before cross-node groups have one-node ones)."""
    grouped = any(st.group_devices for st in plan.stages)
    if tensor_parallel_note_mode(plan.cost_model) == "off" and not grouped:
        return problem
    splits = tuple(UnitSplit(flops=u.fwd_flops + u.bwd_flops, flops_fraction=u.tp_flops_fraction,
                             param_fraction=u.tp_param_fraction,
                             blocks=tuple(block_split(b) for b in u.tp_blocks)) for u in plan.units)
    widest = max((len(st.group_devices) for st in plan.stages), default=1)
    return replace(problem, tensor_parallel=splits if any(s.blocks for s in splits) else (),
                   group_max=max(DEFAULT_GROUP_MAX, widest), group_nodes=MAX_GROUP_NODES)


def share_violations(plan: Any, ev: Evaluation) -> list[str]:
    """Each group stage's recorded shares against the re-derived ones."""
    out = []
    for st, cost in zip(plan.stages, ev.stages):
        want = tuple(cost.shares)
        got = tuple(st.group_shares)
        if len(got) != len(want) or any(abs(a - b) > SHARE_RTOL * max(abs(b), 1e-300) for a, b in zip(got, want)):
            out.append(f"stage {st.index}: recorded group_shares {list(got)} != re-derived {list(want)}")
    return out


def member_memory(problem: Problem, stages: tuple[Stage, ...]) -> dict[str, tuple[int, int, int]]:
    """Per member of every group stage: (stage index, its M_s, its usable bytes), re-derived
    (the plan records a group stage's tightest member only; `problem_from_plan`, `stages_from_plan`)."""
    out = {}
    for s, st in enumerate(stages):
        if st.members:
            g = group_stage(problem, first=st.first_unit, last=st.last_unit, members=st.members,
                            position=stage_position(problem, stages, s))
            for d, mem, usable in zip(st.members, g.memory_bytes, g.usable_bytes):
                out[problem.devices[d].id] = (s, mem, usable)
    return out
