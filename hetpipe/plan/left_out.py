"""Why a plan leaves a card out: the best plan that uses every card, or why none exists.

Example (no card left out: nothing to explain):
    >>> from types import SimpleNamespace
    >>> left_out_reasons(None, SimpleNamespace(unused_devices=()), solver="dp", time_limit_s=1.0, seed=0)
    ()
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hetpipe.errors import InfeasibleError
from hetpipe.partitioner.problem import Problem
from hetpipe.plan.schema import LeftOut
from hetpipe.schedule.interleaved import chunks_of


def left_out_reasons(problem: Problem, sol: Any, *, solver: str, time_limit_s: float, seed: int) -> tuple[LeftOut, ...]:
    """Explain left-out devices by the best plan that uses every device (or why none exists)."""
    from hetpipe.partitioner.solvers.solve import solve

    if not sol.unused_devices:
        return ()
    n = len(problem.devices)
    if n > problem.num_units:
        why = f"the model has only {problem.num_units} units for {n} devices"
    else:
        try:
            # a warm-up schedule names one count per stage of its own depth: all n stages get its base
            base = "1f1b" if chunks_of(problem.schedule) > 1 else problem.schedule.partition("@")[0]
            plain = dataclasses.replace(problem, schedule=base)
            full = solve(plain, solver=solver, time_limit_s=time_limit_s, seed=seed, num_stages=n)
            why = (
                f"the best plan using all {n} devices predicts {full.iteration_s:.4g} s per iteration vs "
                f"{sol.iteration_s:.4g} s without it ({full.iteration_s / sol.iteration_s:.2f}x slower)"
            )
        except InfeasibleError:
            why = f"no plan using all {n} devices fits in memory"
    return tuple(LeftOut(problem.devices[i].id, f"{problem.devices[i].kind}: {why}") for i in sol.unused_devices)
