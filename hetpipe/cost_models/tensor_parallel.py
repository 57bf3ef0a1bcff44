"""Cost of a stage that spans a *group* of cards splitting each layer unevenly (issue 15).

Within a tensor-parallel group of k cards (of one node, or of two: `partitioner.tp_tables.MAX_GROUP_NODES`),
every tensor-parallel block (a Megatron column-parallel -> row-parallel pair: attention q/k/v -> heads -> output
projection, or MLP up[/gate] -> act -> down) is split so that member i holds a share
``w_i`` of its heads / hidden columns (Shoeybi et al. 2019, "Megatron-LM", §3: the first
weight is split by output columns, the second by input rows, so each member computes its
slice without communication until one all-reduce of the block's output).

Shares.  ``w_i ∝ speed_i`` makes every member's sharded compute take the same time; a
member whose memory cannot hold ``w_i`` of the sharded bytes is capped at what it holds
(``(memory_i - replicated) / shardable``) and the rest is shared again in proportion to the
uncapped members' speeds (water filling, `proportional_shares`).  Heads and hidden columns
are integers: `largest_remainder` rounds ``w_i · total`` down and gives the remaining
parts, one each, to the largest fractional remainders (ties: lower member index), so the
parts always sum to ``total`` (Hamilton's method).

Time of a run of tensor-parallel units on the group, per micro-batch, forward + backward:

    T = max_i ((f · w_i + (1 - f)) · flops / speed_i) + 2 · n · allreduce(bytes, k)

where ``f`` is the shardable fraction of the FLOPs (the rest, norms and residual adds,
runs replicated on every member), ``n`` the tensor-parallel blocks (two per transformer
block: attention and MLP; each is one all-reduce of its output forward and one of its
input gradient backward, Megatron-LM §3, Fig. 3) and ``allreduce`` the ring all-reduce
``2(k-1)/k · bytes / bandwidth + 2(k-1) · latency`` (Thakur et al. 2005; NCCL's ring
algorithm; cost_formulas.md §3.4) of the activation ``b · s · h · element bytes``.
Memory per member: ``w_i · shardable + replicated`` bytes.

Example (2 cards, the second twice as fast; an MLP of 96 hidden columns):
    >>> s = proportional_shares((1e12, 2e12))
    >>> [round(w, 4) for w in s.weights], s.parts(96)
    ([0.3333, 0.6667], (32, 64))
    >>> work = TensorParallelWork(flops=6e9, shardable_fraction=1.0, shardable_bytes=8 * 2**20,
    ...                           replicated_bytes=0, allreduce_bytes=2**20, blocks=1)
    >>> c = group_cost(work, s, speeds_flops_s=(1e12, 2e12), memory_bytes=(2**30, 2**30),
    ...                bandwidth_bytes_s=16e9, latency_s=1e-5)
    >>> round(c.compute_s * 1e3, 3), round(c.allreduce_s * 1e6, 1), c.fits
    (2.0, 171.1, True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hetpipe.cost_models.sync import ring_allreduce_s
from hetpipe.errors import ConfigError, InfeasibleError

#: Two all-reduces per tensor-parallel block and step: one forward (the row-parallel
#: output), one backward (the column-parallel input's gradient); Megatron-LM §3, Fig. 3.
ALLREDUCES_PER_BLOCK = 2
#: Forward all-reduces of the vocab-parallel cross-entropy, each of one (b, s) fp32 vector:
#: the logits' max, the target's logit, the sum of exp (Megatron-LM
#: ``core/tensor_parallel/cross_entropy.py``: ``_VocabParallelCrossEntropy.forward``).
LOSS_ALLREDUCES = 3


def block_allreduce_bytes(kind: str, *, allreduce_bytes: int, loss_allreduce_bytes: int = 0
                          ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(forward, backward) bytes of each all-reduce one micro-batch of a block costs the group.

    * a Megatron pair (``attention`` / ``mlp``, or ``""``): its row output forward, its column input's
      gradient backward, each ``b · s · h`` (Megatron-LM §3, Fig. 3);
    * ``embedding`` split by vocabulary: each member looks up only its rows, zeros elsewhere, and the
      (b, s, h) output is all-reduced forward; nothing backward, the ids have no gradient
      (Megatron-LM ``VocabParallelEmbedding.forward``: mask, lookup, ``reduce_from_tensor_model_parallel_region``);
    * ``head`` split by vocabulary with the vocab-parallel cross-entropy: three all-reduces of a (b, s)
      fp32 vector forward (`LOSS_ALLREDUCES`); backward the loss needs none (each member's softmax
      slice minus its part of the one-hot is its logits' gradient), and the head's input gradient
      one all-reduce of (b, s, h) (the column-parallel ``copy_to_tensor_model_parallel_region``).

    Example:
        >>> block_allreduce_bytes("head", allreduce_bytes=8192, loss_allreduce_bytes=128)
        ((128, 128, 128), (8192,))
        >>> block_allreduce_bytes("embedding", allreduce_bytes=8192), block_allreduce_bytes("mlp", allreduce_bytes=8)
        (((8192,), ()), ((8,), (8,)))
    """
    if kind == "embedding":
        return (allreduce_bytes,), ()
    if kind == "head":
        return (loss_allreduce_bytes,) * LOSS_ALLREDUCES, (allreduce_bytes,)
    return (allreduce_bytes,), (allreduce_bytes,)


