"""Honest baselines: each framework's cut rule on its best device subset and order.

A careful Megatron-LM / DeepSpeed / torchgpipe user picks which cards to use and in which
order; the framework then cuts the model its own way into one stage per card
(`baselines.rule_bounds`).  `best_baseline` searches those choices under
`problem.evaluate` (the planner's objective and memory check), so a plan's headline
speed-up is over the best a user could do by hand, not over every card forced in file order.

What is searched, per rule: every stage count p = 1 .. min(n, L); for ``time-homogeneous``
also the device kind it is profiled on (any kind in the cluster; the forced baseline uses
the first card's).  For fixed p (and kind) the cuts are fixed, and stage s's memory M_s and
time W_s depend only on s, p and the card's kind and usable bytes (which units it recomputes
under the planner's lever, `Problem.recompute`, as the planner would), so a card may hold
position s iff M_s <= its usable bytes, and

    T(c_0 .. c_{p-1}) = sum_s W_s(c_s) + sum_s 2 C_s(c_s, c_{s+1}) + (m - 1) max(all of those terms)

over sequences of distinct cards.  Interchangeable cards (`solvers.dp.device_classes`:
same kind, node, memory and links) are one class, so sequences of classes are searched.

1. Local search: seeds are, for every p, the first p cards in file order, the p fastest
   cards grouped by node, and node blocks (fastest node first) cut after p cards; the best
   `LOCAL_SEARCH_STARTS` of them are improved by swapping two positions, moving a card
   elsewhere, replacing a card with an unused one, dropping a card or inserting an unused one
   (the rule re-cuts for the new stage count) until no move helps.
2. Exact branch and bound over class sequences, started from the local search's best and
   pruned with T >= partial + the cheapest remaining terms.  It is exact when it finishes
   within `EXACT_NODE_BUDGET` (recorded as ``search="exact"``); otherwise the answer is the
   local search's (``search="local search"``).

Guarantee: ``exact`` is the minimum T over all ordered device subsets for the rule (the
brute-force test checks it); ``local search`` is a local optimum never worse than the forced
placement (the seed with p = min(n, L) in file order) nor than the p fastest cards grouped by
node, for any p.  A rule that fits on no subset stays out of memory.

Example:
    >>> from hetpipe.partitioner.problem import DeviceSlot
    >>> inf = float("inf")
    >>> prob = Problem(fwd_s={"fast": (1.0,) * 4, "slow": (9.0,) * 4}, bwd_s={"fast": (2.0,) * 4, "slow": (18.0,) * 4},
    ...                state_bytes=(1,) * 4, activation_bytes=(1,) * 4, boundary_bytes=(0,) * 4,
    ...                devices=(DeviceSlot("t4", "slow", "n", 100), DeviceSlot("a", "fast", "n", 100),
    ...                         DeviceSlot("b", "fast", "n", 100)),
    ...                bandwidth_bytes_s=((inf,) * 3,) * 3, latency_s=((0.0,) * 3,) * 3, microbatches=4)
    >>> best = best_baseline(prob, "uniform")
    >>> [prob.devices[s.device].id for s in best.stages], best.iteration_s, best.search
    (['a', 'b'], 30.0, 'exact')
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from hetpipe.partitioner.baselines import BaselineResult, baseline, rule_bounds, without_offload
from hetpipe.partitioner.problem import Problem, Stage, evaluate, stage_memory_bytes
from hetpipe.partitioner.recompute import added_backward_s, choose_levers
from hetpipe.partitioner.solvers.dp import DeviceClass, device_classes

#: Work the branch and bound may do per rule (all stage counts together), in classes looked at
#: (a tree node looks at every class), before the local search's answer stands: about 1.5 s
#: on the 2-core reference VM.  8 cards of 8 classes need at most 219,192 nodes (x 8 classes)
#: per profiled kind without pruning (sum over k of A(8, k) (9 - k)); pruning cuts most of them.
EXACT_NODE_BUDGET = 1_000_000
#: Candidates the local search evaluates per rule at most (each costs O(p); only large
#: clusters, with many classes to swap in, reach it).
LOCAL_SEARCH_EVALUATIONS = 30_000
#: Seeds (over all stage counts and kinds) that the local search improves.
LOCAL_SEARCH_STARTS = 3
#: Improvement passes of one local search at most (each pass tries every move once).
LOCAL_SEARCH_PASSES = 50
_INF = math.inf


@dataclass(frozen=True)
class BestBaseline:
    """A baseline's cut rule on its best device subset and order (see the module docstring)."""

    name: str
    stages: tuple[Stage, ...]
    iteration_s: float
    fits: bool
    search: str  # "exact" | "local search" | "none fits" (proved: the branch and bound finished)
    profile_kind: str = ""  # time-homogeneous: the kind whose times it balances
    note: str = ""


