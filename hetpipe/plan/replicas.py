"""Replica plans (plan version 2): build them from a captured graph, write them, re-check them.

`partition_replicas` is the entry point; it solves with `partitioner.replicas.solve_replicas` (or the exact reference), records every replica's stages, its
m_r and gradient weight, the sync groups and the policy, and the baselines a user
compares against: ``ddp-equal`` (one replica per card, equal batches, every-step sync;
``fits`` is False where a card cannot hold it) and ``single-pipeline`` (issue #3's plan).
`plan.replica_check.check_replicas` re-checks such a plan from its tables.

Example (the tiny test MLP on the home lab: the 3090 and 4090 each hold the whole model, so
two one-card replicas with 2 micro-batches each beat a two-stage pipeline):
    >>> from hetpipe.cost_models.cluster import load_cluster
    >>> from hetpipe.plan.build import capture_builtin
    >>> from hetpipe.plan.check import check_plan
    >>> graph = capture_builtin("mlp-tiny", batch=2)
    >>> plan = partition_replicas(graph, load_cluster("examples/clusters/homelab.yaml"), global_batch=8,
    ...                           time_limit_s=2)
    >>> plan.version, [(r.microbatches, r.num_stages) for r in plan.replicas], plan.sync.policy
    (9, [(2, 1), (2, 1)], 'synchronous')
    >>> check_plan(plan).ok
    True
"""

from __future__ import annotations

import dataclasses
import time

from hetpipe.cost_models.cluster_checks import as_cluster
from hetpipe.cost_models.devices import Cluster
from hetpipe.cost_models.recompute import check_recompute_option
from hetpipe.cost_models.sharding import check_sharding_option
from hetpipe.cost_models.validate import check_solver_options
from hetpipe.cost_models.sync import BUCKET_CAP_BYTES, SYNC_BUDGET_FRACTION
from hetpipe.errors import ConfigError, InfeasibleError
from hetpipe.partitioner.capture.graph import UnitGraph
from hetpipe.plan.build import assemble_plan, build_problem, microbatches_for, plan_stages
from hetpipe.plan.replica_shards import plan_shard, replica_evaluations
from hetpipe.plan.schema import (
    PLAN_VERSION_REPLICAS,
    BaselineReport,
    LeftOut,
    Plan,
    PlanReplica,
    PlanSync,
    PlanSyncGroup,
    Predicted,
    SolverReport,
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
                          bucket_cap_bytes: int = BUCKET_CAP_BYTES, recompute: str = "auto",
                          sharding: str = "never", offload: str = "never") -> ReplicaProblem:
    """The replica solver's input: every device, M = global_batch / b, gradients = parameter bytes,
    the activation-recomputation lever every replica's stages may use (`Problem.recompute`) and the
    optimizer-state sharding lever (`partitioner.replica_shard`)."""
    check_sharding_option(sharding)
    if bucket_cap_bytes < 1:
        raise ConfigError(f"bucket_cap_bytes must be a positive number of bytes, got {bucket_cap_bytes!r}")
    _, m = microbatches_for(graph, global_batch, len(cluster.devices))
    base = build_problem(graph, cluster, microbatches=m, recompute=recompute, offload=offload)
    return ReplicaProblem(base, grad_bytes=tuple(u.param_bytes for u in graph.units),
                          bucket_cap_bytes=int(bucket_cap_bytes), sharding=sharding)


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
        BaselineReport(iteration_s=14.0, fits=False, note='OOM on small', best=None)
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
    shard = {s.group: plan_shard(s) for s in sol.shards}
    groups = tuple(PlanSyncGroup(g.first_unit, g.last_unit, tuple(ids[d] for d in g.devices), g.num_bytes,
                                 g.bandwidth_bytes_s, g.latency_s, g.time_s, shard.get(k))
                   for k, g in enumerate(sol.sync))
    pol = sol.policy
    return PlanSync(pol.policy, pol.outer_steps, sol.compute_s, sol.sync_s, pol.amortised_s, budget_fraction,
                    pol.reason, groups, bucket_cap_bytes)


