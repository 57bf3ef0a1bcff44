"""Is a captured model the one a plan was made for (`verify_model`)?

Example:
    >>> from types import SimpleNamespace
    >>> plan = SimpleNamespace(model=SimpleNamespace(name="m", fingerprint="ab"))
    >>> verify_model(plan, SimpleNamespace(fingerprint="ab"))   # the same: nothing to say
"""

from __future__ import annotations

from typing import Any

from hetpipe.errors import PlanError


def verify_model(plan: Any, graph: Any) -> None:
    """Refuse to use `plan` (a `plan.schema.Plan`) for a model whose captured graph (a `UnitGraph`) differs
    from the one planned."""
    if graph.fingerprint != plan.model.fingerprint:
        raise PlanError(
            f"this plan was made for model {plan.model.name!r} (fingerprint {plan.model.fingerprint[:12]}), but the "
            f"given model {graph.model_name!r} captures to fingerprint {graph.fingerprint[:12]} "
            f"({graph.num_units} units, {graph.param_count:,} parameters); re-plan it with `hetpipe plan`"
        )
