"""Optimizer-state sharding across replicas (ZeRO-1, uneven by free memory): the contract and its choice.

Issue 14's third lever, for replica plans with every-step (synchronous) sync.  A sync group g
(`cost_models.sync`: units [first, last] held by one card d_r in every replica r) may shard
the optimizer state of its units over its R holders: holder r keeps and steps the fraction
f_r of it, gradients are all-reduced (each holder keeps its slice: gloo has no uneven
reduce-scatter) and the updated weights all-gathered over the group's ring.  With O_g the group's optimizer-state bytes
(K Psi: Adam's two fp32 moments, and the fp32 master weights under bf16/fp16-mixed -- per
parameter the offload lever's ``host_bytes_per_param``, `cost_models.offload`) and a set S of
sharded groups (`cost_models.sharding` for the formulas and their sources):

    M0_d  = M_d - sum_{g in S held by d} O_g        (M_d: `problem.evaluate`'s stage memory)
    free_d = usable_d - M0_d;   f_r^g = free_{d_r} / sum_q free_{d_q}   (rule ``free``; ``even``: 1 / R)
    M'_d  = M0_d + sum_{g in S held by d} round(f^g_d O_g)
    S'_d  = S_d - sum_{g in S held by d} (1 - f^g_d) sum_{u in g} step_u   (the step is elementwise:
            a card steps only its slice; the kind's launch share stays)
    T'_r  = the replica's 1F1B schedule replayed with S'  (`problem.schedule_s`)
    t_g   = shard_sync_s(f^g, G_g, W_g = G_g) for g in S, the ring all-reduce otherwise
    T     = max_r T'_r + sum_g t_g                  (synchronous; DiLoCo's inner steps keep full state)

Tied parameters (GPT-2's wte = lm_head): a group whose units include every unit that uses one
(one-card replicas, or a stage holding both ends) holds all its aliases on one card per replica,
so its state shards with the group's (O_g counts it, the runtime appends it to the group's
flattened parameters); a tied parameter whose users are split over several groups keeps its
whole state on every copy (its copies sit on different ranks of a replica and sync in a bucket of
their own), and no O_g counts it (`group_optimizer_bytes`).  Which S the
planner takes is `choose_sharding`: the fitting S of least T, fewer groups on ties --
every subset while there are at most `SHARD_ENUM_MAX` shardable groups, else a greedy walk.

Example (two one-card replicas of a 1-unit model; the state only fits when sharded):
    >>> from hetpipe.partitioner.problem import DeviceSlot, Stage
    >>> from hetpipe.cost_models.offload import offload_rates
    >>> inf = float("inf")
    >>> base = Problem(fwd_s={"a": (1.0,)}, bwd_s={"a": (2.0,)}, state_bytes=(160,), activation_bytes=(0,),
    ...                boundary_bytes=(0,), devices=(DeviceSlot("d0", "a", "n", 150), DeviceSlot("d1", "a", "n", 120)),
    ...                bandwidth_bytes_s=((inf, 40.0), (40.0, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)),
    ...                microbatches=2, grad_bytes=(40,), offload_rates=offload_rates("adam", "fp32"))
    >>> rp = ReplicaProblem(base, grad_bytes=(40,), sharding="auto")
    >>> pipes = [((Stage(0, 0, 0),), 1), ((Stage(1, 0, 0),), 1)]
    >>> evaluate_sharding(rp, pipes, ()).fits   # 160 B each (80 of it Adam state): neither fits
    False
    >>> ev = choose_sharding(rp, pipes)           # free 150 - 80 and 120 - 80: f = 70/110, 40/110
    >>> [round(f, 3) for f in ev.shards[0].fractions], [c.memory_bytes for r in ev.evaluations for c in r.stages]
    ([0.636, 0.364], [131, 109])
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Collection, Sequence

from hetpipe.cost_models.sharding import SHARDING_MODES, even_fractions, shard_fractions, shard_sync_s
from hetpipe.cost_models.sync import SyncGroup, num_buckets
from hetpipe.partitioner.problem import Evaluation, Problem, Stage, evaluate, schedule_s
from hetpipe.partitioner.replica_types import GroupShard, ReplicaProblem, evaluate_sync, replica_problem

#: Shardable groups up to which `choose_sharding` tries every subset (2^10 cheap evaluations).
SHARD_ENUM_MAX = 10
#: Fraction rules: ``free`` (the planner's: by free memory), ``even`` (ZeRO-1's 1/R, for comparison).
SHARD_RULES = ("free", "even")

Pipelines = Sequence[tuple[Sequence[Stage], int]]  # per replica: its stages and its m_r


@dataclass(frozen=True)
class ShardedEvaluation:
    """A replica layout with sharded set S: each replica's evaluation (memory and step as sharded)."""

    evaluations: tuple[Evaluation, ...]
    sync: tuple[SyncGroup, ...]  # time_s of a sharded group is its shard time
    shards: tuple[GroupShard, ...]
    fits: bool

    @property
    def compute_s(self) -> float:
        return max(ev.iteration_s for ev in self.evaluations)

    @property
    def sync_s(self) -> float:
        return sum((g.time_s for g in self.sync), 0.0)

    @property
    def iteration_s(self) -> float:
        return self.compute_s + self.sync_s


