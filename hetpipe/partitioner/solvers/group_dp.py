"""Exact DP over pipelines whose stages may be tensor-parallel groups (issue 15).

Each stage runs on a *group*: one card (today's stage, with its recompute / offload levers
priced exactly as `dp.StageTables` prices them) or 2..`Problem.group_max` cards of one node, or of
two when `Problem.group_nodes` is 2 (`candidate_groups`; `tp_tables.group_stage`: shares by the
``uneven`` rule, the slowest member's integer parts, the all-reduces and broadcasts on the group's ring, every member under M_s; no levers).
The shares are not decisions: they follow from the run, the members and the in-flight count.
A group's *lead* (`Stage.device`, the member that exchanges the cuts with the neighbouring
stages' leads) is a decision: every member may lead; the others follow in index order.

The search is the count-vector DP of `dp.py` with device *sets* in place of counts: the
state is (cards used by the pipeline suffix, its number of stages, its front stage's lead),
the value a vector over the unit the suffix starts at, so a stage knows how many stages follow
it (its in-flight count) and whom it sends to.  `dp.parametric_search` walks the cap on the
bottleneck as for the pipeline-only DP, so the answer is optimal under the H-1F1B estimate
T_est over every cut, group, lead and order (`tests/test_tp_solver.py`: brute force).  States
grow as 2^cards: `solve_groups` declines above `MAX_GROUP_CARDS` cards (`GroupSpaceTooLarge`).

Example (two equal cards; a group of both halves each unit's split work):
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem
    >>> from hetpipe.partitioner.tp_tables import BlockSplit, UnitSplit
    >>> blk = BlockSplit(parts=8, fwd_flops=1, allreduce_bytes=0, activation_bytes=0)
    >>> inf = float("inf")
    >>> prob = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (2.0, 2.0)}, state_bytes=(1, 1),
    ...                activation_bytes=(1, 1), boundary_bytes=(100, 0),
    ...                devices=(DeviceSlot("d0", "a", "n", 100), DeviceSlot("d1", "a", "n", 100)),
    ...                bandwidth_bytes_s=((inf, 10.0), (10.0, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)),
    ...                microbatches=4, tensor_parallel=(UnitSplit(3, 1.0, 1.0, (blk,)),) * 2, group_max=2)
    >>> res = solve_groups(prob)
    >>> res.iteration_s, [(s.members, s.first_unit, s.last_unit) for s in res.stages]   # 4 x 3 s
    (12.0, [((0, 1), 0, 1)])
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Sequence

import numpy as np

from hetpipe.errors import ConfigError, InfeasibleError
from hetpipe.partitioner.problem import (Problem, Stage, StagePosition, grad_cut_bytes, stage_activation_bytes,
                                         stage_step_bytes, stage_transient_bytes, tied_bytes)
from hetpipe.partitioner.recompute import with_recompute
from hetpipe.partitioner.solvers.cap_walk import DPResult, check_deadline, parametric_search
from hetpipe.partitioner.solvers.dp import DeviceClass, StageTables
from hetpipe.partitioner.tp_tables import MAX_GROUP_NODES, group_stage, ring_of
from hetpipe.schedule.held import position_held_terms

#: Cards above which the set DP (2^cards states x stages x leads) is declined.
MAX_GROUP_CARDS = 8


class GroupSpaceTooLarge(Exception):
    """The device-set DP would be too large for this cluster."""


def candidate_groups(problem: Problem) -> tuple[tuple[int, ...], ...]:
    """Every group a stage may run on: each card alone, and every set of 2..group_max cards of at
    most ``problem.group_nodes`` nodes (1: one node; `tp_tables.MAX_GROUP_NODES`) with each member as
    lead (lead first, the rest by index).  Sets in card-index order, one node's before two nodes'.

    Whether a set across nodes is worth it is left to the DP: it prices the set's ring on the nodes'
    link (`tp_tables.ring_of`), so on a slow link it loses to a pipeline and is not chosen.

    Example (cards 0, 1 on node a, card 2 on node b; groups of 2):
        >>> from types import SimpleNamespace as NS
        >>> p = NS(devices=[NS(node="a"), NS(node="a"), NS(node="b")], group_max=2, group_nodes=2,
        ...        tensor_parallel=(1,))
        >>> candidate_groups(p)
        ((0,), (1,), (2,), (0, 1), (1, 0), (0, 2), (2, 0), (1, 2), (2, 1))
        >>> len(candidate_groups(NS(**{**vars(p), "group_nodes": 1})))
        5
    """
    out: list[tuple[int, ...]] = [(d,) for d in range(len(problem.devices))]
    if problem.group_max < 2 or not problem.tensor_parallel:
        return tuple(out)
    spans = getattr(problem, "group_nodes", 1)
    if not 1 <= spans <= MAX_GROUP_NODES:
        raise ConfigError(f"Problem.group_nodes is {spans}; a tensor-parallel group may span 1..{MAX_GROUP_NODES} "
                          "nodes (its ring is priced on one node pair's link); use 1 or 2")
    nodes: dict[str, list[int]] = {}
    for i, d in enumerate(problem.devices):
        nodes.setdefault(d.node, []).append(i)
    subsets = [s for cards in nodes.values() for k in range(2, min(problem.group_max, len(cards)) + 1)
               for s in itertools.combinations(cards, k)]
    if spans > 1:  # after the one-node sets (their order, hence the DP's ties, as before cross-node groups)
        node_of = [d.node for d in problem.devices]
        subsets += [s for k in range(2, problem.group_max + 1) for s in itertools.combinations(range(len(node_of)), k)
                    if len({node_of[d] for d in s}) == 2]
    return tuple(out) + tuple((lead, *(d for d in s if d != lead)) for s in subsets for lead in s)


class GroupTablesDP:
    """Per candidate group and stages-after, its stage cost over the band [lo, w] (inf: not allowed)."""

    def __init__(self, problem: Problem, groups: Sequence[tuple[int, ...]], cost_cache: dict | None = None,
                 deadline: float = math.inf) -> None:
        self.problem, self.groups, self.L = problem, tuple(groups), problem.num_units
        self.deadline = deadline  # `time.perf_counter()` past which pricing the groups gives up
        singles = tuple(DeviceClass(d.kind, d.node, d.usable_bytes, (i,)) for i, d in enumerate(problem.devices))
        self.single = StageTables(problem, singles)  # width-1 stages: the pipeline DP's own tables and levers
        self._group: dict[tuple[int, int], np.ndarray] = {}
        # a group's F + B per (member set, units, what its position changes): the lead does not change it;
        # shared between the passes of one solve (the offload walk changes only width-1 stages)
        self._cost: dict[tuple, float] = {} if cost_cache is None else cost_cache
        self._signatures: dict[tuple[int, ...], tuple] = {}
        n, L = len(problem.devices), self.L
        self.comm2 = np.zeros((n, n, L + 1))  # round trip over the cut after unit u-1, lead a -> lead b
        for a in range(n):
            for b in range(n):
                if a != b:
                    for u in range(1, L):
                        self.comm2[a, b, u] = 2.0 * problem.comm_s(a, b, u - 1)

    def _group_band(self, g: int, after: int) -> np.ndarray:
        """F + B of group g on [lo, lo + w + 1) with `after` stages after it; inf where it does not fit."""
        key = (self.signature(self.groups[g]), after)
        if key not in self._group:
            p, L, members = self.problem, self.L, self.groups[g]
            band = np.full((L + 1, L), np.inf)
            for lo in range(L):
                if time.perf_counter() > self.deadline:
                    raise GroupSpaceTooLarge(f"pricing {len(self.groups)} groups x {L} units ran past the time limit")
                for hi in range(lo + 1, L + 1):
                    if (hi == L) != (after == 0):
                        continue
                    band[lo, hi - lo - 1] = self._group_cost(members, lo, hi - 1, after)
            self._group[key] = band
        return self._group[key]

    def signature(self, members: tuple[int, ...]) -> tuple:
        """All a group's price reads of its members: each one's kind and usable bytes in card-index order
        (`tp_tables.group_stage` prices them in that order, whoever leads) and the ring's link
        (`tp_tables.ring_of`).  Sets with one signature cost the same: on a cluster of like nodes the
        two-node sets collapse to a few (4 + 4 like cards: 6 signatures for 120 sets)."""
        if members not in self._signatures:
            order = tuple(sorted(members))
            self._signatures[members] = (tuple((self.problem.devices[d].kind, self.problem.devices[d].usable_bytes)
                                               for d in order), ring_of(self.problem, order))
        return self._signatures[members]

    def _group_cost(self, members: tuple[int, ...], lo: int, last: int, after: int) -> float:
        """`group_cost`, shared between leads, between sets of one `signature`, and between positions whose
        moments are the same."""
        m = self.problem.microbatches
        held = position_held_terms(after, first=lo == 0, microbatches=m)
        key = (self.signature(members), lo, last, after == 0, min(after + 1, m), held)
        if key not in self._cost:
            self._cost[key] = group_cost(self.problem, members, lo, last, after)
        return self._cost[key]

    def band(self, g: int, after: int, cap: float) -> np.ndarray:
        """Stage cost of group g (band form, full width) under `cap`; inf where not allowed."""
        if len(self.groups[g]) == 1:
            return self.single.band(self.groups[g][0], after, cap, self.L)
        band = self._group_band(g, after)
        return np.where(band <= cap, band, np.inf)


def group_cost(problem: Problem, members: tuple[int, ...], lo: int, last: int, after: int) -> float:
    """F + B of units [lo, last] on the group `members` with `after` stages after it (inf: does not fit)."""
    st = Stage(members[0], lo, last, members=members)
    pos = StagePosition(
        stages_after=after, first=lo == 0, microbatches=problem.microbatches,
        in_bytes=problem.boundary_bytes[lo - 1] if lo > 0 else 0,
        out_bytes=problem.boundary_bytes[last] if after else 0,
        in_grad_bytes=grad_cut_bytes(problem, lo - 1) if lo > 0 else 0,
        out_grad_bytes=grad_cut_bytes(problem, last) if after else 0,
        activation_bytes=stage_activation_bytes(problem, st), tied_bytes=tied_bytes(problem, st),
        transient_bwd_bytes=stage_transient_bytes(problem, st), step_bytes=stage_step_bytes(problem, st))
    try:
        g = group_stage(problem, first=lo, last=last, members=members, position=pos)
    except InfeasibleError:
        return math.inf
    return g.fwd_s + g.bwd_s if g.fits else math.inf


State = tuple[int, int, int]  # (mask of the suffix's cards, its stages, its front stage's lead card)


def run_pass(tab: GroupTablesDP, cap: float, bottleneck: bool, exact_stages: int | None,
             deadline: float = math.inf) -> tuple[float, list[tuple[int, int, int]]] | None:
    """One pass: the least sum (or bottleneck) over suffixes; (value, [(group, lo, hi)] front to back).

    A suffix is known by its cards, its stage count and its front stage's *lead* (the only member the
    stage before it sends to): suffixes that differ only in the front group's other members merge, the
    front group of each start unit kept in `backs` (with 2 nodes' sets, 8 cards: ~64x fewer states).
    """
    combine = np.maximum if bottleneck else np.add
    L, groups = tab.L, tab.groups
    masks = [sum(1 << d for d in g) for g in groups]
    comm = np.where(tab.comm2 <= cap, tab.comm2, np.inf)
    vals: dict[State, np.ndarray] = {}
    backs: dict[State, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # next start unit; index into prev; group
    prev_keys: dict[State, list[State]] = {}
    layer: list[State] = []
    for g in range(len(groups)):  # the last stage: it ends at unit L (a (cards, lead) pair is one group)
        v = tab.band(g, 0, cap)[np.arange(L + 1), np.maximum(L - np.arange(L + 1) - 1, 0)]
        v = np.where(np.arange(L + 1) < L, v, np.inf)
        if np.isfinite(v).any():
            key = (masks[g], 1, groups[g][0])
            vals[key], prev_keys[key] = v, []
            backs[key] = (np.full(L + 1, L), np.full(L + 1, -1), np.full(L + 1, g))
            layer.append(key)
    limit = min(len(tab.problem.devices), L, exact_stages or L)
    for j in range(1, limit):
        check_deadline(deadline)  # between levels (`cap_walk.DeadlineReached`: the walk keeps its best so far)
        layer = _extend(tab, j, cap, combine, comm, masks, layer, vals, backs, prev_keys)
    finals = [k for k in vals if exact_stages is None or k[1] == exact_stages]
    if not finals:
        return None
    best = min(finals, key=lambda k: vals[k][0])
    if not math.isfinite(vals[best][0]):
        return None
    out, key, lo = [], best, 0
    while True:
        hi, back, g = (int(x) for x in (backs[key][0][lo], backs[key][1][lo], backs[key][2][lo]))
        out.append((g, lo, hi))
        if key[1] == 1:
            return float(vals[best][0]), out
        key, lo = prev_keys[key][back], hi


def _extend(tab: GroupTablesDP, j: int, cap: float, combine, comm: np.ndarray, masks: list[int], layer: list[State],
            vals: dict, backs: dict, prev_keys: dict) -> list[State]:
    """The suffixes of j + 1 stages: each group in front of each suffix of j it is disjoint from."""
    L, groups = tab.L, tab.groups
    nxt: list[State] = []
    windows_of: dict[tuple[State, int], np.ndarray] = {}  # (suffix, next lead) -> its windows, shared by groups
    starts = np.arange(L + 1)[:, None] + np.arange(L)[None, :]  # window [lo, lo + w]: the next stage starts after
    for g, members in enumerate(groups):
        band = tab.band(g, j, cap)
        for key in layer:
            mask, _, lead = key
            if mask & masks[g]:
                continue
            if (key, members[0]) not in windows_of:
                h = combine(comm[members[0], lead], vals[key])  # indexed by the next stage's first unit
                windows_of[(key, members[0])] = np.concatenate((h[1:], np.full(L, np.inf)))[starts]
            cand = combine(band, windows_of[(key, members[0])])
            w = np.argmin(cand, axis=1)
            v = cand[np.arange(L + 1), w]
            if not np.isfinite(v).any():
                continue
            new = (mask | masks[g], j + 1, members[0])
            if new not in vals:
                vals[new], prev_keys[new] = np.full(L + 1, np.inf), []
                backs[new] = (np.full(L + 1, -1), np.full(L + 1, -1), np.full(L + 1, -1))
                nxt.append(new)
            better = v < vals[new]
            if not better.any():
                continue
            prev_keys[new].append(key)
            vals[new] = np.where(better, v, vals[new])
            backs[new][0][better] = np.minimum(np.arange(L + 1) + w + 1, L)[better]
            backs[new][1][better] = len(prev_keys[new]) - 1
            backs[new][2][better] = g
    return nxt


def _stages(problem: Problem, groups: Sequence[tuple[int, ...]], picks: Sequence[tuple[int, int, int]],
            ) -> tuple[Stage, ...]:
    plain = tuple(Stage(groups[g][0], lo, hi - 1, members=groups[g] if len(groups[g]) > 1 else ())
                  for g, lo, hi in picks)
    return with_recompute(problem, plain)


def solve_groups(problem: Problem, *, time_limit_s: float = 60.0, exact_stages: int | None = None,
                 seed: Sequence[Stage] | None = None, cost_cache: dict | None = None,
                 deadline: float = math.inf) -> DPResult | None:
    """The best placement under T_est over cuts, groups, leads and orders (None if nothing fits).

    Raises `GroupSpaceTooLarge` above `MAX_GROUP_CARDS` cards, or when pricing the groups runs
    past `deadline` (a `time.perf_counter()` value).
    """
    if len(problem.devices) > MAX_GROUP_CARDS:
        raise GroupSpaceTooLarge(f"{len(problem.devices)} cards > {MAX_GROUP_CARDS} for the group DP")
    groups = candidate_groups(problem)
    tab = GroupTablesDP(problem, groups, cost_cache, deadline)

    def min_sum(cap: float, bottleneck: bool, deadline: float) -> tuple[float, tuple[Stage, ...]] | None:
        out = run_pass(tab, cap, bottleneck, exact_stages, deadline)
        return None if out is None else (out[0], _stages(problem, groups, out[1]))

    # A group of k cards can run a stage faster than the fastest single card, so the walk's
    # default bound (one card per stage) is not valid here; a walk stopped at its deadline
    # claims nothing (0 s).  `tp_solve.group_bound` is the bound a grouped plan records.
    return parametric_search(problem, min_sum, time_limit_s=time_limit_s, seed=seed, lower_bound_s=0.0)
