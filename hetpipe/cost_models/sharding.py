"""Optimizer-state sharding across replicas (ZeRO-1), uneven by free memory: the cost formula.

Issue 14's third lever; the replica planner prices it per sync group with these functions
(`hetpipe.partitioner.replica_shard`).  R replicas hold the same stage (the same units) on cards
r = 1..R.  ZeRO stage 1 (Rajbhandari et al., SC'20, arXiv:1910.02054; `apis_next.md` s.7)
partitions the optimizer state: each card keeps and updates only its shard, then the
updated weights are all-gathered.  Shards here are **uneven, in proportion to each card's free
memory** (Poplar's idea for mixed clusters; ZeRO and torch's `ZeroRedundancyOptimizer` split
evenly):

* free_r = usable_r - (M_r without any optimizer state);  f_r = free_r / sum_q free_q  (sum f_r = 1;
  a card with no free memory takes no shard, and sharding cannot help if sum free < K Psi);
* **M_r = M_r(no optimizer state) + f_r K Psi** (K Psi: the stage's optimizer-state bytes, e.g.
  12 B/param for bf16-mixed Adam, or 8 for fp32 Adam);
* per step, what the runtime runs (`runtime/replicas/shard.py`): the gradients' ring all-reduce
  (G bytes, unchanged: gloo has no reduce-scatter of uneven chunks, so each holder all-reduces
  and keeps its slice), then an all-gather of the updated weights (W bytes) in which every
  holder sends its slice padded to the largest.  On a ring the all-gather takes R - 1 steps of
  one padded chunk over the ring's slowest link (cost_formulas.md s.3.4, ring collectives):

      T_shard = 2 (R - 1)/R G / BW_min + k 2 (R - 1) latency      (the all-reduce, k buckets)
              + (R - 1) max_r f_r W / BW_min + (R - 1) latency     (the padded all-gather)

  so a sharded group's exchange always takes longer than the all-reduce alone (even shards and
  W = G: 1.5x its bandwidth term); sharding pays through the memory it frees (and the smaller step).  A true ZeRO-1 exchange
  (a reduce-scatter instead of the all-reduce: (R - 1) max_r f_r (G + W) / BW_min, the all-reduce's
  bytes for even shards) is not what runs on gloo, so it is not what the plan prices.

Example (3 replicas, 10 GB of Adam state; free 6, 3 and 1 GB beyond their other bytes):
    >>> shares = shard_fractions([6e9, 3e9, 1e9])
    >>> [round(f, 2) for f in shares]
    [0.6, 0.3, 0.1]
    >>> sharded_memory_bytes([10e9, 12e9, 5e9], shares, optimizer_bytes=10e9)
    (16000000000.0, 15000000000.0, 6000000000.0)
    >>> round(shard_sync_s(shares, grad_bytes=2e9, weight_bytes=2e9, bandwidth_bytes_s=1e9, latency_s=0.0), 3)
    5.067
"""

from __future__ import annotations

from typing import Sequence

from hetpipe.cost_models.sync import ring_allreduce_s
from hetpipe.errors import ConfigError

#: The lever's settings (``--sharding``): ``never``; ``auto`` = each sync group of a replica plan
#: shards where that makes the plan fit or lowers T; ``all`` = every group that can (comparisons).
SHARDING_MODES = ("never", "auto", "all")


def check_sharding_option(mode: object) -> None:
    """Refuse anything but one of `SHARDING_MODES` (``--sharding``, ``sharding=``).

    Example:
        >>> check_sharding_option("auto")
        >>> check_sharding_option("even")
        Traceback (most recent call last):
        ...
        hetpipe.errors.ConfigError: sharding (--sharding): 'even' is not a setting; use one of never, auto, all
    """
    if mode not in SHARDING_MODES:
        raise ConfigError(f"sharding (--sharding): {mode!r} is not a setting; use one of {', '.join(SHARDING_MODES)}")


def shard_fractions(free_bytes: Sequence[float]) -> tuple[float, ...]:
    """f_r proportional to each card's free memory (negative free counts as none).

    Raises `ConfigError` when no card has any free memory (nothing can hold the state).
    """
    free = [max(0.0, float(b)) for b in free_bytes]
    total = sum(free)
    if total <= 0:
        raise ConfigError("optimizer-state sharding: no replica has free memory for a shard; "
                          "use cards with more memory or offload the state (--offload auto)")
    return tuple(b / total for b in free)


def sharded_memory_bytes(base_bytes: Sequence[float], fractions: Sequence[float], *,
                         optimizer_bytes: float) -> tuple[float, ...]:
    """M_r = M_r(no optimizer state) + f_r * K Psi, per replica."""
    if len(base_bytes) != len(fractions):
        raise ValueError(f"{len(base_bytes)} replicas' bytes but {len(fractions)} shares")
    return tuple(b + f * optimizer_bytes for b, f in zip(base_bytes, fractions))


def shard_sync_s(fractions: Sequence[float], *, grad_bytes: float, weight_bytes: float,
                 bandwidth_bytes_s: float, latency_s: float, buckets: int = 1) -> float:
    """T_shard: the ring all-reduce of the gradients, then the all-gather of the weights padded to the largest slice.

    ``buckets`` parts of the all-reduce pay its 2 (R - 1) latency steps each
    (`cost_models.sync.ring_allreduce_s`); the all-gather is one call per group and step.

    Example (2 holders 0.7 / 0.3 of 1 GB of gradients and of weights, 1 GB/s, no latency):
        >>> round(shard_sync_s((0.7, 0.3), grad_bytes=1e9, weight_bytes=1e9, bandwidth_bytes_s=1e9,
        ...                    latency_s=0.0), 3)   # all-reduce 2 * 1/2 * 1 s + all-gather 1 * 0.7 * 1 s
        1.7
    """
    r = len(fractions)
    if r <= 1:
        return 0.0
    all_reduce = ring_allreduce_s(num_bytes=int(grad_bytes), ranks=r, bandwidth_bytes_s=bandwidth_bytes_s,
                                  latency_s=latency_s, buckets=buckets)
    all_gather = (r - 1) * (max(fractions) * weight_bytes / bandwidth_bytes_s + latency_s)
    return all_reduce + all_gather


def even_fractions(replicas: int) -> tuple[float, ...]:
    """ZeRO-1's even split, 1/R each (the comparison the uneven rule is measured against).

    Example:
        >>> even_fractions(4)
        (0.25, 0.25, 0.25, 0.25)
    """
    return tuple(1.0 / replicas for _ in range(replicas))
