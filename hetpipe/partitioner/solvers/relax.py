"""A relaxation of the contract for clusters too large for the exact DP.

`relaxed_problem` forgets which node a card sits in: cards of one kind become one class
with the kind's largest usable memory, and every link between two kinds is priced at
the fastest link any such pair has (highest bandwidth, lowest latency).  Every real
placement is a placement of the relaxed problem with T no larger, so the relaxed
optimum (exact DP over kind counts, which is small: a few kinds) is a valid lower
bound on the real optimum (with recomputation too: more memory never needs a longer prefix).

`realise` maps a relaxed placement back to real cards: it walks the pipeline and gives
each stage a card of the wanted kind, staying on the node of the previous stage while
that node has one free (links inside a node are the fast ones), then the fixed-order
DP re-cuts the model for the real links and memory.

Example:
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem
    >>> devs = (DeviceSlot("a:0", "x", "a", 10), DeviceSlot("b:0", "x", "b", 20))
    >>> p = Problem({"x": (1.0,)}, {"x": (1.0,)}, (1,), (1,), (0,), devs,
    ...             ((float("inf"), 1.0), (2.0, float("inf"))), ((0.0, 0.5), (0.1, 0.0)), 2)
    >>> r = relaxed_problem(p)
    >>> [d.usable_bytes for d in r.devices], r.bandwidth_bytes_s[0][1], r.latency_s[0][1]
    ([20, 20], 2.0, 0.1)
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Sequence

from hetpipe.partitioner.solvers.dp import (
    CAP_TOLERANCE,
    DPResult,
    StateSpaceTooLarge,
    least_bottleneck,
    solve_exact,
    sum_lower_bound,
)
from hetpipe.partitioner.solvers.fixed_order import solve_fixed_order
from hetpipe.partitioner.problem import Problem, Stage, evaluate

#: Node name every card gets in the relaxed problem.
ANY_NODE = "*"


def relaxed_problem(problem: Problem) -> Problem:
    """The node-free relaxation of `problem` (see the module docstring)."""
    devs = problem.devices
    usable: dict[str, int] = {}
    for d in devs:
        usable[d.kind] = max(usable.get(d.kind, 0), d.usable_bytes)
    best_bw: dict[tuple[str, str], float] = {}
    best_lat: dict[tuple[str, str], float] = {}
    for i, a in enumerate(devs):
        for j, b in enumerate(devs):
            if i != j:
                key = (a.kind, b.kind)
                best_bw[key] = max(best_bw.get(key, 0.0), problem.bandwidth_bytes_s[i][j])
                best_lat[key] = min(best_lat.get(key, math.inf), problem.latency_s[i][j])
    n = len(devs)
    bw = tuple(tuple(math.inf if i == j else best_bw[(devs[i].kind, devs[j].kind)] for j in range(n))
               for i in range(n))
    lat = tuple(tuple(0.0 if i == j else best_lat[(devs[i].kind, devs[j].kind)] for j in range(n))
                for i in range(n))
    relaxed = tuple(replace(d, node=ANY_NODE, usable_bytes=usable[d.kind]) for d in devs)
    return replace(problem, devices=relaxed, bandwidth_bytes_s=bw, latency_s=lat)


def realise(problem: Problem, kinds: Sequence[str]) -> list[int]:
    """Real card indices for a pipeline of the given kinds (stage order), node-local where possible."""
    free: dict[str, list[int]] = {}
    for i, d in enumerate(problem.devices):
        free.setdefault(d.kind, []).append(i)
    order: list[int] = []
    for kind in kinds:
        pool = free[kind]
        here = problem.devices[order[-1]].node if order else None
        pick = next((i for i in pool if problem.devices[i].node == here), None)
        if pick is None:  # start the kind's largest remaining node block
            nodes: dict[str, int] = {}
            for i in pool:
                nodes[problem.devices[i].node] = nodes.get(problem.devices[i].node, 0) + 1
            biggest = max(nodes, key=lambda nd: nodes[nd])
            pick = next(i for i in pool if problem.devices[i].node == biggest)
        pool.remove(pick)
        order.append(pick)
    return order


def _realised(problem: Problem, relaxed_stages: Sequence[Stage], *, time_limit_s: float) -> DPResult | None:
    order = realise(problem, [problem.devices[st.device].kind for st in relaxed_stages])
    return solve_fixed_order(problem, order, time_limit_s=time_limit_s)


def relaxed_bound(problem: Problem, *, seed: Sequence[Stage] | None, time_limit_s: float,
                  num_stages: int | None = None) -> tuple[float, DPResult | None]:
    """(lower bound on T, best real placement realised from relaxed solutions).

    First one min-max pass: b_min of the relaxation gives T >= S_lb + (m-1) b_min.
    Then, if the time limit allows about two more such passes, the exact relaxed
    optimum (a tighter bound).  The bound is 0 when the relaxation is itself too large,
    inf when nothing fits even relaxed.
    """
    start = time.perf_counter()
    relaxed = relaxed_problem(problem)
    cap = evaluate(problem, seed).bottleneck_s * (1 + CAP_TOLERANCE) if seed is not None else math.inf
    try:
        least = least_bottleneck(relaxed, cap_s=cap)
        if least is None and math.isfinite(cap):
            least = least_bottleneck(relaxed)
    except StateSpaceTooLarge:
        return 0.0, None
    if least is None:
        return math.inf, None  # nothing fits even with every card at its kind's best
    b_min, stages = least
    bound = sum_lower_bound(problem) + (problem.microbatches - 1) * b_min
    best = _realised(problem, stages, time_limit_s=time_limit_s) if num_stages is None else None
    pass_s = time.perf_counter() - start
    if time_limit_s - pass_s > 2 * pass_s:
        try:
            res = solve_exact(relaxed, time_limit_s=time_limit_s - 2 * pass_s, exact_stages=num_stages,
                              seed=best.stages if best is not None else seed)
        except StateSpaceTooLarge:
            res = None
        if res is not None:
            bound = max(bound, res.bound_s)
            if num_stages is None or len(res.stages) == num_stages:
                real = _realised(problem, res.stages, time_limit_s=time_limit_s)
                if real is not None and (best is None or real.iteration_s < best.iteration_s):
                    best = real
    return bound, best
