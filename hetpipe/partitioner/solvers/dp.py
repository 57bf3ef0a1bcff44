"""Exact dynamic program for the pipeline-partitioning contract (`problem.evaluate`).

The objective T = S + (m - 1) * b mixes a sum S (every stage's compute and every
cut's round trip) with a bottleneck b (the largest of those terms).  For a fixed
cap B on every term, the minimum sum S(B) decomposes over stages, so a DP solves it
exactly.  `solve_exact` then walks the cap downwards (parametric search, `cap_walk`):

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

Recomputation (`Problem.recompute`): each table entry is priced with its stage's smallest
fitting recompute prefix (`recompute_band`; why that keeps the DP exact: `partitioner/recompute.py`).

`hetpipe.partitioner.solvers.fixed_order.solve_fixed_order` is the same DP for one given
device sequence (a fast heuristic for clusters whose count space is too large).

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

import logging
import math
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from hetpipe.cost_models.selective import selective_variant
from hetpipe.partitioner.problem import Problem, Stage
from hetpipe.partitioner.solvers.cap_walk import DPResult, check_deadline, parametric_search
from hetpipe.partitioner.solvers.counts import count_vectors, vectors
from hetpipe.partitioner.recompute import with_recompute
from hetpipe.partitioner.solvers.offload_band import offload_band
from hetpipe.partitioner.solvers.count_pass import CountPass, run_counts
from hetpipe.partitioner.solvers.pace_rule import LevelCaps
from hetpipe.partitioner.solvers.recompute_band import shared_band
from hetpipe.partitioner.solvers.stage_moments import band_moments, memory_tables, step_band, tied_band, transient_band

log = logging.getLogger(__name__)

#: DP rows (count vectors x classes x (units + 1)) above which `solve_exact` declines and
#: the caller falls back to the relaxation and CP-SAT.  Each row costs one band of W
#: stage lengths per pass; 4e7 rows is about 1 s per pass on the 2-core reference VM
#: when the cap keeps W near 10 (96-layer GPT, 4 kinds x 16 cards, relaxed).
DEFAULT_STATE_BUDGET = 40_000_000
#: Count vectors `_Lattice.build` lists between two deadline checks (~16 ms of CPU at 0.9 s per 58,651).
LATTICE_CHECK_EVERY = 1024


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


class StateSpaceTooLarge(Exception):
    """The count-vector DP would exceed its state budget."""


def _links_match(links: tuple[np.ndarray, np.ndarray], a: int, b: int) -> bool:
    """Devices a and b see identical links to every other device, both ways (`links`: the
    bandwidth and latency tables as arrays; numpy, as 1,024 cards make a million pairs)."""
    others = np.ones(links[0].shape[0], dtype=bool)
    others[[a, b]] = False
    return all(bool((t[a, others] == t[b, others]).all() and (t[others, a] == t[others, b]).all()) for t in links)


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
    groups: dict[tuple[str, str, int, float, float], list[int]] = {}
    for i, d in enumerate(problem.devices):  # host figures too: they price the offload lever
        groups.setdefault((d.kind, d.node, d.usable_bytes, d.host_link_bytes_s, d.host_memory_bytes_s), []).append(i)
    out: list[DeviceClass] = []
    links = (np.asarray(problem.bandwidth_bytes_s, dtype=float), np.asarray(problem.latency_s, dtype=float))
    for (kind, node, usable, _, _), members in groups.items():
        buckets: list[list[int]] = []
        for i in members:
            home = next((b for b in buckets if _links_match(links, b[0], i)
                         and _links_match_pair(problem, b, i)), None)
            if home is None:
                buckets.append([i])
            else:
                home.append(i)
        out.extend(DeviceClass(kind, node, usable, tuple(b)) for b in buckets)
    return tuple(out)


def _links_match_pair(problem: Problem, bucket: Sequence[int], i: int) -> bool:
    """Every link inside the bucket plus `i`, in both directions, must be the same link.

    The DP prices a stage handing over to another card of its own class with one link
    (first member -> last member); that is only right when the links between members are
    all equal *and symmetric*.  Two cards whose links differ by direction (possible through
    the API or an edited plan) stay in separate classes.
    """
    bw, lat = problem.bandwidth_bytes_s, problem.latency_s
    ref = bucket[0]
    want = (bw[ref][bucket[1]], lat[ref][bucket[1]]) if len(bucket) > 1 else (bw[ref][i], lat[ref][i])
    return all((bw[j][i], lat[j][i]) == want and (bw[i][j], lat[i][j]) == want for j in bucket)


def _selective_tables(problem: Problem, classes: Sequence[DeviceClass]) -> StageTables | None:
    """The tables of a stage that runs the selective level: its variant problem's, each class's usable bytes
    less the level's peak (`Problem.selective`, priced as `evaluate` does; offered under ``auto`` only)."""
    tab = problem.selective
    if tab is None or problem.recompute != "auto":
        return None
    return StageTables(selective_variant(problem),
                       [replace(c, usable_bytes=c.usable_bytes - tab.peak_bytes) for c in classes])


