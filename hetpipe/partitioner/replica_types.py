"""The replica problem's data: the input (`ReplicaProblem`), a solution, and how one is evaluated.

Kept apart from the search (`partitioner.replicas`) so that re-checking a replica plan
(`plan.replica_check`) evaluates replicas without importing the solvers.

Example:
    >>> from hetpipe.partitioner.problem import DeviceSlot
    >>> inf = float("inf")
    >>> base = Problem(fwd_s={"a": (1.0,)}, bwd_s={"a": (2.0,)}, state_bytes=(1,), activation_bytes=(1,),
    ...                boundary_bytes=(0,), devices=(DeviceSlot("d0", "a", "n", 100), DeviceSlot("d1", "a", "n", 100)),
    ...                bandwidth_bytes_s=((inf, 10.0), (10.0, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)),
    ...                microbatches=4)
    >>> work_lower_bound(base)  # 4 micro-batches over two devices doing 3 s each
    6.0
    >>> [d.id for d in sub_problem(base, [1], 2).devices]
    ['d1']
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from hetpipe.cost_models.sync import BUCKET_CAP_BYTES, SyncGroup, SyncPolicy, sync_groups
from hetpipe.partitioner.problem import Problem, Stage


@dataclass(frozen=True)
class ReplicaProblem:
    """`base` covers every device with `base.microbatches` = M in all; `grad_bytes[u]` are synced per step."""

    base: Problem
    grad_bytes: tuple[int, ...]
    bucket_cap_bytes: int = BUCKET_CAP_BYTES  # the runtime's gradient all-reduce part size
    # Optimizer-state sharding across replicas (`partitioner.replica_shard`): never | auto | all.
    sharding: str = "never"


@dataclass(frozen=True)
class Replica:
    """One pipeline replica: its stages (device indices into the base problem) and its m_r."""

    stages: tuple[Stage, ...]
    microbatches: int
    iteration_s: float  # T_r


@dataclass(frozen=True)
class GroupShard:
    """One sharded sync group: fractions per replica, bytes each holder saves, seconds paid."""

    group: int  # index into the sync groups
    fractions: tuple[float, ...]  # f_r, replica order (the group's `devices` order)
    optimizer_bytes: int  # O_g
    saved_bytes: tuple[int, ...]  # O_g - round(f_r O_g) per holder
    time_s: float  # the all-reduce and then the slices' all-gather (`cost_models.sharding.shard_sync_s`)
    allreduce_s: float  # the all-reduce it replaces: time_s - allreduce_s is what sharding pays


@dataclass(frozen=True)
class ReplicaSolution:
    """A replica plan and how it was found."""

    replicas: tuple[Replica, ...]
    sync: tuple[SyncGroup, ...]
    policy: SyncPolicy
    compute_s: float  # max_r T_r
    sync_s: float  # one full exchange, sum of the groups
    iteration_s: float  # compute_s + sync_s / H
    solver: str  # replicas-exact | replicas-search
    status: str  # OPTIMAL (within the search space) | FEASIBLE
    bound_s: float
    wall_s: float
    unused_devices: tuple[int, ...]
    shards: tuple[GroupShard, ...] = ()  # the sharded sync groups (`partitioner.replica_shard`)


def replica_problem(base: Problem, microbatches: int) -> Problem:
    """`base` with m_r micro-batches: the problem a replica's stages are evaluated on."""
    return dataclasses.replace(base, microbatches=microbatches)


def sub_problem(base: Problem, group: Sequence[int], microbatches: int) -> Problem:
    """`base` restricted to the devices in `group` (indices renumbered 0..len-1)."""
    return dataclasses.replace(
        base,
        devices=tuple(base.devices[i] for i in group),
        bandwidth_bytes_s=tuple(tuple(base.bandwidth_bytes_s[i][j] for j in group) for i in group),
        latency_s=tuple(tuple(base.latency_s[i][j] for j in group) for i in group),
        microbatches=microbatches,
    )


def evaluate_sync(rp: ReplicaProblem, pipelines: Sequence[Sequence[Stage]]) -> tuple[SyncGroup, ...]:
    """Sync groups of replicas running `pipelines` (see `cost_models.sync`)."""
    return sync_groups([[(st.device, st.first_unit, st.last_unit) for st in p] for p in pipelines],
                       grad_bytes=rp.grad_bytes, bandwidth_bytes_s=rp.base.bandwidth_bytes_s,
                       latency_s=rp.base.latency_s, bucket_cap_bytes=rp.bucket_cap_bytes)


def work_lower_bound(base: Problem) -> float:
    """M / sum_d 1/w_d: no plan processes M micro-batches faster than every device at full speed."""
    rate = sum(1.0 / sum(base.fwd_s[d.kind][u] + base.bwd_s[d.kind][u] for u in range(base.num_units))
               for d in base.devices)
    return base.microbatches / rate
