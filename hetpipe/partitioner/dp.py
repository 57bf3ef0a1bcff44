"""Exact dynamic program for the pipeline-partitioning contract (`problem.evaluate`).

The objective T = S + (m - 1) * b mixes a sum S (every stage's compute and every
cut's round trip) with a bottleneck b (the largest of those terms).  For a fixed
cap B on every term, the minimum sum S(B) decomposes over stages, so a DP solves it
exactly.  `solve_exact` then walks the cap downwards (parametric search):

    B_0 = inf;  (s_i, b_i) = argmin S(B_i);  B_{i+1} = b_i - tol

Every optimum with bottleneck b* is dominated by the answer at the last B_i >= b*
(its sum is <= the optimum's, its bottleneck <= b*), so min_i (s_i + (m-1) b_i) is
optimal up to `tol`.  Because S(B) only grows as B shrinks, the walk stops as soon as
s_i + (m - 1) * lower_bound(b) cannot beat the best T found.

States.  Devices that are interchangeable (same kind, node and usable memory, and the
same links to everything else) form a *class* (`device_classes`); the DP counts how
many devices of each class a pipeline suffix uses instead of which ones, which removes
the symmetry between identical cards.  It runs from the last stage backwards so a
stage knows how many stages follow it: j stages after stage s means 1F1B keeps
min(j + 1, m) micro-batches of activations in flight on it (the memory contract).
State = (count vector, class of the suffix's first stage); value = a vector over the
unit at which the suffix starts.

`solve_fixed_order` is the same DP for one given device sequence (a fast heuristic
for clusters whose count space is too large).

Example:
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem
    >>> inf = float("inf")
    >>> prob = Problem(fwd_s={"a": (1.0, 1.0, 1.0, 1.0)}, bwd_s={"a": (2.0, 2.0, 2.0, 2.0)},
    ...                state_bytes=(1,) * 4, activation_bytes=(1,) * 4, boundary_bytes=(0, 0, 0, 0),
    ...                devices=(DeviceSlot("d0", "a", "n", 100), DeviceSlot("d1", "a", "n", 100)),
    ...                bandwidth_bytes_s=((inf, 1.0), (1.0, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)),
    ...                microbatches=4)
    >>> res = solve_exact(prob)
    >>> res.iteration_s, [(s.first_unit, s.last_unit) for s in res.stages]
    (30.0, [(0, 1), (2, 3)])
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from hetpipe.partitioner.problem import Problem, Stage, evaluate

log = logging.getLogger(__name__)

#: Relative step below the last bottleneck when the cap is tightened (see module doc).
CAP_TOLERANCE = 1e-9
#: DP work (count vectors x classes x (units + 1)^2 matrix cells per pass) above which
#: `solve_exact` declines and the caller falls back to CP-SAT with a heuristic hint.
#: 4e7 cells take about 1-2 s per pass of the cap walk on the 2-core reference VM
#: (96-layer GPT on 16 cards of 4 kinds: 2.4e7 cells, proved optimal in ~2 s).
DEFAULT_STATE_BUDGET = 40_000_000


@dataclass(frozen=True)
class DeviceClass:
    """Interchangeable devices: indices into `Problem.devices`, in id order."""

    kind: str
    node: str
    usable_bytes: int
    members: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.members)


@dataclass(frozen=True)
class DPResult:
    """An optimal (or, for `solve_fixed_order`, best-in-order) placement."""

    stages: tuple[Stage, ...]
    iteration_s: float
    bound_s: float  # lower bound on T proven by the search (== iteration_s when exact)
    caps_tried: int
    exact: bool


class StateSpaceTooLarge(Exception):
    """The count-vector DP would exceed its state budget."""


def _links_match(problem: Problem, a: int, b: int) -> bool:
    """Devices a and b see identical links to every other device (and to each other)."""
    n = len(problem.devices)
    bw, lat = problem.bandwidth_bytes_s, problem.latency_s
    for o in range(n):
        if o in (a, b):
            continue
        if (bw[a][o], lat[a][o], bw[o][a], lat[o][a]) != (bw[b][o], lat[b][o], bw[o][b], lat[o][b]):
            return False
    return True


def device_classes(problem: Problem) -> tuple[DeviceClass, ...]:
    """Group devices by (kind, node, usable bytes), splitting groups whose links differ.

    Example:
        >>> from hetpipe.partitioner.problem import DeviceSlot
        >>> devs = (DeviceSlot("a", "k", "n", 1), DeviceSlot("b", "k", "n", 1), DeviceSlot("c", "k", "m", 1))
        >>> one = ((1.0,) * 3,) * 3
        >>> p = Problem({}, {}, (), (), (), devs, one, ((0.0,) * 3,) * 3, 1)
        >>> [c.members for c in device_classes(p)]
        [(0, 1), (2,)]
    """
    groups: dict[tuple[str, str, int], list[int]] = {}
    for i, d in enumerate(problem.devices):
        groups.setdefault((d.kind, d.node, d.usable_bytes), []).append(i)
    out: list[DeviceClass] = []
    for (kind, node, usable), members in groups.items():
        buckets: list[list[int]] = []
        for i in members:
            home = next((b for b in buckets if _links_match(problem, b[0], i)
                         and _links_match_pair(problem, b, i)), None)
            if home is None:
                buckets.append([i])
            else:
                home.append(i)
        out.extend(DeviceClass(kind, node, usable, tuple(b)) for b in buckets)
    return tuple(out)


def _links_match_pair(problem: Problem, bucket: Sequence[int], i: int) -> bool:
    """Links inside a bucket must all be equal for its devices to be interchangeable."""
    if not bucket or len(bucket) < 1:
        return True
    ref = bucket[0]
    bw, lat = problem.bandwidth_bytes_s, problem.latency_s
    for j in bucket[1:]:
        if (bw[ref][j], lat[ref][j]) != (bw[ref][i], lat[ref][i]) or (bw[j][ref], lat[j][ref]) != (bw[i][ref], lat[i][ref]):
            return False
    return True


class _Tables:
    """Prefix sums and per-class matrices shared by every cap (units of seconds, bytes)."""

    def __init__(self, problem: Problem, classes: Sequence[DeviceClass]) -> None:
        L = problem.num_units
        self.L = L
        self.m = problem.microbatches
        self.classes = tuple(classes)
        # compute prefix per class: P[c][u] = sum of (fwd+bwd) of units < u on kind(c)
        self.work = [np.concatenate(([0.0], np.cumsum(np.add(problem.fwd_s[c.kind], problem.bwd_s[c.kind]))))
                     for c in classes]
        st = np.concatenate(([0], np.cumsum(np.asarray(problem.state_bytes, dtype=np.float64))))
        act = np.concatenate(([0], np.cumsum(np.asarray(problem.activation_bytes, dtype=np.float64))))
        bd = np.asarray(problem.boundary_bytes, dtype=np.float64)
        lo, hi = np.meshgrid(np.arange(L + 1), np.arange(L + 1), indexing="ij")  # stage = units [lo, hi)
        self.valid = hi > lo
        self.state = np.where(self.valid, st[hi] - st[lo], 0.0)
        self.act = np.where(self.valid, act[hi] - act[lo], 0.0)
        before = np.where(lo > 0, 2.0 * bd[np.maximum(lo - 1, 0)], 0.0)  # buffers for the cut before
        after = np.where(hi >= 1, 2.0 * bd[np.clip(hi - 1, 0, L - 1)], 0.0)  # ... and after (if any stage follows)
        self.before, self.after = before, after
        self.compute = [np.where(self.valid, w[hi] - w[lo], np.inf) for w in self.work]
        # round trip 2*C over the cut after unit u-1 (index u = start of the next stage), per class pair
        self.comm2 = np.zeros((len(classes), len(classes), L + 1))
        for a, ca in enumerate(classes):
            for b, cb in enumerate(classes):
                src, dst = ca.members[0], cb.members[-1]
                if src == dst:
                    continue  # a class of one device cannot follow itself: counts forbid it
                for u in range(1, L):
                    nbytes = problem.boundary_bytes[u - 1]
                    if nbytes > 0:
                        self.comm2[a, b, u] = 2.0 * problem.comm_s(src, dst, u - 1)

    def stage_matrix(self, c: int, after_stages: int, cap: float) -> np.ndarray:
        """Cost of a stage of class c on units [lo, hi) with `after_stages` stages after it (inf = not allowed)."""
        inflight = min(after_stages + 1, self.m)
        mem = self.state + inflight * self.act + self.before + (self.after if after_stages else 0.0)
        cost = self.compute[c]
        ok = self.valid & (cost <= cap) & (mem <= self.classes[c].usable_bytes)
        if not after_stages:
            ok &= np.arange(self.L + 1)[None, :] == self.L  # the last stage ends at the last unit
        return np.where(ok, cost, np.inf)


def _count_states(classes: Sequence[DeviceClass], max_stages: int) -> list[tuple[int, ...]]:
    """Count vectors with 1..max_stages devices in all, ordered by their total."""
    ranges = [range(c.count + 1) for c in classes]
    states = [v for v in itertools.product(*ranges) if 0 < sum(v) <= max_stages]
    states.sort(key=sum)
    return states


def _min_sum_counts(tab: _Tables, cap: float, states: list[tuple[int, ...]], stages: int | None = None,
                    *, bottleneck: bool = False) -> tuple[float, list[tuple[int, int, int]]] | None:
    """min S(cap) over the count vectors (exactly `stages` devices if given); with
    `bottleneck`, the least max term instead of the least sum.

    Returns (value, [(class, lo, hi)] front to back), or None when nothing fits under the cap.
    """
    value, back = _run_counts(tab, cap, states, np.maximum if bottleneck else np.add)
    best: tuple[float, tuple[tuple[int, ...], int]] | None = None
    for state, val in value.items():
        if stages is not None and sum(state) != stages:
            continue
        c0 = int(np.argmin(val[:, 0]))
        if math.isfinite(val[c0, 0]) and (best is None or val[c0, 0] < best[0]):
            best = (float(val[c0, 0]), (state, c0))
    if best is None:
        return None
    return best[0], _unwind(back, best[1], tab.L)


def _unwind(back: dict[tuple[int, ...], np.ndarray], key: tuple[tuple[int, ...], int], L: int) -> list[tuple[int, int, int]]:
    state, c = key
    lo, out = 0, []
    while True:
        hi, nxt = (int(x) for x in back[state][c, lo])
        if sum(state) == 1:
            out.append((c, lo, L))
            return out
        out.append((c, lo, hi))
        state = tuple(v - (i == c) for i, v in enumerate(state))
        lo, c = hi, nxt


def _assign(classes: Sequence[DeviceClass], picks: Sequence[tuple[int, int, int]]) -> tuple[Stage, ...]:
    """Concrete devices for (class, lo, hi) stages: each class hands out members in id order."""
    used = {i: 0 for i in range(len(classes))}
    stages = []
    for c, lo, hi in picks:
        stages.append(Stage(classes[c].members[used[c]], lo, hi - 1))
        used[c] += 1
    return tuple(stages)


def simple_lower_bound(problem: Problem) -> float:
    """A valid lower bound on T for any placement: S >= every unit on its fastest kind (S_lb),
    and the bottleneck >= the largest such unit and >= S_lb / #devices.

    Example:
        >>> from hetpipe.partitioner.problem import DeviceSlot
        >>> p = Problem({"a": (1.0, 3.0)}, {"a": (0.0, 0.0)}, (0, 0), (0, 0), (0, 0),
        ...             (DeviceSlot("x", "a", "n", 1),), ((1.0,),), ((0.0,),), 3)
        >>> simple_lower_bound(p)  # 4 + 2 * max(3, 4 / 1)
        12.0
    """
    kinds = list(problem.fwd_s)
    fastest = [min(problem.fwd_s[k][u] + problem.bwd_s[k][u] for k in kinds) for u in range(problem.num_units)]
    s_lb = sum(fastest)
    b_lb = max(max(fastest, default=0.0), s_lb / max(1, len(problem.devices)))
    return s_lb + (problem.microbatches - 1) * b_lb


MinSum = Callable[[float, bool], "tuple[float, tuple[Stage, ...]] | None"]


def _parametric(problem: Problem, min_sum: MinSum, *, time_limit_s: float) -> DPResult | None:
    """The cap walk of the module docstring around `min_sum(cap, bottleneck)`.

    `min_sum(cap, False)` is min S under the cap; `min_sum(inf, True)` is the least
    achievable bottleneck b_min (the same DP with max in place of +).  Any placement
    better than the best T found has S >= S(inf) and so a bottleneck below
    (best - S(inf)) / (m - 1): the walk scans only [b_min, that].
    """
    m = problem.microbatches
    start = time.perf_counter()
    first = min_sum(math.inf, False)
    if first is None:
        return None
    s_inf, stages = first
    best, best_stages, tries = evaluate(problem, stages).iteration_s, stages, 1
    if m == 1:
        return DPResult(best_stages, best, best, tries, True)
    b_min = min_sum(math.inf, True)[0]  # feasible since `first` is
    bottom = min_sum(b_min * (1.0 + CAP_TOLERANCE), False)  # the window's floor: least sum at b_min
    if bottom is not None:
        tries += 1
        t_bottom = evaluate(problem, bottom[1]).iteration_s
        if t_bottom < best:
            best, best_stages = t_bottom, bottom[1]
    cap = (best - s_inf) / (m - 1)
    while cap > b_min * (1.0 + CAP_TOLERANCE):  # walk down; S only grows as the cap falls
        tries += 1
        res = min_sum(cap, False)
        if res is None:
            break
        s_cap, stages = res
        ev = evaluate(problem, stages)
        if ev.iteration_s < best:
            best, best_stages = ev.iteration_s, stages
        if s_cap + (m - 1) * b_min >= best * (1.0 - CAP_TOLERANCE):
            break
        if time.perf_counter() - start > time_limit_s:
            return DPResult(best_stages, best, min(best, s_cap + (m - 1) * b_min), tries, False)
        cap = min(ev.bottleneck_s, (best - s_inf) / (m - 1)) * (1.0 - CAP_TOLERANCE)
    return DPResult(best_stages, best, best, tries, True)


def solve_exact(problem: Problem, *, state_budget: int = DEFAULT_STATE_BUDGET,
                time_limit_s: float = 60.0, max_stages: int | None = None,
                exact_stages: int | None = None) -> DPResult | None:
    """Optimal placement over every device subset and order (None if nothing fits).

    `exact_stages` restricts to pipelines of exactly that many stages.  Raises
    `StateSpaceTooLarge` when the count space exceeds `state_budget`.
    """
    classes = device_classes(problem)
    limit = min(problem.num_units, len(problem.devices), max_stages or len(problem.devices))
    size = math.prod(c.count + 1 for c in classes)  # count vectors, before the stage limit prunes them
    work = size * len(classes) * (problem.num_units + 1) ** 2
    if work > state_budget:
        raise StateSpaceTooLarge(f"{size} device-count states x {len(classes)} classes x "
                                 f"{problem.num_units + 1}^2 cells > budget {state_budget:.3g}")
    states = _count_states(classes, limit)
    tab = _Tables(problem, classes)

    if exact_stages is not None:
        states = [s for s in states if sum(s) <= exact_stages]

    def min_sum(cap: float, bottleneck: bool) -> tuple[float, tuple[Stage, ...]] | None:
        out = _min_sum_counts(tab, cap, states, exact_stages, bottleneck=bottleneck)
        return None if out is None else (out[0], _assign(classes, out[1]))

    return _parametric(problem, min_sum, time_limit_s=time_limit_s)


def _run_counts(tab: _Tables, cap: float, states: list[tuple[int, ...]], combine: Callable = np.add,
                ) -> tuple[dict[tuple[int, ...], np.ndarray], dict[tuple[int, ...], np.ndarray]]:
    """Backward DP over count vectors (in order of their total).

    value[state] has shape (C, L+1): the least cost of a suffix that starts at unit u
    with its front stage on class f and uses `state` devices; back[state] (C, L+1, 2)
    holds the next stage's start unit and front class.
    """
    C, L = len(tab.classes), tab.L
    value: dict[tuple[int, ...], np.ndarray] = {}
    back: dict[tuple[int, ...], np.ndarray] = {}
    comm_ok = np.where(tab.comm2 <= cap, tab.comm2, np.inf)
    for state in states:
        k = sum(state)
        val = np.full((C, L + 1), np.inf)
        bp = np.full((C, L + 1, 2), -1, dtype=np.int64)
        for c in range(C):
            if state[c] == 0:
                continue
            if k == 1:
                val[c] = tab.stage_matrix(c, 0, cap)[:, L]
                continue
            pv = value.get(tuple(v - (i == c) for i, v in enumerate(state)))
            if pv is None:
                continue
            tot = combine(comm_ok[c], pv)  # H[u] = min_f 2C(c->f, cut u) (+ or max) suffix(prev, f, u)
            f_best = np.argmin(tot, axis=0)
            h = tot[f_best, np.arange(L + 1)]
            cand = combine(tab.stage_matrix(c, k - 1, cap), h[None, :])
            u_best = np.argmin(cand, axis=1)
            val[c] = cand[np.arange(L + 1), u_best]
            bp[c, :, 0], bp[c, :, 1] = u_best, f_best[u_best]
        if np.isfinite(val).any():
            value[state], back[state] = val, bp
    return value, back


def _min_sum_fixed(tab: _Tables, cap: float, order: Sequence[int], *,
                   bottleneck: bool = False) -> tuple[float, list[tuple[int, int, int]]] | None:
    """min S(cap) (or the least max term) when stage i runs on class `order[i]`, every position used."""
    combine = np.maximum if bottleneck else np.add
    L, p = tab.L, len(order)
    comm_ok = np.where(tab.comm2 <= cap, tab.comm2, np.inf)
    suffix = tab.stage_matrix(order[-1], 0, cap)[:, L]  # suffix[u]: stages i..p-1 starting at u
    cuts: list[np.ndarray] = []
    for i in range(p - 2, -1, -1):
        c, nxt = order[i], order[i + 1]
        h = combine(comm_ok[c, nxt], suffix)
        cand = combine(tab.stage_matrix(c, p - 1 - i, cap), h[None, :])
        u_best = np.argmin(cand, axis=1)
        suffix = cand[np.arange(L + 1), u_best]
        cuts.append(u_best)
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
    tab = _Tables(problem, singles)
    positions = list(range(len(order)))

    def min_sum(cap: float, bottleneck: bool) -> tuple[float, tuple[Stage, ...]] | None:
        out = _min_sum_fixed(tab, cap, positions, bottleneck=bottleneck)
        return None if out is None else (out[0], _assign(singles, out[1]))

    return _parametric(problem, min_sum, time_limit_s=time_limit_s)