def optimizer_bytes_per_unit(problem: Problem) -> tuple[int, ...]:
    """K Psi of each unit's own parameters, tied ones left out (0 without gradient bytes or rates).

    Example:
        >>> from hetpipe.cost_models.offload import offload_rates
        >>> p = Problem(fwd_s={"a": (1.0,)}, bwd_s={"a": (1.0,)}, state_bytes=(16,), activation_bytes=(0,),
        ...             boundary_bytes=(0,), devices=(), bandwidth_bytes_s=(), latency_s=(), microbatches=1,
        ...             grad_bytes=(4,), offload_rates=offload_rates("adam", "fp32"))
        >>> optimizer_bytes_per_unit(p)   # one fp32 parameter: Adam's two moments
        (8,)
    """
    rates = problem.offload_rates
    if rates is None or not problem.grad_bytes:
        return (0,) * problem.num_units
    out = [g // rates.grad_bytes_per_param * rates.host_bytes_per_param for g in problem.grad_bytes]
    for t in problem.tied:  # a tied parameter syncs in a bucket of its own and keeps its whole state
        out[t.owner_unit] -= t.state_bytes // rates.state_bytes_per_param * rates.host_bytes_per_param
    return tuple(max(0, o) for o in out)


def group_optimizer_bytes(problem: Problem, first_unit: int, last_unit: int) -> int:
    """O_g of the group of units [first_unit, last_unit]: its units' own K Psi, plus that of every tied
    parameter all of whose users the group holds (see the module docstring).

    Example (units 0-1 share one fp32 parameter, owned by unit 0; 1 own parameter each):
        >>> from hetpipe.cost_models.offload import offload_rates
        >>> from hetpipe.partitioner.problem import TiedCopy
        >>> p = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (1.0, 1.0)}, state_bytes=(32, 16),
        ...             activation_bytes=(0, 0), boundary_bytes=(0, 0), devices=(), bandwidth_bytes_s=(),
        ...             latency_s=(), microbatches=1, grad_bytes=(8, 4), tied=(TiedCopy(0, (0, 1), 16),),
        ...             offload_rates=offload_rates("adam", "fp32"))
        >>> optimizer_bytes_per_unit(p), group_optimizer_bytes(p, 0, 1), group_optimizer_bytes(p, 0, 0)
        ((8, 8), 24, 8)
    """
    opt = optimizer_bytes_per_unit(problem)
    own = sum(opt[first_unit:last_unit + 1])
    rates = problem.offload_rates
    if rates is None or not problem.grad_bytes:
        return own
    return own + sum(t.state_bytes // rates.state_bytes_per_param * rates.host_bytes_per_param for t in problem.tied
                     if first_unit <= min(t.user_units) and max(t.user_units) <= last_unit)


def relaxed_problem(problem: Problem) -> Problem:
    """`problem` with every unit's optimizer state taken off its state bytes: the pipelines the
    search tries for replicas that fit only once their state is sharded away."""
    opt = optimizer_bytes_per_unit(problem)
    return dataclasses.replace(problem, state_bytes=tuple(s - o for s, o in zip(problem.state_bytes, opt)),
                               offload="never")  # the state is gone already: offloading it would count twice


def shardable(rp: ReplicaProblem, sync: Sequence[SyncGroup], offloading: Collection[int] = ()) -> list[int]:
    """Groups that can shard: several holders, some optimizer state, no holder in `offloading` (devices
    whose stage keeps its optimizer state on the host: nothing of it is left on the card to shard)."""
    return [k for k, g in enumerate(sync) if len(g.devices) > 1
            and group_optimizer_bytes(rp.base, g.first_unit, g.last_unit) > 0 and not set(g.devices) & set(offloading)]


Unsharded = tuple[tuple[SyncGroup, ...], tuple[Evaluation, ...]]  # the sync groups and each replica's evaluation


def unsharded(rp: ReplicaProblem, pipes: Pipelines) -> Unsharded:
    """What every sharded set starts from (computed once per layout by `choose_sharding`)."""
    return (evaluate_sync(rp, [tuple(stages) for stages, _ in pipes]),
            tuple(evaluate(replica_problem(rp.base, m), tuple(stages)) for stages, m in pipes))


def evaluate_sharding(rp: ReplicaProblem, pipes: Pipelines, sharded: Collection[int], *,
                      rule: str = "free", start: Unsharded | None = None) -> ShardedEvaluation:
    """The contract above for the sharded groups `sharded` (indices into the sync groups); `start` is
    `unsharded(rp, pipes)` when the caller has it."""
    if rule not in SHARD_RULES:
        raise ValueError(f"shard rule {rule!r}; use one of {', '.join(SHARD_RULES)}")
    base = rp.base
    sync, evs = start if start is not None else unsharded(rp, pipes)
    if any(st.offload and st.device in sync[g].devices for stages, _ in pipes for st in stages for g in sharded):
        raise ValueError("a sharded sync group is held by a stage that offloads its optimizer state")
    where = {st.device: (r, k) for r, (stages, _) in enumerate(pipes) for k, st in enumerate(stages)}
    group_opt = {g: group_optimizer_bytes(base, sync[g].first_unit, sync[g].last_unit) for g in sharded}
    memory = {d: evs[r].stages[k].memory_bytes for d, (r, k) in where.items()}
    for g in sharded:
        for d in sync[g].devices:
            memory[d] -= group_opt[g]
    free = {d: base.devices[d].usable_bytes - memory[d] for d in memory}
    step = {d: evs[r].stages[k].step_s for d, (r, k) in where.items()}
    shards, groups, fits = [], list(sync), True
    for g in sorted(sharded):
        grp = sync[g]
        holders = [free[d] for d in grp.devices]
        if rule == "even":
            fr = even_fractions(len(holders))
        elif sum(max(0, f) for f in holders) > 0:
            fr = shard_fractions(holders)
        else:
            fr, fits = even_fractions(len(holders)), False  # no card has room: priced, but it cannot fit
        kept = [round(f * group_opt[g]) for f in fr]
        for d, f, keep in zip(grp.devices, fr, kept):
            memory[d] += keep
            kind = base.devices[d].kind
            if kind in base.step_s:
                step[d] -= (1.0 - f) * sum(base.step_s[kind][grp.first_unit:grp.last_unit + 1])
        t = shard_sync_s(fr, grad_bytes=grp.num_bytes, weight_bytes=grp.num_bytes,
                         bandwidth_bytes_s=grp.bandwidth_bytes_s, latency_s=grp.latency_s,
                         buckets=num_buckets(grp.num_bytes, rp.bucket_cap_bytes))
        shards.append(GroupShard(g, fr, group_opt[g], tuple(group_opt[g] - k for k in kept), t, grp.time_s))
        groups[g] = dataclasses.replace(grp, time_s=t)
    out = []
    for r, ((stages, m), ev) in enumerate(zip(pipes, evs)):
        costs = tuple(dataclasses.replace(c, memory_bytes=int(memory[st.device]), step_s=step[st.device])
                      for st, c in zip(stages, ev.stages))
        t_r = ev.iteration_s if ev.objective == "estimate" else schedule_s(costs, m)
        out.append(dataclasses.replace(ev, stages=costs, iteration_s=t_r))
    fits = fits and all(ev.fits for ev in out)
    return ShardedEvaluation(tuple(out), tuple(groups), tuple(shards), fits)


def _better(a: ShardedEvaluation | None, b: ShardedEvaluation) -> bool:
    """Whether `b` beats `a`: fits, then T (relative 1e-12), then fewer sharded groups."""
    if not b.fits:
        return False
    if a is None:
        return True
    if b.iteration_s < a.iteration_s * (1 - 1e-12):
        return True
    return b.iteration_s <= a.iteration_s * (1 + 1e-12) and len(b.shards) < len(a.shards)


def choose_sharding(rp: ReplicaProblem, pipes: Pipelines, *, mode: str | None = None,
                    rule: str = "free") -> ShardedEvaluation:
    """The sharded set for `pipes` under `mode` (`ReplicaProblem.sharding` by default): ``never``
    shards nothing, ``all`` every shardable group, ``auto`` the best fitting set (module docstring).

    Returns the unsharded evaluation (``fits`` False) when no set fits.
    """
    mode = rp.sharding if mode is None else mode
    if mode not in SHARDING_MODES:
        raise ValueError(f"sharding mode {mode!r}; use one of {', '.join(SHARDING_MODES)}")
    first = unsharded(rp, pipes)
    none = evaluate_sharding(rp, pipes, (), rule=rule, start=first)
    if mode == "never" or len(pipes) < 2:
        return none
    cands = shardable(rp, none.sync, [st.device for stages, _ in pipes for st in stages if st.offload])
    if mode == "all":
        return evaluate_sharding(rp, pipes, cands, rule=rule, start=first)
    best = none if none.fits else None
    if len(cands) <= SHARD_ENUM_MAX:
        for n in range(1, len(cands) + 1):
            for subset in itertools.combinations(cands, n):
                ev = evaluate_sharding(rp, pipes, subset, rule=rule, start=first)
                if _better(best, ev):
                    best = ev
        return best or none
    return _greedy(rp, pipes, cands, rule=rule, start=best, first=first) or none


def _greedy(rp: ReplicaProblem, pipes: Pipelines, cands: list[int], *, rule: str,
            start: ShardedEvaluation | None, first: Unsharded) -> ShardedEvaluation | None:
    """From no sharding (or all, when that does not fit), flip one group at a time while T improves."""
    chosen: set[int] = set() if start is not None else set(cands)
    best = start if start is not None else evaluate_sharding(rp, pipes, chosen, rule=rule, start=first)
    improved = True
    while improved:
        improved = False
        for g in cands:
            ev = evaluate_sharding(rp, pipes, chosen ^ {g}, rule=rule, start=first)
            if _better(best if best.fits else None, ev):
                best, chosen, improved = ev, chosen ^ {g}, True
    return best if best.fits else None
