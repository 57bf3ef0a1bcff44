"""Recomputation re-chosen after optimizer-state sharding in replica plans (issue 14).

A replica's pipeline is solved on its own cards with the whole optimizer state (its recompute
prefixes chosen by `recompute.with_recompute` against that memory); sharding then frees
``M_d - M'_d`` bytes on every card holding a sharded group (`replica_shard`), so a shorter
prefix may fit, and a set S that costs sync time may pay for itself by the recompute it saves.
`shard_then_recompute` (``--recompute auto``, replica plans that shard) starts from
`choose_sharding`'s layout and, for its set S and (under ``--sharding auto``, as `choose_sharding`
does) every subset of the shardable groups, from the layout as solved and from every stage at the
shortest prefix that fits with the bytes S frees on its card (``M_d(r) - (M_d - M'_d) <= usable_d``,
the freed bytes held at S's fractions f); from the fastest start of each kind it then takes the best
single shorter prefix of one stage while T drops, every step evaluated by `evaluate_sharding` (f
re-derived from the new free memory, as `hetpipe check` re-derives it from the plan).  The fastest
layout that fits wins, `choose_sharding`'s own included, so it is never worse than sharding alone.
Not a joint search: f depends on every prefix through free memory (a stage that recomputes more
has more free memory and keeps a larger shard), so it is not proven optimal over every prefix
combination; tests/test_replica_recompute.py compares it with brute force over prefixes x sets.

Example (two one-card replicas recompute both units until sharding frees half of the Adam state):
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage
    >>> from hetpipe.partitioner.recompute import with_recompute
    >>> from hetpipe.cost_models.offload import offload_rates
    >>> inf = float("inf")
    >>> base = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (2.0, 2.0)}, state_bytes=(80, 80),
    ...                activation_bytes=(20, 20), boundary_bytes=(0, 0), recompute="auto",
    ...                devices=(DeviceSlot("d0", "a", "n", 180), DeviceSlot("d1", "a", "n", 180)),
    ...                bandwidth_bytes_s=((inf, 40.0), (40.0, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)),
    ...                microbatches=2, grad_bytes=(20, 20), offload_rates=offload_rates("adam", "fp32"))
    >>> rp = ReplicaProblem(base, grad_bytes=(20, 20), sharding="auto")
    >>> pipes = [(with_recompute(base, (Stage(d, 0, 1),)), 1) for d in (0, 1)]
    >>> [st.recompute_units for stages, _ in pipes for st in stages]   # 160 + 40 > 180 unsharded
    [(0, 1), (0, 1)]
    >>> after, ev = shard_then_recompute(rp, pipes)
    >>> [st.recompute_units for stages, _ in after for st in stages], ev.fits, len(ev.shards)
    ([(), ()], True, 1)
    >>> ev.iteration_s < choose_sharding(rp, pipes).iteration_s   # sharding alone: no shard, both recompute
    True
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

from hetpipe.partitioner.problem import Problem, Stage, evaluate, stage_memory_bytes
from hetpipe.partitioner.recompute import stage_order
from hetpipe.partitioner.replica_shard import (SHARD_ENUM_MAX, Pipelines, ShardedEvaluation, choose_sharding,
                                               evaluate_sharding, shardable)
from hetpipe.partitioner.replica_types import ReplicaProblem, replica_problem


def shorter_prefixes(rp: ReplicaProblem, pipes: Pipelines, sharded: ShardedEvaluation
                     ) -> list[tuple[tuple[Stage, ...], int]]:
    """Each stage's shortest recompute prefix that fits with the bytes `sharded` freed on its card."""
    out = []
    for (stages, m), ev in zip(pipes, sharded.evaluations):
        prob = replica_problem(rp.base, m)
        before = evaluate(prob, tuple(stages))
        new = list(stages)
        for k, st in enumerate(stages):
            freed = before.stages[k].memory_bytes - ev.stages[k].memory_bytes
            if rp.base.recompute != "auto" or st.offload or st.members or freed <= 0 or not st.recompute_units:
                continue
            new[k] = _shortest_fitting(prob, new, k, freed)
        out.append((tuple(new), m))
    return out