class StageTables:
    """Per-class stage costs in *band* form, shared by every cap (seconds, bytes).

    Entry [lo, w] describes the stage on units [lo, lo + w + 1).  Under a cap on every
    stage's time, stages are short, so a pass only needs the first W columns
    (`width`): L*W work instead of L^2.
    """

    def __init__(self, problem: Problem, classes: Sequence[DeviceClass]) -> None:
        L = problem.num_units
        self.L, self.m, self.classes = L, problem.microbatches, tuple(classes)
        lo = np.arange(L + 1)[:, None]
        hi = lo + np.arange(L)[None, :] + 1
        self.valid = hi <= L
        hi_c = np.minimum(hi, L)
        self.hi = hi_c
        st = np.concatenate(([0.0], np.cumsum(np.asarray(problem.state_bytes, dtype=np.float64))))
        act = np.concatenate(([0.0], np.cumsum(np.asarray(problem.activation_bytes, dtype=np.float64))))
        bd = np.asarray(problem.boundary_bytes, dtype=np.float64)
        self.tied = tied_band(problem, lo, hi_c)
        self.state = st[hi_c] - st[lo] + self.tied
        self.grads, held_out, self.before_grad, self.after_grad = memory_tables(problem, lo, hi_c, self.valid.shape)
        self.act = act[hi_c] - act[lo] - held_out  # A_s (`problem.stage_activation_bytes`)
        self.transient = transient_band(problem, lo, hi_c)  # T_s, memory model 4
        self.step_params, self.step_largest = step_band(problem, lo, hi_c)  # U_s's tables, memory model 5
        self.step_rules, self._step_ok = problem.step_transient, {}  # class -> step_fits over the whole band
        # in/out cut bytes of a stage on [lo, hi): the cut before (none for the first) and after
        self.before = np.broadcast_to(np.where(lo > 0, bd[np.maximum(lo - 1, 0)], 0.0), self.valid.shape)
        self.after = bd[np.clip(hi_c - 1, 0, L - 1)]  # counted only if a stage follows
        self.first = np.broadcast_to(lo == 0, self.valid.shape)
        self.is_last = hi == L
        # compute per class: F + B of the stage's units on kind(c)
        self.compute, self.forward = [], []  # forward: F alone (the pace walk's rules, `PaceRule`)
        for c in classes:
            work = np.concatenate(([0.0], np.cumsum(np.add(problem.fwd_s[c.kind], problem.bwd_s[c.kind]))))
            self.compute.append(np.where(self.valid, work[hi_c] - work[lo], np.inf))
            fwd = np.concatenate(([0.0], np.cumsum(np.asarray(problem.fwd_s[c.kind], dtype=np.float64))))
            self.forward.append(np.where(self.valid, fwd[hi_c] - fwd[lo], np.inf))
        self.levers = None if problem.recompute == "none" else shared_band(problem, hi_c, self.valid)
        self.offload = offload_band(problem, self)
        self.selective = _selective_tables(problem, classes)
        self._memory: dict[int, np.ndarray] = {}  # stages after -> M_s over the full band (`memory`)
        # round trip 2*C over the cut after unit u-1 (index u = start of the next stage), per class pair
        self.comm2 = np.zeros((len(classes), len(classes), L + 1))
        for a, ca in enumerate(classes):
            for b, cb in enumerate(classes):
                src, dst = ca.members[0], cb.members[-1]
                if src == dst:
                    continue  # a class of one device cannot follow itself: counts forbid it
                for u in range(1, L):  # a 0-byte cut still pays the latency (`Problem.comm_s`)
                    self.comm2[a, b, u] = 2.0 * problem.comm_s(src, dst, u - 1)

    def width(self, cap: float) -> int:
        """Columns a pass under `cap` needs: the longest stage any class can run within the cap."""
        if not math.isfinite(cap):
            return self.L
        longest = 0
        for comp in self.compute:
            cols = np.flatnonzero((comp <= cap).any(axis=0))
            if cols.size:
                longest = max(longest, int(cols[-1]) + 1)
        return max(1, longest)

    def moments(self, after_stages: int, width: int | None = None) -> list[tuple[int, int, np.ndarray]]:
        """(k_t, in a backward, bytes without recomputation) per moment (`stage_moments.band_moments`)."""
        return band_moments(self, after_stages, self.m, np.s_[:, :width])

    def memory(self, after_stages: int, width: int | None = None) -> np.ndarray:
        """M_s of `pipeline_stage_bytes` without recomputation over the band: the largest moment
        (worked out once per position over the whole band: every class and cap shares it)."""
        if after_stages not in self._memory:
            self._memory[after_stages] = np.max([held for _, backward, held in self.moments(after_stages)
                                                 if not backward], axis=0)
        return self._memory[after_stages][:, :width]

    def band(self, c: int, after_stages: int, cap: float, width: int) -> np.ndarray:
        """Cost of a stage of class c on [lo, lo+w+1) with `after_stages` stages after it (inf = not allowed)."""
        sl = np.s_[:, :width]
        base = cost = self.compute[c][sl]
        if self.levers is None:
            cost = np.where(self.memory(after_stages, width) <= self.classes[c].usable_bytes, cost, np.inf)
        else:  # the recompute choice's seconds; inf where no choice fits
            cls = self.classes[c]
            cost = cost + self.levers.extra_s(cls.kind, cls.usable_bytes, after_stages, self.moments, cost <= cap)
        cost = np.where(self.step_fits(c, width), cost, np.inf)  # the step's moment; offloading steps on the host
        if self.offload is not None:  # the cheaper of offloading or not (`offload_band`)
            cost = self.offload.cost(self, c, after_stages, cap, width, base, cost)
        ok = cost <= cap
        ok &= self.is_last[sl] if not after_stages else ~self.is_last[sl]  # only the last stage ends at unit L
        if self.selective is not None:  # the cheaper of running the selective level or not (`cost_models.selective`)
            return np.minimum(np.where(ok, cost, np.inf), self.selective.band(c, after_stages, cap, width))
        return np.where(ok, cost, np.inf)

    def step_fits(self, c: int, width: int) -> np.ndarray:
        """Memory model 5: the stage's step moment, state + U_s on kind(c) (`problem.stage_step_transient`), fits
        class c's usable bytes (an offloading stage's step allocates on its host: `offload_band` prices it);
        worked out once per class over the whole band."""
        if c not in self._step_ok:
            rule = self.step_rules.get(self.classes[c].kind)
            held = self.state if rule is None else (
                self.state + rule.list_multiple * self.step_params + rule.tensor_multiple * self.step_largest)
            self._step_ok[c] = held <= (self.classes[c].usable_bytes if rule is not None else np.inf)
        return self._step_ok[c][:, :width]

    def gather(self, h: np.ndarray, width: int) -> np.ndarray:
        """h[lo + w + 1] as an (L+1, width) array (h indexed by the next stage's first unit)."""
        return h[self.hi[:, :width]]