@dataclass(frozen=True)
class _Links:
    """Per class pair (a, b): the link from a card of a to the next card of b (a == b: two cards
    of one class; latency inf when the class has one card).  `kinds` are its distinct (latency,
    bandwidth) values, so the cheapest cut is found without scanning every pair."""

    latency_s: tuple[tuple[float, ...], ...]
    bandwidth_bytes_s: tuple[tuple[float, ...], ...]
    kinds: tuple[tuple[float, float], ...]

    def send2_s(self, a: int, b: int, cut_bytes: int) -> float:
        """2C of a cut carrying `cut_bytes` from class a to class b (as `Problem.comm_s` computes C)."""
        return 2.0 * (self.latency_s[a][b] + cut_bytes / self.bandwidth_bytes_s[a][b])

    def cheapest_send2_s(self, cut_bytes: int) -> float:
        return min(2.0 * (lat + cut_bytes / bw) for lat, bw in self.kinds)


def _links(problem: Problem, classes: Sequence[DeviceClass]) -> _Links:
    lat, bw = [], []
    for a in classes:
        lat_row, bw_row = [], []
        for b in classes:
            dst = b.members[1] if a is b and b.count > 1 else b.members[0]
            same = dst == a.members[0]  # one card cannot follow itself
            lat_row.append(_INF if same else problem.latency_s[a.members[0]][dst])
            bw_row.append(1.0 if same else problem.bandwidth_bytes_s[a.members[0]][dst])
        lat.append(tuple(lat_row))
        bw.append(tuple(bw_row))
    kinds = {(la, bb) for lr, br in zip(lat, bw) for la, bb in zip(lr, br) if la < _INF}
    return _Links(tuple(lat), tuple(bw), tuple(sorted(kinds)) or ((_INF, 1.0),))


@dataclass(frozen=True)
class _Tables:
    """One rule at p stages: F+B per position and class (inf: does not fit; recomputed forwards and the
    selective level's seconds included), each stage's levers (`Problem.recompute`), bytes per cut."""

    kind: str
    bounds: tuple[tuple[int, int], ...]  # [start, end) per stage
    work_s: tuple[tuple[float, ...], ...]
    levers: tuple[tuple[Stage, ...], ...]  # [s][c]: stage s on class c, its recompute units and selective level
    cut_bytes: tuple[int, ...]  # per cut s (after stage s), s < p - 1
    links: _Links

    @property
    def p(self) -> int:
        return len(self.bounds)


def _tables(problem: Problem, classes: Sequence[DeviceClass], links: _Links, name: str, p: int,
            kind: str) -> _Tables:
    bounds = tuple(rule_bounds(problem, name, p, profile_kind=kind))
    stages = [Stage(0, lo, hi - 1) for lo, hi in bounds]  # M_s reads only stage s and p
    work, levers = [], []
    plain = without_offload(problem)  # the baselines never offload; `check` re-derives them with `with_recompute`
    for s, (lo, hi) in enumerate(bounds):
        # A stage's recompute set, selective level, memory and time depend on the card only through its
        # kind and usable bytes (`choose_levers`), so each (kind, usable) is priced once.
        priced: dict[tuple[str, int], tuple[float, Stage]] = {}
        for c in classes:
            if (c.kind, c.usable_bytes) not in priced:
                stages[s] = choose_levers(plain, stages[:s] + [Stage(c.members[0], lo, hi - 1)] + stages[s + 1:], s)
                fits = stage_memory_bytes(problem, stages, s) <= c.usable_bytes
                time_s = (sum(problem.fwd_s[c.kind][lo:hi]) + sum(problem.bwd_s[c.kind][lo:hi])
                          + added_backward_s(problem, stages[s]))
                priced[c.kind, c.usable_bytes] = (time_s if fits else _INF, stages[s])
        work.append(tuple(priced[c.kind, c.usable_bytes][0] for c in classes))
        levers.append(tuple(priced[c.kind, c.usable_bytes][1] for c in classes))
    cuts = tuple(problem.boundary_bytes[hi - 1] for _, hi in bounds[:-1])
    return _Tables(kind, bounds, tuple(work), tuple(levers), cuts, links)


