"""The plan's record of the optimizer-offload setting (`Plan.cost_model["offload"]`, version 4).

A plan solved with ``--offload auto`` or ``all`` records the setting and why in its cost-model
notes (absent = ``never``, every plan made before the lever); `hetpipe check` re-derives each
stage's choice under it (`hetpipe.plan.check`).

Example:
    >>> from types import SimpleNamespace
    >>> offload_mode(SimpleNamespace(cost_model={"offload": "auto: ..."})), offload_mode(SimpleNamespace(cost_model={}))
    ('auto', 'never')
"""

from __future__ import annotations

from typing import Any

from hetpipe.cost_models.offload import OFFLOAD_MODES
from hetpipe.errors import PlanError
from hetpipe.partitioner.problem import Problem

#: `Plan.cost_model` key of the setting.
OFFLOAD_NOTE = "offload"

_WHY = {"auto": "a stage keeps its optimizer state on the host only where that lowers T (its state does not "
                "fit otherwise, or offloading costs less than recomputing); O_s = P (gradient + weight bytes) / "
                "host link + P (host-step bytes) / host memory bandwidth, after its last backward, no overlap",
        "all": "every stage that can keeps its optimizer state on the host (ZeRO-Offload on every card)"}


def offload_mode(plan: Any) -> str:
    """The offload setting `plan` was solved with (``never`` when it records none)."""
    word = str(plan.cost_model.get(OFFLOAD_NOTE, "never")).split(":")[0].strip()
    if word not in OFFLOAD_MODES:
        raise PlanError(f"plan.cost_model.{OFFLOAD_NOTE}: {word!r} is not one of {', '.join(OFFLOAD_MODES)}; "
                        "fix the field or re-create the plan with `hetpipe plan`")
    return word


def offload_note(problem: Problem) -> dict[str, str]:
    """The cost-model note of `problem`'s setting (nothing for ``never``)."""
    return {OFFLOAD_NOTE: f"{problem.offload}: {_WHY[problem.offload]}"} if problem.offload != "never" else {}
