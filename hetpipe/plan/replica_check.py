"""Re-check a replica plan (version 2) from its own tables: every T_r, M_s, sync group and T.

`check_replicas` is what `plan.check.check_plan` runs for a plan with replicas; it
evaluates each replica with `problem.evaluate` on its m_r micro-batches and recomputes
the sync groups with `cost_models.sync.sync_groups`: no solver, no replica planner.

Example:
    >>> from hetpipe.plan.replicas import partition_replicas
    >>> from hetpipe.plan.build import capture_builtin
    >>> from hetpipe.cost_models.cluster import load_cluster
    >>> graph = capture_builtin("mlp-tiny", batch=2)
    >>> plan = partition_replicas(graph, load_cluster("examples/clusters/homelab.yaml"), global_batch=8,
    ...                           time_limit_s=2)
    >>> check_replicas(plan).ok, replica_structure(plan)
    (True, [])
"""

from __future__ import annotations

import math

from hetpipe.cost_models.sync import sync_groups
from hetpipe.errors import PlanError
from hetpipe.partitioner.problem import Problem, Stage, evaluate
from hetpipe.partitioner.replica_shard import ShardedEvaluation
from hetpipe.partitioner.replica_types import replica_problem
from hetpipe.plan.replica_shards import shard_violations, sharded_from_plan
from hetpipe.plan.schema import (
    CheckReport,
    Plan,
    PlanSyncGroup,
    close_to_recorded,
    problem_from_plan,
    stages_from_plan,
    structure_violations,
)


def replica_structure(plan: Plan) -> list[str]:
    """Replicas tile `stages`, split the micro-batches, weigh gradients by samples, use disjoint devices."""
    out, t = [], plan.training
    pos = 0
    for k, rep in enumerate(plan.replicas):
        where = f"replicas[{k}]"
        if rep.index != k or rep.first_stage != pos or rep.num_stages < 1 or rep.microbatches < 1:
            out.append(f"{where}: expected index {k}, first_stage {pos}, num_stages >= 1, microbatches >= 1")
        if rep.samples != rep.microbatches * t.micro_batch_size:
            out.append(f"{where}: samples {rep.samples} != {rep.microbatches} x {t.micro_batch_size}")
        if not close_to_recorded(rep.grad_weight, rep.samples / t.global_batch):
            out.append(f"{where}: grad_weight {rep.grad_weight!r} != samples / global_batch")
        pos += rep.num_stages
    if pos != len(plan.stages):
        out.append(f"replicas cover {pos} stages, the plan lists {len(plan.stages)}")
    if sum(r.microbatches for r in plan.replicas) != t.microbatches:
        out.append(f"replicas' micro-batches sum to {sum(r.microbatches for r in plan.replicas)}, "
                   f"training.microbatches is {t.microbatches}")
    used = [s.device for s in plan.stages]
    if len(set(used)) != len(used):
        out.append(f"a device runs two stages: {sorted(d for d in set(used) if used.count(d) > 1)}")
    return out


def _check_stages(plan: Plan, problem: Problem, stages: tuple[Stage, ...],
                  sharded: ShardedEvaluation | None) -> tuple[list[float], list[str]]:
    """Per replica T_r, and every stage-level mismatch or memory violation."""
    out, times = [], []
    for rep in plan.replicas:
        sl = slice(rep.first_stage, rep.first_stage + rep.num_stages)
        try:
            ev = (sharded.evaluations[rep.index] if sharded is not None
                  else evaluate(replica_problem(problem, rep.microbatches), stages[sl]))
        except ValueError as err:
            out.append(f"replicas[{rep.index}]: {err}")
            times.append(math.nan)
            continue
        times.append(ev.iteration_s)
        if not close_to_recorded(rep.iteration_s, ev.iteration_s):
            out.append(f"replicas[{rep.index}]: recorded iteration_s {rep.iteration_s!r} != "
                       f"recomputed {ev.iteration_s!r}")
        for st, cost in zip(plan.stages[sl], ev.stages):
            for name, recorded, actual in (("fwd_s", st.fwd_s, cost.fwd_s), ("bwd_s", st.bwd_s, cost.bwd_s),
                                           ("send_s", st.send_s, cost.send_s), ("step_s", st.step_s, cost.step_s),
                                           ("memory_bytes", st.memory_bytes, cost.memory_bytes)):
                if not close_to_recorded(recorded, actual):
                    out.append(f"replica {rep.index} stage {st.index}: recorded {name} {recorded!r} != {actual!r}")
            if not cost.fits:
                out.append(f"replica {rep.index} stage {st.index} on {st.device}: needs {cost.memory_bytes / 2**30:.2f}"
                           f" GiB but only {cost.usable_bytes / 2**30:.2f} GiB is usable")
    return times, out


