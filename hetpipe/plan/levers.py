"""What each stage's memory levers cost and bought, re-derived from a plan's own tables.

`stage_levers` answers, per stage that recomputes (issue 14), how many units, how many bytes
its M_s is below the same stage without recomputation, and how many seconds the recomputed
forwards add to its backward; per stage that offloads its optimizer state, the bytes that
leave its card and the tail O_s it pays: `hetpipe show`'s "levers" column.

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
from hetpipe.partitioner.problem import evaluate, stage_offload, stage_recompute_cost
from hetpipe.plan.schema import Plan, problem_from_plan, stages_from_plan


@dataclass(frozen=True)
class StageLevers:
    """One stage's recomputation: units, memory saved (M_s without it - with it), seconds added per micro-batch."""

    recompute_units: tuple[int, ...]
    saved_bytes: int
    extra_s: float
    offload_bytes: int = 0  # optimizer state kept on the host (0: the stage does not offload)
    offload_s: float = 0.0  # O_s: its copies and host step after the stage's last backward

    def describe(self) -> str:
        """E.g. ``3 units, -12.00 MiB, +4.10 ms`` (memory saved at the stage's peak, backward time added),
        and for an offloading stage ``offload -1.00 GiB, +210.00 ms tail``.

        Example:
            >>> StageLevers((3, 4, 5), 12 * 2**20, 0.0041).describe()
            '3 units, -12.00 MiB, +4.10 ms'
            >>> StageLevers((), 0, 0.0, 2**30, 0.21).describe()
            'offload -1.00 GiB, +210.00 ms tail'
        """
        parts = [f"{len(self.recompute_units)} units, -{human_bytes(self.saved_bytes)}, +{self.extra_s * 1e3:.2f} ms"
                 ] if self.recompute_units else []
        if self.offload_bytes:
            parts.append(f"offload -{human_bytes(self.offload_bytes)}, +{self.offload_s * 1e3:.2f} ms tail")
        return "; ".join(parts)


def stage_levers(plan: Plan) -> tuple[StageLevers | None, ...]:
    """Per stage of a single-pipeline `plan`: its `StageLevers`, or None when it uses none."""
    if not any(st.recompute_units or st.offload for st in plan.stages) or plan.replicas:
        return tuple(None for _ in plan.stages)
    problem, stages = problem_from_plan(plan), stages_from_plan(plan)
    rc_only = tuple(replace(st, offload=False) for st in stages)  # recompute's saving, offload apart
    plain = tuple(replace(st, recompute_units=()) for st in rc_only)
    with_, without = evaluate(problem, rc_only), evaluate(problem, plain)
    out: list[StageLevers | None] = []
    for st, a, b in zip(stages, with_.stages, without.stages):
        off = stage_offload(problem, st)
        out.append(StageLevers(st.recompute_units, b.memory_bytes - a.memory_bytes,
                               stage_recompute_cost(problem, st).extra_s, off.saved_bytes, off.tail_s)
                   if st.recompute_units or st.offload else None)
    return tuple(out)
