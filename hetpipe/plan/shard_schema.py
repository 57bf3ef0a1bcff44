"""The plan record of a sharded sync group (plan version 5; issue 14's sharding lever).

Kept apart from `plan.schema` (which only names it) so the schema stays one readable file.
A `PlanSyncGroup` with a `PlanShard` shards its units' optimizer state over its holders
(`hetpipe.partitioner.replica_shard`): holder r keeps the fraction ``fractions[r]`` of the
``optimizer_bytes`` (its card saves ``saved_bytes[r]``), and the group's ``time_s`` is what
runs: the gradients' all-reduce, then the all-gather of the updated slices
(`cost_models.sharding.shard_sync_s`); ``time_s - allreduce_s`` is what sharding pays on the wire.

Example:
    >>> s = PlanShard(fractions=(0.7, 0.3), optimizer_bytes=1000, saved_bytes=(300, 700), allreduce_s=1.0)
    >>> s.rule
    'free'
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlanShard:
    """How one sync group shards its optimizer state (module docstring)."""

    fractions: tuple[float, ...]  # f_r per replica, in the group's `devices` order; sum 1
    optimizer_bytes: int  # O_g: the group's units' optimizer state (moments, fp32 master weights)
    saved_bytes: tuple[int, ...]  # per holder: O_g - round(f_r O_g) off its card
    allreduce_s: float  # the gradient all-reduce it replaces
    rule: str = "free"  # free: f_r by each holder's free memory; even: 1 / R
