"""The plan is never slower than a baseline it records (issue 17: objective = the schedule).

The solvers search the H-1F1B estimate and `verify` improves their answer locally under the schedule;
a baseline (forced onto every card, or on its best cards: `baseline_search`, also searched on the
estimate) can still be faster under the schedule on large clusters where the local search runs out
of time.  Every baseline placement is
in hetpipe's own search space, so `adopt_faster_baselines` starts `verify` again from each baseline
that is faster and keeps the fastest; the solver's bound stays valid (it bounds every placement).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from hetpipe.partitioner.baselines import BASELINES, baseline
from hetpipe.partitioner.problem import Problem, Stage
from hetpipe.partitioner.recompute import with_recompute
from hetpipe.partitioner.solvers.solve import Solution
from hetpipe.partitioner.solvers.verify import verify
from hetpipe.plan.schema import BaselineReport


def adopt_faster_baselines(problem: Problem, sol: Solution, baselines: Mapping[str, BaselineReport], *,
                           limit_s: float) -> Solution:
    """`sol`, or a faster placement found from a recorded baseline's best cards (module docstring)."""
    index = {d.id: i for i, d in enumerate(problem.devices)}
    starts = [with_recompute(problem, tuple(Stage(index[s.device], s.first_unit, s.last_unit) for s in rep.best.stages))
              for rep in baselines.values()
              if rep.best is not None and rep.best.fits and rep.best.stages and rep.best.iteration_s < sol.iteration_s]
    starts += [baseline(problem, name).stages for name, rep in baselines.items()  # forced onto every card
               if name in BASELINES and rep.fits and rep.iteration_s < sol.iteration_s]
    if not starts or problem.objective != "schedule":
        return sol
    found = verify(problem, [sol.stages, *starts], limit_s=limit_s)
    if found.iteration_s >= sol.iteration_s:
        return sol
    used = {d for st in found.stages for d in (st.members or (st.device,))}  # a group's members too
    status = "OPTIMAL" if sol.bound_s >= found.iteration_s * (1 - 1e-9) else "FEASIBLE"
    return dataclasses.replace(sol, stages=found.stages, iteration_s=found.iteration_s, status=status,
                               bound_s=min(sol.bound_s, found.iteration_s),
                               unused_devices=tuple(i for i in range(len(problem.devices)) if i not in used))
