"""Gradient synchronisation between data-parallel replicas: its cost and its policy (issue #6).

Cost model.  Replica r runs a pipeline; unit u's parameters live on one device h_r(u) of
each replica.  Units whose holders (h_0(u), ..., h_{R-1}(u)) are the same form a *sync
group*: a contiguous run of units between the union of every replica's cuts.  When all
replicas share one stage layout, the groups are exactly the stages (per-stage rings);
when layouts differ the exchange is parameter-wise, refined at every replica's cut.
Each group is one ring all-reduce over its R holders (cost_formulas.md §3.4, α-β model):

    t_group = k · 2 (R - 1) · latency_max + 2 (R - 1) / R · bytes / bandwidth_min

where ``bandwidth_min`` / ``latency_max`` are over every ordered pair of the group's
holders (a ring is bounded by its slowest link), ``bytes`` is the groups' parameter
bytes in the training precision (one gradient per parameter) and k = ceil(bytes /
`BUCKET_CAP_BYTES`) the buckets the runtime splits the group into (each bucket is one
all-reduce and pays the latency term; at least k, since a bucket holds whole
parameters).  T_sync is the *sum* over groups: the rings of different groups cross the
same node uplinks, which the link table does not describe, so they are not assumed to
run concurrently.  The runtime overlaps each bucket with the backward passes still
running (`hetpipe.runtime.replicas.sync`); T does not credit that (conservative), the
simulator does (`overlapped_sync_end_s`).

Policy.  ``synchronous``: every step, gradients weighted by each replica's sample share
so the update equals the large-batch update.  ``diloco``: H local steps, then an outer
step on the averaged parameter deltas (Douillard et al. 2023, arXiv 2311.08105), whose
exchange has the same bytes as one gradient sync (pseudo-gradients all-reduced in
16-bit, as OpenDiLoCo does), so it costs T_sync / H per step.

Example:
    >>> ring_allreduce_s(num_bytes=10**9, ranks=2, bandwidth_bytes_s=125e6, latency_s=2e-4)
    8.0004
    >>> choose_policy(compute_s=1.0, sync_s=0.05).policy
    'synchronous'
    >>> p = choose_policy(compute_s=1.0, sync_s=8.0)
    >>> p.policy, p.outer_steps
    ('diloco', 80)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Mapping, Sequence

from hetpipe.errors import ConfigError

#: Largest share of the per-step compute time that gradient sync may add before the
#: planner considers local steps.  10 %: synchronous training is exact (the large-batch
#: update), while infrequent sync changes the optimisation (DiLoCo reports a loss gap that
#: grows with H), so exactness is kept whenever it costs at most a tenth of the step; the
#: same fraction bounds the amortised sync of a chosen H (T_sync / H <= 0.1 · compute) and
#: is the least speed-up for which local steps replace synchronous training.  Overridable.
SYNC_BUDGET_FRACTION = 0.10
#: Largest H the planner picks: DiLoCo's main setting (500 inner steps per outer step,
#: arXiv 2311.08105 §3), beyond which it reports no evidence of convergence.
MAX_OUTER_STEPS = 500
POLICIES = ("auto", "synchronous", "diloco")
#: Bytes per gradient all-reduce bucket: torch DistributedDataParallel's default
#: (``bucket_cap_mb=25``, torch.nn.parallel.DistributedDataParallel docs), a size at which
#: a ring's bandwidth term dominates its latency term on datacenter links while buckets
#: stay small enough to start during backward.  The runtime and the cost model share it.
BUCKET_CAP_BYTES = 25 * 2**20


@dataclass(frozen=True)
class SyncGroup:
    """One ring all-reduce: units [first_unit, last_unit], held by `devices[r]` in replica r."""

    first_unit: int
    last_unit: int
    devices: tuple[int, ...]  # device index per replica
    num_bytes: int
    bandwidth_bytes_s: float  # slowest link between two holders
    latency_s: float  # largest latency between two holders
    time_s: float


@dataclass(frozen=True)
class SyncPolicy:
    """How replicas are kept consistent: policy, H (steps per sync) and why."""

    policy: str  # synchronous | diloco
    outer_steps: int  # H; 1 for synchronous
    amortised_s: float  # sync time charged per step: T_sync / H
    reason: str


def ring_allreduce_s(*, num_bytes: int, ranks: int, bandwidth_bytes_s: float, latency_s: float,
                     buckets: int = 1) -> float:
    """Ring all-reduce time, k·2(d-1)·α + 2(d-1)/d · S / β for S bytes in k buckets (cost_formulas.md §3.4)."""
    if ranks <= 1 or num_bytes <= 0:
        return 0.0
    steps = 2 * (ranks - 1)
    return max(1, buckets) * steps * latency_s + steps / ranks * num_bytes / bandwidth_bytes_s


def num_buckets(num_bytes: int, cap_bytes: int = BUCKET_CAP_BYTES) -> int:
    """Least number of all-reduce buckets of at most ``cap_bytes`` for ``num_bytes``.

    Example:
        >>> num_buckets(60 * 2**20), num_buckets(1)
        (3, 1)
    """
    return max(1, -(-int(num_bytes) // int(cap_bytes)))


def _holders(pipelines: Sequence[Sequence[tuple[int, int, int]]], num_units: int) -> list[tuple[int, ...]]:
    """Per unit, the device holding it in each replica (pipelines as (device, first, last))."""
    out: list[list[int]] = [[] for _ in range(num_units)]
    for pipe in pipelines:
        for device, first, last in pipe:
            for u in range(first, last + 1):
                out[u].append(device)
    return [tuple(h) for h in out]


def sync_groups(
    pipelines: Sequence[Sequence[tuple[int, int, int]]],
    *,
    grad_bytes: Sequence[int],
    bandwidth_bytes_s: Sequence[Sequence[float]],
    latency_s: Sequence[Sequence[float]],
    bucket_cap_bytes: int = BUCKET_CAP_BYTES,
) -> tuple[SyncGroup, ...]:
    """The rings of one gradient sync (module docstring); empty for a single replica.

    `pipelines[r]` lists replica r's stages as (device index, first unit, last unit).

    Example:
        >>> bw = ((math.inf, 2.0, 1.0), (2.0, math.inf, 1.0), (1.0, 1.0, math.inf))
        >>> lat = ((0.0,) * 3,) * 3
        >>> [g.time_s for g in sync_groups([[(0, 0, 1)], [(1, 0, 0), (2, 1, 1)]], grad_bytes=(4, 6),
        ...                                bandwidth_bytes_s=bw, latency_s=lat)]
        [2.0, 6.0]
    """
    replicas = len(pipelines)
    if replicas <= 1:
        return ()
    holders = _holders(pipelines, len(grad_bytes))
    groups: list[SyncGroup] = []
    start = 0
    for u in range(1, len(grad_bytes) + 1):
        if u < len(grad_bytes) and holders[u] == holders[start]:
            continue
        devs = holders[start]
        pairs = [(a, b) for a in devs for b in devs if a != b]
        bw = min(bandwidth_bytes_s[a][b] for a, b in pairs)
        lat = max(latency_s[a][b] for a, b in pairs)
        num_bytes = sum(grad_bytes[start:u])
        t = ring_allreduce_s(num_bytes=num_bytes, ranks=replicas, bandwidth_bytes_s=bw, latency_s=lat,
                             buckets=num_buckets(num_bytes, bucket_cap_bytes))
        groups.append(SyncGroup(start, u - 1, devs, num_bytes, bw, lat, t))
        start = u
    return tuple(groups)


@dataclass(frozen=True)
class Ring:
    """One all-reduce as overlap sees it: its holders, its seconds, and when each holder's gradients are final."""

    holders: tuple[Hashable, ...]
    seconds: float
    ready_s: tuple[float, ...]  # per holder


