"""`best_levers` under the schedule (offload ``auto``): for a fixed placement, the levers of least schedule T.

Under the schedule an offloading stage's tail O_s is its own step, replayed after its last backward: a late stage's
tail hides behind the drain, stage 0's ends the iteration.  One cap on every stage's tail (what the estimate's walk
needs: it counts only max_s O_s) lets stage 0 offload whenever a later stage with a larger tail does; the schedule's
choice (`offload_walk.schedule_levers`) picks which stages offload.  Checked against enumeration of every lever
choice (recompute prefix x offload x selective level) of every placement of random instances.
"""

from __future__ import annotations

import math
import random

import pytest

from hetpipe.partitioner.problem import evaluate
from hetpipe.partitioner.solvers import offload_walk
from hetpipe.partitioner.solvers.offload_walk import best_levers
from tests.instances import all_placements, random_problem, recompute_choices, with_offload, with_selective

REL = 1e-9


def _instances(seed: int, count: int):
    rng = random.Random(seed)
    for _ in range(count):
        base = random_problem(rng, units=rng.randint(2, 4), devices=rng.randint(2, 3), tight_memory=True,
                              recompute="auto", activation_max=20, objective="schedule")
        prob = with_offload(rng, base, "auto")
        yield with_selective(rng, prob) if rng.random() < 0.3 else prob


def _enumerated(prob, placement) -> float:
    """Least schedule T over every lever choice of `placement` that fits (inf if none)."""
    return min((ev.iteration_s for ev in (evaluate(prob, c) for c in recompute_choices(prob, placement)) if ev.fits),
               default=math.inf)


@pytest.mark.parametrize("subsets_max", [16, 1])  # enumeration of offload subsets, and the descent beyond it
def test_schedule_levers_equal_enumeration_for_fixed_placements(monkeypatch: pytest.MonkeyPatch,
                                                                 subsets_max: int) -> None:
    monkeypatch.setattr(offload_walk, "SUBSETS_MAX", subsets_max)
    checked = mixed = 0
    for prob in _instances(1414, 30):
        for placement in all_placements(prob):
            best = _enumerated(prob, placement)
            ev = evaluate(prob, best_levers(prob, placement, "schedule"))
            if math.isinf(best):
                assert not ev.fits
                continue
            checked += 1
            assert ev.fits and ev.iteration_s <= best * (1 + REL), (placement, ev.iteration_s, best)
            offl = [st.offload for st in best_levers(prob, placement, "schedule")]
            mixed += any(offl) and not all(offl)
            if subsets_max > 1:  # exact: never below the enumeration either (it is one of its choices)
                assert ev.iteration_s >= best * (1 - REL)
    assert checked >= 100 and mixed >= 5, (checked, mixed)
