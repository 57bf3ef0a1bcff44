"""Mixed data parallelism: several pipeline replicas side by side (issue #6, planning half).

Model.  The cluster's devices are grouped into R replicas (a device may be in none).
Replica r runs its own 1F1B pipeline (any depth; one card is plain data parallelism) on
m_r >= 1 micro-batches of the captured size b, with sum_r m_r = M = global_batch / b
(uneven batches are uneven m_r).  Its time T_r and stage memory are `problem.evaluate`
of its stages with m_r micro-batches.  Gradient sync is `cost_models.sync.sync_groups`
(ring all-reduce per group of units held by the same devices).  The objective is

    T = max_r T_r + T_sync / H          (H = 1 for synchronous sync; cost_formulas.md §3.3)

Search space.  Each replica runs the pipeline minimising its own T_r (`dp.solve_exact`
or `solve.solve` on its device group with m_r micro-batches); the solvers choose the
grouping and the split (m_r).  "Exact" means exact over groupings and splits with those
pipelines: a slower pipeline chosen only to cheapen the sync is not searched.

* `solve_replicas_exact`: every set partition of the devices (one block may be left
  out) x every split of M into R positive parts.  Tiny instances only.
* `solve_replicas`: seeds (one pipeline, one replica per node, per node and kind, per
  device), each split by water-filling (the next micro-batch goes to the replica whose
  T_r grows least: optimal for max_r T_r since every T_r is non-decreasing in m_r), then
  local search (move a device to another replica, a new one or none; merge two replicas)
  under a time limit.  Its bound is the work bound M / sum_d 1 / w_d (w_d: the whole
  model's forward + backward per micro-batch on device d), so a gap is always stated.

Example:
    >>> from hetpipe.partitioner.problem import DeviceSlot
    >>> inf = float("inf")
    >>> base = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (2.0, 2.0)}, state_bytes=(1, 1),
    ...                activation_bytes=(1, 1), boundary_bytes=(1, 0),
    ...                devices=(DeviceSlot("d0", "a", "n", 100), DeviceSlot("d1", "a", "n", 100)),
    ...                bandwidth_bytes_s=((inf, 10.0), (10.0, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)),
    ...                microbatches=4)
    >>> rp = ReplicaProblem(base, grad_bytes=(10, 10))
    >>> sol = solve_replicas_exact(rp)
    >>> [r.microbatches for r in sol.replicas], sol.compute_s, sol.sync_s   # 2 x DP: 2 x 6 s + 2 s sync
    ([2, 2], 12.0, 2.0)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from hetpipe.cost_models.sync import (
    SYNC_BUDGET_FRACTION,
    SyncGroup,
    SyncPolicy,
    check_policy,
    choose_policy,
    outer_steps_for,
)
from hetpipe.errors import ConfigError, InfeasibleError
from hetpipe.partitioner.solvers.dp import StateSpaceTooLarge, solve_exact
from hetpipe.partitioner.solvers.offload_walk import tail_walk
from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage, evaluate
from hetpipe.partitioner.recompute import with_recompute
from hetpipe.partitioner.replica_recompute import shard_then_recompute
from hetpipe.partitioner.replica_shard import relaxed_problem
from hetpipe.partitioner.replica_types import (  # the data types live apart; re-exported here
    GroupShard,
    Replica,
    ReplicaProblem,
    ReplicaSolution,
    evaluate_sync,
    replica_problem,
    sub_problem,
    work_lower_bound,
)

log = logging.getLogger(__name__)

#: Set partitions x splits above which `solve_replicas_exact` refuses (about a minute on 2 cores).
EXACT_MAX_CANDIDATES = 200_000
#: Replicas up to this size are tried in every two-way split by the local search (2^7 - 1 splits).
SPLIT_ALL_MAX = 8
Groups = tuple[tuple[int, ...], ...]


class PipelineCache:
    """Best pipeline of each (device group, m) - solved once.  `exact` uses `dp.solve_exact` only."""

    def __init__(self, base: Problem, *, exact: bool, time_limit_s: float = 5.0, seed: int = 0,
                 sharding: bool = False) -> None:
        self.base, self.exact, self.time_limit_s, self.seed = base, exact, time_limit_s, seed
        self._memo: dict[tuple[tuple[int, ...], int], tuple[tuple[Stage, ...], float] | None] = {}
        # With optimizer-state sharding: the same search with the state taken off (`relaxed_problem`).
        self.relaxed = PipelineCache(relaxed_problem(base), exact=exact, time_limit_s=time_limit_s,
                                     seed=seed) if sharding else None

    def best(self, group: tuple[int, ...], m: int) -> tuple[tuple[Stage, ...], float] | None:
        """(stages in base indices, T_r) of the best pipeline on `group` with m micro-batches, or None
        (with sharding: the relaxed one where none fits with the whole state)."""
        key = (group, m)
        if key not in self._memo:
            self._memo[key] = self._solve(group, m)
        if self._memo[key] is None and self.relaxed is not None:
            return self.relaxed.best(group, m)
        return self._memo[key]

    def fitting(self, group: tuple[int, ...], m: int) -> tuple[tuple[Stage, ...], float] | None:
        """The best pipeline that fits with its whole optimizer state (no relaxed fallback)."""
        self.best(group, m)
        return self._memo[(group, m)]

    def options(self, group: tuple[int, ...], m: int) -> list[tuple[tuple[Stage, ...], float]]:
        """The pipelines a sharded layout tries on `group`: the best fitting one and the relaxed one."""
        found = [self.best(group, m)] + ([self.relaxed.best(group, m)] if self.relaxed is not None else [])
        return list(dict.fromkeys(f for f in found if f is not None))

    def _solve(self, group: tuple[int, ...], m: int) -> tuple[tuple[Stage, ...], float] | None:
        sub = sub_problem(self.base, group, m)
        if len(group) == 1:  # one card holds the whole model: plain data parallelism (its recompute choice)
            whole = with_recompute(sub, (Stage(0, 0, sub.num_units - 1),))
            local: tuple[Stage, ...] | None = whole if evaluate(sub, whole).fits else None
        elif self.exact:
            try:  # the offload lever's exact outer walk around the DP (the DP alone without offload)
                res = tail_walk(sub, lambda p, _: solve_exact(p, time_limit_s=math.inf))
            except StateSpaceTooLarge as err:
                raise ConfigError(f"the exact replica reference is too large for {len(group)} devices ({err}); "
                                  "use solver='search'") from None
            local = None if res is None else res.stages
        else:
            from hetpipe.partitioner.solvers.solve import solve

            try:
                local = solve(sub, time_limit_s=self.time_limit_s, seed=self.seed).stages
            except InfeasibleError:
                local = None
        if local is None:
            return None
        stages = tuple(Stage(group[st.device], st.first_unit, st.last_unit, st.recompute_units, st.offload)
                       for st in local)
        return stages, evaluate(replica_problem(self.base, m), stages).iteration_s


@dataclass(frozen=True)
class Scorer:
    """T as a function of (max_r T_r, T_sync) under `policy` (auto-H for diloco without `outer_steps`)."""

    policy: str
    outer_steps: int | None = None
    budget_fraction: float = SYNC_BUDGET_FRACTION

    def __call__(self, compute_s: float, sync_s: float) -> tuple[float, int]:
        if self.policy == "synchronous":
            return compute_s + sync_s, 1
        h = self.outer_steps or outer_steps_for(compute_s=compute_s, sync_s=sync_s,
                                                budget_fraction=self.budget_fraction)
        return compute_s + sync_s / h, h


def scorer_for(policy: str, *, outer_steps: int | None = None,
               budget_fraction: float = SYNC_BUDGET_FRACTION) -> Scorer:
    """The `Scorer` of `policy`."""
    return Scorer(policy, outer_steps, budget_fraction)


@dataclass(frozen=True)
class _Candidate:
    """A scored grouping + split (internal to the search)."""

    iteration_s: float
    compute_s: float
    sync_s: float
    groups: Groups
    replicas: tuple[Replica, ...]
    sync: tuple[SyncGroup, ...]
    shards: tuple[GroupShard, ...] = ()


def _score(rp: ReplicaProblem, cache: PipelineCache, groups: Groups, split: Sequence[int],
           scorer: Scorer) -> _Candidate | None:
    if rp.sharding != "never" and scorer.policy == "synchronous" and len(groups) > 1:
        return _score_sharded(rp, cache, groups, split, scorer)
    reps = []
    for g, m in zip(groups, split):
        best = cache.fitting(g, m)
        if best is None:
            return None
        reps.append(Replica(best[0], m, best[1]))
    sync = evaluate_sync(rp, [r.stages for r in reps])
    compute = max(r.iteration_s for r in reps)
    sync_s = sum((s.time_s for s in sync), 0.0)
    return _Candidate(scorer(compute, sync_s)[0], compute, sync_s, groups, tuple(reps), sync)


def _score_sharded(rp: ReplicaProblem, cache: PipelineCache, groups: Groups, split: Sequence[int],
                   scorer: Scorer) -> _Candidate | None:
    """Every replica's pipeline options (`PipelineCache.options`) x `choose_sharding`: the best that fits."""
    options = [cache.options(g, m) for g, m in zip(groups, split)]
    best: _Candidate | None = None
    for pick in itertools.product(*options):
        pipes = [(stages, m) for (stages, _), m in zip(pick, split)]
        pipes, ev = shard_then_recompute(rp, pipes)  # sharding, then the recompute it makes unnecessary
        if not ev.fits:
            continue
        reps = tuple(Replica(tuple(stages), m, e.iteration_s) for (stages, m), e in zip(pipes, ev.evaluations))
        t = scorer(ev.compute_s, ev.sync_s)[0]
        if best is None or t < best.iteration_s * (1 - 1e-12):
            best = _Candidate(t, ev.compute_s, ev.sync_s, groups, reps, ev.sync, ev.shards)
    return best


