"""Re-plan a running job from its plan's own tables: without lost devices, or with a device measured slower.

A plan records everything the solver needs (per-unit times per device kind, memory, cut bytes,
devices, links: `problem_from_plan`), so re-planning needs neither the model nor the cluster file
and takes the solver's time only (issue 16, items 3 and 4).  Two changes of the cluster:

* ``lost``: devices that are gone (a dead rank's card) are removed with their links;
* ``link_slowdown``: (device id, device id) -> factor by which the link between them carries
  messages slower than its plan says (a link straggler report).  `scale_link` divides that
  pair's bandwidth and multiplies its latency by the factor, in **both** directions: the
  objective prices a cut as twice its forward link (activations out, gradients back), so a
  slow direction is priced as a slow pair -- conservative when only one direction degraded;
* ``slowdown``: device id -> factor by which it runs slower than its plan says (a straggler
  report).  `scale_device` gives that card its own kind, ``<kind>@x<factor>``, whose unit
  times are the kind's times x factor -- the same as dividing its profile's FLOP/s and
  bandwidth and multiplying its per-op overhead by the factor.  The other cards of its kind keep
  their times.  It is the one function to replace by a calibrated cluster (`hetpipe calibrate`)
  where one exists.

The new plan keeps the model, training settings and unit table; its stages, predicted figures,
solver record and baselines are those of the changed cluster, so `hetpipe check` accepts it.

Example (the 3-device synthetic test cluster; the slow card n1:0 lost):
    >>> from tests.runtime_plans import synthetic_plan                       # doctest: +SKIP
    >>> r = replan(synthetic_plan(), lost=("n1:0",))                         # doctest: +SKIP
    >>> sorted({s.device for s in r.plan.stages}) <= ["n0:0", "n0:1"]        # doctest: +SKIP
    True
    >>> slowed_kind("rtx3090", 3.0), slowed_kind("rtx3090@x3", 1.5)
    ('rtx3090@x3', 'rtx3090@x4.5')
    >>> link_pair("n0:1 -> n1:2")
    ('n0:1', 'n1:2')
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hetpipe.errors import ConfigError
from hetpipe.partitioner.problem import Problem, evaluate
from hetpipe.partitioner.selective_mode import SELECTIVE_MODE, forced_problem, lift
from hetpipe.plan.baseline_report import baseline_reports
from hetpipe.plan.build import plan_stages, predicted_figures
from hetpipe.plan.selective_plan import level_used
from hetpipe.plan.schema import KindSeconds, Plan, SolverReport, UnitTimes, problem_from_plan, stages_from_plan
from hetpipe.plan.step_schema import step_transient_records

SLOW_MARK = "@x"  # <kind>@x<factor>: a card measured <factor> times slower than its kind


@dataclass(frozen=True)
class Replan:
    """A re-planned job: the new plan and what the change costs the old one.

    ``old_iteration_s``: the old placement's T on the changed cluster (with the slowdown) when
    all its cards remain, else the old plan's recorded T; ``new_iteration_s``: the new plan's T
    (both device seconds per iteration); ``replan_s``: wall seconds of the re-plan.
    """

    plan: Plan
    old_iteration_s: float
    new_iteration_s: float
    replan_s: float


def slowed_kind(kind: str, factor: float) -> str:
    """The kind name of a ``kind`` card ``factor`` times slower (factors compose)."""
    base, _, prior = kind.partition(SLOW_MARK)
    total = factor * (float(prior) if prior else 1.0)
    return f"{base}{SLOW_MARK}{total:.4g}"


def scale_device(problem: Problem, device_id: str, factor: float) -> Problem:
    """``problem`` with ``device_id``'s unit times multiplied by ``factor`` (under its own kind)."""
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
        raise ConfigError(f"slowdown factor of {device_id} must be a positive number, got {factor!r}")
    ids = [d.id for d in problem.devices]
    if device_id not in ids:
        raise ConfigError(f"slowdown names device {device_id!r}, which the plan does not have ({', '.join(ids)})")
    i = ids.index(device_id)
    old = problem.devices[i].kind
    kind = slowed_kind(old, factor)
    devices = tuple(dataclasses.replace(d, kind=kind) if j == i else d for j, d in enumerate(problem.devices))
    scaled = {name: {**table, kind: tuple(t * factor for t in table[old])} if old in table else table
              for name, table in (("fwd_s", problem.fwd_s), ("bwd_s", problem.bwd_s), ("step_s", problem.step_s))}
    launch, rules = dict(problem.step_launch_s), dict(problem.step_transient)
    if old in launch:  # the optimizer step's launch share: the card is slower at it too
        launch[kind] = launch[old] * factor
    if old in rules:  # its step's transient (memory model 5) is the same card's
        rules[kind] = rules[old]
    sel = problem.selective  # the selective level's re-run nodes: slower on that card too
    if sel is not None and old in sel.extra_s:
        sel = dataclasses.replace(sel, extra_s={**sel.extra_s, kind: tuple(t * factor for t in sel.extra_s[old])})
    return dataclasses.replace(problem, devices=devices, step_launch_s=launch, step_transient=rules, selective=sel,
                               **scaled)


