"""Replica plans (plan version 2): build them from a captured graph, write them, re-check them.

`partition_replicas` is the entry point (re-exported by `partitioner.api`); it solves with
`replicas.solve_replicas` (or the exact reference), records every replica's stages, its
m_r and gradient weight, the sync groups and the policy, and the baselines a user
compares against: ``ddp-equal`` (one replica per card, equal batches, every-step sync;
``fits`` is False where a card cannot hold it) and ``single-pipeline`` (issue #3's plan).
`check_replicas` recomputes every T_r, M_s, sync group and T from the plan's tables.

Example:
    >>> from hetpipe.plan.schema import check_plan
    >>> from tests.synthetic import synthetic_cluster, synthetic_graph   # doctest: +SKIP
    >>> plan = partition_replicas(synthetic_graph(6), synthetic_cluster(), global_batch=16,
    ...                           time_limit_s=5)  # doctest: +SKIP
    >>> check_plan(plan).ok                          # doctest: +SKIP
    True
"""

from __future__ import annotations

import dataclasses
import math
import time

from hetpipe.cost_models.devices import Cluster
from hetpipe.cost_models.sync import BUCKET_CAP_BYTES, SYNC_BUDGET_FRACTION, sync_groups
from hetpipe.errors import ConfigError, InfeasibleError, PlanError
from hetpipe.partitioner.capture.graph import UnitGraph
from hetpipe.plan.schema import (
    PLAN_VERSION_REPLICAS,
    BaselineReport,
    CheckReport,
    LeftOut,
    Plan,
    PlanReplica,
    PlanSync,
    PlanSyncGroup,
    Predicted,
    SolverReport,
    _close,
    _structure_violations,
    problem_from_plan,
    stages_from_plan,
)
from hetpipe.partitioner.problem import Problem, Stage, evaluate
from hetpipe.partitioner.replicas import (
    PipelineCache,
    ReplicaProblem,
    ReplicaSolution,
    canon_groups,
    GroupingSearch,
    evaluate_sync,
    replica_problem,
    scorer_for,
    solve_replicas,
    solve_replicas_exact,
)

REPLICA_SOLVERS = ("search", "exact")


def build_replica_problem(graph: UnitGraph, cluster: Cluster, *, global_batch: int,
                          bucket_cap_bytes: int = BUCKET_CAP_BYTES) -> ReplicaProblem:
    """The replica solver's input: every device, M = global_batch / b, gradients = parameter bytes."""
    from hetpipe.plan.build import build_problem, microbatches_for

    if bucket_cap_bytes < 1:
        raise ConfigError(f"bucket_cap_bytes must be a positive number of bytes, got {bucket_cap_bytes!r}")
    _, m = microbatches_for(graph, global_batch, len(cluster.devices))
    base = build_problem(graph, cluster, microbatches=m)
    return ReplicaProblem(base, grad_bytes=tuple(u.param_bytes for u in graph.units),
                          bucket_cap_bytes=int(bucket_cap_bytes))


def ddp_equal(rp: ReplicaProblem) -> BaselineReport:
    """Plain DDP: every card a replica with M / n micro-batches, every-step sync of the whole model.

    Example:
        >>> from hetpipe.partitioner.problem import DeviceSlot
        >>> inf = float("inf")
        >>> base = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (2.0, 2.0)}, state_bytes=(5, 5),
        ...                activation_bytes=(1, 1), boundary_bytes=(1, 0),
        ...                devices=(DeviceSlot("big", "a", "n", 100), DeviceSlot("small", "a", "n", 11)),
        ...                bandwidth_bytes_s=((inf, 10.0), (10.0, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)),
        ...                microbatches=4)
        >>> ddp_equal(ReplicaProblem(base, grad_bytes=(10, 10)))   # 2 x (6 + 6) s + 20 B / 10 B/s
        BaselineReport(iteration_s=14.0, fits=False, note='OOM on small')
    """
    n, total = len(rp.base.devices), rp.base.microbatches
    if total % n:
        return BaselineReport(0.0, False, f"not applicable: {total} micro-batches do not split equally over {n} cards")
    m = total // n
    whole = rp.base.num_units - 1
    pipes = [(Stage(d, 0, whole),) for d in range(n)]
    evs = [evaluate(replica_problem(rp.base, m), p) for p in pipes]
    sync_s = sum(g.time_s for g in evaluate_sync(rp, pipes))
    t = max(ev.iteration_s for ev in evs) + sync_s
    short = [rp.base.devices[d].id for d, ev in enumerate(evs) if not ev.fits]
    note = f"OOM on {', '.join(short)}" if short else f"{m} micro-batches per card, sync {sync_s:.3g} s"
    return BaselineReport(t, not short, note)


