"""The selective recompute level in a plan (version 7, issue 14): what each unit drops, frees and re-runs.

`Plan.selective` records the level's tables the planner priced (`cost_models.selective.SelectiveTables`)
and, per unit that frees something, the fx nodes it drops (`partitioner.selective.unit_level`), so that
`check` re-prices the plan from the file alone and the runtime (`runtime/stage/selective.py`) drops
exactly those outputs.  `PlanStage.selective` says which stages run it.  Plans without the level (every
plan before version 7) leave both out: `tables_from_plan` is then None and no stage runs it.

Example:
    >>> sel = PlanSelective(peak_bytes=16, units=(PlanSelectiveUnit(1, ("ln", "gelu"), 12, {"a": 0.5}),))
    >>> tab = tables_from_plan_selective(sel, num_units=3, kinds=("a",))
    >>> tab.freed_bytes, tab.peak_bytes, tab.extra_s["a"]
    ((0, 12, 0), 16, (0.0, 0.5, 0.0))
    >>> dropped_nodes(sel, 1, 2), dropped_nodes(None, 0, 2)
    ({1: ('ln', 'gelu')}, {})
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from hetpipe.cost_models.selective import SelectiveTables
from hetpipe.errors import PlanError


@dataclass(frozen=True)
class PlanSelectiveUnit:
    """One unit's level: the fx nodes whose outputs it drops, the bytes per micro-batch that frees and
    the seconds their re-run adds to the unit's backward on each device kind."""

    index: int  # global unit index
    nodes: tuple[str, ...]  # fx node names (the stage graph's), re-run in the backward
    freed_bytes: int
    time_s: Mapping[str, float]  # device kind -> seconds


@dataclass(frozen=True)
class PlanSelective:
    """The level as offered to the planner: its peak (bytes, once per stage that runs it) and its units
    (only those that free something, ascending)."""

    peak_bytes: int
    units: tuple[PlanSelectiveUnit, ...]


def tables_from_plan_selective(sel: PlanSelective | None, *, num_units: int,
                               kinds: Sequence[str]) -> SelectiveTables | None:
    """The `SelectiveTables` `sel` records (None: the plan offers no level)."""
    if sel is None:
        return None
    freed, extra = [0] * num_units, {k: [0.0] * num_units for k in kinds}
    for u in sel.units:
        if not 0 <= u.index < num_units:
            raise PlanError(f"selective.units: unit {u.index} is not one of the plan's {num_units} units; "
                            "re-create the plan with `hetpipe plan`")
        missing = [k for k in kinds if k not in u.time_s]
        if missing:
            raise PlanError(f"selective.units[{u.index}].time_s has no entry for device kind {missing[0]!r}; "
                            "re-create the plan with `hetpipe plan`")
        freed[u.index] = u.freed_bytes
        for k in kinds:
            extra[k][u.index] = u.time_s[k]
    return SelectiveTables(freed_bytes=tuple(freed), peak_bytes=sel.peak_bytes,
                           extra_s={k: tuple(v) for k, v in extra.items()})


def dropped_nodes(sel: PlanSelective | None, first_unit: int, last_unit: int) -> dict[int, tuple[str, ...]]:
    """Unit index -> the fx nodes the level drops, for the units in [first_unit, last_unit]."""
    if sel is None:
        return {}
    return {u.index: tuple(u.nodes) for u in sel.units if first_unit <= u.index <= last_unit}