@dataclass(frozen=True)
class _Lattice:
    """Count vectors grouped by their total, and for each (total, class) which vector is the
    same one with that class's count lowered by one (the suffix after a stage of that class).

    Built once per solve: it does not depend on the cap.
    """

    groups: dict[int, list[tuple[int, ...]]]
    moves: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]  # (k, c) -> (rows in k, rows in k-1)

    @classmethod
    def build(cls, classes: Sequence[DeviceClass], max_stages: int, deadline: float = math.inf) -> _Lattice:
        """Raises `DeadlineReached` past `deadline` (Python over every count vector: 0.9 s of CPU for 58,651
        vectors of 9 classes, a random 16-card instance of the suite, so it checks every `LATTICE_CHECK_EVERY`)."""
        groups: dict[int, list[tuple[int, ...]]] = {}
        for n, v in enumerate(vectors([c.count for c in classes], max_stages)):
            if n % LATTICE_CHECK_EVERY == 0:
                check_deadline(deadline)
            groups.setdefault(sum(v), []).append(v)
        moves = {}
        for k, group in groups.items():
            if k == 1:
                continue
            where = {st: i for i, st in enumerate(groups[k - 1])}
            for c in range(len(classes)):
                check_deadline(deadline)
                pairs = [(i, where[st[:c] + (st[c] - 1,) + st[c + 1:]]) for i, st in enumerate(group) if st[c] > 0]
                moves[(k, c)] = (np.asarray([i for i, _ in pairs], dtype=np.int64),
                                 np.asarray([q for _, q in pairs], dtype=np.int64))
        return cls(groups, moves)