def overlapped_sync_end_s(rings: Sequence[Ring]) -> float:
    """When the last ring ends if each starts as soon as its holders are all ready and free.

    ``rings`` in the order the runtime issues them (the reverse of the unit order: a
    stage's backward produces its last units' gradients first).  A holder runs one ring
    at a time, so a ring starts at the latest of its holders' ready times and previous
    rings' ends.  Rings on disjoint holders may run at once even when they share a node
    uplink, which T does not assume (T charges every ring serially after the slowest
    replica); the truth lies between the two.

    Example:
        >>> overlapped_sync_end_s([Ring(("a", "c"), 2.0, (5.0, 4.0)), Ring(("b", "c"), 1.0, (9.0, 4.0))])
        10.0
    """
    free: dict[Hashable, float] = {}
    end = 0.0
    for ring in rings:
        start = max(max(r, free.get(h, r)) for h, r in zip(ring.holders, ring.ready_s)) if ring.holders else 0.0
        for h in ring.holders:
            free[h] = start + ring.seconds
        end = max(end, start + ring.seconds)
    return end


def backward_done_fraction(unit_bwd_s: Sequence[float], first_unit: int) -> float:
    """Share of a stage's backward done once units ``first_unit..`` are (backward runs last unit first).

    ``unit_bwd_s`` are the stage's units' backward seconds in order; ``first_unit`` is an
    index into it (the first unit of a sync group held there).

    Example:
        >>> backward_done_fraction([1.0, 1.0, 2.0], 1)
        0.75
    """
    total = sum(unit_bwd_s)
    return sum(unit_bwd_s[first_unit:]) / total if total > 0 else 1.0


