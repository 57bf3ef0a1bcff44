"""What each stage's memory levers cost and bought, re-derived from a plan's own tables.

`stage_levers` answers, per stage that recomputes (issue 14), how many units, how many bytes
its M_s is below the same stage without recomputation, and how many seconds the recomputed
forwards add to its backward; per stage that offloads its optimizer state, the bytes that
leave its card and the tail O_s it pays; per stage that runs the selective recompute level
(plan version 7), the bytes that level takes off its M_s (net of its peak) and the seconds its
re-run nodes add: `hetpipe show`'s "levers" column.

Example:
    >>> from hetpipe.models import build
    >>> from hetpipe.plan.build import partition
    >>> model, inputs = build("mlp-tiny", device="meta", batch=2)
    >>> plan = partition(model, "examples/clusters/homelab.yaml", example_inputs=inputs, global_batch=8)
    >>> stage_levers(plan)   # everything fits without recomputation
    (None, None)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from hetpipe.cost_models.quantities import human_bytes
from hetpipe.partitioner.problem import evaluate, stage_offload
from hetpipe.partitioner.recompute import added_backward_s
from hetpipe.plan.schema import Plan, problem_from_plan, stages_from_plan


def unit_ranges(units: Sequence[int], sep: str = ",") -> str:
    """Unit indices as runs of consecutive ones: ``1-3,5`` for units 1, 2, 3 and 5 (a stage's recompute units).

    Example:
        >>> unit_ranges((1, 2, 3, 5)), unit_ranges([8, 3, 4, 5], sep=", ")
        ('1-3,5', '3-5, 8')
    """
    parts: list[list[int]] = []
    for u in sorted(units):
        if parts and u == parts[-1][1] + 1:
            parts[-1][1] = u
        else:
            parts.append([u, u])
    return sep.join(f"{a}-{b}" if b > a else str(a) for a, b in parts)


@dataclass(frozen=True)
class StageLevers:
    """One stage's recomputation: units, memory saved (M_s without it - with it), seconds added per micro-batch."""

    recompute_units: tuple[int, ...]
    saved_bytes: int
    extra_s: float
    offload_bytes: int = 0  # optimizer state kept on the host (0: the stage does not offload)
    offload_s: float = 0.0  # O_s: its copies and host step after the stage's last backward
    selective: bool = False  # runs the selective level (`Plan.selective`)
    selective_saved_bytes: int = 0  # M_s without the level - with it (no whole-unit prefix either way)
    selective_s: float = 0.0  # the level's re-run nodes, added to the stage's backward per micro-batch

    def describe(self) -> str:
        """E.g. ``3 units, -12.00 MiB, +4.10 ms`` (memory saved at the stage's peak, backward time added),
        and for an offloading stage ``offload -1.00 GiB, +210.00 ms tail``.

        Example:
            >>> StageLevers((3, 4, 5), 12 * 2**20, 0.0041).describe()
            '3 units, -12.00 MiB, +4.10 ms'
            >>> StageLevers((), 0, 0.0, 2**30, 0.21).describe()
            'offload -1.00 GiB, +210.00 ms tail'
            >>> StageLevers((), 0, 0.0, selective=True, selective_saved_bytes=2**20, selective_s=0.0005).describe()
            'selective -1.00 MiB, +0.50 ms'
        """
        # a stage whose units free nothing runs the level only where it is forced (``--recompute selective``):
        # it pays the level's peak, a saving below 0 shown as an added "+" amount
        sign = "-" if self.selective_saved_bytes >= 0 else "+"
        parts = [f"selective {sign}{human_bytes(abs(self.selective_saved_bytes))}, +{self.selective_s * 1e3:.2f} ms"
                 ] if self.selective else []
        parts += [f"{len(self.recompute_units)} units, -{human_bytes(self.saved_bytes)}, +{self.extra_s * 1e3:.2f} ms"
                 ] if self.recompute_units else []
        if self.offload_bytes:
            parts.append(f"offload -{human_bytes(self.offload_bytes)}, +{self.offload_s * 1e3:.2f} ms tail")
        return "; ".join(parts)


def stage_levers(plan: Plan) -> tuple[StageLevers | None, ...]:
    """Per stage of a single-pipeline `plan`: its `StageLevers`, or None when it uses none."""
    if not any(st.recompute_units or st.offload or st.selective for st in plan.stages) or plan.replicas:
        return tuple(None for _ in plan.stages)
    problem, stages = problem_from_plan(plan), stages_from_plan(plan)
    rc_only = tuple(replace(st, offload=False) for st in stages)  # recompute's saving, offload apart
    level = tuple(replace(st, recompute_units=()) for st in rc_only)  # the selective level alone
    plain = tuple(replace(st, selective=False) for st in level)
    with_, alone, without = (evaluate(problem, x).stages for x in (rc_only, level, plain))
    out: list[StageLevers | None] = []
    for s, st in enumerate(stages):
        if not (st.recompute_units or st.offload or st.selective):
            out.append(None)
            continue
        off, kind = stage_offload(problem, st), problem.devices[st.device].kind
        sel_s = problem.selective.stage_extra_s(kind, st.first_unit, st.last_unit) if st.selective else 0.0
        out.append(StageLevers(st.recompute_units, alone[s].memory_bytes - with_[s].memory_bytes,
                               added_backward_s(problem, st) - sel_s, off.saved_bytes, off.tail_s, st.selective,
                               without[s].memory_bytes - alone[s].memory_bytes, sel_s))
    return tuple(out)
