"""A plan's tables must be physically possible before anything recomputes from them.

`validate_plan` runs when a plan is loaded (`Plan.from_dict`) and when `check_plan` is
given a `Plan` object.  It refuses, with one `PlanError` naming the field, the value and
the fix, what would otherwise surface as a symptom far away ("recorded X != recomputed T",
a negative iteration time, a link priced as free):

* training: micro-batches, micro-batch size and global batch are whole numbers >= 1;
* devices: unique ids, 0 < usable_bytes <= memory_bytes <= the sanity bound;
* links: one per ordered pair of distinct devices (a deleted link is not a free link),
  finite bandwidth > 0, finite latency >= 0;
* units: FLOPs and bytes whole and >= 0, state_bytes >= param_bytes (the state holds the
  weights), a finite time >= 0 for every device kind; the optimizer step's stepped bytes (version 9),
  the largest tensor within them, and each kind's path and multiples;
* stages: a known device, the device's own usable_bytes (not an inflated copy), finite
  non-negative times and bytes; recompute_units distinct units of the stage's own range;
  a tensor-parallel group's members and shares well formed (`plan.groups`);
* the schedule, optimizer and precision are known, and the stages run every unit once, in order
  (`plan.structure`);
* predicted / solver figures finite; tied parameters name real units.

Whether the tables are the model's (and not consistently edited) is `check --model`'s
job (`hetpipe.plan.tables`).

Example:
    >>> from hetpipe.plan.check import check_plan    # refuses a non-Plan first, then runs validate_plan
    >>> check_plan("not a plan")
    Traceback (most recent call last):
    ...
    hetpipe.errors.PlanError: plan: expected a Plan (from Plan.load or hetpipe.partition), got str; load it with hetpipe.Plan.load(path)
"""

from __future__ import annotations

import math
from typing import Any

from hetpipe.cost_models.validate import (
    MAX_BANDWIDTH_BYTES_S, MAX_DEVICE_MEMORY_BYTES, MAX_DEVICES, MAX_LATENCY_S, finite_number, whole_number,
)
from hetpipe.cost_models.step_transient import STEP_PATHS
from hetpipe.errors import PlanError
from hetpipe.plan.groups import validate_groups
from hetpipe.plan.structure import validate_structure

#: Largest FLOP or byte count in a unit table: the solvers' numpy tables are 64-bit.
INT64_MAX = 2**63 - 1
_FIX = "the plan was edited or corrupted; re-create it with `hetpipe plan`"


def _num(value: object, field: str, *, minimum: float = 0.0, strict: bool = False,
         maximum: float = math.inf) -> float:
    return finite_number(value, field, minimum=minimum, strict=strict, maximum=maximum, fix=_FIX, error=PlanError)


