"""Device-count vectors of the exact DP: how many there are, and all of them, without a full product.

The count-vector DP (`hetpipe.partitioner.solvers.dp`) keys its states by how many cards
of each device class a pipeline suffix uses.  A pipeline has at most `max_total` stages
(units and cards both bound it), so a class never contributes more than `max_total`
cards and only vectors whose total is at most `max_total` are reachable.  Counting and
enumerating exactly those vectors (instead of the product of ``count + 1`` over classes)
is what lets a cluster with many cards of a few kinds stay inside the DP: 8 kinds of 128
cards and a 34-unit model have 1.8e7 reachable vectors, not 129^8 = 7.7e16.

Example:
    >>> count_vectors((2, 2), 2)        # (0,1) (1,0) (1,1) (0,2) (2,0)
    5
    >>> sorted(vectors((2, 2), 2))
    [(0, 1), (0, 2), (1, 0), (1, 1), (2, 0)]
"""

from __future__ import annotations

from typing import Iterator, Sequence


def count_vectors(counts: Sequence[int], max_total: int) -> int:
    """Vectors v with 0 <= v[c] <= counts[c] and 1 <= sum(v) <= max_total."""
    # ways[t] = vectors over the classes seen so far with total t (a bounded-knapsack count).
    ways = [1] + [0] * max_total
    for cap in counts:
        nxt = [0] * (max_total + 1)
        for t, w in enumerate(ways):
            if w:
                for add in range(min(cap, max_total - t) + 1):
                    nxt[t + add] += w
        ways = nxt
    return sum(ways[1:])


def vectors(counts: Sequence[int], max_total: int) -> Iterator[tuple[int, ...]]:
    """Every vector `count_vectors` counts, depth first."""
    n = len(counts)

    def walk(c: int, left: int, prefix: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
        if c == n:
            if left < max_total:  # at least one card
                yield prefix
            return
        for take in range(min(counts[c], left) + 1):
            yield from walk(c + 1, left - take, prefix + (take,))

    yield from walk(0, max_total, ())