def outer_steps_for(*, compute_s: float, sync_s: float, budget_fraction: float = SYNC_BUDGET_FRACTION) -> int:
    """Least H with sync_s / H <= budget_fraction · compute_s, clamped to [1, MAX_OUTER_STEPS].

    Example:
        >>> outer_steps_for(compute_s=2.0, sync_s=1.0)
        5
    """
    if sync_s <= 0:
        return 1
    if compute_s <= 0:
        return MAX_OUTER_STEPS
    need = sync_s / (budget_fraction * compute_s)
    return max(1, min(MAX_OUTER_STEPS, math.ceil(need * (1 - 1e-12))))


def choose_policy(
    *,
    compute_s: float,
    sync_s: float,
    policy: str = "auto",
    outer_steps: int | None = None,
    budget_fraction: float = SYNC_BUDGET_FRACTION,
) -> SyncPolicy:
    """The policy for one plan from its compute time (max_r T_r) and full sync time.

    ``auto`` keeps synchronous training while sync_s <= budget_fraction · compute_s and
    otherwise proposes DiLoCo with the least H meeting the budget; the replica solver then
    keeps DiLoCo only if it beats the best synchronous plan (see `replicas.solve_replicas`).
    A forced ``diloco`` without `outer_steps` picks H the same way.
    """
    check_policy(policy, outer_steps=outer_steps, budget_fraction=budget_fraction)
    share = sync_s / compute_s if compute_s > 0 else math.inf
    if sync_s <= 0:  # one replica: nothing to sync, every policy is the synchronous one
        return SyncPolicy("synchronous", 1, 0.0, "a single replica needs no gradient sync")
    if policy == "synchronous" or (policy == "auto" and sync_s <= budget_fraction * compute_s):
        why = "forced by the user" if policy == "synchronous" else (
            f"every-step sync takes {share:.1%} of the step's compute, within the {budget_fraction:.0%} budget")
        return SyncPolicy("synchronous", 1, sync_s, why)
    h = outer_steps if outer_steps is not None else outer_steps_for(
        compute_s=compute_s, sync_s=sync_s, budget_fraction=budget_fraction)
    why = (f"every-step sync would take {sync_s:.3g} s = {share:.0%} of the {compute_s:.3g} s compute; "
           f"H = {h} keeps it at {sync_s / h / compute_s:.1%}" if compute_s > 0 else f"H = {h}")
    if outer_steps is not None:
        why = f"H = {h} forced by the user ({sync_s / h:.3g} s of sync per step)"
    return SyncPolicy("diloco", h, sync_s / h, why)


def check_policy(policy: str, *, outer_steps: int | None, budget_fraction: float) -> None:
    """Raise `ConfigError` for an unknown policy, H < 1, H with synchronous, or a budget outside (0, 1]."""
    if policy not in POLICIES:
        raise ConfigError(f"unknown sync policy {policy!r}; use one of: {', '.join(POLICIES)}")
    if outer_steps is not None and outer_steps < 1:
        raise ConfigError(f"outer_steps (H) must be at least 1, got {outer_steps}; use e.g. --outer-steps 16")
    if outer_steps is not None and policy == "synchronous":
        raise ConfigError("outer_steps (H) applies to the diloco policy only; drop it or use policy 'diloco'")
    if not 0 < budget_fraction <= 1:
        raise ConfigError(f"the sync budget fraction must be in (0, 1], got {budget_fraction}; e.g. 0.1")
