"""The exact DP of `hetpipe.partitioner.solvers.dp` for ONE given device sequence.

Stage i must run on device ``order[i]`` (all of them, in order); only the cuts are
chosen.  Same banded tables and parametric cap walk as the count-vector DP, without
the count lattice: p x (L + 1) x W work per pass.  Used by the heuristic (a few device
orders), the relaxation's realised placements and the infeasibility search.

Example:
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem
    >>> inf = float("inf")
    >>> prob = Problem(fwd_s={"a": (1.0,) * 3}, bwd_s={"a": (1.0,) * 3}, state_bytes=(0,) * 3,
    ...                activation_bytes=(0,) * 3, boundary_bytes=(0,) * 3,
    ...                devices=(DeviceSlot("x", "a", "n", 1), DeviceSlot("y", "a", "n", 1)),
    ...                bandwidth_bytes_s=((inf, 1.0), (1.0, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)),
    ...                microbatches=2)
    >>> [(s.device, s.first_unit, s.last_unit) for s in solve_fixed_order(prob, [1, 0]).stages]
    [(1, 0, 0), (0, 1, 2)]
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from hetpipe.partitioner.solvers.cap_walk import DPResult, check_deadline, parametric_search
from hetpipe.partitioner.solvers.dp import DeviceClass, assign_stages, StageTables
from hetpipe.partitioner.problem import Problem, Stage
from hetpipe.partitioner.recompute import with_recompute


def _min_sum_fixed(tab: StageTables, cap: float, order: Sequence[int], *, bottleneck: bool = False,
                   deadline: float = math.inf) -> tuple[float, list[tuple[int, int, int]]] | None:
    """min S(cap) (or the least max term) when stage i runs on class `order[i]`, every position used."""
    combine = np.maximum if bottleneck else np.add
    L, p = tab.L, len(order)
    width, rows = tab.width(cap), np.arange(L + 1)
    comm_ok = np.where(tab.comm2 <= cap, tab.comm2, np.inf)
    suffix = tab.band(order[-1], 0, cap, width).min(axis=1)  # suffix[u]: stages i..p-1 starting at u
    cuts: list[np.ndarray] = []
    for i in range(p - 2, -1, -1):
        check_deadline(deadline)
        c, nxt = order[i], order[i + 1]
        h = combine(comm_ok[c, nxt], suffix)
        cand = combine(tab.band(c, p - 1 - i, cap, width), tab.gather(h, width))
        w_best = np.argmin(cand, axis=1)
        suffix = cand[rows, w_best]
        cuts.append(np.minimum(rows + w_best + 1, L))
    if not math.isfinite(suffix[0]):
        return None
    cuts.reverse()
    picks, lo = [], 0
    for i in range(p - 1):
        hi = int(cuts[i][lo])
        picks.append((order[i], lo, hi))
        lo = hi
    picks.append((order[-1], lo, L))
    return float(suffix[0]), picks


def solve_fixed_order(problem: Problem, order: Sequence[int], *, time_limit_s: float = 10.0) -> DPResult | None:
    """Best cuts when stage i must run on device `order[i]` (all of them, in order); None if nothing fits.

    Example:
        >>> from hetpipe.partitioner.problem import DeviceSlot
        >>> inf = float("inf")
        >>> prob = Problem(fwd_s={"a": (1.0,) * 3}, bwd_s={"a": (1.0,) * 3}, state_bytes=(0,) * 3,
        ...                activation_bytes=(0,) * 3, boundary_bytes=(0,) * 3,
        ...                devices=(DeviceSlot("x", "a", "n", 1), DeviceSlot("y", "a", "n", 1)),
        ...                bandwidth_bytes_s=((inf, 1.0), (1.0, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)),
        ...                microbatches=2)
        >>> [(s.device, s.first_unit, s.last_unit) for s in solve_fixed_order(prob, [1, 0]).stages]
        [(1, 0, 0), (0, 1, 2)]
    """
    if not order or len(order) > problem.num_units or len(set(order)) != len(order):
        return None
    singles = tuple(DeviceClass(problem.devices[d].kind, problem.devices[d].node,
                                problem.devices[d].usable_bytes, (d,)) for d in order)
    tab = StageTables(problem, singles)
    positions = list(range(len(order)))

    def min_sum(cap: float, bottleneck: bool, deadline: float) -> tuple[float, tuple[Stage, ...]] | None:
        out = _min_sum_fixed(tab, cap, positions, bottleneck=bottleneck, deadline=deadline)
        return None if out is None else (out[0], with_recompute(problem, assign_stages(singles, out[1])))

    return parametric_search(problem, min_sum, time_limit_s=time_limit_s)
