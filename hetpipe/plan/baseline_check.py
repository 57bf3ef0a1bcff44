"""Re-check the baselines a plan records from its own tables (issue 17).

The forced placement is re-cut and re-evaluated; a recorded best placement must use the
rule's own cuts for its number of stages, its T and fit are recomputed, and it may not be
worse than the forced placement (the search includes it).  The search is run again so a
plan cannot record a worse subset than it finds (which would inflate the headline): a
placement recorded as ``exact`` (or ``none fits``) is searched again within the same node
budget, one recorded as ``local search`` against the local search alone (milliseconds).
`check_plan` calls this.

Example:
    >>> from hetpipe.models import build
    >>> from hetpipe.plan.build import partition
    >>> import dataclasses
    >>> model, inputs = build("mlp-tiny", device="meta", batch=2)
    >>> plan = partition(model, "examples/clusters/homelab.yaml", example_inputs=inputs, global_batch=8)
    >>> baseline_violations(plan, problem_from_plan(plan))
    []
    >>> rec = plan.baselines["uniform"]
    >>> edited = dataclasses.replace(rec, best=dataclasses.replace(rec.best, iteration_s=1e-6))
    >>> bad = dataclasses.replace(plan, baselines={**plan.baselines, "uniform": edited})
    >>> baseline_violations(bad, problem_from_plan(bad))[0].startswith("baselines.uniform.best: recorded T")
    True
"""

from __future__ import annotations

from hetpipe.partitioner.baseline_search import EXACT_NODE_BUDGET, best_baseline
from hetpipe.partitioner.baselines import BASELINES, baseline, rule_bounds, without_offload
from hetpipe.partitioner.problem import Problem, Stage, evaluate
from hetpipe.partitioner.recompute import with_recompute
from hetpipe.partitioner.selective_mode import forced_problem
from hetpipe.plan.schema import BaselineReport, Plan, close_to_recorded, problem_from_plan  # noqa: F401 (doctest)


def _best_violations(problem: Problem, name: str, rec: BaselineReport) -> list[str]:
    best = rec.best
    assert best is not None
    where = f"baselines.{name}.best"
    if not best.fits:
        return [f"{where}: recorded as not fitting, but the forced placement fits"] if rec.fits else []
    ids = {d.id: i for i, d in enumerate(problem.devices)}
    unknown = [s.device for s in best.stages if s.device not in ids]
    if not best.stages or unknown:
        return [f"{where}: stages name devices the plan does not list ({unknown}) or are empty"]
    bounds = rule_bounds(problem, name, len(best.stages), profile_kind=best.profile_kind or None)
    if [(s.first_unit, s.last_unit + 1) for s in best.stages] != list(bounds):
        return [f"{where}: its cuts are not the {name} rule's for {len(best.stages)} stages"]
    try:  # each stage recomputes what the plan's lever chooses (`with_recompute`), as the search priced it
        ev = evaluate(problem, with_recompute(without_offload(problem), tuple(Stage(ids[s.device], s.first_unit, s.last_unit)
                                                             for s in best.stages)))
    except ValueError as err:
        return [f"{where}: {err}"]
    out = []
    if not close_to_recorded(best.iteration_s, ev.iteration_s) or not ev.fits:
        out.append(f"{where}: recorded T {best.iteration_s!r} (fits) != recomputed {ev.iteration_s!r} "
                   f"(fits: {ev.fits})")
    if rec.fits and ev.iteration_s > rec.iteration_s * (1 + 1e-9):
        out.append(f"{where}: T {ev.iteration_s!r} is worse than the forced placement's {rec.iteration_s!r}, "
                   "which the search includes")
    return out


def baseline_violations(plan: Plan, problem: Problem) -> list[str]:
    """Re-derive every recorded baseline of `BASELINES` from the plan's tables.

    The forced placement is re-cut and re-evaluated; a recorded best placement must use
    the rule's own cuts for its number of stages, and its T and fit are recomputed.
    Other names (a replica plan's ``ddp-equal``) are checked by `plan.replica_check`.  Under
    ``recompute selective`` the baselines were searched, like the plan, on `selective_mode.forced_problem`.
    """
    problem, out = forced_problem(problem), []
    for name, rec in plan.baselines.items():
        if name not in BASELINES:
            continue
        forced = baseline(problem, name)
        if not close_to_recorded(rec.iteration_s, forced.iteration_s) or rec.fits != forced.fits:
            out.append(f"baselines.{name}: recorded T {rec.iteration_s!r} (fits: {rec.fits}) != recomputed "
                       f"{forced.iteration_s!r} (fits: {forced.fits})")
        if rec.best is not None:
            out.extend(_best_violations(problem, name, rec) or _search_violations(problem, name, rec))
    return out


def _search_violations(problem: Problem, name: str, rec: BaselineReport) -> list[str]:
    """The search run again may not find a better placement than the one recorded (module docstring)."""
    best = rec.best
    assert best is not None
    where = f"baselines.{name}.best"
    again = best_baseline(problem, name, node_budget=0 if best.search == "local search" else EXACT_NODE_BUDGET)
    if best.search == "exact" and again.search not in ("exact", "none fits"):
        return [f"{where}: recorded as an exact search, but the search does not finish within "
                f"its budget ({EXACT_NODE_BUDGET:,} classes looked at) here; re-plan"]
    if again.fits and (not best.fits or again.iteration_s < best.iteration_s * (1 - 1e-9)):
        cards = ", ".join(problem.devices[s.device].id for s in again.stages)
        return [f"{where}: recorded T {best.iteration_s!r} (fits: {best.fits}), but the search finds "
                f"{again.iteration_s!r} on {cards}; re-plan"]
    return []