def assemble_replica_plan(graph: UnitGraph, cluster: Cluster, *, rp: ReplicaProblem, sol: ReplicaSolution,
                          global_batch: int, time_limit_s: float = 0.0, seed: int = 0,
                          budget_fraction: float = SYNC_BUDGET_FRACTION,
                          baselines: dict[str, BaselineReport] | None = None,
                          left_out: tuple[LeftOut, ...] = ()) -> Plan:
    """A version-2 plan from a solved replica layout (tables recorded exactly as optimised)."""
    report = SolverReport(sol.solver, sol.status, sol.iteration_s, sol.bound_s, sol.wall_s, time_limit_s, seed)
    first = sol.replicas[0].stages
    plan = assemble_plan(graph, cluster, problem=rp.base, stages=first, solver=report, global_batch=global_batch,
                         baselines=baselines, left_out=left_out)
    stages, replicas = [], []
    b = graph.micro_batch_size
    for r, (rep, ev) in enumerate(zip(sol.replicas, replica_evaluations(rp, sol))):
        replicas.append(PlanReplica(r, len(stages), len(rep.stages), rep.microbatches, rep.microbatches * b,
                                    rep.microbatches * b / global_batch, ev.iteration_s))
        stages.extend(plan_stages(rp.base, rep.stages, ev))
    return dataclasses.replace(plan, stages=tuple(stages), predicted=_predicted(rp.base, sol, global_batch),
                               version=max(PLAN_VERSION_REPLICAS, plan.version), replicas=tuple(replicas),
                               sync=_plan_sync(rp.base, sol, budget_fraction, rp.bucket_cap_bytes))


def partition_replicas(graph: UnitGraph, cluster: Cluster, *, global_batch: int | None = None,
                       policy: str = "auto", outer_steps: int | None = None,
                       budget_fraction: float = SYNC_BUDGET_FRACTION, solver: str = "search",
                       time_limit_s: float = 30.0, seed: int = 0, bucket_cap_bytes: int = BUCKET_CAP_BYTES,
                       recompute: str = "auto", sharding: str = "never", offload: str = "never") -> Plan:
    """Plan pipeline replicas for `graph` on `cluster` (see `partitioner.replicas`); `recompute` is
    the activation-recomputation lever of every replica's stages (auto | none | all), `sharding`
    the optimizer-state sharding of each sync group (never | auto | all; synchronous sync only),
    `offload` each replica stage's optimizer-state offload (`Problem.offload`; a group held by an
    offloading stage does not shard).

    ``bucket_cap_bytes`` is the runtime's gradient all-reduce part size (recorded in the
    plan's ``sync``; the cost model charges each part one ring latency).

    Raises `ConfigError` for a global batch that is not a multiple of the micro-batch
    size or an unknown solver/policy, `InfeasibleError` when nothing fits.
    """
    if solver not in REPLICA_SOLVERS:
        raise ConfigError(f"unknown replica solver {solver!r}; use one of: {', '.join(REPLICA_SOLVERS)}")
    check_solver_options(solver, time_limit_s, seed)
    cluster = as_cluster(cluster)  # a path, a dict or a checked Cluster
    global_batch, _ = microbatches_for(graph, global_batch, len(cluster.devices))
    check_recompute_option(recompute)
    if recompute == "selective":  # no replica solver prices the selective level (`plan.replica_count`)
        raise ConfigError("recompute: 'selective' with replicas: the selective level is priced for one pipeline "
                          "only; use hetpipe.partition or recompute='auto'")
    rp = build_replica_problem(graph, cluster, global_batch=global_batch, bucket_cap_bytes=bucket_cap_bytes,
                               recompute=recompute, sharding=sharding, offload=offload)
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