def _min_sum_counts(tab: StageTables, cap: float, lattice: _Lattice, stages: int | None = None,
                    *, bottleneck: bool = False, deadline: float = math.inf, level_caps: LevelCaps | None = None,
                    threshold: float = math.inf) -> tuple[float, list[tuple[int, int, int]]] | None:
    """min S(cap) over the count vectors (exactly `stages` devices if given); with
    `bottleneck`, the least max term instead of the least sum.

    Returns (value, [(class, lo, hi)] front to back), or None when nothing fits under the cap (or, with a finite
    `threshold`, nothing ends under it: `count_pass.run_counts`).
    Raises `DeadlineReached` past `deadline` (`time.perf_counter()` seconds).
    """
    levels = run_counts(tab, cap, lattice, np.maximum if bottleneck else np.add, deadline=deadline,
                        level_caps=level_caps, threshold=threshold)
    best: tuple[float, int, int, int] | None = None  # (value, total, count vector, class)
    for k, val in levels.vals.items():
        if (stages is not None and k != stages) or not val.size:
            continue
        i, c = np.unravel_index(int(np.argmin(val[:, :, 0])), val.shape[:2])
        v = float(val[i, c, 0])
        if math.isfinite(v) and (best is None or v < best[0]):
            best = (v, k, levels.vector(k, int(i)), int(c))
    if best is None:
        return None
    return best[0], _unwind(lattice, levels, best[1:], tab.L)


def _unwind(lattice: _Lattice, levels: CountPass, key: tuple[int, int, int], L: int) -> list[tuple[int, int, int]]:
    """Follow back-pointers from (total, count vector, class) at unit 0 to the last stage."""
    k, i, c = key
    lo, out = 0, []
    while True:
        if k == 1:
            out.append((c, lo, L))
            return out
        hi, nxt = (int(x) for x in levels.backs[k][levels.rows[k][i], c, lo])
        out.append((c, lo, hi))
        rows, prev = lattice.moves[(k, c)]
        i = int(prev[np.flatnonzero(rows == i)[0]])
        k, lo, c = k - 1, hi, nxt


def assign_stages(classes: Sequence[DeviceClass], picks: Sequence[tuple[int, int, int]]) -> tuple[Stage, ...]:
    """Concrete devices for (class, lo, hi) stages: each class hands out members in id order."""
    used = {i: 0 for i in range(len(classes))}
    stages = []
    for c, lo, hi in picks:
        stages.append(Stage(classes[c].members[used[c]], lo, hi - 1))
        used[c] += 1
    return tuple(stages)


def solve_exact(problem: Problem, *, state_budget: int = DEFAULT_STATE_BUDGET,
                time_limit_s: float = 60.0, max_stages: int | None = None,
                exact_stages: int | None = None, seed: Sequence[Stage] | None = None) -> DPResult | None:
    """Optimal placement over every device subset and order (None if nothing fits).

    `exact_stages` restricts to pipelines of exactly that many stages; `seed`, any
    placement (e.g. the heuristic's), only speeds the search up.  Raises
    `StateSpaceTooLarge` when the count space exceeds `state_budget`.
    """
    if seed is not None and exact_stages is not None and len(seed) != exact_stages:
        seed = None
    classes = device_classes(problem)
    limit = min(problem.num_units, len(problem.devices), max_stages or len(problem.devices))
    size = count_vectors([c.count for c in classes], min(limit, exact_stages or limit))
    work = size * len(classes) * (problem.num_units + 1)
    if work > state_budget:
        raise StateSpaceTooLarge(f"{size} device-count states x {len(classes)} classes x "
                                 f"{problem.num_units + 1} units > budget {state_budget:.3g}")
    lattice = _Lattice.build(classes, min(limit, exact_stages or limit))
    tab = StageTables(problem, classes)

    def min_sum(cap: float, bottleneck: bool, deadline: float) -> tuple[float, tuple[Stage, ...]] | None:
        out = _min_sum_counts(tab, cap, lattice, exact_stages, bottleneck=bottleneck, deadline=deadline)
        return None if out is None else (out[0], with_recompute(problem, assign_stages(classes, out[1])))

    return parametric_search(problem, min_sum, time_limit_s=time_limit_s, seed=seed)