def single_pipeline(rp: ReplicaProblem, *, time_limit_s: float, seed: int) -> BaselineReport:
    """The best single pipeline over all devices (issue #3's plan) under the same tables."""
    from hetpipe.partitioner.solvers.solve import solve

    try:
        sol = solve(rp.base, time_limit_s=time_limit_s, seed=seed)
    except InfeasibleError as err:
        return BaselineReport(0.0, False, f"no single pipeline fits: {str(err).split(';')[0]}")
    return BaselineReport(sol.iteration_s, True, f"{len(sol.stages)} stages, {sol.solver} {sol.status}")


def explain_unused(rp: ReplicaProblem, sol: ReplicaSolution, *, time_limit_s: float = 5.0) -> dict[int, str]:
    """Why each unused device is left out: T when it joins a replica or runs as its own (best of those)."""
    out: dict[int, str] = {}
    if not sol.unused_devices:
        return out
    cache = PipelineCache(rp.base, exact=False, time_limit_s=time_limit_s)
    groups = tuple(tuple(sorted(st.device for st in r.stages)) for r in sol.replicas)
    scorer = scorer_for(sol.policy.policy, outer_steps=sol.policy.outer_steps)
    search = GroupingSearch(rp, cache, scorer, time.perf_counter() + time_limit_s)
    for d in sol.unused_devices:
        tries = [canon_groups([list(g) + ([d] if k == j else []) for k, g in enumerate(groups)])
                 for j in range(len(groups))]
        tries.append(canon_groups([list(g) for g in groups] + [[d]]))
        scored = [c for c in (search.score(g) for g in tries) if c is not None]
        used = [c for c in scored if any(st.device == d for r in c.replicas for st in r.stages)]
        alone = search.cache.best((d,), 1) is not None
        if not used:
            out[d] = ("the pipeline solver drops it from every replica it joins" + (
                "" if alone else ", and alone it cannot hold the model (out of memory)"))
        else:
            alt = min(c.iteration_s for c in used)
            out[d] = (f"the best tried plan using it predicts {alt:.4g} s per iteration vs {sol.iteration_s:.4g} s "
                      f"without it ({alt / sol.iteration_s:.2f}x the chosen T)")
    return out


def _predicted(problem: Problem, sol: ReplicaSolution, global_batch: int) -> Predicted:
    util = {d.id: 0.0 for d in problem.devices}
    busy, stages = 0.0, 0
    for rep in sol.replicas:
        ev = evaluate(replica_problem(problem, rep.microbatches), rep.stages)
        for st, cost in zip(rep.stages, ev.stages):
            work = rep.microbatches * (cost.fwd_s + cost.bwd_s)
            util[problem.devices[st.device].id] = work / sol.iteration_s
            busy, stages = busy + work, stages + 1
    return Predicted(sol.iteration_s, 1.0 - busy / (stages * sol.iteration_s), global_batch / sol.iteration_s, util)


def _plan_sync(problem: Problem, sol: ReplicaSolution, budget_fraction: float, bucket_cap_bytes: int) -> PlanSync:
    ids = [d.id for d in problem.devices]
    groups = tuple(PlanSyncGroup(g.first_unit, g.last_unit, tuple(ids[d] for d in g.devices), g.num_bytes,
                                 g.bandwidth_bytes_s, g.latency_s, g.time_s) for g in sol.sync)
    pol = sol.policy
    return PlanSync(pol.policy, pol.outer_steps, sol.compute_s, sol.sync_s, pol.amortised_s, budget_fraction,
                    pol.reason, groups, bucket_cap_bytes)