@dataclass(frozen=True)
class TensorShares:
    """Each member's fraction of every tensor-parallel block, in member order.

    Attributes:
        weights: fractions, positive or zero, summing to 1.
        capped: member i's share was limited by its memory (not by its speed).

    Example:
        >>> TensorShares(weights=(0.75, 0.25), capped=(False, False)).parts(4)
        (3, 1)
    """

    weights: tuple[float, ...]
    capped: tuple[bool, ...]

    def __post_init__(self) -> None:
        if not self.weights or any(w < 0 for w in self.weights) or not math.isclose(sum(self.weights), 1.0):
            raise ConfigError(f"tensor-parallel shares {self.weights} must be >= 0 and sum to 1; "
                              "build them with proportional_shares() or even_shares()")

    @property
    def size(self) -> int:
        """Members in the group."""
        return len(self.weights)

    def parts(self, total: int) -> tuple[int, ...]:
        """Integer heads / columns per member for a block of ``total`` parts (`largest_remainder`)."""
        return largest_remainder(self.weights, total)


def even_shares(size: int) -> TensorShares:
    """Megatron's split: every member holds ``1/size`` (the baseline uneven shares are compared with).

    Example:
        >>> even_shares(3).parts(8)
        (3, 3, 2)
    """
    if size < 1:
        raise ConfigError(f"a tensor-parallel group needs at least 1 member, got size={size}")
    return TensorShares(weights=tuple(1.0 / size for _ in range(size)), capped=(False,) * size)


def largest_remainder(weights: Sequence[float], total: int) -> tuple[int, ...]:
    """Round ``w_i · total`` to integers summing to ``total`` (Hamilton's largest-remainder method).

    Each member first gets ``floor(w_i · total)``; the parts left over go one each to the
    largest fractional remainders, ties to the lower member index.  A member may get 0 parts
    of a small block (it then idles on that block; the cost model prices the real parts).

    Example:
        >>> largest_remainder((0.5, 0.3, 0.2), 7), largest_remainder((0.75, 0.25), 176)
        ((4, 2, 1), (132, 44))
    """
    if total < 0:
        raise ConfigError(f"cannot split total={total} parts; it must be >= 0")
    scale = sum(weights)
    exact = [w / scale * total for w in weights]
    floors = [math.floor(x + 1e-9) for x in exact]  # 1e-9: 0.3 * 10 is 2.9999999999999996 in floats
    left = total - sum(floors)
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - floors[i]), i))
    for i in order[:left]:
        floors[i] += 1
    return tuple(floors)


def memory_caps(memory_bytes: Sequence[int], *, shardable_bytes: int, replicated_bytes: int) -> tuple[float, ...]:
    """The largest share each member can hold: ``(memory - replicated) / shardable`` (inf if nothing shards).

    Example:
        >>> memory_caps((10, 4), shardable_bytes=8, replicated_bytes=2)
        (1.0, 0.25)
    """
    if shardable_bytes <= 0:
        return tuple(math.inf for _ in memory_bytes)
    return tuple(max(0.0, (m - replicated_bytes) / shardable_bytes) for m in memory_bytes)


def proportional_shares(speeds_flops_s: Sequence[float], caps: Sequence[float] | None = None, *,
                        replicated_fraction: float = 0.0) -> TensorShares:
    """Shares that make every member finish together, each at most its cap (water filling).

    With ``replicated_fraction`` r = 0 (the issue's first-order rule) the shares are ``∝ speed``.
    With r > 0 every member also runs r of the work whole, so equal finish times need
    ``(1 - r) · w_i + r = τ · speed_i`` (τ common): a slower member gets less than its speed's
    share, and none if even ``r`` alone makes it the slowest (the solver may then drop it).
    Capped members hold their cap; the rest is shared again among the others.  Raises
    `InfeasibleError` when the caps sum to less than 1 (the group cannot hold the block).

    Example:
        >>> s = proportional_shares((3.0, 1.0, 1.0), caps=(0.5, 1.0, 1.0))
        >>> s.weights, s.capped
        ((0.5, 0.25, 0.25), (True, False, False))
        >>> [round(w, 4) for w in proportional_shares((3.0, 1.0), replicated_fraction=0.1).weights]
        [0.8056, 0.1944]
    """
    if not speeds_flops_s or any(v <= 0 for v in speeds_flops_s):
        raise ConfigError(f"member speeds {tuple(speeds_flops_s)} must be positive FLOP/s")
    if not 0.0 <= replicated_fraction < 1.0:
        raise ConfigError(f"replicated_fraction={replicated_fraction} must be in [0, 1)")
    limit = tuple(caps) if caps is not None else tuple(math.inf for _ in speeds_flops_s)
    if sum(min(c, 1.0) for c in limit) < 1.0 - 1e-12:
        raise InfeasibleError(f"the group's members can hold {sum(limit):.3f} of a tensor-parallel block "
                              f"(memory caps {tuple(round(c, 3) for c in limit)}); add a member or free memory")
    weights, capped = _water_fill(speeds_flops_s, limit, replicated_fraction)
    total = sum(weights)
    return TensorShares(weights=tuple(w / total for w in weights), capped=capped)