def least_bottleneck(problem: Problem, *, cap_s: float = math.inf, state_budget: int = DEFAULT_STATE_BUDGET,
                     deadline: float = math.inf) -> tuple[float, tuple[Stage, ...]] | None:
    """(b_min, a placement achieving it): the least possible max_s of every F_s + B_s and 2 C_s.

    One DP pass; `cap_s` (any feasible placement's bottleneck) narrows it.  Together with
    `sum_lower_bound`, T >= S_lb + (m - 1) * b_min is a valid lower bound.  Raises `DeadlineReached`
    past `deadline` (`time.perf_counter()` seconds; checked between DP levels).
    """
    check_kinds_fit(problem, state_budget)
    classes = device_classes(problem)
    size = count_vectors([c.count for c in classes], min(problem.num_units, len(problem.devices)))
    if size * len(classes) * (problem.num_units + 1) > state_budget:
        raise StateSpaceTooLarge(f"{size} device-count states")
    lattice = _Lattice.build(classes, min(problem.num_units, len(problem.devices)), deadline)
    out = _min_sum_counts(StageTables(problem, classes), cap_s, lattice, bottleneck=True, deadline=deadline)
    return None if out is None else (out[0], with_recompute(problem, assign_stages(classes, out[1])))


def check_kinds_fit(problem: Problem, state_budget: int = DEFAULT_STATE_BUDGET) -> None:
    """Raise `StateSpaceTooLarge` where the count DP cannot fit even with one class per kind: classes split
    kinds (node, memory, links), which only adds count vectors, so this is a cheap early refusal
    (`device_classes` compares every card pair: 0.5 s at 1,024 cards under load).

    Example:
        >>> from hetpipe.partitioner.problem import DeviceSlot
        >>> p = Problem({"a": (1.0,)}, {"a": (1.0,)}, (1,), (1,), (0,), (DeviceSlot("d", "a", "n", 9),),
        ...             ((1.0,),), ((0.0,),), 1)
        >>> check_kinds_fit(p)   # one card: one state
    """
    kinds: dict[str, int] = {}
    for d in problem.devices:
        kinds[d.kind] = kinds.get(d.kind, 0) + 1
    size = count_vectors(list(kinds.values()), min(problem.num_units, len(problem.devices)))
    if size * len(kinds) * (problem.num_units + 1) > state_budget:
        raise StateSpaceTooLarge(f"at least {size} device-count states")


class CountDP:
    """The count-vector DP of `problem` built once, for callers that run many passes under caps of their
    own (`schedule_bound`); raises `StateSpaceTooLarge` beyond `state_budget` rows, `DeadlineReached` when its count
    vectors are not listed by `deadline` (`_Lattice.build`)."""

    def __init__(self, problem: Problem, *, state_budget: int = DEFAULT_STATE_BUDGET, deadline: float = math.inf) -> None:
        check_kinds_fit(problem, state_budget)
        self.problem, self.classes = problem, device_classes(problem)
        limit = min(problem.num_units, len(problem.devices))
        size = count_vectors([c.count for c in self.classes], limit)
        if size * len(self.classes) * (problem.num_units + 1) > state_budget:
            raise StateSpaceTooLarge(f"{size} device-count states")
        self.lattice = _Lattice.build(self.classes, limit, deadline)
        self.tables = StageTables(problem, self.classes)

    def min_sum(self, cap: float, *, level_caps: LevelCaps | None = None,
                deadline: float = math.inf, threshold: float = math.inf) -> tuple[float, tuple[Stage, ...]] | None:
        """Least S over placements whose stages' F + B are under `cap` and the caps of `level_caps`; with a finite
        `threshold`, None when none is under it (`count_pass.run_counts`: states that cannot end under it dropped)."""
        out = _min_sum_counts(self.tables, cap, self.lattice, deadline=deadline, level_caps=level_caps,
                              threshold=threshold)
        return None if out is None else (out[0], with_recompute(self.problem, assign_stages(self.classes, out[1])))
