"""Moves of whole node runs for the annealing on the windowed pace (`pace_search`, issue 12 item 3, session 15).

Why.  The annealing's moves change one stage or one unit at a time (`pace_search._neighbour`, `_reordered`), and
at its low temperature it cannot carry a run of eight stages on one node to another place in the pipeline one
stage at a time: every placement on the way is slower.  Yet which node's run comes where is what separates the
placements it stalls at from the best ones: gpt2-xl on 64 cards (eight nodes, one kind each), the window start
runs A5000, V100, A6000, 4090, A100 (3.376 s of windowed pace) and the best placement found runs A5000, 4080,
V100, A6000, A100 (3.250 s).  A **run** is a maximal sequence of consecutive stages whose cards share a node.
Two moves on runs, each keeping every stage's unit count (the cuts follow the counts):

* `runs_swapped`: two runs trade places in the pipeline, each with its cards and unit counts;
* `run_rehomed`: a run's stages move to unused cards of another node (the same number of them, in card order).

Example (stages on nodes a, a, b: the run on b and the run on a swap):
    >>> import random
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage
    >>> inf = float("inf")
    >>> devs = (DeviceSlot("d0", "k", "a", 9), DeviceSlot("d1", "k", "a", 9), DeviceSlot("d2", "k", "b", 9))
    >>> moved = runs_swapped(random.Random(0), (Stage(0, 0, 0), Stage(1, 1, 2), Stage(2, 3, 3)), devs)
    >>> [(st.device, st.first_unit, st.last_unit) for st in moved]
    [(2, 0, 0), (0, 1, 1), (1, 2, 3)]
"""

from __future__ import annotations

import random
from typing import Sequence

from hetpipe.partitioner.problem import DeviceSlot, Stage


def runs(stages: Sequence[Stage], devices: Sequence[DeviceSlot]) -> list[tuple[int, int]]:
    """The runs of `stages` as [first, end) index pairs (module docstring).

    Example:
        >>> from hetpipe.partitioner.problem import DeviceSlot
        >>> devs = (DeviceSlot("d0", "k", "a", 9), DeviceSlot("d1", "k", "a", 9), DeviceSlot("d2", "k", "b", 9))
        >>> runs((Stage(0, 0, 0), Stage(1, 1, 1), Stage(2, 2, 2)), devs)
        [(0, 2), (2, 3)]
    """
    out: list[tuple[int, int]] = []
    for i, st in enumerate(stages):
        if out and devices[stages[i - 1].device].node == devices[st.device].node:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _with_counts(first_unit: int, cards: Sequence[int], counts: Sequence[int]) -> tuple[Stage, ...]:
    """Stages on `cards` holding `counts` units each, in order from `first_unit`."""
    out, first = [], first_unit
    for card, count in zip(cards, counts):
        out.append(Stage(card, first, first + count - 1))
        first += count
    return tuple(out)


def runs_swapped(rng: random.Random, stages: Sequence[Stage], devices: Sequence[DeviceSlot]) -> tuple[Stage, ...] | None:
    """Two runs drawn at random trade places, each with its cards and unit counts; None with fewer than two runs."""
    found = runs(stages, devices)
    if len(found) < 2:
        return None
    (a, a_end), (b, b_end) = sorted(rng.sample(found, 2))
    order = list(range(a)) + list(range(b, b_end)) + list(range(a_end, b)) + list(range(a, a_end)) + \
        list(range(b_end, len(stages)))
    return _with_counts(stages[0].first_unit, [stages[i].device for i in order],
                        [stages[i].last_unit - stages[i].first_unit + 1 for i in order])


def run_rehomed(rng: random.Random, stages: Sequence[Stage], devices: Sequence[DeviceSlot]) -> tuple[Stage, ...] | None:
    """A run drawn at random moved onto unused cards of another node that has enough of them (drawn at random
    among those nodes), in card order; None where no node has."""
    found = runs(stages, devices)
    first, end = found[rng.randrange(len(found))]
    used = {st.device for st in stages}
    free: dict[str, list[int]] = {}
    for i, d in enumerate(devices):
        if i not in used:
            free.setdefault(d.node, []).append(i)
    home = devices[stages[first].device].node
    fits = sorted(node for node, cards in free.items() if node != home and len(cards) >= end - first)
    if not fits:
        return None
    cards = free[rng.choice(fits)][:end - first]
    out = list(stages)
    out[first:end] = [Stage(card, st.first_unit, st.last_unit) for card, st in zip(cards, stages[first:end])]
    return tuple(out)