def _check_sync(plan: Plan, problem: Problem, stages: tuple[Stage, ...], compute_s: float,
                sharded: ShardedEvaluation | None) -> tuple[float, list[str]]:
    """Recompute the sync groups and the policy's amortised time; returns (T, violations)."""
    sync, out = plan.sync, []
    assert sync is not None  # Plan.__post_init__: replicas and sync go together
    pipes = [[(st.device, st.first_unit, st.last_unit) for st in stages[r.first_stage:r.first_stage + r.num_stages]]
             for r in plan.replicas]
    groups = sharded.sync if sharded is not None else sync_groups(
        pipes, grad_bytes=[u.param_bytes for u in plan.units], bandwidth_bytes_s=problem.bandwidth_bytes_s,
        latency_s=problem.latency_s, bucket_cap_bytes=sync.bucket_cap_bytes)
    ids = [d.id for d in problem.devices]
    want = tuple(PlanSyncGroup(g.first_unit, g.last_unit, tuple(ids[d] for d in g.devices), g.num_bytes,
                               g.bandwidth_bytes_s, g.latency_s, g.time_s) for g in groups)
    if sharded is not None:
        out += shard_violations([g.shard for g in sync.groups], sharded)
        if sync.policy != "synchronous":
            out.append(f"sync: a sharded plan needs the synchronous policy, not {sync.policy!r} (DiLoCo's inner "
                       "steps use each replica's whole optimizer state); re-plan it with `hetpipe plan`")
    if len(want) != len(sync.groups) or any(
            (a.first_unit, a.last_unit, a.devices, a.num_bytes) != (b.first_unit, b.last_unit, b.devices, b.num_bytes)
            or not all(close_to_recorded(x, y) for x, y in ((a.bandwidth_bytes_s, b.bandwidth_bytes_s),
                                                (a.latency_s, b.latency_s), (a.time_s, b.time_s)))
            for a, b in zip(want, sync.groups)):
        out.append("sync.groups do not match the groups recomputed from the stages, units and links")
    sync_s = sum((g.time_s for g in groups), 0.0)
    if sync.policy not in ("synchronous", "diloco") or sync.outer_steps < 1 or (
            sync.policy == "synchronous" and sync.outer_steps != 1):
        out.append(f"sync: policy {sync.policy!r} with H = {sync.outer_steps} is not valid "
                   "(synchronous has H = 1, diloco H >= 1)")
    total = compute_s + sync_s / max(1, sync.outer_steps)
    for name, recorded, actual in (("sync.compute_s", sync.compute_s, compute_s), ("sync.sync_s", sync.sync_s, sync_s),
                                   ("sync.amortised_s", sync.amortised_s, sync_s / max(1, sync.outer_steps)),
                                   ("predicted.iteration_s", plan.predicted.iteration_s, total),
                                   ("solver.objective_s", plan.solver.objective_s, total)):
        if not close_to_recorded(recorded, actual):
            out.append(f"{name} {recorded!r} != recomputed {actual!r}")
    return total, out


def _sharded(plan: Plan, problem: Problem, stages: tuple[Stage, ...]) -> tuple[ShardedEvaluation | None, list[str]]:
    """The sharding contract re-evaluated for the plan's sharded groups (None: the plan shards nothing)."""
    assert plan.sync is not None
    recorded = [k for k, g in enumerate(plan.sync.groups) if g.shard is not None]
    if not recorded:
        return None, []
    rules = {g.shard.rule for g in plan.sync.groups if g.shard is not None}
    pipes = [(stages[r.first_stage:r.first_stage + r.num_stages], r.microbatches) for r in plan.replicas]
    try:
        ev = sharded_from_plan(problem, pipes, grad_bytes=[u.param_bytes for u in plan.units],
                               bucket_cap_bytes=plan.sync.bucket_cap_bytes, sharded=recorded, rule=min(rules))
    except (ValueError, IndexError) as err:
        return None, [f"sync.groups: the sharded groups {recorded} cannot be re-evaluated ({err})"]
    if len(ev.sync) != len(plan.sync.groups):
        return None, ["sync.groups do not match the groups recomputed from the stages, units and links"]
    return ev, ([] if len(rules) == 1 else [f"sync.groups: shards mix rules {sorted(rules)}; use one"])


def check_replicas(plan: Plan) -> CheckReport:
    """`check_plan` for a version-2 plan with replicas: every T_r, M_s, sync group and T."""
    violations = structure_violations(plan) + replica_structure(plan)
    problem = problem_from_plan(plan)
    try:
        stages = stages_from_plan(plan)
    except PlanError as err:  # a stage names a device the plan does not list
        return CheckReport(math.nan, tuple(violations + [str(err)]))
    if violations:
        return CheckReport(math.nan, tuple(violations))
    sharded, out = _sharded(plan, problem, stages)
    violations += out
    times, out = _check_stages(plan, problem, stages, sharded)
    violations += out
    if any(math.isnan(t) for t in times):
        return CheckReport(math.nan, tuple(violations))
    total, out = _check_sync(plan, problem, stages, max(times), sharded)
    return CheckReport(total, tuple(violations + out))