def water_fill(cache: PipelineCache, groups: Groups, total: int) -> tuple[int, ...] | None:
    """Split `total` micro-batches (>= 1 each) minimising max_r T_r; None if some group cannot run."""
    if total < len(groups):
        return None
    split = [1] * len(groups)
    nxt = []
    for g in groups:
        if cache.best(g, 1) is None:
            return None
        nxt.append(cache.best(g, 2))
    for _ in range(total - len(groups)):
        options = [(b[1], r) for r, b in enumerate(nxt) if b is not None]
        if not options:
            return None
        _, r = min(options)
        split[r] += 1
        nxt[r] = cache.best(groups[r], split[r] + 1)
    return tuple(split)


def set_partitions(items: Sequence[int]) -> Iterator[list[list[int]]]:
    """Every partition of `items` into non-empty blocks.

    Example:
        >>> sorted(len(p) for p in set_partitions([0, 1, 2]))
        [1, 2, 2, 2, 3]
    """
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [[first]] + part
        for i in range(len(part)):
            yield part[:i] + [[first] + part[i]] + part[i + 1:]


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every split of `total` into `parts` positive integers (in order)."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def _exact_groupings(n: int) -> Iterator[Groups]:
    """Groupings of devices 0..n-1; the block holding the sentinel n is left out."""
    for part in set_partitions(list(range(n + 1))):
        yield tuple(tuple(b) for b in part if n not in b)