def link_pair(text: str) -> tuple[str, str]:
    """``"a:0 -> b:1"`` (a straggler record's ``link``) -> ``("a:0", "b:1")``."""
    src, arrow, dst = str(text).partition("->")
    if not arrow or not src.strip() or not dst.strip():
        raise ConfigError(f"link {text!r} is not 'SRC -> DST' (two device ids); write e.g. 'n0:1 -> n1:2'")
    return src.strip(), dst.strip()


def scale_link(problem: Problem, pair: tuple[str, str], factor: float) -> Problem:
    """``problem`` with the link between ``pair``'s devices ``factor`` times slower, both directions:
    bandwidth / factor and latency x factor, so every message over it takes ``factor`` times as long."""
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
        raise ConfigError(f"slowdown factor of link {pair[0]} -> {pair[1]} must be a positive number, got {factor!r}")
    ids = [d.id for d in problem.devices]
    missing = [d for d in pair if d not in ids]
    if missing:
        raise ConfigError(f"link slowdown names device {missing[0]!r}, which the plan does not have ({', '.join(ids)})")
    a, b = ids.index(pair[0]), ids.index(pair[1])
    slow = {(a, b), (b, a)}
    bandwidth = tuple(tuple(bw / factor if (i, j) in slow else bw for j, bw in enumerate(row))
                      for i, row in enumerate(problem.bandwidth_bytes_s))
    latency = tuple(tuple(lat * factor if (i, j) in slow else lat for j, lat in enumerate(row))
                    for i, row in enumerate(problem.latency_s))
    return dataclasses.replace(problem, bandwidth_bytes_s=bandwidth, latency_s=latency)


def without_devices(problem: Problem, lost: Iterable[str]) -> Problem:
    """``problem`` without the devices ``lost`` (ids) and their links."""
    gone = set(lost)
    unknown = gone - {d.id for d in problem.devices}
    if unknown:
        raise ConfigError(f"lost device {sorted(unknown)[0]!r} is not in the plan; name one of "
                          f"{', '.join(d.id for d in problem.devices)}")
    keep = [i for i, d in enumerate(problem.devices) if d.id not in gone]
    if not keep:
        raise ConfigError("every device of the plan is lost; nothing is left to re-plan on")
    used = {problem.devices[i].kind for i in keep}
    return dataclasses.replace(
        problem, devices=tuple(problem.devices[i] for i in keep),
        fwd_s={k: v for k, v in problem.fwd_s.items() if k in used},
        bwd_s={k: v for k, v in problem.bwd_s.items() if k in used},
        step_s={k: v for k, v in problem.step_s.items() if k in used},
        step_launch_s={k: v for k, v in problem.step_launch_s.items() if k in used},
        step_transient={k: v for k, v in problem.step_transient.items() if k in used},
        bandwidth_bytes_s=tuple(tuple(problem.bandwidth_bytes_s[i][j] for j in keep) for i in keep),
        latency_s=tuple(tuple(problem.latency_s[i][j] for j in keep) for i in keep))


def replan(plan: Plan, *, lost: Iterable[str] = (), slowdown: Mapping[str, float] | None = None,
           link_slowdown: Mapping[tuple[str, str], float] | None = None, solver: str = "auto",
           time_limit_s: float = 10.0, seed: int = 0) -> Replan:
    """Solve ``plan``'s problem again without ``lost`` devices, with ``slowdown`` and ``link_slowdown`` applied."""
    from hetpipe.partitioner.solvers.solve import solve

    if plan.replicas:
        raise ConfigError("re-planning replica plans is not supported yet; run a single-pipeline plan")
    start = time.perf_counter()
    lost = tuple(lost)
    problem = problem_from_plan(plan)
    for device, factor in (slowdown or {}).items():
        problem = scale_device(problem, device, factor)
    for pair, factor in (link_slowdown or {}).items():
        problem = scale_link(problem, pair, factor)
    old_s = plan.predicted.iteration_s
    if not set(lost) & {s.device for s in plan.stages}:
        old_s = evaluate(problem, stages_from_plan(plan)).iteration_s
    problem = without_devices(problem, lost)
    # ``--recompute selective``: solved as its reduced problem, the answer's stages marked (`selective_mode`)
    sol = solve(forced_problem(problem), solver=solver, time_limit_s=time_limit_s, seed=seed)
    stages = lift(sol.stages) if problem.recompute == SELECTIVE_MODE else sol.stages
    report = SolverReport(sol.solver, sol.status, sol.iteration_s, sol.bound_s, sol.wall_s, time_limit_s, seed)
    new = plan_on(plan, problem, stages, report, slowdown=slowdown or {}, link_slowdown=link_slowdown or {})
    return Replan(new, old_s, new.predicted.iteration_s, time.perf_counter() - start)