def _shortest_fitting(prob: Problem, stages: list[Stage], k: int, freed: int) -> Stage:
    """Stage k with the shortest prefix of its order whose M_k - freed fits (its current one if none shorter)."""
    st, usable = stages[k], prob.devices[stages[k].device].usable_bytes
    order = stage_order(prob, st)
    trial = list(stages)
    for r in range(len(st.recompute_units)):
        trial[k] = dataclasses.replace(st, recompute_units=tuple(sorted(order[:r])))
        if stage_memory_bytes(prob, trial, k) - freed <= usable:
            return trial[k]
    return st


def _sets(rp: ReplicaProblem, pipes: Pipelines, chosen: ShardedEvaluation) -> list[tuple[int, ...]]:
    """The sharded sets tried with shorter prefixes: `choose_sharding`'s own, and under ``auto`` every
    non-empty subset of the shardable groups up to `SHARD_ENUM_MAX` of them (else also all of them)."""
    cands = shardable(rp, chosen.sync, [st.device for stages, _ in pipes for st in stages if st.offload])
    sets = [tuple(s.group for s in chosen.shards)] if chosen.shards else []
    if rp.sharding == "all" or len(cands) > SHARD_ENUM_MAX:
        return sets + [tuple(cands)]
    return sets + [c for n in range(1, len(cands) + 1) for c in itertools.combinations(cands, n)]


def _faster(best: ShardedEvaluation | None, ev: ShardedEvaluation) -> bool:
    return ev.fits and (best is None or ev.iteration_s < best.iteration_s * (1 - 1e-12))


def shard_then_recompute(rp: ReplicaProblem, pipes: Pipelines
                         ) -> tuple[Sequence[tuple[Sequence[Stage], int]], ShardedEvaluation]:
    """`choose_sharding`, then the recompute prefixes sharding lets shrink (module docstring):
    (the pipelines, their sharded evaluation), the fastest that fits of every layout tried."""
    ev = choose_sharding(rp, pipes)
    recomputes = any(st.recompute_units for stages, _ in pipes for st in stages)
    if rp.base.recompute != "auto" or rp.sharding == "never" or len(pipes) < 2 or not recomputes:
        return pipes, ev
    starts: list[tuple[Sequence[tuple[Sequence[Stage], int]], ShardedEvaluation]] = [(pipes, ev)]
    for sharded in dict.fromkeys(_sets(rp, pipes, ev)):
        cur = evaluate_sharding(rp, pipes, sharded)
        if not cur.fits:
            continue
        shorter = shorter_prefixes(rp, pipes, cur)
        starts += [(pipes, cur), (shorter, evaluate_sharding(rp, shorter, sharded))]
    fitting = [x for x in starts if x[1].fits]
    if not fitting:
        return pipes, ev
    # the fastest start of each kind (as solved, and all prefixes shortened at once), then one stage at a time
    firsts = [min(fitting[i::2] or fitting, key=lambda x: x[1].iteration_s) for i in (0, 1)]
    done = [_one_at_a_time(rp, p, e) if e.shards else (p, e) for p, e in firsts]
    return min(done, key=lambda x: (x[1].iteration_s, len(x[1].shards)))


def _one_at_a_time(rp: ReplicaProblem, pipes: Sequence[tuple[Sequence[Stage], int]], ev: ShardedEvaluation
                   ) -> tuple[Sequence[tuple[Sequence[Stage], int]], ShardedEvaluation]:
    """From a layout, the best single shorter prefix of one stage, the fractions re-derived each time (a
    stage that recomputes less has less free memory, so it keeps a smaller shard), while T drops."""
    sharded = [s.group for s in ev.shards]
    while True:
        moves = []
        for r, k in ((r, k) for r, (stages, _) in enumerate(pipes) for k in range(len(stages))):
            st = pipes[r][0][k]
            order = stage_order(replica_problem(rp.base, pipes[r][1]), st) if st.recompute_units else ()
            for n in range(len(st.recompute_units)):
                stages = list(pipes[r][0])
                stages[k] = dataclasses.replace(st, recompute_units=tuple(sorted(order[:n])))
                trial = [(tuple(stages), m) if q == r else (s, m) for q, (s, m) in enumerate(pipes)]
                moves.append((trial, evaluate_sharding(rp, trial, sharded)))
        better = [mv for mv in moves if _faster(ev, mv[1])]
        if not better:
            return pipes, ev
        pipes, ev = min(better, key=lambda mv: mv[1].iteration_s)