def _finish(rp: ReplicaProblem, best: _Candidate, *, policy: SyncPolicy, solver: str, status: str,
            bound_s: float, start: float) -> ReplicaSolution:
    used = {st.device for r in best.replicas for st in r.stages}
    unused = tuple(i for i in range(len(rp.base.devices)) if i not in used)
    total = best.compute_s + policy.amortised_s
    return ReplicaSolution(best.replicas, best.sync, policy, best.compute_s, best.sync_s, total, solver, status,
                           min(bound_s, total), time.perf_counter() - start, unused, best.shards)


def _check_problem(rp: ReplicaProblem) -> None:
    if not rp.base.devices:
        raise ConfigError("the cluster has no devices; add at least one device to the cluster file")
    if len(rp.grad_bytes) != rp.base.num_units:
        raise ConfigError(f"grad_bytes lists {len(rp.grad_bytes)} units, the problem has {rp.base.num_units}")


def solve_replicas_exact(rp: ReplicaProblem, *, policy: str = "synchronous", outer_steps: int | None = None,
                         budget_fraction: float = SYNC_BUDGET_FRACTION) -> ReplicaSolution:
    """Reference: best grouping x split by enumeration, each replica's pipeline by the exact DP."""
    start = time.perf_counter()
    _check_problem(rp)
    check_policy(policy, outer_steps=outer_steps, budget_fraction=budget_fraction)
    n, total = len(rp.base.devices), rp.base.microbatches
    groupings = [g for g in _exact_groupings(n) if 0 < len(g) <= total]
    count = sum(math.comb(total - 1, len(g) - 1) for g in groupings)
    if count > EXACT_MAX_CANDIDATES:
        raise ConfigError(f"the exact replica reference would try {count:,} groupings x splits "
                          f"(limit {EXACT_MAX_CANDIDATES:,}); use solver='search'")
    cache = PipelineCache(rp.base, exact=True, sharding=rp.sharding != "never")
    found = {kind: _best_over(rp, cache, groupings, splits=lambda g: compositions(total, len(g)),
                              scorer=scorer_for(kind, outer_steps=outer_steps, budget_fraction=budget_fraction))
             for kind in _kinds(policy)}
    best, pol = _pick(found, policy, outer_steps=outer_steps, budget_fraction=budget_fraction)
    if best is None:
        raise _infeasible(rp)
    return _finish(rp, best, policy=pol, solver="replicas-exact", status="OPTIMAL", bound_s=math.inf, start=start)


