"""What `check_plan` reports, and the checks every plan version shares (re-exported by `plan.schema`).

Example:
    >>> CheckReport(1.0, ()).ok, close_to_recorded(0.1 + 0.2, 0.3)
    (True, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Relative tolerance when re-checking recorded floats against recomputed ones:
# JSON round-trips Python floats exactly, so only summation order differs.
CHECK_RTOL = 1e-9


@dataclass(frozen=True)
class CheckReport:
    """What `check_plan` found: recomputed T and a list of violations (empty when ok)."""

    iteration_s: float
    violations: tuple[str, ...]
    objective: str = "schedule"  # what iteration_s is (`Plan.objective_name`)

    @property
    def ok(self) -> bool:
        return not self.violations


def close_to_recorded(recorded: float, actual: float) -> bool:
    """Whether a float recorded in a plan equals the recomputed one (`CHECK_RTOL`).

    Example:
        >>> close_to_recorded(0.1 + 0.2, 0.3), close_to_recorded(1.0, 1.001)
        (True, False)
    """
    return math.isclose(recorded, actual, rel_tol=CHECK_RTOL, abs_tol=1e-15)


def structure_violations(plan: Any) -> list[str]:
    """The batch arithmetic and unit numbering every plan version must satisfy."""
    out = []
    t = plan.training
    if t.micro_batch_size * t.microbatches != t.global_batch:
        out.append(
            f"training: micro_batch_size {t.micro_batch_size} x microbatches {t.microbatches} != "
            f"global_batch {t.global_batch}"
        )
    if [u.index for u in plan.units] != list(range(len(plan.units))):
        out.append("units: indices must be 0..L-1 in order")
    if plan.model.num_units != len(plan.units):
        out.append(f"model.num_units is {plan.model.num_units} but {len(plan.units)} units are listed")
    return out