def _seq_time(tab: _Tables, seq: Sequence[int], microbatches: int) -> float:
    """T of a class sequence under `tab` (inf when a stage does not fit)."""
    total = peak = 0.0
    for s, c in enumerate(seq):
        w = tab.work_s[s][c]
        total, peak = total + w, max(peak, w)
        if s:
            link = tab.links.send2_s(seq[s - 1], c, tab.cut_bytes[s - 1])
            total, peak = total + link, max(peak, link)
    return total + (microbatches - 1) * peak


def _speed(problem: Problem) -> dict[str, float]:
    return {k: sum(problem.fwd_s[k]) + sum(problem.bwd_s[k]) for k in problem.fwd_s}


def _seed_orders(problem: Problem, max_p: int) -> list[list[list[int]]]:
    """Per stage count p (index p - 1): the device sequences a user would try (module docstring)."""
    work = _speed(problem)
    speed = sorted(range(len(problem.devices)), key=lambda d: work[problem.devices[d].kind])

    def grouped(devs: Sequence[int]) -> list[int]:
        nodes: dict[str, list[int]] = {}
        for d in devs:  # fastest first, so a node's position is that of its fastest card
            nodes.setdefault(problem.devices[d].node, []).append(d)
        return [d for ds in nodes.values() for d in ds]

    blocks = grouped(speed)
    return [[list(range(p)), grouped(speed[:p]), blocks[:p]] for p in range(1, max_p + 1)]


def _neighbours(seq: list[int], counts: Sequence[int], max_p: int) -> list[list[int]]:
    """Every sequence one move away: swap two positions, move a card elsewhere, replace one card by
    an unused one, drop a card, or insert an unused one (the stage count changes: the rule re-cuts)."""
    left = [n - seq.count(c) for c, n in enumerate(counts)]
    free = [c for c in range(len(counts)) if left[c] > 0]
    out = []
    for i in range(len(seq)):
        out += [seq[:i] + [seq[j]] + seq[i + 1:j] + [seq[i]] + seq[j + 1:]
                for j in range(i + 1, len(seq)) if seq[i] != seq[j]]
        out += [seq[:i] + [c] + seq[i + 1:] for c in free]
        if len(seq) > 1:
            rest = seq[:i] + seq[i + 1:]
            out.append(rest)
            out += [rest[:j] + [seq[i]] + rest[j:] for j in range(len(rest) + 1) if j != i]  # move card i to j
    if len(seq) < max_p:
        out += [seq[:i] + [c] + seq[i:] for i in range(len(seq) + 1) for c in free]
    return out


def _local_search(tables: dict[tuple[int, str], _Tables], kind: str, seq: list[int], counts: Sequence[int],
                  microbatches: int, evaluations: int) -> tuple[float, list[int]]:
    """First-improvement descent over `_neighbours` (tables by (stage count, profiled kind)),
    stopping after `evaluations` candidates."""
    max_p = max(p for p, _ in tables)
    best, left = _seq_time(tables[len(seq), kind], seq, microbatches), evaluations
    for _ in range(LOCAL_SEARCH_PASSES):
        for cand in _neighbours(seq, counts, max_p):
            left -= 1
            t = _seq_time(tables[len(cand), kind], cand, microbatches)
            if t < best:
                best, seq = t, cand
                break
            if left <= 0:
                return best, seq
        else:
            break
    return best, seq


class _BudgetSpent(Exception):
    """The branch and bound reached `EXACT_NODE_BUDGET`."""


class _BranchAndBound:
    """Exact minimum of `_seq_time` over class sequences with per-class counts, above an incumbent."""

    def __init__(self, counts: Sequence[int], microbatches: int, best_s: float, budget: int) -> None:
        self.counts, self.m, self.budget = list(counts), microbatches, budget
        self.best_s = best_s
        self.best: tuple[_Tables, list[int]] | None = None

    def run(self, tab: _Tables) -> None:
        p = tab.p
        min_work = [min(row) for row in tab.work_s]
        min_send = [tab.links.cheapest_send2_s(b) for b in tab.cut_bytes]
        if any(math.isinf(w) for w in min_work):
            return
        # suf_sum[s] / suf_max[s]: the cheapest terms of positions s.. and the links into them.
        suf_sum, suf_max = [0.0] * (p + 1), [0.0] * (p + 1)
        for s in reversed(range(p)):
            link = min_send[s - 1] if s else 0.0
            suf_sum[s] = suf_sum[s + 1] + min_work[s] + link
            suf_max[s] = max(suf_max[s + 1], min_work[s], link)
        self._visit(tab, [0] * p, 0, -1, 0.0, 0.0, suf_sum, suf_max)

    def _visit(self, tab: _Tables, seq: list[int], s: int, last: int, total: float, peak: float,
               suf_sum: list[float], suf_max: list[float]) -> None:
        self.budget -= len(self.counts)  # the work of one node: every class is looked at
        if self.budget < 0:
            raise _BudgetSpent
        if s == tab.p:
            if total + (self.m - 1) * peak < self.best_s:
                self.best_s, self.best = total + (self.m - 1) * peak, (tab, seq.copy())
            return
        options = []
        for c, left in enumerate(self.counts):
            link = tab.links.send2_s(last, c, tab.cut_bytes[s - 1]) if s else 0.0
            if left and tab.work_s[s][c] + link < _INF:
                options.append((tab.work_s[s][c] + link, c, max(peak, tab.work_s[s][c], link)))
        for step, c, new_peak in sorted(options):
            if total + step + suf_sum[s + 1] + (self.m - 1) * max(new_peak, suf_max[s + 1]) >= self.best_s:
                continue
            self.counts[c] -= 1
            seq[s] = c
            self._visit(tab, seq, s + 1, c, total + step, new_peak, suf_sum, suf_max)
            self.counts[c] += 1