def _kinds(policy: str) -> list[str]:
    """Objectives to solve: both for ``auto`` (then `_pick` decides), else the forced one."""
    return ["synchronous", "diloco"] if policy == "auto" else [policy]


def _best_over(rp: ReplicaProblem, cache: PipelineCache, groupings: Sequence[Groups], *,
               splits: Callable[[Groups], Iterator[tuple[int, ...]]], scorer: Scorer) -> _Candidate | None:
    """Best candidate over `groupings` x `splits` under `scorer`."""
    best: _Candidate | None = None
    for groups in groupings:
        for split in splits(groups):
            cand = _score(rp, cache, groups, split, scorer)
            if cand is not None and (best is None or cand.iteration_s < best.iteration_s):
                best = cand
    return best


def _pick(found: dict[str, _Candidate | None], policy: str, *, outer_steps: int | None,
          budget_fraction: float) -> tuple[_Candidate | None, SyncPolicy]:
    """The chosen candidate and its recorded policy.

    For ``auto``, DiLoCo replaces synchronous training only when its best plan is faster
    than the best every-step-synchronous plan by more than `budget_fraction` (the speed
    worth giving up the exact large-batch update for, see `cost_models.sync`).
    """
    sync, local = found.get("synchronous"), found.get("diloco")
    if policy != "auto":
        best = sync if policy == "synchronous" else local
        if best is None:
            return None, SyncPolicy(policy, 1, 0.0, "infeasible")
        return best, choose_policy(compute_s=best.compute_s, sync_s=best.sync_s, policy=policy,
                                   outer_steps=outer_steps, budget_fraction=budget_fraction)
    if sync is None or local is None:
        best = sync or local
        if best is None:
            return None, SyncPolicy("synchronous", 1, 0.0, "infeasible")
        return best, choose_policy(compute_s=best.compute_s, sync_s=best.sync_s, budget_fraction=budget_fraction)
    if local.iteration_s * (1 + budget_fraction) >= sync.iteration_s:
        pol = choose_policy(compute_s=sync.compute_s, sync_s=sync.sync_s, budget_fraction=budget_fraction)
        if pol.policy == "synchronous":
            if local.iteration_s < sync.iteration_s * (1 - 1e-9):
                pol = dataclasses.replace(pol, reason=f"{pol.reason}; local steps (DiLoCo) would predict "
                                          f"{local.iteration_s:.4g} s vs {sync.iteration_s:.4g} s, less than "
                                          f"{budget_fraction:.0%} faster, so exact every-step sync is kept")
            return sync, pol
        why = (f"every-step sync takes {sync.sync_s / sync.compute_s:.0%} of compute, over the "
               f"{budget_fraction:.0%} budget, but local steps (DiLoCo) would predict {local.iteration_s:.4g} s "
               f"vs {sync.iteration_s:.4g} s, less than {budget_fraction:.0%} faster, so exact sync is kept")
        return sync, SyncPolicy("synchronous", 1, sync.sync_s, why)
    pol = choose_policy(compute_s=local.compute_s, sync_s=local.sync_s, policy="diloco",
                        outer_steps=outer_steps, budget_fraction=budget_fraction)
    why = f"{pol.reason}; {sync.iteration_s / local.iteration_s:.2f}x faster than the best every-step-sync plan"
    return local, dataclasses.replace(pol, reason=why)


