"""Re-check a plan from the file alone: `check_plan` (every plan version).

`check_plan` rebuilds the solver's `Problem` from the tables the plan records and
recomputes T and every stage's M_s with `problem.evaluate`; a plan with replicas
(version 2) is checked by `plan.replica_check`; the recorded baselines by
`plan.baseline_check` (which re-runs the baseline search, not the planner's).  Nothing here
imports the planner's solvers or the replica planner: checking a plan is cheap.

Example (a plan is re-checked; an edited prediction is caught):
    >>> from hetpipe.models import build
    >>> from hetpipe.plan.build import partition
    >>> model, inputs = build("mlp-tiny", device="meta", batch=2)
    >>> plan = partition(model, "examples/clusters/homelab.yaml", example_inputs=inputs, global_batch=8)
    >>> check_plan(plan).ok
    True
    >>> import dataclasses
    >>> edited = dataclasses.replace(plan, predicted=dataclasses.replace(plan.predicted, iteration_s=1.0))
    >>> check_plan(edited).violations[0].startswith("predicted.iteration_s 1.0 != recomputed T")
    True
"""

from __future__ import annotations

import dataclasses
import math

from hetpipe.cost_models.stage_memory import MEMORY_MODEL, PRICED_AS_CURRENT, SAME_AS_PREVIOUS
from hetpipe.errors import PlanError
from hetpipe.partitioner.problem import Problem, Stage, evaluate, is_split
from hetpipe.schedule.interleaved import parse_interleaved
from hetpipe.partitioner.recompute import choose_recompute, is_prefix_choice
from hetpipe.plan.baseline_check import baseline_violations
from hetpipe.plan.chunk_schema import chunk_violations
from hetpipe.plan.tp_plan import share_violations
from hetpipe.plan.offload_check import offload_violations
from hetpipe.plan.replica_check import check_replicas
from hetpipe.plan.selective_check import record_violations, selective_violations
from hetpipe.plan.schema import (
    CheckReport,
    Plan,
    close_to_recorded,
    problem_from_plan,
    stages_from_plan,
    structure_violations,
)
from hetpipe.plan.validate import validate_plan


def check_plan(plan: Plan) -> CheckReport:
    """Recompute T and every M_s from the recorded tables; report every mismatch or violation.

    A plan made with another memory model (`Plan.memory_model`) gets one plain violation
    saying so instead of a mismatch per stage: its memory_bytes follow another formula.
    """
    if not isinstance(plan, Plan):
        raise PlanError(f"plan: expected a Plan (from Plan.load or hetpipe.partition), got {type(plan).__name__}; "
                        "load it with hetpipe.Plan.load(path)")
    validate_plan(plan)  # NaN, a deleted link: one PlanError naming the field, not a symptom below
    report = check_replicas(plan) if plan.replicas else _check_pipeline(plan)
    report = dataclasses.replace(report, objective=plan.objective_name)
    if same_memory_model(plan):
        return report
    others = [v for v in report.violations if "memory_bytes" not in v]
    return CheckReport(report.iteration_s, (memory_model_mismatch(plan), *others), plan.objective_name)


def same_memory_model(plan: Plan) -> bool:
    """Are ``plan``'s memory_bytes priced as this hetpipe prices them (its model, or model 2 for a
    schedule whose memory model 3 did not change: neither split nor interleaved)?"""
    if plan.memory_model == MEMORY_MODEL or plan.memory_model in PRICED_AS_CURRENT:  # no transient tables: as 5
        return True
    name = plan.training.schedule
    return plan.memory_model == SAME_AS_PREVIOUS and not is_split(name) and parse_interleaved(name) is None


def memory_model_mismatch(plan: Plan) -> str:
    """The violation of a plan whose stage memory was computed with another memory model.

    Example:
        >>> from types import SimpleNamespace
        >>> memory_model_mismatch(SimpleNamespace(memory_model=1))[:62]
        'memory_model: this plan was made with memory model 1, this het'
    """
    return (f"memory_model: this plan was made with memory model {plan.memory_model}, this hetpipe uses memory "
            f"model {MEMORY_MODEL} (each stage's memory_bytes is computed differently); re-plan with `hetpipe plan`")


def _check_pipeline(plan: Plan) -> CheckReport:
    violations = structure_violations(plan)
    problem = problem_from_plan(plan)
    try:
        stages = stages_from_plan(plan)  # a tensor-parallel group's members too (issue 15)
        ev = evaluate(problem, stages)
    except ValueError as err:
        return CheckReport(math.nan, tuple(violations + [f"stages: {err}"]))
    violations += (recompute_violations(problem, stages) + offload_violations(problem, stages)
                   + selective_violations(problem, stages) + record_violations(plan)
                   + share_violations(plan, ev) + chunk_violations(plan.stages, ev.stages))
    for st, cost in zip(plan.stages, ev.stages):
        for name, recorded, actual in (
            ("fwd_s", st.fwd_s, cost.fwd_s),
            ("bwd_s", st.bwd_s, cost.bwd_s),
            ("send_s", st.send_s, cost.send_s),
            ("memory_bytes", st.memory_bytes, cost.memory_bytes),
            ("offload_bytes", st.offload_bytes, cost.offload_bytes),
            ("offload_s", st.offload_s, cost.offload_s),
            ("step_s", st.step_s, cost.step_s),
            ("bwd_weight_s", st.bwd_weight_s, cost.bwd_weight_s if is_split(problem.schedule) else 0.0),
        ):
            if not close_to_recorded(recorded, actual):
                violations.append(f"stage {st.index}: recorded {name} {recorded!r} != recomputed {actual!r}")
        if not cost.fits:
            violations.append(
                f"stage {st.index} on {st.device}: needs {cost.memory_bytes / 2**30:.2f} GiB but only "
                f"{cost.usable_bytes / 2**30:.2f} GiB is usable (over by "
                f"{(cost.memory_bytes - cost.usable_bytes) / 2**30:.2f} GiB)"
            )
    violations.extend(baseline_violations(plan, dataclasses.replace(problem, schedule="1f1b")))  # baselines run 1F1B
    for name, recorded in (("predicted.iteration_s", plan.predicted.iteration_s),
                           ("solver.objective_s", plan.solver.objective_s)):
        if not close_to_recorded(recorded, ev.iteration_s):
            violations.append(f"{name} {recorded!r} != recomputed T {ev.iteration_s!r}")
    estimate = plan.predicted.t_1f1b_estimate_s
    if plan.objective and not close_to_recorded(estimate, ev.estimate_s):
        violations.append(f"predicted.t_1f1b_estimate_s {estimate!r} != recomputed {ev.estimate_s!r}")
    return CheckReport(ev.iteration_s, tuple(violations))


def recompute_violations(problem: Problem, stages: tuple[Stage, ...]) -> list[str]:
    """Each stage's recompute set against the plan's setting (`Problem.recompute`): a prefix of the
    stage's order, and under ``auto``/``all`` exactly the choice the planner makes (re-derived)."""
    out = []
    for s, st in enumerate(stages):
        if st.members:  # a group has no levers (`evaluate` refuses them)
            continue
        if st.recompute_units and not is_prefix_choice(problem, st):
            out.append(f"stage {s}: recompute_units {list(st.recompute_units)} are not the first units of the "
                       "stage's recompute order (saved bytes per recompute second)")
        elif problem.recompute != "none":
            want = choose_recompute(problem, stages, s)
            if want != st.recompute_units:
                out.append(f"stage {s}: recompute_units {list(st.recompute_units)}, but recompute "
                           f"{problem.recompute!r} chooses {list(want)}")
    return out
