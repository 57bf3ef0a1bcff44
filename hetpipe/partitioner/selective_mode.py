"""``--recompute selective``: the selective level alone on every stage, solved exactly by a reduction (issue 14).

Under ``Problem.recompute == "selective"`` every stage runs the selective level (`cost_models.selective`:
its units drop their norm/GELU outputs and re-run them in the backward) and recomputes no whole unit:
Megatron-LM's ``--recompute-granularity selective``, which applies its level to every layer.  The
user forces it; the planner chooses only the placement.

`evaluate` prices a stage with `Stage.selective` exactly as the same stage of the problem's selective
variant (activation and recompute bytes less ``freed_bytes``, backward plus ``extra_s``) with the level's
``peak_bytes`` added to M_s once.  So, placement for placement, the forced problem is `forced_problem`:
the variant with no lever left to choose (``recompute="none"``) and every card's usable bytes less
``peak_bytes``.  A placement fits one iff it fits the other (M + peak <= U iff M <= U - peak), and its T
is the same float sum of the same tables (no recomputed unit adds a forward on either side).  Every solver
(DP, CP-SAT, the brute force in tests/test_selective_mode.py) therefore solves the reduced problem, its
bound and status carry over unchanged, and `lift` marks the answer's stages as running the level.

A stage whose units free nothing still runs the level, as forced, and still reserves ``peak_bytes``
(the level's conservative pricing: the model's largest dropped outputs, at every moment).

Example (two units, one card; unit 1 frees 12 bytes for 0.25 s of re-run norms):
    >>> from hetpipe.cost_models.selective import SelectiveTables
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage, evaluate
    >>> prob = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (2.0, 2.0)}, state_bytes=(10, 10),
    ...                activation_bytes=(30, 30), boundary_bytes=(4, 0), devices=(DeviceSlot("d0", "a", "n", 99),),
    ...                bandwidth_bytes_s=((1.0,),), latency_s=((0.0,),), microbatches=2, recompute="selective",
    ...                selective=SelectiveTables((0, 12), 15, {"a": (0.0, 0.25)}))
    >>> reduced = forced_problem(prob)
    >>> reduced.recompute, reduced.selective, reduced.devices[0].usable_bytes, reduced.activation_bytes
    ('none', None, 84, (30, 18))
    >>> plain = (Stage(0, 0, 1),)
    >>> evaluate(prob, lift(plain)).iteration_s == evaluate(reduced, plain).iteration_s
    True
    >>> evaluate(prob, lift(plain)).stages[0].memory_bytes - evaluate(reduced, plain).stages[0].memory_bytes
    15
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from hetpipe.partitioner.problem import Problem, Stage

#: The `Problem.recompute` setting this module serves.
SELECTIVE_MODE = "selective"


def forced_problem(problem: Problem) -> Problem:
    """The problem whose placements price as `problem`'s with the level forced on every stage (module
    docstring); `problem` itself under any other recompute setting."""
    tab = problem.selective
    if problem.recompute != SELECTIVE_MODE:
        return problem
    if tab is None:
        raise ValueError("Problem.recompute is 'selective' but Problem.selective is None (no level to force)")
    # the peak is live once on every stage that runs the level: off every card's usable bytes (may go < 0:
    # then nothing fits there, exactly as peak + M_s > usable says for the forced stage)
    devices = tuple(replace(d, usable_bytes=d.usable_bytes - tab.peak_bytes) for d in problem.devices)
    return replace(problem, **tab.variant_fields(problem), recompute="none", devices=devices)


def lift(stages: Sequence[Stage]) -> tuple[Stage, ...]:
    """A placement of `forced_problem` as the forced problem's: every stage runs the level, no whole unit.

    Example:
        >>> lift((Stage(0, 0, 1),))[0].selective
        True
    """
    return tuple(replace(st, selective=True, recompute_units=()) for st in stages)
