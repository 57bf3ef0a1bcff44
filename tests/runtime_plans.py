"""Plans for runtime tests, assembled from hand-chosen stages (no solver needed)."""

from __future__ import annotations

from hetpipe.plan.build import assemble_plan, build_problem
from hetpipe.partitioner.capture.graph import UnitGraph
from hetpipe.plan.schema import Plan, SolverReport
from hetpipe.partitioner.problem import Stage, evaluate
from tests.synthetic import synthetic_cluster, synthetic_graph


def plan_for(graph, cluster, stages: tuple[Stage, ...], *, microbatches: int) -> Plan:
    """A plan of ``graph`` on ``cluster`` with the given stage placement."""
    problem = build_problem(graph, cluster, microbatches=microbatches)
    ev = evaluate(problem, stages)
    solver = SolverReport("hand", "FEASIBLE", ev.iteration_s, 0.0, 0.0)
    return assemble_plan(graph, cluster, problem=problem, stages=stages, solver=solver,
                         global_batch=graph.micro_batch_size * microbatches)


def thirds_plan(model: str, cluster_file, *, batch: int, seq: int, microbatches: int) -> tuple[UnitGraph, Plan]:
    """Built-in ``model`` captured on meta and cut in three even stages on the first three cards of ``cluster_file``."""
    from hetpipe.cost_models.cluster import load_cluster
    from hetpipe.models import build
    from hetpipe.partitioner.capture.capture import capture

    meta, inputs = build(model, device="meta", batch=batch, seq=seq)
    graph = capture(meta, inputs, name=model)
    n = graph.num_units
    stages = (Stage(0, 0, n // 3 - 1), Stage(1, n // 3, 2 * n // 3 - 1), Stage(2, 2 * n // 3, n - 1))
    return graph, plan_for(graph, load_cluster(cluster_file), stages, microbatches=microbatches)


def synthetic_plan() -> Plan:
    """Three stages of the synthetic 6-unit graph on the synthetic 3-device cluster."""
    return plan_for(synthetic_graph(6), synthetic_cluster(), (Stage(0, 0, 2), Stage(1, 3, 4), Stage(2, 5, 5)),
                    microbatches=4)


def replica_plan_for(graph, cluster, pipelines, *, policy: str = "synchronous", outer_steps: int | None = None,
                     bucket_cap_bytes: int | None = None) -> Plan:
    """A version-2 plan with hand-chosen replicas: ``pipelines`` lists (stages, m_r) per replica."""
    from hetpipe.cost_models.sync import choose_policy
    from hetpipe.plan.replicas import assemble_replica_plan
    from hetpipe.partitioner.replicas import Replica, ReplicaProblem, ReplicaSolution, evaluate_sync, replica_problem

    total = sum(m for _, m in pipelines)
    base = build_problem(graph, cluster, microbatches=total)
    rp = ReplicaProblem(base, grad_bytes=tuple(u.param_bytes for u in graph.units),
                        **({"bucket_cap_bytes": bucket_cap_bytes} if bucket_cap_bytes else {}))
    reps = tuple(Replica(tuple(stages), m, evaluate(replica_problem(base, m), tuple(stages)).iteration_s)
                 for stages, m in pipelines)
    sync = evaluate_sync(rp, [r.stages for r in reps])
    compute_s, sync_s = max(r.iteration_s for r in reps), sum(g.time_s for g in sync)
    pol = choose_policy(compute_s=compute_s, sync_s=sync_s, policy=policy, outer_steps=outer_steps)
    sol = ReplicaSolution(reps, sync, pol, compute_s, sync_s, compute_s + pol.amortised_s, "hand", "FEASIBLE",
                          0.0, 0.0, ())
    return assemble_replica_plan(graph, cluster, rp=rp, sol=sol, global_batch=graph.micro_batch_size * total)
