"""A placement's simulated iteration: the solver's stage costs handed to the torch-free simulator.

`costs_from_problem` is the one bridge from a `Problem` and its `Stage`s to the simulator's
plain `SimCosts`; `simulate_placement` runs a named schedule over them.  The planner
(`plan.build`), the plan views (`plan.analysis`) and the demo all simulate through here.

Example:
    >>> from hetpipe.partitioner.problem import DeviceSlot
    >>> prob = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (2.0, 2.0)},
    ...                state_bytes=(10, 10), activation_bytes=(1, 1), boundary_bytes=(0, 0),
    ...                devices=(DeviceSlot("d0", "a", "n0", 100), DeviceSlot("d1", "a", "n0", 100)),
    ...                bandwidth_bytes_s=((1.0, 4.0), (4.0, 1.0)), latency_s=((0.0, 0.0), (0.0, 0.0)),
    ...                microbatches=4)
    >>> simulate_placement(prob, (Stage(0, 0, 0), Stage(1, 1, 1))).iteration_s   # (m + p - 1)(F + B)
    15.0
"""

from __future__ import annotations

from typing import Sequence

from hetpipe.partitioner.problem import Problem, Stage, evaluate
from hetpipe.schedule.simulate import SimCosts, SimResult, simulate_stages


def costs_from_problem(problem: Problem, stages: Sequence[Stage]) -> SimCosts:
    """Per-stage F, B, one-way C and optimizer step exactly as `evaluate` computes them (an offloading
    stage's step is its offload tail O_s).

    Example:
        >>> from hetpipe.partitioner.problem import DeviceSlot
        >>> prob = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (2.0, 2.0)},
        ...                state_bytes=(10, 10), activation_bytes=(1, 1), boundary_bytes=(4, 0),
        ...                devices=(DeviceSlot("d0", "a", "n0", 100), DeviceSlot("d1", "a", "n0", 100)),
        ...                bandwidth_bytes_s=((1.0, 4.0), (4.0, 1.0)), latency_s=((0.0, 0.0), (0.0, 0.0)),
        ...                microbatches=4)
        >>> costs_from_problem(prob, (Stage(0, 0, 0), Stage(1, 1, 1)))
        SimCosts(fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), send_s=(1.0,), step_s=(0.0, 0.0), bwd_weight_s=(1.0, 1.0))
    """
    ev = evaluate(problem, stages, objective="estimate")  # the stage costs; the schedule is simulated by the caller
    return SimCosts(fwd_s=tuple(c.fwd_s for c in ev.stages), bwd_s=tuple(c.bwd_s for c in ev.stages),
                    send_s=tuple(c.send_s for c in ev.stages[:-1]), step_s=tuple(c.step_s for c in ev.stages),
                    bwd_weight_s=tuple(c.bwd_weight_s for c in ev.stages))  # used by split (ZB-H1) lists only


def simulate_placement(problem: Problem, stages: Sequence[Stage], *, schedule: str = "1f1b") -> SimResult:
    """The discrete-event simulation of `stages` on `problem.microbatches` under `schedule`."""
    return simulate_stages(costs_from_problem(problem, stages), problem.microbatches, schedule=schedule)