def _placement(classes: Sequence[DeviceClass], tab: _Tables, seq: Sequence[int]) -> tuple[Stage, ...]:
    """Concrete devices for a class sequence: each class's members in id order."""
    taken = [0] * len(classes)
    stages = []
    for s, c in enumerate(seq):
        stages.append(replace(tab.levers[s][c], device=classes[c].members[taken[c]]))
        taken[c] += 1
    return tuple(stages)


def best_baseline(problem: Problem, name: str, *, node_budget: int = EXACT_NODE_BUDGET) -> BestBaseline:
    """Baseline `name`'s cut rule on its best device subset and order (see the module docstring)."""
    forced: BaselineResult = baseline(problem, name)  # also rejects an unknown name
    classes = device_classes(problem)
    class_of = {d: i for i, c in enumerate(classes) for d in c.members}
    counts = [c.count for c in classes]
    first = problem.devices[0].kind  # the forced rule's kind first: ties keep it
    kinds = [first] + sorted(set(problem.fwd_s) - {first}) if name == "time-homogeneous" else [first]
    links = _links(problem, classes)
    tables = {(p, k): _tables(problem, classes, links, name, p, k)
              for p in range(1, min(len(problem.devices), problem.num_units) + 1) for k in kinds}
    orders = _seed_orders(problem, max(p for p, _ in tables))
    seeds = []
    for t, ((p, kind), tab) in enumerate(tables.items()):
        for order in orders[p - 1]:
            seq = [class_of[d] for d in order]
            seeds.append((_seq_time(tab, seq, problem.microbatches), t, kind, seq))
    seeds.sort(key=lambda x: x[:2])
    best_s, best = _INF, None
    for _, _, kind, seq in seeds[:LOCAL_SEARCH_STARTS]:
        t, found = _local_search(tables, kind, seq, counts, problem.microbatches,
                                 LOCAL_SEARCH_EVALUATIONS // LOCAL_SEARCH_STARTS)
        if t < best_s:
            best_s, best = t, (tables[len(found), kind], found)
    bnb = _BranchAndBound(counts, problem.microbatches, best_s, node_budget)
    try:
        for tab in tables.values():
            bnb.run(tab)
        search = "exact"
    except _BudgetSpent:
        search = "local search"
    best = bnb.best or best
    if best is None and forced.fits:  # the local search's starts missed every fitting order; the forced one fits
        return BestBaseline(name, forced.stages, forced.iteration_s, True, search, "",
                            "every card in cluster order: the local search found no other fitting order")
    if best is None:  # proved only when the branch and bound finished
        return BestBaseline(name, forced.stages, forced.iteration_s, False,
                            "none fits" if search == "exact" else search, "",
                            forced.note + "; no device subset or order " +
                            ("fits either" if search == "exact" else "that the local search tried fits"))
    stages = _placement(classes, best[0], best[1])
    ev = evaluate(problem, stages)
    if forced.fits and forced.iteration_s < ev.iteration_s:
        # The search ranks placements by the H-1F1B estimate (total + (m - 1) x peak); under the
        # simulated schedule the forced placement, which the search includes, can still be faster.
        return BestBaseline(name, forced.stages, forced.iteration_s, True, search,
                            first if name == "time-homogeneous" else "",
                            "every card in cluster order: no subset or order found faster under the schedule")
    return BestBaseline(name, stages, ev.iteration_s, ev.fits, search,
                        best[0].kind if name == "time-homogeneous" else "")
