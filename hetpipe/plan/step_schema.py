"""The plan's record of the optimizer step per device kind (`Plan.step_launch_s`, version 4; `Plan.step_transient`,
version 9) and how it returns to the solver's `Problem` (memory model 5's tables).

Memory model 5 prices the step's moment, state + U_s (`hetpipe.cost_models.step_transient`): each unit
records its stepped parameter bytes, all and its largest tensor (`PlanUnit.step_param_bytes`,
``step_tensor_bytes``), each tied replica its own (`PlanTied.step_bytes`), and the plan records per
device kind which path its step takes and that path's multiples (`KindStepTransient`).  A plan of an
older memory model records none of it: its U_s is 0 (`stage_memory.PRICED_AS_CURRENT`).

Example:
    >>> from types import SimpleNamespace as NS
    >>> plan = NS(step_transient=(KindStepTransient("rtx3090", "foreach", 1, 0),),
    ...           units=(NS(step_param_bytes=40, step_tensor_bytes=24),))
    >>> problem_step_fields(plan)["step_transient"]
    {'rtx3090': StepTransient(list_multiple=1, tensor_multiple=0)}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from hetpipe.cost_models.devices import Cluster, steps_foreach
from hetpipe.cost_models.step_transient import STEP_PATHS, StepTransient, path_transient
from hetpipe.partitioner.capture.graph import UnitGraph


@dataclass(frozen=True)
class KindSeconds:
    """A per-device-kind figure in seconds (version 4: the launch share of the optimizer step)."""

    kind: str
    seconds: float


@dataclass(frozen=True)
class KindStepTransient:
    """A device kind's optimizer step path (`step_transient.STEP_PATHS`) and its transient's multiples of the
    stage's stepped parameter bytes (``list_multiple``) and of its largest stepped tensor (``tensor_multiple``)."""

    kind: str
    path: str
    list_multiple: int
    tensor_multiple: int


def step_transient_records(rules: Mapping[str, StepTransient], paths: Mapping[str, str]) -> tuple[KindStepTransient, ...]:
    """The plan's `Plan.step_transient` of a problem's rules and each kind's path name, sorted by kind.

    Example:
        >>> step_transient_records({"cpu": StepTransient(0, 3)}, {"cpu": "per-tensor"})
        (KindStepTransient(kind='cpu', path='per-tensor', list_multiple=0, tensor_multiple=3),)
    """
    return tuple(KindStepTransient(k, paths[k], r.list_multiple, r.tensor_multiple) for k, r in sorted(rules.items()))


def problem_step_fields(plan: Any) -> dict[str, Any]:
    """The `Problem` fields of memory model 5 recorded in `plan` (empty tables and rules in older plans)."""
    records = tuple(getattr(plan, "step_transient", ()))
    if not records:
        return {"step_param_bytes": (), "step_tensor_bytes": (), "step_transient": {}}
    return {"step_param_bytes": tuple(u.step_param_bytes for u in plan.units),
            "step_tensor_bytes": tuple(u.step_tensor_bytes for u in plan.units),
            "step_transient": {r.kind: StepTransient(r.list_multiple, r.tensor_multiple) for r in records}}


def step_paths(cluster: Cluster) -> dict[str, str]:
    """Per device kind, the path its optimizer step takes (`devices.steps_foreach`; `step_transient.STEP_PATHS`)."""
    return {k: STEP_PATHS[0] if steps_foreach(cluster.profile(k)) else STEP_PATHS[1] for k in cluster.kinds}


def step_fields(graph: UnitGraph, cluster: Cluster) -> dict[str, Any]:
    """Memory model 5's `Problem` fields: each unit's stepped bytes and each kind's step transient rule."""
    return {"step_param_bytes": tuple(u.step_param_bytes for u in graph.units),
            "step_tensor_bytes": tuple(u.step_tensor_bytes for u in graph.units),
            "step_transient": {k: path_transient(graph.optimizer, path) for k, path in step_paths(cluster).items()}}
