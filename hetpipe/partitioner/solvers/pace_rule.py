"""The pace walk's filters on a DP suffix's front stage (`schedule_bound.level_caps`, issue 12 item 3).

`PaceRule` holds, per number of stages in a suffix, the caps every placement whose pace G is under a
cap gamma meets (round trips, single steps, and the pair chain with the next stage); the count DP
(`dp.CountDP`) and the node-run DP (`pace_runs.RunDP`) apply them level by level.  The pair chain needs the
next stage's W: the DPs keep beside each state's least R the least x W_front + R of its suffixes
(`paired_values`), x being the pair count of the level above (`next_pairs`).

Example (a front stage of W = 2 s before two possible next stages, x = 1 pair):
    >>> import numpy as np
    >>> rule = PaceRule(trips=0, steps=0, weighted=1, forward=0, cap=10.0, pairs=1, pair_steps=0)
    >>> comm2 = np.array([[1.0], [0.5]])          # 2C to each next kind at the cut
    >>> paired = np.array([[3.0], [5.0]])         # least x W_front + R of the suffixes there
    >>> pair_filter(rule, comm2, paired)          # min(2 x 1 + 3, 2 x 0.5 + 5)
    array([5.])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class PaceRule:
    """Filters on a suffix's front stage s (W = F + B with its levers, R its suffix value), kept when
    ``trips * R + steps * W <= cap`` and ``weighted * W - forward * F <= cap`` (`schedule_bound.level_caps`):
    both grow with R and W, so a least-R suffix that fails them has no costlier sibling that passes.

    With ``pairs`` = x >= 0 (y = ``pair_steps``), the pair chain `schedule_bound.pair_chain` too:
    x (W + 2C + W_{s+1}) + y W + R <= cap.  The DP keeps beside each state's least R the least
    x W_front + R over its suffixes (`next_pairs`), so x W_{s+1} + R_{s+1} is bounded exactly per state; the
    filter takes the least over the next stages while the value keeps the least R: a relaxation (a suffix is
    dropped only when no next stage passes), so the walk's bound stays valid but its argmin may break this rule.
    """

    trips: float
    steps: float
    weighted: float
    forward: float
    cap: float
    pairs: int = -1  # x; -1: no pair chain at this level
    pair_steps: int = 0  # y


#: Per number k of stages in a suffix: (cap on its front stage's F + B, cap on the suffix's value), and
#: optionally a `PaceRule` as a third item.
LevelCaps = Callable[[int], "tuple[float, float] | tuple[float, float, PaceRule]"]


def pair_filter(rule: PaceRule, comm2: np.ndarray, paired: np.ndarray) -> np.ndarray:
    """min over the next stage (axis -2) of (x + 1) 2C + (x W_{s+1} + R_{s+1}): the pair chain's part beyond
    the front stage's (x + y + 1) W (`PaceRule`).  comm2 (..., K, L+1): 2C to each next kind at each cut;
    paired (..., K, L+1): the least x W_front + R of the suffixes there (`next_pairs`)."""
    return ((rule.pairs + 1) * comm2 + paired).min(axis=-2)


def pair_kept(rule: PaceRule, band: np.ndarray, rest: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """`cand` where the pair chain (x + y + 1) W + `rest` (`pair_filter` at each front stage's end) is under
    the rule's cap, inf elsewhere."""
    with np.errstate(invalid="ignore"):  # inf entries give nan: they stay inf
        return np.where((rule.pairs + rule.pair_steps + 1) * band + rest <= rule.cap, cand, np.inf)


def next_pairs(level_caps: LevelCaps | None, k: int) -> int:
    """x of the level above k (the pair chain a front stage over a suffix of k stages checks), -1 if none."""
    if level_caps is None:
        return -1
    caps = level_caps(k + 1)
    return caps[2].pairs if len(caps) > 2 else -1


def paired_values(x: int, band: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """min over the front stage's length (last axis) of x W + R: `next_pairs`'s companion of the DP's values."""
    with np.errstate(invalid="ignore"):  # 0 x inf where the band is inf: those entries are inf in cand
        return np.where(np.isfinite(cand), x * band + cand, np.inf).min(axis=-1)
