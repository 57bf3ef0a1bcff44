"""Issue 12 item 3 (session 15): the annealing's moves on whole node runs (`solvers/run_moves.py`).

* `runs` cuts a pipeline into maximal same-node runs (checked against its definition on random pipelines).
* `runs_swapped` keeps every stage's card and unit count and the run blocks whole, and its draws reach every order
  of three runs (enumerated: 3! orders); `run_rehomed` moves one run onto unused cards of one other node with
  enough of them, and its draws reach every such node; None where no move applies.
"""

from __future__ import annotations

import itertools
import random

from hetpipe.partitioner.problem import DeviceSlot, Stage
from hetpipe.partitioner.solvers.run_moves import run_rehomed, runs, runs_swapped


def _devices(per_node: tuple[int, ...]) -> tuple[DeviceSlot, ...]:
    return tuple(DeviceSlot(f"d{n}.{i}", f"k{n}", f"n{n}", 99) for n, count in enumerate(per_node) for i in range(count))


def _pipeline(cards: list[int], counts: list[int]) -> tuple[Stage, ...]:
    out, first = [], 0
    for card, count in zip(cards, counts):
        out.append(Stage(card, first, first + count - 1))
        first += count
    return tuple(out)


def _well_formed(stages: tuple[Stage, ...], units: int) -> bool:
    return (stages[0].first_unit == 0 and stages[-1].last_unit == units - 1
            and all(a.last_unit + 1 == b.first_unit for a, b in zip(stages, stages[1:]))
            and len({st.device for st in stages}) == len(stages))


def test_runs_are_the_maximal_same_node_sequences() -> None:
    devs = _devices((3, 3, 3))
    rng = random.Random(0)
    for _ in range(200):
        cards = rng.sample(range(len(devs)), rng.randint(1, len(devs)))
        stages = _pipeline(cards, [1] * len(cards))
        found = runs(stages, devs)
        assert [i for a, b in found for i in range(a, b)] == list(range(len(stages)))  # a cover, in order
        for a, b in found:
            assert len({devs[st.device].node for st in stages[a:b]}) == 1
        for (_, b), (c, _) in zip(found, found[1:]):
            assert devs[stages[b - 1].device].node != devs[stages[c].device].node  # maximal


def test_swaps_keep_cards_and_counts_and_reach_every_order_of_the_runs() -> None:
    devs = _devices((2, 2, 2))
    start = _pipeline([0, 1, 2, 4, 5], [1, 2, 1, 3, 1])  # runs: n0 (2 stages), n1 (1), n2 (2)
    units = 8
    blocks = {node: [(st.device, st.last_unit - st.first_unit + 1) for st in start if devs[st.device].node == node]
              for node in ("n0", "n1", "n2")}
    rng, orders, current = random.Random(1), set(), start
    for _ in range(300):
        moved = runs_swapped(rng, current, devs)
        assert moved is not None and _well_formed(moved, units)
        seq = [(st.device, st.last_unit - st.first_unit + 1) for st in moved]
        nodes = [devs[d].node for d, _ in seq]
        order = tuple(dict.fromkeys(nodes))
        assert sorted(seq) == sorted((st.device, st.last_unit - st.first_unit + 1) for st in start)
        assert [x for node in order for x in blocks[node]] == seq  # each run whole, in its own order
        orders.add(order)
        current = moved
    assert orders == set(itertools.permutations(("n0", "n1", "n2")))
    assert runs_swapped(rng, _pipeline([0, 1], [4, 4]), devs) is None  # one run: nothing to swap


def test_rehoming_moves_one_run_onto_free_cards_of_each_node_with_enough() -> None:
    devs = _devices((2, 3, 1, 2))  # n0: 0-1, n1: 2-4, n2: 5, n3: 6-7
    start = _pipeline([0, 1, 2], [2, 1, 3])  # runs: n0 (cards 0, 1), n1 (card 2)
    rng, homes = random.Random(2), set()
    for _ in range(300):
        moved = run_rehomed(rng, start, devs)
        assert moved is not None and _well_formed(moved, 6)
        assert [st.last_unit - st.first_unit + 1 for st in moved] == [2, 1, 3]
        changed = [i for i, (a, b) in enumerate(zip(start, moved)) if a.device != b.device]
        assert changed in ([0, 1], [2])  # one run, whole
        new = {devs[moved[i].device].node for i in changed}
        assert len(new) == 1 and not {moved[i].device for i in changed} & {st.device for st in start}
        homes.add((tuple(changed), new.pop()))
    # n0's two-stage run fits on n1 (2 free) or n3 (2 free), not n2 (1); n1's one-stage run on n2 or n3
    assert homes == {((0, 1), "n1"), ((0, 1), "n3"), ((2,), "n2"), ((2,), "n3")}
    full = _devices((2, 2))
    assert run_rehomed(rng, _pipeline([0, 1, 2, 3], [1, 1, 1, 1]), full) is None  # no card free
