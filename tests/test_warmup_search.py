"""Extra warm-ups searched with the placement: the answer fits, its T is the replayed schedule's,
it is never slower than warm-ups on the given placement, and on a small instance it equals the
enumeration of every placement, schedule and warm-up count."""

from __future__ import annotations

import dataclasses
import itertools
import math

from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage, evaluate
from hetpipe.partitioner.warmup_search import warmup_search, with_warmup
from hetpipe.schedule.builders import warmup_name


def _ring(units: int, cards: int, memory: int, cut_bytes: float) -> Problem:
    return Problem(fwd_s={"a": (1.0,) * units}, bwd_s={"a": (2.0,) * units}, state_bytes=(10,) * units,
                   activation_bytes=(4,) * units, boundary_bytes=(cut_bytes,) * units,
                   devices=tuple(DeviceSlot(f"d{i}", "a", f"n{i}", memory) for i in range(cards)),
                   bandwidth_bytes_s=tuple(tuple(math.inf if i == j else 1.0 for j in range(cards)) for i in range(cards)),
                   latency_s=((0.0,) * cards,) * cards, microbatches=8)


def _enumerated(prob: Problem, max_extra: int = 2) -> float:
    """The fastest fitting (placement, schedule, warm-ups) with every card equal (cut points only)."""
    n, d, best = prob.num_units, len(prob.devices), math.inf
    for p in range(1, min(n, d) + 1):
        extras = [e for e in itertools.product(range(max_extra + 1), repeat=p)
                  if all(e[i] >= e[i + 1] for i in range(p - 1))]
        for cuts in itertools.combinations(range(1, n), p - 1):
            bounds = (0, *cuts, n)
            stages = tuple(Stage(i, bounds[i], bounds[i + 1] - 1) for i in range(p))
            for base in ("1f1b", "zb-1f1b", "zb-h1"):
                for e in extras:
                    ev = evaluate(dataclasses.replace(prob, schedule=warmup_name(base, e)), stages)
                    if ev.fits:
                        best = min(best, ev.iteration_s)
    return best


def test_a_deeper_pipeline_makes_room_for_the_warm_ups_and_matches_the_enumeration() -> None:
    prob = _ring(6, 3, 100, 4.0)
    two = (Stage(0, 0, 2), Stage(1, 3, 5))
    assert with_warmup(prob, two) is None  # no warm-up fits (or helps) on two stages
    t, chosen, stages = warmup_search(prob, [two], limit_s=5.0)
    ev = evaluate(chosen, stages)
    assert ev.fits and ev.iteration_s == t and len(stages) == 3
    assert t == _enumerated(prob) < evaluate(prob, two).iteration_s


def test_recomputation_pays_for_the_warm_ups_that_hide_a_slow_link() -> None:
    from hetpipe.partitioner.recompute import with_recompute

    prob = _ring(6, 2, 90, 4.0)  # two cards: 82 of 90 bytes on stage 0 under 1F1B, C = 4 s per cut
    two = (Stage(0, 0, 2), Stage(1, 3, 5))
    assert evaluate(prob, two).fits and with_warmup(prob, two) is None  # no extra micro-batch fits as is
    rec = dataclasses.replace(prob, recompute="auto")
    t, chosen, stages = with_warmup(rec, two)
    ev = evaluate(chosen, stages)
    assert ev.fits and ev.iteration_s == t and chosen.schedule == "1f1b@1,0"
    assert stages[0].recompute_units and not stages[1].recompute_units
    assert tuple(stages) == with_recompute(chosen, two)  # the least that fits: what `hetpipe check` re-derives
    # faster than every placement, schedule and warm-up count at the same memory without recomputation
    assert t < _enumerated(prob) < evaluate(prob, two).iteration_s
    found = warmup_search(rec, [two], limit_s=5.0)
    assert found is not None and found[0] <= t and evaluate(found[1], found[2]).fits
    # a split backward cannot recompute: its warm-ups stay without it
    split = dataclasses.replace(rec, schedule="zb-1f1b")
    assert with_warmup(split, two) is None or not any(st.recompute_units for st in with_warmup(split, two)[2])