def assemble_replica_plan(graph: UnitGraph, cluster: Cluster, *, rp: ReplicaProblem, sol: ReplicaSolution,
                          global_batch: int, time_limit_s: float = 0.0, seed: int = 0,
                          budget_fraction: float = SYNC_BUDGET_FRACTION,
                          baselines: dict[str, BaselineReport] | None = None,
                          left_out: tuple[LeftOut, ...] = ()) -> Plan:
    """A version-2 plan from a solved replica layout (tables recorded exactly as optimised)."""
    from hetpipe.plan.build import _plan_stages, assemble_plan

    report = SolverReport(sol.solver, sol.status, sol.iteration_s, sol.bound_s, sol.wall_s, time_limit_s, seed)
    first = sol.replicas[0].stages
    plan = assemble_plan(graph, cluster, problem=rp.base, stages=first, solver=report, global_batch=global_batch,
                         baselines=baselines, left_out=left_out)
    stages, replicas = [], []
    b = graph.micro_batch_size
    for r, rep in enumerate(sol.replicas):
        ev = evaluate(replica_problem(rp.base, rep.microbatches), rep.stages)
        replicas.append(PlanReplica(r, len(stages), len(rep.stages), rep.microbatches, rep.microbatches * b,
                                    rep.microbatches * b / global_batch, ev.iteration_s))
        stages.extend(_plan_stages(rp.base, rep.stages, ev))
    return dataclasses.replace(plan, stages=tuple(stages), predicted=_predicted(rp.base, sol, global_batch),
                               version=PLAN_VERSION_REPLICAS, replicas=tuple(replicas),
                               sync=_plan_sync(rp.base, sol, budget_fraction, rp.bucket_cap_bytes))


def partition_replicas(graph: UnitGraph, cluster: Cluster, *, global_batch: int | None = None,
                       policy: str = "auto", outer_steps: int | None = None,
                       budget_fraction: float = SYNC_BUDGET_FRACTION, solver: str = "search",
                       time_limit_s: float = 30.0, seed: int = 0, bucket_cap_bytes: int = BUCKET_CAP_BYTES) -> Plan:
    """Plan pipeline replicas for `graph` on `cluster` (see `partitioner.replicas`).

    ``bucket_cap_bytes`` is the runtime's gradient all-reduce part size (recorded in the
    plan's ``sync``; the cost model charges each part one ring latency).

    Raises `ConfigError` for a global batch that is not a multiple of the micro-batch
    size or an unknown solver/policy, `InfeasibleError` when nothing fits.
    """
    from hetpipe.plan.build import microbatches_for

    if solver not in REPLICA_SOLVERS:
        raise ConfigError(f"unknown replica solver {solver!r}; use one of: {', '.join(REPLICA_SOLVERS)}")
    global_batch, _ = microbatches_for(graph, global_batch, len(cluster.devices))
    rp = build_replica_problem(graph, cluster, global_batch=global_batch, bucket_cap_bytes=bucket_cap_bytes)
    if solver == "exact":
        sol = solve_replicas_exact(rp, policy=policy, outer_steps=outer_steps, budget_fraction=budget_fraction)
    else:
        sol = solve_replicas(rp, policy=policy, outer_steps=outer_steps, budget_fraction=budget_fraction,
                             time_limit_s=time_limit_s, seed=seed)
    base = {"ddp-equal": ddp_equal(rp),
            "single-pipeline": single_pipeline(rp, time_limit_s=max(1.0, time_limit_s / 3), seed=seed)}
    why = explain_unused(rp, sol, time_limit_s=max(1.0, time_limit_s / 6))
    left = tuple(LeftOut(rp.base.devices[d].id, f"{rp.base.devices[d].kind}: {text}") for d, text in why.items())
    return assemble_replica_plan(graph, cluster, rp=rp, sol=sol, global_batch=global_batch,
                                 time_limit_s=time_limit_s, seed=seed, budget_fraction=budget_fraction,
                                 baselines=base, left_out=left)


def _replica_structure(plan: Plan) -> list[str]:
    """Replicas tile `stages`, split the micro-batches, weigh gradients by samples, use disjoint devices."""
    out, t = [], plan.training
    pos = 0
    for k, rep in enumerate(plan.replicas):
        where = f"replicas[{k}]"
        if rep.index != k or rep.first_stage != pos or rep.num_stages < 1 or rep.microbatches < 1:
            out.append(f"{where}: expected index {k}, first_stage {pos}, num_stages >= 1, microbatches >= 1")
        if rep.samples != rep.microbatches * t.micro_batch_size:
            out.append(f"{where}: samples {rep.samples} != {rep.microbatches} x {t.micro_batch_size}")
        if not _close(rep.grad_weight, rep.samples / t.global_batch):
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


