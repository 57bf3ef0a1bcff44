"""`check --model`: the plan's cost tables must be the model's, not an edited copy.

The fingerprint covers the captured graph, not the numbers a plan records for it, so a
plan whose tables were edited consistently (activations set to 0, state divided by 4, a
tied parameter's replica set to 0 bytes) would pass `check_plan` and reach `run`, where it
runs out of memory.  `verify_tables` re-derives every unit's table from a fresh capture of
the model (and, given the cluster, every unit's time on every device kind) and raises one
`PlanError` naming the unit, the field, the recorded and the derived value.

Integers (FLOPs, bytes) must match exactly: the capture is deterministic.  Times must match
within `TIME_RTOL` (float noise of the same formula evaluated twice).

Example:
    >>> verify_tables(plan, capture_builtin("gpt-tiny", batch=2))   # doctest: +SKIP
"""

from __future__ import annotations

import math
from typing import Any

from hetpipe.errors import PlanError
from hetpipe.plan.schema import Plan

#: Relative tolerance on re-derived unit times (the same float formula, evaluated twice).
TIME_RTOL = 1e-9
#: Table fields compared exactly, unit by unit.
UNIT_FIELDS = ("fwd_flops", "bwd_flops", "param_bytes", "state_bytes", "activation_bytes", "boundary_bytes",
               "transient_bwd_bytes", "step_param_bytes", "step_tensor_bytes")
#: Fields the training loss adds to the last unit (`capture(..., loss_fn=...)`).
LOSS_FIELDS = ("fwd_flops", "bwd_flops", "activation_bytes", "transient_bwd_bytes")
#: The first memory model whose plans record `transient_bwd_bytes` (older plans hold 0: not compared).
TRANSIENT_MODEL = 4
#: The first memory model whose plans record the optimizer step's tables (`plan.step_schema`; older: not compared).
STEP_MODEL = 5
#: Fields that only fall where the loss's gradient does not reach a parameter (`capture.liveness`).
TRAINABLE_FIELDS = ("state_bytes", "step_param_bytes", "step_tensor_bytes")

_FIX = ("the plan's tables are not this model's (edited, or planned with other options); "
        "re-create it with `hetpipe plan`")


def _unit_mismatch(plan: Plan, graph: Any, *, loss_costed: bool) -> str | None:
    if [u.node_names for u in plan.units] != [tuple(u.node_names) for u in graph.units]:
        return (f"the plan's {len(plan.units)} units group the model's nodes differently from a fresh capture "
                f"({graph.num_units} units); the tables cannot be compared unit by unit")
    last = len(plan.units) - 1
    for rec, new in zip(plan.units, graph.units):
        for name in _compared(plan):
            recorded, derived = getattr(rec, name), getattr(new, name)
            if not loss_costed and rec.index == last and name in LOSS_FIELDS:
                if recorded < derived:  # the loss only adds; the fresh capture here did not cost it
                    return f"unit {rec.index} ({rec.name}): {name} is {recorded}, below the model's {derived}"
            elif not loss_costed and name in TRAINABLE_FIELDS:
                if recorded > derived:  # parameters the loss's gradient never reaches cost less (capture.liveness)
                    return f"unit {rec.index} ({rec.name}): {name} is {recorded}, above the model's {derived}"
            elif recorded != derived:
                return f"unit {rec.index} ({rec.name}): {name} is {recorded}, the model's is {derived}"
    return None


def _compared(plan: Plan) -> tuple[str, ...]:
    """The unit fields `plan`'s memory model records (`TRANSIENT_MODEL`, `STEP_MODEL`)."""
    return UNIT_FIELDS[:6] + UNIT_FIELDS[6:7] * (plan.memory_model >= TRANSIENT_MODEL) + UNIT_FIELDS[7:] * (
        plan.memory_model >= STEP_MODEL)


def _tied_mismatch(plan: Plan, graph: Any) -> str | None:
    from hetpipe.plan.build import tied_copies

    names = ("state_bytes", "step_bytes") if plan.memory_model >= STEP_MODEL else ("state_bytes",)
    for name in names:
        derived = {tuple(c.user_units): getattr(c, name) for c in tied_copies(graph)}
        recorded = {tuple(t.units): getattr(t, name) for t in plan.model.tied if len(t.units) > 1}
        for units, nbytes in derived.items():
            if recorded.get(units) != nbytes:
                return f"model.tied (units {list(units)}): {name} is {recorded.get(units)}, the model's is {nbytes}"
    extra = set(recorded) - set(derived)
    if extra:
        return f"model.tied lists units {sorted(extra)[0]} as sharing a parameter; the model does not"
    return None


def _time_mismatch(plan: Plan, graph: Any, cluster: Any) -> str | None:
    from hetpipe.plan.build import unit_times

    derived = unit_times(graph, cluster)
    for kind in sorted({d.kind for d in plan.devices}):
        if kind not in derived:
            raise PlanError(f"device kind {kind!r} of the plan is not in the given cluster; pass the cluster the plan "
                            "was made for with --cluster")
        for rec, times in zip(plan.units, derived[kind]):
            for name in ("fwd", "bwd"):
                got, want = getattr(rec.time_s[kind], name), getattr(times, name)
                if not math.isclose(got, want, rel_tol=TIME_RTOL, abs_tol=0.0):
                    return (f"unit {rec.index} ({rec.name}): time_s.{kind}.{name} is {got!r} s, "
                            f"the model's is {want!r} s")
    return _step_rule_mismatch(plan, cluster)


def _step_rule_mismatch(plan: Plan, cluster: Any) -> str | None:
    """The plan's per-kind step transient records (memory model 5) against the cluster's paths."""
    from hetpipe.plan.step_schema import step_paths, step_transient_records
    from hetpipe.cost_models.step_transient import path_transient

    if plan.memory_model < STEP_MODEL or not any(u.step_param_bytes for u in plan.units):
        return None  # no step tables recorded: the unit comparison says whether the model has some
    paths = {k: p for k, p in step_paths(cluster).items() if k in {d.kind for d in plan.devices}}
    derived = step_transient_records({k: path_transient(plan.training.optimizer, p) for k, p in paths.items()}, paths)
    for want in derived:
        got = next((r for r in plan.step_transient if r.kind == want.kind), None)
        if got != want:
            return f"step_transient of kind {want.kind!r} is {got}, the cluster's is {want}"
    return None


def verify_tables(plan: Plan, graph: Any, *, cluster: Any = None, loss_costed: bool = True) -> None:
    """Raise `PlanError` unless `plan`'s unit tables are `graph`'s (and its times `cluster`'s, when given).

    `loss_costed`: whether `graph` was captured with the training loss, as `hetpipe plan`
    does for built-in models; when not, the last unit's recorded FLOPs and activations may
    only exceed the fresh capture's (the loss adds to them), never fall below, and a unit's
    state only fall below it (parameters the loss never reaches keep no gradient).
    """
    if plan.model.param_count != graph.param_count:
        raise PlanError(f"model.param_count is {plan.model.param_count}, the model has {graph.param_count}; {_FIX}")
    for problem in (_unit_mismatch(plan, graph, loss_costed=loss_costed), _tied_mismatch(plan, graph),
                    _time_mismatch(plan, graph, cluster) if cluster is not None else None):
        if problem:
            raise PlanError(f"{problem}; {_FIX}")