def canon_groups(groups: Sequence[Sequence[int]]) -> Groups:
    """Sorted groups of sorted device indices, empty ones dropped: one key per grouping.

    Example:
        >>> canon_groups([[3, 1], [], [0]])
        ((0,), (1, 3))
    """
    return tuple(sorted(tuple(sorted(g)) for g in groups if g))


def seed_groupings(base: Problem, fits_alone: Callable[[int], bool]) -> list[Groups]:
    """Starting points: one pipeline; a replica per node; per node and kind; plain data parallelism.

    Data parallelism seeds use the k fastest cards that hold the model alone (k <= M), and
    each node's such cards (a node's ring avoids the slow links between nodes).
    """
    n = len(base.devices)
    by_node: dict[str, list[int]] = {}
    by_class: dict[tuple[str, str], list[int]] = {}
    for i, d in enumerate(base.devices):
        by_node.setdefault(d.node, []).append(i)
        by_class.setdefault((d.node, d.kind), []).append(i)
    work = {k: sum(base.fwd_s[k]) + sum(base.bwd_s[k]) for k in base.fwd_s}
    speed = sorted(range(n), key=lambda i: work[base.devices[i].kind])
    seeds = [canon_groups([list(range(n))]), canon_groups(list(by_node.values())),
             canon_groups(list(by_class.values()))]
    alone = [i for i in speed if fits_alone(i)]
    seeds += [canon_groups([[i] for i in alone[:k]]) for k in range(min(len(alone), base.microbatches), 0, -1)]
    for node in by_node.values():
        seeds.append(canon_groups([[i] for i in alone if i in node][: base.microbatches]))
    return list(dict.fromkeys(seeds))


def _splits(group: tuple[int, ...], devices: Sequence[DeviceSlot]) -> Iterator[tuple[list[int], list[int]]]:
    """Two-way splits of a replica: every one up to `SPLIT_ALL_MAX` devices, else by node and by kind."""
    if len(group) <= SPLIT_ALL_MAX:
        first, rest = group[0], group[1:]
        for mask in range(2 ** len(rest) - 1):
            a = [first] + [d for k, d in enumerate(rest) if mask >> k & 1]
            yield a, [d for d in group if d not in a]
        return
    for key in (lambda d: devices[d].node, lambda d: devices[d].kind):
        for value in dict.fromkeys(key(d) for d in group):
            a = [d for d in group if key(d) == value]
            if len(a) < len(group):
                yield a, [d for d in group if key(d) != value]


def _neighbours(groups: Groups, devices: Sequence[DeviceSlot]) -> Iterator[Groups]:
    """Move one device (to another replica, a new one, or none; or back in), merge, split or swap."""
    n = len(devices)
    used = {d for g in groups for d in g}
    for d in range(n):
        src = next((k for k, g in enumerate(groups) if d in g), None)
        rest = [[x for x in g if x != d] for g in groups]
        targets = [k for k in range(len(groups)) if k != src]
        for k in targets:
            yield canon_groups([g + [d] if j == k else g for j, g in enumerate(rest)])
        if src is None or len(groups[src]) > 1:
            yield canon_groups(rest + [[d]])
        if d in used and len(used) > 1:
            yield canon_groups(rest)
    for a, b in itertools.combinations(range(len(groups)), 2):
        others = [list(g) for k, g in enumerate(groups) if k not in (a, b)]
        yield canon_groups(others + [list(groups[a] + groups[b])])
        for x, y in itertools.product(groups[a], groups[b]):
            if devices[x] != devices[y]:
                yield canon_groups(others + [[d for d in groups[a] if d != x] + [y],
                                             [d for d in groups[b] if d != y] + [x]])
    for k, g in enumerate(groups):
        for a, b in _splits(g, devices):
            yield canon_groups([list(h) for j, h in enumerate(groups) if j != k] + [a, b])


