"""A relaxation of the contract for clusters too large for the exact DP.

`relaxed_problem` forgets which node a card sits in: cards of one kind become one class
with the kind's largest usable memory and fastest host figures (host link and host memory
bandwidth: they price the offload lever's tail, and the DP's classes split on them), and
every link between two kinds is priced at the fastest link any such pair has (highest
bandwidth, lowest latency).  Every real
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
from typing import Mapping, Sequence

import numpy as np

from hetpipe.partitioner.solvers.counts import count_vectors
from hetpipe.partitioner.solvers.cap_walk import CAP_TOLERANCE, DeadlineReached, DPResult
from hetpipe.partitioner.solvers.dp import (
    DEFAULT_STATE_BUDGET,
    StateSpaceTooLarge,
    least_bottleneck,
    solve_exact,
)
from hetpipe.partitioner.solvers.fixed_order import solve_fixed_order
from hetpipe.partitioner.solvers.offload_walk import tail_walk
from hetpipe.partitioner.solvers.simple_bounds import sum_lower_bound
from hetpipe.partitioner.problem import Problem, Stage, evaluate

#: Usable bytes of a merged kind under ``recompute="auto"`` (`aggregate_kinds`): no memory limit.
UNLIMITED_BYTES = 2**62
#: Node name every card gets in the relaxed problem.
ANY_NODE = "*"
#: DP rows the aggregated relaxation may have (`aggregate_kinds`).  Smaller than the exact
#: DP's budget on purpose: the bound needs several passes within the time limit.  Measured
#: on the 2-core VM (llama-7b, 64 cards of 8 kinds, loaded): at 4e7 rows one pass took 4.7 s
#: and the exact relaxed walk 17 s; at 1e7 and 3e6 rows 0.6 s and 1.4 s, with the same bound
#: (it proved the plan optimal), because merging kinds no good pipeline uses costs nothing.
RELAXED_STATE_BUDGET = 5_000_000
#: Kinds up to which `pace_relaxation` tries every cut into consecutive groups (2^(kinds - 1) cuts).
MAX_PARTITION_KINDS = 12


def relaxed_problem(problem: Problem, *, one_per_kind: bool = False) -> Problem:
    """The node-free relaxation of `problem` (see the module docstring); with `one_per_kind`, only the first
    card of each kind is kept (for DPs without card counts, `pace_runs.RunDP`: the n x n link tables of
    1,024 cards took a second to rebuild under load)."""
    devs = problem.devices
    usable: dict[str, int] = {}
    host: dict[str, tuple[float, float]] = {}  # kind -> (host link, host memory) bytes/s, the best of its cards
    for d in devs:
        usable[d.kind] = max(usable.get(d.kind, 0), d.usable_bytes)
        link, memory = host.get(d.kind, (0.0, 0.0))
        host[d.kind] = (max(link, d.host_link_bytes_s), max(memory, d.host_memory_bytes_s))
    kinds = list(dict.fromkeys(d.kind for d in devs))
    of = np.asarray([kinds.index(d.kind) for d in devs])
    # numpy over the n x n link tables: a Python loop over card pairs took seconds at 1,024 cards
    bw_in, lat_in = np.asarray(problem.bandwidth_bytes_s, dtype=float), np.asarray(problem.latency_s, dtype=float)
    off = ~np.eye(len(devs), dtype=bool)  # a card's link to itself is not a link
    best_bw, best_lat = np.full((len(kinds),) * 2, 0.0), np.full((len(kinds),) * 2, math.inf)
    for a in range(len(kinds)):
        for b in range(len(kinds)):
            pair = off & (of[:, None] == a) & (of[None, :] == b)
            if pair.any():
                best_bw[a, b], best_lat[a, b] = bw_in[pair].max(), lat_in[pair].min()
    if one_per_kind:
        firsts = [int(np.flatnonzero(of == k)[0]) for k in range(len(kinds))]
        devs, of = tuple(devs[i] for i in firsts), np.arange(len(kinds))
    bw, lat = best_bw[of[:, None], of[None, :]], best_lat[of[:, None], of[None, :]]
    np.fill_diagonal(bw, math.inf)
    np.fill_diagonal(lat, 0.0)
    # One class per kind (`dp.device_classes` groups by kind, node, usable bytes and host figures):
    # a faster host only shortens an offloading stage's tail, so the bound stays valid.
    relaxed = tuple(replace(d, node=ANY_NODE, usable_bytes=usable[d.kind], host_link_bytes_s=host[d.kind][0],
                            host_memory_bytes_s=host[d.kind][1]) for d in devs)
    # ``all`` forces every able stage to offload, so a card made able (a better host) could only be
    # forced to pay a tail: relaxed, the lever is ``auto`` (a superset of the choices ``all`` leaves)
    lever = "auto" if problem.offload == "all" else problem.offload
    return replace(problem, devices=relaxed, bandwidth_bytes_s=tuple(map(tuple, bw.tolist())),
                   latency_s=tuple(map(tuple, lat.tolist())), offload=lever)


def realise(problem: Problem, kinds: Sequence[str | tuple[str, ...]]) -> list[int]:
    """Real card indices for a pipeline of the given kinds (stage order), node-local where possible.

    A stage may name several kinds (an aggregated class of `aggregate_kinds`): it takes a card
    of any of them, the first listed (fastest) that still has one when nothing is node-local.
    """
    free: dict[str, list[int]] = {}
    for i, d in enumerate(problem.devices):
        free.setdefault(d.kind, []).append(i)
    order: list[int] = []
    for want in kinds:
        allowed = (want,) if isinstance(want, str) else want
        here_node = problem.devices[order[-1]].node if order else None
        local = [k for k in allowed if any(problem.devices[i].node == here_node for i in free.get(k, ()))]
        kind = local[0] if local else next(k for k in allowed if free.get(k))
        pool = free[kind]
        pick = next((i for i in pool if problem.devices[i].node == here_node), None)
        if pick is None:  # start the kind's largest remaining node block
            nodes: dict[str, int] = {}
            for i in pool:
                nodes[problem.devices[i].node] = nodes.get(problem.devices[i].node, 0) + 1
            biggest = max(nodes, key=lambda nd: nodes[nd])
            pick = next(i for i in pool if problem.devices[i].node == biggest)
        pool.remove(pick)
        order.append(pick)
    return order


def _speed_order(problem: Problem) -> list[str]:
    """Device kinds, fastest first (the whole model's F + B on that kind)."""
    work = {k: sum(f + b for f, b in zip(problem.fwd_s[k], problem.bwd_s[k])) for k in problem.fwd_s}
    kinds = list(dict.fromkeys(d.kind for d in problem.devices))
    return sorted(kinds, key=lambda k: (work[k], kinds.index(k)))


def dp_rows(problem: Problem, groups: Sequence[Sequence[str]]) -> int:
    """DP rows of the node-free problem whose classes are `groups` (see `dp.solve_exact`)."""
    limit = min(problem.num_units, len(problem.devices))
    counts = [sum(1 for d in problem.devices if d.kind in g) for g in groups]
    return count_vectors(counts, limit) * len(groups) * (problem.num_units + 1)


def aggregate_kinds(relaxed: Problem, *, merge_above: int = DEFAULT_STATE_BUDGET,
                    state_budget: int = RELAXED_STATE_BUDGET) -> tuple[Problem, dict[str, tuple[str, ...]]]:
    """A further relaxation of a node-free problem whose DP fits `state_budget`.

    Only when the node-free problem's own DP has more than `merge_above` rows (the exact DP's
    budget) does anything merge; then, while its DP has more than `state_budget` rows, the
    two slowest groups of kinds merge into one class that is at least as good as each member: per unit the fastest member's F and B,
    the largest usable memory, the best link any member pair has.  Every placement keeps
    its devices and can only get faster and roomier, so the merged optimum is still a lower
    bound on the real one; the fastest kinds (where good pipelines live) stay exact.
    Returns the problem (kinds renamed to their group label) and label -> member kinds,
    fastest first.

    Example:
        >>> from hetpipe.partitioner.problem import DeviceSlot
        >>> devs = tuple(DeviceSlot(f"{k}{i}", k, ANY_NODE, 9) for k in "abc" for i in range(2))
        >>> one = tuple(tuple(1.0 for _ in devs) for _ in devs)
        >>> zero = tuple(tuple(0.0 for _ in devs) for _ in devs)
        >>> p = Problem({"a": (1.0,), "b": (2.0,), "c": (3.0,)}, {"a": (0.0,), "b": (0.0,), "c": (0.0,)},
        ...             (0,), (0,), (0,), devs, one, zero, 1)
        >>> agg, members = aggregate_kinds(p, merge_above=0, state_budget=8)
        >>> members, agg.fwd_s["b+c"]
        ({'a': ('a',), 'b+c': ('b', 'c')}, (2.0,))
    """
    groups = [[k] for k in _speed_order(relaxed)]
    if dp_rows(relaxed, groups) <= merge_above:  # the plain relaxation fits: keep it exact
        return relaxed, {k: (k,) for k in relaxed.fwd_s}
    while len(groups) > 1 and dp_rows(relaxed, groups) > state_budget:
        groups[-2:] = [groups[-2] + groups[-1]]
    return merge_groups(relaxed, groups)


def merge_groups(relaxed: Problem, groups: Sequence[Sequence[str]]) -> tuple[Problem, dict[str, tuple[str, ...]]]:
    """`relaxed` (node-free) with each group of kinds merged into one class that is at least as good as each
    member (`aggregate_kinds`): per unit the fastest member's F and B, the largest usable memory, the best link
    any member pair has.  Returns the problem (kinds renamed to their group label) and label -> member kinds."""
    label = {k: "+".join(g) for g in groups for k in g}

    def fastest(table: Mapping[str, tuple[float, ...]]) -> dict[str, tuple[float, ...]]:
        """Per group, each unit's time on its fastest member."""
        return {"+".join(g): tuple(min(times) for times in zip(*(table[k] for k in g))) for g in groups}

    fwd, bwd = fastest(relaxed.fwd_s), fastest(relaxed.bwd_s)
    devices = tuple(replace(d, kind=label[d.kind]) for d in relaxed.devices)
    # the selective level's seconds per merged kind: its fastest member's too (`Problem.selective` is per kind)
    sel = relaxed.selective and replace(relaxed.selective, extra_s=fastest(relaxed.selective.extra_s))
    merged = relaxed_problem(replace(relaxed, fwd_s=fwd, bwd_s=bwd, devices=devices, selective=sel))
    if relaxed.recompute == "auto":
        # A merged kind's recompute order (by its fastest member's F) is no member's order, so its
        # shortest fitting prefix could cost more than a member's: give merged kinds unlimited memory
        # instead (they never recompute, and every member's stage is at least as slow and as full).
        roomy = {"+".join(g) for g in groups if len(g) > 1}
        merged = replace(merged, devices=tuple(replace(d, usable_bytes=UNLIMITED_BYTES) if d.kind in roomy else d
                                               for d in merged.devices))
    return merged, {"+".join(g): tuple(g) for g in groups}


def merge_loss(relaxed: Problem, groups: Sequence[Sequence[str]], stages: int) -> float:
    """How much a merge speeds up the cards a pipeline of `stages` stages would use: with the cards sorted by
    their kind's whole-model F + B (w, fastest first; groups are consecutive in that order) and e_i = 1 -
    w_fastest of i's group / w_i for the first `stages` of them, the sum of the e_i (each used card's speed
    enters R_0) plus `stages` times the last one's (the slowest card used sets the pace, which every micro-batch
    pays).  What `pace_relaxation` minimises.  Measured on gpt2-xl at 64 cards of eight kinds (42 stages,
    uncapped walks): A100 | 4090 A6000 V100 | the rest: loss 3.4, bound 3.069 s; A100 | 4090 A6000 V100 A5000 |
    the rest 5.0, 2.925 s; A100 | 4090 A6000 | the rest 7.3, 2.939 s; A100 | 4090 | the rest (`aggregate_kinds`)
    15.8, 2.654 s.  On llama-7b at 64 cards (25 stages: the 25th card is a V100) A100 | 4090 | A6000 | the rest
    costs nothing (15.24 s; A100 | 4090 A6000 V100 | A5000 L4 4080 | 3090: 14.01 s).

    Example:
        >>> from hetpipe.partitioner.problem import DeviceSlot
        >>> devs = tuple(DeviceSlot(f"{k}{i}", k, ANY_NODE, 9) for k in "ab" for i in range(2))
        >>> p = Problem({"a": (1.0,), "b": (4.0,)}, {"a": (0.0,), "b": (0.0,)}, (0,), (0,), (0,), devs,
        ...             ((1.0,) * 4,) * 4, ((0.0,) * 4,) * 4, 1)
        >>> merge_loss(p, [["a", "b"]], 3), merge_loss(p, [["a", "b"]], 2), merge_loss(p, [["a"], ["b"]], 4)
        (3.0, 0.0, 0.0)
    """
    work = {k: sum(f + b for f, b in zip(relaxed.fwd_s[k], relaxed.bwd_s[k])) for k in relaxed.fwd_s}
    fastest = {k: min(work[j] for j in g) for g in groups for k in g}
    used = sorted((work[d.kind], fastest[d.kind]) for d in relaxed.devices)[:max(1, stages)]
    errors = [1.0 - best / w if w > 0 else 0.0 for w, best in used]
    return sum(errors) + len(errors) * errors[-1]


def pace_relaxation(problem: Problem, *, stages: int | None = None,
                    state_budget: int = RELAXED_STATE_BUDGET) -> tuple[Problem, dict[str, tuple[str, ...]]]:
    """The count relaxation of the pace walk (`verify`, issue 12 item 3): the node-free problem with its
    kinds (fastest first) cut into consecutive groups whose DP has at most `state_budget` rows, the cut of
    least `merge_loss` for pipelines of `stages` stages (`verify` passes the length of the candidate of least
    pace; by default as many as there are units or cards; on a tie the finer cut, as `aggregate_kinds` keeps
    the finest that fits), each group merged (`merge_groups`); the node-free problem itself when its DP fits.
    The walk makes 20-25 passes, each about linear in the rows (gpt2-xl on 64 cards, load 7-11, uncapped walks
    to their end: 0.53e6 rows 3.2 CPU s, 1.06e6 rows 5.7 CPU s; a 4-group cut of 8.8e6 rows, over the budget,
    finished two passes in 13 s).  `aggregate_kinds` merges the slowest kinds into one group instead, which
    lets every slow card run at the speed of the fastest of them: the pace bound then fills the pipeline with
    cards of that speed (gpt2-xl on 64 cards: 2.654 s, 3.069 s with this cut).  More than
    `MAX_PARTITION_KINDS` kinds: `aggregate_kinds`'s groups.

    Example (three kinds, a budget that fits two groups: the slow pair merges, not the fast one):
        >>> from hetpipe.partitioner.problem import DeviceSlot
        >>> devs = tuple(DeviceSlot(f"{k}{i}", k, ANY_NODE, 9) for k in "abc" for i in range(2))
        >>> p = Problem({"a": (1.0,) * 2, "b": (3.0,) * 2, "c": (3.3,) * 2}, {k: (0.0,) * 2 for k in "abc"},
        ...             (0,) * 2, (0,) * 2, (0,) * 2, devs, ((1.0,) * 6,) * 6, ((0.0,) * 6,) * 6, 1)
        >>> sorted(pace_relaxation(p, state_budget=40)[1].values())   # 81 rows unmerged, 30 for either pair
        [('a',), ('b', 'c')]
    """
    plain = relaxed_problem(problem)
    if dp_rows(plain, [[k] for k in _speed_order(plain)]) <= state_budget:
        return plain, {k: (k,) for k in plain.fwd_s}
    groups = pace_groups(problem, stages=stages, state_budget=state_budget)
    if groups is None:  # more than `MAX_PARTITION_KINDS` kinds, or not even one group fits: as `aggregate_kinds`
        return aggregate_kinds(plain, merge_above=state_budget, state_budget=state_budget)
    return merge_groups(plain, groups)


def pace_groups(problem: Problem, *, stages: int | None = None,
                state_budget: int = RELAXED_STATE_BUDGET) -> list[list[str]] | None:
    """The cut of the kinds `pace_relaxation` merges (its docstring), or None where it merges none (the node-free
    DP fits `state_budget`) or takes `aggregate_kinds`'s groups.  It reads the kinds, units and F + B only (the
    node-free problem's are the same), so it builds no link tables (`finer_walk` asks for it at every `verify`)."""
    order = _speed_order(problem)
    stages = min(problem.num_units, len(problem.devices)) if stages is None else stages
    if dp_rows(problem, [[k] for k in order]) <= state_budget or len(order) > MAX_PARTITION_KINDS:
        return None
    best: tuple[float, int, list[list[str]]] | None = None
    for cuts in range(2 ** (len(order) - 1)):  # bit i: a new group starts after kind i
        groups, current = [], [order[0]]
        for i, kind in enumerate(order[1:]):
            if cuts >> i & 1:
                groups.append(current)
                current = []
            current.append(kind)
        groups.append(current)
        rows = dp_rows(problem, groups)
        if rows <= state_budget:
            key = (round(merge_loss(problem, groups, stages), 9), -rows, groups)  # a tie: the finer cut
            if best is None or key[:2] < best[:2]:
                best = key
    return None if best is None else best[2]


def realised(problem: Problem, relaxed: Problem, members: dict[str, tuple[str, ...]],
              relaxed_stages: Sequence[Stage], *, deadline: float) -> DPResult | None:
    """The relaxed pipeline's kinds on real cards (`realise`), re-cut for the real links and memory."""
    order = realise(problem, [members[relaxed.devices[st.device].kind] for st in relaxed_stages])
    try:
        return tail_walk(problem, lambda p, _: solve_fixed_order(p, order, time_limit_s=deadline - time.perf_counter()))
    except DeadlineReached:
        return None


def relaxation_levels(problem: Problem) -> list[tuple[Problem, dict[str, tuple[str, ...]]]]:
    """The relaxations `relaxed_bound` solves, coarsest first: the node-free problem with its slowest
    kinds merged until its DP has at most `RELAXED_STATE_BUDGET` rows, then the node-free problem
    itself when its DP fits the exact DP's budget (finer, so a tighter bound, but its pass is longer)."""
    plain = relaxed_problem(problem)
    coarse = aggregate_kinds(plain, merge_above=RELAXED_STATE_BUDGET)
    fine = aggregate_kinds(plain)
    return [coarse] if fine[0] is coarse[0] or fine[1] == coarse[1] else [coarse, fine]


def relaxed_bound(problem: Problem, *, seed: Sequence[Stage] | None, time_limit_s: float,
                  num_stages: int | None = None) -> tuple[float, DPResult | None]:
    """(lower bound on T, best real placement realised from relaxed solutions).

    One min-max pass per level of `relaxation_levels`, coarsest first: b_min of a relaxation gives
    T >= S_lb + (m-1) b_min.  Then, if the time limit allows at least one more such pass, the
    exact optimum of the finest level solved (a tighter bound).  Every pass gives up between two
    of its DP levels at the deadline (`cap_walk.DeadlineReached`): a finer level that does not
    finish leaves the coarser one's bound.  The bound is 0 when even the coarsest relaxation is too
    large or too slow, inf when nothing fits even relaxed.
    """
    start = time.perf_counter()
    deadline = start + time_limit_s
    cap = evaluate(problem, seed, objective="estimate").bottleneck_s * (1 + CAP_TOLERANCE) if seed is not None else math.inf
    bound, best, solved, last = 0.0, None, None, None
    for relaxed, members in relaxation_levels(problem):
        rows = dp_rows(relaxed, list(members.values()))
        if last is not None and last[0] * rows / last[1] > (deadline - time.perf_counter()) / 2:
            break  # its pass would take most of the time left (passes scale with the DP's rows): solve the last
        level_start = time.perf_counter()
        try:
            least = least_bottleneck(relaxed, cap_s=cap, deadline=deadline)
            if least is None and math.isfinite(cap):
                least = least_bottleneck(relaxed, deadline=deadline)
        except (StateSpaceTooLarge, DeadlineReached):
            break
        if least is None:
            return math.inf, None  # nothing fits even with every card at its kind's best
        bound = max(bound, sum_lower_bound(problem) + (problem.microbatches - 1) * least[0])
        if num_stages is None:
            best = _better(best, realised(problem, relaxed, members, least[1], deadline=deadline))
        solved, last = (relaxed, members), (time.perf_counter() - level_start, rows)
    pass_s = time.perf_counter() - start
    if solved is None or time_limit_s - pass_s <= pass_s:  # not even one more pass's time left
        return bound, best
    relaxed, members = solved
    warm = best.stages if best is not None else seed
    try:  # under the offload lever the DP's T carries a tail it does not minimise: the walk makes it exact
        res = tail_walk(relaxed, lambda p, first: solve_exact(
            p, time_limit_s=deadline - time.perf_counter(), exact_stages=num_stages, seed=warm if first else None))
    except (StateSpaceTooLarge, DeadlineReached):
        res = None
    if res is not None:
        bound = max(bound, res.bound_s)
        if num_stages is None or len(res.stages) == num_stages:
            best = _better(best, realised(problem, relaxed, members, res.stages, deadline=deadline))
    return bound, best


def _better(a: DPResult | None, b: DPResult | None) -> DPResult | None:
    return b if a is None or (b is not None and b.iteration_s < a.iteration_s) else a
