"""Plans for runtime tests, assembled from hand-chosen stages (no solver needed)."""

from __future__ import annotations

from hetpipe.partitioner.api import assemble_plan, build_problem
from hetpipe.partitioner.plan import Plan, SolverReport
from hetpipe.partitioner.problem import Stage, evaluate
from tests.synthetic import synthetic_cluster, synthetic_graph


def plan_for(graph, cluster, stages: tuple[Stage, ...], *, microbatches: int) -> Plan:
    """A plan of ``graph`` on ``cluster`` with the given stage placement."""
    problem = build_problem(graph, cluster, microbatches=microbatches)
    ev = evaluate(problem, stages)
    solver = SolverReport("hand", "FEASIBLE", ev.iteration_s, 0.0, 0.0)
    return assemble_plan(graph, cluster, problem=problem, stages=stages, solver=solver,
                         global_batch=graph.micro_batch_size * microbatches)


def synthetic_plan() -> Plan:
    """Three stages of the synthetic 6-unit graph on the synthetic 3-device cluster."""
    return plan_for(synthetic_graph(6), synthetic_cluster(), (Stage(0, 0, 2), Stage(1, 3, 4), Stage(2, 5, 5)),
                    microbatches=4)
