"""Replica plans with optimizer-state sharding: record the choice, and re-check it from the plan.

`replica_evaluations` and `plan_shard` turn a solved `ReplicaSolution` into the plan's records
(each stage's memory and step as sharded, each sharded group's `PlanShard`);
`sharded_from_plan` re-derives the same figures from a plan's own tables for `check`
(`plan.replica_check`), with `shard_violations` listing every recorded figure that differs.

Example:
    >>> from hetpipe.partitioner.replica_types import GroupShard
    >>> plan_shard(GroupShard(0, (0.75, 0.25), 800, (200, 600), 3.0, 2.0))
    PlanShard(fractions=(0.75, 0.25), optimizer_bytes=800, saved_bytes=(200, 600), allreduce_s=2.0, rule='free')
"""

from __future__ import annotations

from typing import Sequence

from hetpipe.partitioner.problem import Evaluation, Problem, Stage, evaluate
from hetpipe.partitioner.replica_shard import ShardedEvaluation, evaluate_sharding
from hetpipe.partitioner.replica_types import GroupShard, ReplicaProblem, ReplicaSolution, replica_problem
from hetpipe.plan.check_report import close_to_recorded
from hetpipe.plan.shard_schema import PlanShard


def plan_shard(shard: GroupShard) -> PlanShard:
    """The plan record of one sharded group."""
    return PlanShard(shard.fractions, shard.optimizer_bytes, shard.saved_bytes, shard.allreduce_s)


def replica_evaluations(rp: ReplicaProblem, sol: ReplicaSolution) -> list[Evaluation]:
    """Each replica's evaluation as planned: with the sharded groups' memory and steps when it shards."""
    if not sol.shards:
        return [evaluate(replica_problem(rp.base, r.microbatches), r.stages) for r in sol.replicas]
    pipes = [(r.stages, r.microbatches) for r in sol.replicas]
    return list(evaluate_sharding(rp, pipes, [s.group for s in sol.shards]).evaluations)


def sharded_from_plan(problem: Problem, pipes: Sequence[tuple[Sequence[Stage], int]], *, grad_bytes: Sequence[int],
                      bucket_cap_bytes: int, sharded: Sequence[int], rule: str = "free") -> ShardedEvaluation:
    """The sharding contract re-evaluated from a plan's tables (`plan.replica_check`)."""
    rp = ReplicaProblem(problem, grad_bytes=tuple(grad_bytes), bucket_cap_bytes=bucket_cap_bytes)
    return evaluate_sharding(rp, pipes, sharded, rule=rule)


def shard_violations(recorded: Sequence[PlanShard | None], ev: ShardedEvaluation) -> list[str]:
    """Every recorded shard figure that differs from the re-evaluation (fractions, bytes, seconds)."""
    out = []
    want = {s.group: s for s in ev.shards}
    for k, rec in enumerate(recorded):
        if rec is None:
            continue
        got = want[k]
        if rec.rule not in ("free", "even"):
            out.append(f"sync.groups[{k}].shard.rule {rec.rule!r}: use free or even")
        same = (len(rec.fractions) == len(got.fractions) and rec.optimizer_bytes == got.optimizer_bytes
                and rec.saved_bytes == got.saved_bytes and close_to_recorded(rec.allreduce_s, got.allreduce_s)
                and all(close_to_recorded(a, b) for a, b in zip(rec.fractions, got.fractions)))
        if not same:
            out.append(f"sync.groups[{k}].shard {rec} != recomputed {plan_shard(got)}")
    if not ev.fits:
        out.append("the sharded replicas do not fit: a holder's memory with its shards exceeds its usable bytes")
    return out