def _water_fill(speeds: Sequence[float], limit: Sequence[float], r: float) -> tuple[list[float], tuple[bool, ...]]:
    """Equal-finish shares over the members not fixed yet; fix the capped (and the idle) ones and repeat."""
    f = 1.0 - r
    weights = [0.0] * len(speeds)
    free, capped = set(range(len(speeds))), set()
    remaining = 1.0
    while free:  # each pass fixes at least one member or ends
        tau = (f * remaining + r * len(free)) / sum(speeds[i] for i in free)
        want = {i: (tau * speeds[i] - r) / f for i in free}
        over = [i for i in free if want[i] > limit[i]]
        idle = [i for i in free if want[i] < 0]
        if not over and not idle:
            weights = [want.get(i, w) for i, w in enumerate(weights)]
            break
        for i in over or idle:  # caps first: capping frees work that may bring an idle member back
            weights[i] = limit[i] if over else 0.0
            remaining -= weights[i]
            free.discard(i)
            capped.update([i] if over else [])
    return weights, tuple(i in capped for i in range(len(speeds)))


@dataclass(frozen=True)
class TensorParallelWork:
    """What a run of units costs per micro-batch, as the group model needs it.

    Attributes:
        flops: forward + backward FLOPs of one micro-batch.
        shardable_fraction: share of ``flops`` inside tensor-parallel blocks (the rest runs replicated).
        shardable_bytes: state + activation bytes that split with the shares.
        replicated_bytes: bytes every member holds in full (norms, embeddings, the block inputs).
        allreduce_bytes: bytes of one all-reduced activation (``b · s · h · element bytes``).
        blocks: tensor-parallel blocks (2 per transformer block).
    """

    flops: float
    shardable_fraction: float
    shardable_bytes: int
    replicated_bytes: int
    allreduce_bytes: int
    blocks: int


@dataclass(frozen=True)
class GroupCost:
    """Time and memory of a `TensorParallelWork` on a group with given shares.

    Attributes:
        member_compute_s: each member's compute time (its share plus the replicated part).
        compute_s: the slowest member's compute time.
        allreduce_s: all the group's activation all-reduces, forward and backward.
        time_s: ``compute_s + allreduce_s`` (the all-reduces sit on the critical path).
        memory_bytes: each member's ``w_i · shardable + replicated`` bytes.
        fits: every member's bytes are within its memory.
    """

    member_compute_s: tuple[float, ...]
    compute_s: float
    allreduce_s: float
    time_s: float
    memory_bytes: tuple[int, ...]
    fits: bool


def group_cost(work: TensorParallelWork, shares: TensorShares, *, speeds_flops_s: Sequence[float],
               memory_bytes: Sequence[int], bandwidth_bytes_s: float, latency_s: float) -> GroupCost:
    """Price ``work`` on the group (formula in the module docstring).

    ``bandwidth_bytes_s`` / ``latency_s``: the slowest link of the group's ring.  A group of one
    is a plain stage: no all-reduce, all the work on its one member.

    Example:
        >>> w = TensorParallelWork(flops=4e12, shardable_fraction=0.75, shardable_bytes=100,
        ...                        replicated_bytes=10, allreduce_bytes=0, blocks=2)
        >>> c = group_cost(w, even_shares(2), speeds_flops_s=(1e12, 1e12), memory_bytes=(60, 59),
        ...                bandwidth_bytes_s=1e9, latency_s=0.0)
        >>> c.compute_s, c.memory_bytes, c.fits
        (2.5, (60, 60), False)
    """
    if not (len(speeds_flops_s) == len(memory_bytes) == shares.size):
        raise ConfigError(f"{shares.size} shares for {len(speeds_flops_s)} speeds and {len(memory_bytes)} "
                          "memories; give one of each per group member")
    f = work.shardable_fraction
    member_s = tuple((f * w + (1.0 - f)) * work.flops / v for w, v in zip(shares.weights, speeds_flops_s))
    one = ring_allreduce_s(num_bytes=work.allreduce_bytes, ranks=shares.size,
                           bandwidth_bytes_s=bandwidth_bytes_s, latency_s=latency_s)
    allreduce = ALLREDUCES_PER_BLOCK * work.blocks * one
    held = tuple(int(math.ceil(w * work.shardable_bytes)) + work.replicated_bytes for w in shares.weights)
    return GroupCost(member_compute_s=member_s, compute_s=max(member_s), allreduce_s=allreduce,
                     time_s=max(member_s) + allreduce, memory_bytes=held,
                     fits=all(h <= m for h, m in zip(held, memory_bytes)))