class GroupingSearch:
    """Seeds + water-filling + first-improvement local search under a deadline."""

    def __init__(self, rp: ReplicaProblem, cache: PipelineCache, scorer: Scorer, deadline: float) -> None:
        self.rp, self.cache, self.scorer, self.deadline = rp, cache, scorer, deadline
        self.seen: dict[Groups, _Candidate | None] = {}

    def score(self, groups: Groups) -> _Candidate | None:
        if groups not in self.seen:
            total = self.rp.base.microbatches
            split = (total,) if len(groups) == 1 else water_fill(self.cache, groups, total)
            self.seen[groups] = None if split is None else _score(self.rp, self.cache, groups, split, self.scorer)
        return self.seen[groups]

    def run(self) -> _Candidate | None:
        """Local search from every seed, best first, until the deadline; the best result."""
        groupings = seed_groupings(self.rp.base, lambda d: self.cache.best((d,), 1) is not None)
        seeds = [c for c in (self.score(g) for g in groupings if g) if c is not None]
        best: _Candidate | None = None
        for start in sorted(seeds, key=lambda c: c.iteration_s):
            cand = self.descend(start)
            if best is None or cand.iteration_s < best.iteration_s:
                best = cand
        return best

    def descend(self, best: _Candidate) -> _Candidate:
        """First-improvement descent over `_neighbours` until none improves or the deadline."""
        improved = True
        while improved and time.perf_counter() < self.deadline:
            improved = False
            for groups in _neighbours(best.groups, self.rp.base.devices):
                if time.perf_counter() >= self.deadline:
                    log.info("replica search stopped at its time limit")
                    break
                cand = self.score(groups)
                if cand is not None and cand.iteration_s < best.iteration_s * (1 - 1e-9):
                    best, improved = cand, True
                    break
        return best


def solve_replicas(rp: ReplicaProblem, *, policy: str = "auto", outer_steps: int | None = None,
                   budget_fraction: float = SYNC_BUDGET_FRACTION, time_limit_s: float = 30.0,
                   seed: int = 0) -> ReplicaSolution:
    """Scalable replica planner (module docstring); raises `InfeasibleError` when nothing fits."""
    start = time.perf_counter()
    _check_problem(rp)
    check_policy(policy, outer_steps=outer_steps, budget_fraction=budget_fraction)
    cache = PipelineCache(rp.base, exact=False, time_limit_s=max(1.0, min(5.0, time_limit_s / 6)), seed=seed,
                          sharding=rp.sharding != "never")
    kinds = _kinds(policy)
    found: dict[str, _Candidate | None] = {}
    for i, kind in enumerate(kinds):
        deadline = start + time_limit_s * (i + 1) / len(kinds)
        scorer = scorer_for(kind, outer_steps=outer_steps, budget_fraction=budget_fraction)
        found[kind] = GroupingSearch(rp, cache, scorer, deadline).run()
    best, pol = _pick(found, policy, outer_steps=outer_steps, budget_fraction=budget_fraction)
    if best is None:
        raise _infeasible(rp)
    bound = work_lower_bound(rp.base)
    total = best.compute_s + pol.amortised_s
    status = "OPTIMAL" if bound >= total * (1 - 1e-9) else "FEASIBLE"
    return _finish(rp, best, policy=pol, solver="replicas-search", status=status, bound_s=bound, start=start)


def _infeasible(rp: ReplicaProblem) -> InfeasibleError:
    from hetpipe.partitioner.solvers.infeasible import explain_infeasible

    return explain_infeasible(rp.base)
