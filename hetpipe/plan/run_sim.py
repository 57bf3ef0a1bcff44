"""A plan's simulated iteration as the runtime runs it: every replica's pipeline, then its
gradient sync, overlapped with the last backward the way `hetpipe.runtime.replicas.buckets`
launches it.  The run report compares a measured run with this (`runtime.report`); the
replica emulation paces its sync with `stage_bwd_fraction`.

Example:
    >>> from hetpipe.models import build
    >>> from hetpipe.plan.build import partition
    >>> model, inputs = build("mlp-tiny", device="meta", batch=2)
    >>> plan = partition(model, "examples/clusters/homelab.yaml", example_inputs=inputs, global_batch=8)
    >>> simulated_iteration_s(plan, "1f1b") == plan.predicted.simulated_iteration_s
    True
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from hetpipe.cost_models.sync import Ring, backward_done_fraction, overlapped_sync_end_s
from hetpipe.plan.schema import Plan, PlanStage
from hetpipe.schedule.simulate import SimCosts, SimResult, simulate_stages


def simulated_iteration_s(plan: Plan, schedule_name: str, *, overlap_sync: bool = True) -> float:
    """The simulator's iteration for `plan`'s stage costs under `schedule_name` (emulated seconds).

    A replica plan: every replica's own pipeline, then its gradient sync.  Synchronous sync
    with ``overlap_sync`` (the runtime's default) starts each sync group's ring once every
    holder's last backward has produced that group's gradients (`sync_rings`), groups
    issued from the last unit back (`overlapped_sync_end_s`); otherwise (DiLoCo, or overlap
    off) the slowest replica plus the amortised sync, as T charges it.
    """
    if not plan.replicas:
        return simulate_stage_records(plan.stages, plan.training.microbatches, schedule_name).iteration_s
    sims = [simulate_stage_records(plan.stages[r.first_stage:r.first_stage + r.num_stages], r.microbatches, schedule_name)
            for r in plan.replicas]
    compute = max(res.iteration_s for res in sims)
    sync = plan.sync
    if sync is None or not sync.groups:
        return compute
    if sync.policy != "synchronous" or not overlap_sync:
        return compute + sync.amortised_s
    last_b: dict[str, float] = {}  # device -> start of its last backward
    for rep, res in zip(plan.replicas, sims):
        for i in range(rep.num_stages):
            last_b[plan.stages[rep.first_stage + i].device] = max(
                e.start_s for e in res.events if e.lane == f"rank {i}" and e.op.value == "B")
    return max(compute, overlapped_sync_end_s(sync_rings(plan, last_b)))


def sync_rings(plan: Plan, last_backward_start_s: Mapping[str, float]) -> list[Ring]:
    """The runtime's all-reduce parts as `Ring`s, in launch order (`hetpipe.runtime.replicas.buckets` cuts them).

    Each sync group, last unit first, is cut into parts of whole units up to the plan's
    ``bucket_cap_bytes`` (the runtime cuts at parameters, a finer but similar grain); a
    part costs the group's time times its share of the group's bytes, and a holder is
    ready for it once its last backward (starting at ``last_backward_start_s[device]``)
    has passed the part's lowest unit.
    """
    assert plan.sync is not None
    by_device = {s.device: s for s in plan.stages}
    rings = []
    for g in sorted(plan.sync.groups, key=lambda g: -g.first_unit):
        for lowest, num_bytes in unit_parts(plan, g.first_unit, g.last_unit, plan.sync.bucket_cap_bytes):
            ready = tuple(last_backward_start_s[d] + by_device[d].bwd_s * stage_bwd_fraction(plan, by_device[d], lowest)
                          for d in g.devices)
            seconds = g.time_s * num_bytes / g.num_bytes if g.num_bytes > 0 else 0.0
            rings.append(Ring(tuple(g.devices), seconds, ready))
    return rings


def unit_parts(plan: Plan, first: int, last: int, cap_bytes: int) -> list[tuple[int, int]]:
    """(lowest unit, bytes) of each part of units ``first..last``, cut last unit first at ``cap_bytes``."""
    parts: list[list[int]] = []  # [lowest unit, bytes]
    for u in range(last, first - 1, -1):
        nbytes = plan.units[u].param_bytes
        if not parts or (parts[-1][1] + nbytes > cap_bytes and parts[-1][1] > 0):
            parts.append([u, 0])
        parts[-1][0], parts[-1][1] = u, parts[-1][1] + nbytes
    return [(u, b) for u, b in parts]


def stage_bwd_fraction(plan: Plan, stage: Any, first_unit: int) -> float:
    """Share of ``stage``'s backward after which units ``first_unit..stage.last_unit`` have gradients."""
    kind = plan.devices[plan.device_index()[stage.device]].kind
    times = [plan.units[u].time_s[kind].bwd for u in range(stage.first_unit, stage.last_unit + 1)]
    return backward_done_fraction(times, max(0, first_unit - stage.first_unit))


def simulate_stage_records(stages: Sequence[PlanStage], microbatches: int, schedule_name: str) -> SimResult:
    """Simulate a pipeline of the plan's stage records (their recorded F, B, one-way send and step times;
    an offloading stage's step is its offload tail).  Stages with chunks (``interleaved:V``) are
    simulated as their v p virtual stages in model order (chunk c of stage r is ``c p + r``), each
    with its chunk's F, B, C and step share: the action lists the run executes."""
    virtual = [s.chunks[k // len(stages)] if s.chunks else s
               for k in range(len(stages) * max(1, len(stages[0].chunks) if stages else 1))
               for s in (stages[k % len(stages)],)]
    costs = SimCosts(fwd_s=tuple(s.fwd_s for s in virtual), bwd_s=tuple(s.bwd_s for s in virtual),
                     send_s=tuple(s.send_s for s in virtual[:-1]), step_s=tuple(s.step_s for s in virtual))
    return simulate_stages(costs, microbatches, schedule=schedule_name)