def plan_on(plan: Plan, problem: Problem, stages: tuple, solver: SolverReport, *,
            slowdown: Mapping[str, float], link_slowdown: Mapping[tuple[str, str], float] | None = None) -> Plan:
    """``plan`` moved onto ``problem``'s devices, links and tables with the placement ``stages``."""
    ev = evaluate(problem, stages)
    baselines = baseline_reports(forced_problem(problem))
    kinds = sorted({d.kind for d in problem.devices})
    ids = {d.id: d for d in problem.devices}
    steps = {k: problem.step_s.get(k, (0.0,) * len(plan.units)) for k in kinds}
    units = tuple(dataclasses.replace(u, time_s={k: UnitTimes(problem.fwd_s[k][u.index], problem.bwd_s[k][u.index],
                                                              steps[k][u.index]) for k in kinds}) for u in plan.units)
    notes = {k: v for k, v in plan.cost_model.items() if k not in {d.kind for d in plan.devices} or k in kinds}
    for device, factor in ((d, f) for d, f in slowdown.items() if d in ids):
        base = next(d.kind for d in plan.devices if d.id == device)
        notes[ids[device].kind] = (f"{base}'s unit times x {factor:.4g}: {device} measured {factor:.4g}x slower "
                                   f"than its plan (straggler report)")
    for (a, b), factor in (link_slowdown or {}).items():
        notes[f"link {a} <-> {b}"] = (f"bandwidth / {factor:.4g}, latency x {factor:.4g}: measured {factor:.4g}x "
                                      "slower than its plan (link straggler report)")
    return dataclasses.replace(
        plan, devices=tuple(dataclasses.replace(d, kind=ids[d.id].kind) for d in plan.devices if d.id in ids),
        links=_links_on(plan, problem), units=units,
        stages=plan_stages(problem, stages, ev), predicted=predicted_figures(problem, stages, ev,
                                                                             plan.training.global_batch),
        solver=solver, baselines=baselines, left_out=(), cost_model=notes,
        # recorded where a stage or a recorded baseline runs the level (as `build_plan`): `check` prices the
        # baselines again from the plan's tables, and without the level their best cards cost another T
        selective=(selective_on(plan.selective, problem.selective, kinds)
                   if level_used(problem, stages, baselines) else None),
        step_launch_s=tuple(KindSeconds(k, problem.step_launch_s[k]) for k in kinds if k in problem.step_launch_s),
        step_transient=step_records_on(plan, problem, ids))


def step_records_on(plan: Plan, problem: Problem, ids: Mapping[str, Any]) -> tuple:
    """``plan``'s `Plan.step_transient` records for ``problem``'s kinds: a slowed card's kind takes its base kind's
    path (``ids``: device id -> its re-planned slot)."""
    paths = {r.kind: r.path for r in plan.step_transient}
    paths.update({ids[d.id].kind: paths[d.kind] for d in plan.devices if d.id in ids and d.kind in paths})
    return step_transient_records({k: r for k, r in problem.step_transient.items() if k in paths}, paths)


def selective_on(record: Any, tables: Any, kinds: Sequence[str]) -> Any:
    """The plan's selective level record (`Plan.selective`) with each unit's seconds on `kinds` from the
    re-planned problem's tables (a slowed card's kind included)."""
    return dataclasses.replace(record, units=tuple(
        dataclasses.replace(u, time_s={k: tables.extra_s[k][u.index] for k in kinds}) for u in record.units))


def _links_on(plan: Plan, problem: Problem) -> tuple:
    """``plan``'s links between ``problem``'s devices, with ``problem``'s bandwidth and latency (a slowed link's)."""
    index = {d.id: i for i, d in enumerate(problem.devices)}
    return tuple(dataclasses.replace(link, bandwidth_bytes_s=problem.bandwidth_bytes_s[index[link.src]][index[link.dst]],
                                     latency_s=problem.latency_s[index[link.src]][index[link.dst]])
                 for link in plan.links if link.src in index and link.dst in index)