def _int(value: object, field: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    return whole_number(value, field, minimum=minimum, maximum=maximum, fix=_FIX, error=PlanError)


def _training(plan: Any) -> None:
    t = plan.training
    _int(t.microbatches, "plan.training.microbatches", minimum=1)
    _int(t.micro_batch_size, "plan.training.micro_batch_size", minimum=1)
    _int(t.global_batch, "plan.training.global_batch", minimum=1)


def _devices(plan: Any) -> set[str]:
    _int(len(plan.devices), "plan.devices (count)", minimum=1, maximum=MAX_DEVICES)
    ids: set[str] = set()
    for i, d in enumerate(plan.devices):
        at = f"plan.devices[{i}]"
        if d.id in ids:
            raise PlanError(f"{at}.id: {d.id!r} appears twice; {_FIX}")
        ids.add(d.id)
        _int(d.memory_bytes, f"{at}.memory_bytes", minimum=1, maximum=MAX_DEVICE_MEMORY_BYTES)
        _int(d.usable_bytes, f"{at}.usable_bytes", minimum=1, maximum=d.memory_bytes)
    return ids


def _links(plan: Any, ids: set[str]) -> None:
    seen: set[tuple[str, str]] = set()
    for i, link in enumerate(plan.links):
        at = f"plan.links[{i}]"
        if link.src not in ids or link.dst not in ids or link.src == link.dst:
            raise PlanError(f"{at}: {link.src} -> {link.dst} must join two different devices of plan.devices; {_FIX}")
        if (link.src, link.dst) in seen:
            raise PlanError(f"{at}: {link.src} -> {link.dst} is listed twice; keep one entry or re-create the plan")
        seen.add((link.src, link.dst))
        _num(link.bandwidth_bytes_s, f"{at}.bandwidth_bytes_s", strict=True, maximum=MAX_BANDWIDTH_BYTES_S)
        _num(link.latency_s, f"{at}.latency_s", maximum=MAX_LATENCY_S)
    order = [d.id for d in plan.devices]
    for a in order:
        for b in order:
            if a != b and (a, b) not in seen:
                raise PlanError(f"plan.links: no link {a} -> {b}; every ordered pair of devices needs one (a missing "
                                f"link is not a free link); {_FIX}")


def _units(plan: Any, kinds: set[str]) -> None:
    for i, u in enumerate(plan.units):
        at = f"plan.units[{i}]"
        for name in ("fwd_flops", "bwd_flops", "param_bytes", "state_bytes", "activation_bytes", "boundary_bytes"):
            _int(getattr(u, name), f"{at}.{name}", maximum=INT64_MAX)
        if u.state_bytes < u.param_bytes:
            raise PlanError(f"{at}.state_bytes: {u.state_bytes} is less than its param_bytes {u.param_bytes} (the "
                            f"state holds the weights, their gradients and the optimizer state); {_FIX}")
        for kind in sorted(kinds):
            if kind not in u.time_s:
                raise PlanError(f"{at}.time_s: no entry for device kind {kind!r}; {_FIX}")
            _num(u.time_s[kind].fwd, f"{at}.time_s.{kind}.fwd")
            _num(u.time_s[kind].bwd, f"{at}.time_s.{kind}.bwd")


def _stages(plan: Any, usable: dict[str, int]) -> None:
    for i, st in enumerate(plan.stages):
        at = f"plan.stages[{i}]"
        if st.device not in usable:
            raise PlanError(f"{at}.device: {st.device!r} is not in plan.devices; {_FIX}")
        # a group stage records its tightest member's M_s and usable bytes (`problem.evaluate`), any member's
        members = [m for m in getattr(st, "group_devices", ()) if m in usable] or [st.device]
        if st.usable_bytes not in {usable[m] for m in members}:
            raise PlanError(f"{at}.usable_bytes: {st.usable_bytes} contradicts device {st.device}'s usable_bytes "
                            f"{usable[st.device]}; {_FIX}")
        _int(st.first_unit, f"{at}.first_unit")
        _int(st.last_unit, f"{at}.last_unit", minimum=st.first_unit, maximum=max(st.first_unit, len(plan.units) - 1))
        _int(st.memory_bytes, f"{at}.memory_bytes")
        for name in ("fwd_s", "bwd_s", "send_s"):
            _num(getattr(st, name), f"{at}.{name}")
        _recompute_units(st, at)


def _recompute_units(st: Any, at: str) -> None:
    """Recomputed units are the stage's own (global indices in [first_unit, last_unit]), each once."""
    seen: set[int] = set()
    for u in st.recompute_units:
        _int(u, f"{at}.recompute_units", minimum=st.first_unit, maximum=st.last_unit)
        if u in seen:
            raise PlanError(f"{at}.recompute_units: unit {u} is listed twice; {_FIX}")
        seen.add(u)


def _figures(plan: Any) -> None:
    if plan.objective not in ("", "schedule"):
        raise PlanError(f"plan.objective is {plan.objective!r}; use \"schedule\" (or leave it out for a plan "
                        f"solved with the H-1F1B estimate); {_FIX}")
    _num(plan.predicted.iteration_s, "plan.predicted.iteration_s", strict=True)
    _num(plan.solver.objective_s, "plan.solver.objective_s", strict=True)
    if not (isinstance(plan.solver.bound_s, float) and math.isnan(plan.solver.bound_s)):
        _num(plan.solver.bound_s, "plan.solver.bound_s")
    for k, t in enumerate(plan.model.tied):
        for u in t.units:
            _int(u, f"plan.model.tied[{k}].units", maximum=len(plan.units) - 1)
        _int(t.state_bytes, f"plan.model.tied[{k}].state_bytes")


def _steps(plan: Any) -> None:
    """Memory model 5's tables (version 9): whole bytes >= 0, a largest tensor within its unit's stepped bytes,
    per kind a known path and whole multiples >= 0 (`plan.step_schema`)."""
    for i, u in enumerate(plan.units):
        at = f"plan.units[{i}]"
        _int(u.step_param_bytes, f"{at}.step_param_bytes", maximum=INT64_MAX)
        _int(u.step_tensor_bytes, f"{at}.step_tensor_bytes", maximum=u.step_param_bytes)
    for k, t in enumerate(plan.model.tied):
        _int(t.step_bytes, f"plan.model.tied[{k}].step_bytes", maximum=INT64_MAX)
    for k, r in enumerate(plan.step_transient):
        if r.path not in STEP_PATHS:
            raise PlanError(f"plan.step_transient[{k}].path is {r.path!r}; use one of {', '.join(STEP_PATHS)}; {_FIX}")
        _int(r.list_multiple, f"plan.step_transient[{k}].list_multiple")
        _int(r.tensor_multiple, f"plan.step_transient[{k}].tensor_multiple")


def validate_plan(plan: Any) -> None:
    """Raise `PlanError` unless the `Plan` `plan`'s tables are physically possible (module docstring).

    (`plan.check.check_plan` first refuses anything that is not a `Plan`; this module sits
    below `plan.schema`, which validates every plan it loads.)
    """
    _training(plan)
    ids = _devices(plan)
    _links(plan, ids)
    _units(plan, {d.kind for d in plan.devices})
    _stages(plan, {d.id: d.usable_bytes for d in plan.devices})
    validate_groups(plan)
    validate_structure(plan)  # contiguous stages, a known schedule and optimizer (plan/structure.py)
    _figures(plan)
    _steps(plan)
