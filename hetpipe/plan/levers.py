"""What each stage's memory levers cost and bought, re-derived from a plan's own tables.

`stage_levers` answers, per stage that recomputes (issue 14), how many units, how many bytes
its M_s is below the same stage without recomputation, and how many seconds the recomputed
forwards add to its backward: `hetpipe show`'s "recompute" column.

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

from hetpipe.cost_models.quantities import human_bytes
from hetpipe.partitioner.problem import evaluate, stage_recompute_cost
from hetpipe.plan.schema import Plan, problem_from_plan, stages_from_plan


@dataclass(frozen=True)
class StageLevers:
    """One stage's recomputation: units, memory saved (M_s without it - with it), seconds added per micro-batch."""

    recompute_units: tuple[int, ...]
    saved_bytes: int
    extra_s: float

    def describe(self) -> str:
        """E.g. ``3 units, -12.00 MiB, +4.10 ms`` (memory saved at the stage's peak, backward time added).

        Example:
            >>> StageLevers((3, 4, 5), 12 * 2**20, 0.0041).describe()
            '3 units, -12.00 MiB, +4.10 ms'
        """
        return f"{len(self.recompute_units)} units, -{human_bytes(self.saved_bytes)}, +{self.extra_s * 1e3:.2f} ms"


def stage_levers(plan: Plan) -> tuple[StageLevers | None, ...]:
    """Per stage of a single-pipeline `plan`: its `StageLevers`, or None when it uses none."""
    if not any(st.recompute_units for st in plan.stages) or plan.replicas:
        return tuple(None for _ in plan.stages)
    problem, stages = problem_from_plan(plan), stages_from_plan(plan)
    plain = tuple(replace(st, recompute_units=()) for st in stages)
    with_, without = evaluate(problem, stages), evaluate(problem, plain)
    out: list[StageLevers | None] = []
    for st, a, b in zip(stages, with_.stages, without.stages):
        out.append(StageLevers(st.recompute_units, b.memory_bytes - a.memory_bytes,
                               stage_recompute_cost(problem, st).extra_s) if st.recompute_units else None)
    return tuple(out)