def _check_stages(plan: Plan, problem: Problem, stages: tuple[Stage, ...]) -> tuple[list[float], list[str]]:
    """Per replica T_r, and every stage-level mismatch or memory violation."""
    out, times = [], []
    for rep in plan.replicas:
        sl = slice(rep.first_stage, rep.first_stage + rep.num_stages)
        try:
            ev = evaluate(replica_problem(problem, rep.microbatches), stages[sl])
        except ValueError as err:
            out.append(f"replicas[{rep.index}]: {err}")
            times.append(math.nan)
            continue
        times.append(ev.iteration_s)
        if not _close(rep.iteration_s, ev.iteration_s):
            out.append(f"replicas[{rep.index}]: recorded iteration_s {rep.iteration_s!r} != "
                       f"recomputed {ev.iteration_s!r}")
        for st, cost in zip(plan.stages[sl], ev.stages):
            for name, recorded, actual in (("fwd_s", st.fwd_s, cost.fwd_s), ("bwd_s", st.bwd_s, cost.bwd_s),
                                           ("send_s", st.send_s, cost.send_s),
                                           ("memory_bytes", st.memory_bytes, cost.memory_bytes)):
                if not _close(recorded, actual):
                    out.append(f"replica {rep.index} stage {st.index}: recorded {name} {recorded!r} != {actual!r}")
            if not cost.fits:
                out.append(f"replica {rep.index} stage {st.index} on {st.device}: needs {cost.memory_bytes / 2**30:.2f}"
                           f" GiB but only {cost.usable_bytes / 2**30:.2f} GiB is usable")
    return times, out


def _check_sync(plan: Plan, problem: Problem, stages: tuple[Stage, ...], compute_s: float) -> tuple[float, list[str]]:
    """Recompute the sync groups and the policy's amortised time; returns (T, violations)."""
    sync, out = plan.sync, []
    assert sync is not None  # Plan.__post_init__: replicas and sync go together
    pipes = [[(st.device, st.first_unit, st.last_unit) for st in stages[r.first_stage:r.first_stage + r.num_stages]]
             for r in plan.replicas]
    groups = sync_groups(pipes, grad_bytes=[u.param_bytes for u in plan.units],
                         bandwidth_bytes_s=problem.bandwidth_bytes_s, latency_s=problem.latency_s,
                         bucket_cap_bytes=sync.bucket_cap_bytes)
    ids = [d.id for d in problem.devices]
    want = tuple(PlanSyncGroup(g.first_unit, g.last_unit, tuple(ids[d] for d in g.devices), g.num_bytes,
                               g.bandwidth_bytes_s, g.latency_s, g.time_s) for g in groups)
    if len(want) != len(sync.groups) or any(
            (a.first_unit, a.last_unit, a.devices, a.num_bytes) != (b.first_unit, b.last_unit, b.devices, b.num_bytes)
            or not all(_close(x, y) for x, y in ((a.bandwidth_bytes_s, b.bandwidth_bytes_s),
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
        if not _close(recorded, actual):
            out.append(f"{name} {recorded!r} != recomputed {actual!r}")
    return total, out


def check_replicas(plan: Plan) -> CheckReport:
    """`check_plan` for a version-2 plan with replicas: every T_r, M_s, sync group and T."""
    violations = _structure_violations(plan) + _replica_structure(plan)
    problem = problem_from_plan(plan)
    try:
        stages = stages_from_plan(plan)
    except PlanError as err:  # a stage names a device the plan does not list
        return CheckReport(math.nan, tuple(violations + [str(err)]))
    if violations:
        return CheckReport(math.nan, tuple(violations))
    times, out = _check_stages(plan, problem, stages)
    violations += out
    if any(math.isnan(t) for t in times):
        return CheckReport(math.nan, tuple(violations))
    total, out = _check_sync(plan, problem, stages, max(times))
    return CheckReport(total, tuple(violations + out))
