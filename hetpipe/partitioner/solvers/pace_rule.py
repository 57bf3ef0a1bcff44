"""The pace walk's filters on a DP suffix's front stage (`schedule_bound.level_caps`, issue 12 item 3).

`PaceRule` holds, per number of stages in a suffix, the caps every placement whose pace G is under a
cap gamma meets (round trips, single steps, and the pair chain with the next stage); the count DP
(`dp.CountDP`) and the node-run DP (`pace_runs.RunDP`) apply them level by level.  The pair chain needs the
next stage's W: the DPs keep beside each state's least R the least x W_front + R of its suffixes
(`paired_values`), x being the pair count of the level above (`next_pairs`).  Window chains of three or more
ranks (`PaceRule.windows`, session 15) go the same way through `WindowCompanions`, one companion per window and
level between the window's front and its last rank.

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
    #: Window chains of three or more ranks (`schedule_bound.window_pace`): (w, x, y) with m - 1 - k = x w + y,
    #: x >= 1, kept when x P_w + y W + R <= cap, P_w bounded below per state as the pair's (`WindowCompanions`)
    windows: tuple[tuple[int, int, int], ...] = ()


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


#: Per array of a DP level's states (..., L+1) of values at each next stage's start and a multiplier mu:
#: min over the next stages' kinds (and run positions) of mu 2C (front kind -> next kind) + the value, per
#: front start unit and length (..., L+1, W).  The DP supplies it for one front kind (`WindowCompanions`).
NextMin = Callable[[np.ndarray, float], np.ndarray]


class WindowCompanions:
    """The window chains' filters (`PaceRule.windows`) through a DP that runs from the last stage back.

    A window of w ranks from a front stage s at level K (K stages to the end), x windows and y single steps:
    x P_w + y W_s + R_s = (x + y + 1) W_s + (x + 1) 2C_s + A_1(s + 1) with A_d(t) = x P_{w-d}(t) + R_t, where
    P_1(t) = W_t and P_j(t) = W_t + 2C_t + P_{j-1}(t + 1), so A_{w-1}(t) = x W_t + R_t and, for d < w - 1,
    A_d(t) = (x + 1)(W_t + 2C_t) + A_{d+1}(t + 1).  Each state at level K - d keeps the least A_d over its
    admitted suffixes, keyed (K, w) (x is K's): a lower bound on any admitted suffix's, so the filter at
    level K (least over the next stages, as `pair_filter`) drops no suffix of a pipeline whose windows are
    under the cap, and the DP's least R_0 stays a valid bound (a relaxation, as the pair filter).

    Example (m = 16; level 5 filters windows of 3, x = 3, y = 1; level 4 keeps A_1, levels 3 and 2 A_2):
        >>> rules = {k: PaceRule(0, 0, 1, 0, 1.0, windows=((3, 3, 1),) if k == 5 else ()) for k in range(1, 9)}
        >>> comp = WindowCompanions(lambda k: (1.0, 1.0, rules[k]), levels=8)
        >>> comp.requests(4), comp.requests(3), comp.requests(2)
        ([(5, 3, 3)], [(5, 3, 3)], [])
    """

    def __init__(self, level_caps: LevelCaps | None, levels: int) -> None:
        """`levels`: the most stages a suffix has (the rules are read once per level: the DP asks per class)."""
        caps = [()] + [level_caps(k) if level_caps is not None else () for k in range(1, levels + 1)]
        self.rules = [c[2] if len(c) > 2 else None for c in caps]
        reach = max((w for r in self.rules if r is not None for w, _, _ in r.windows), default=1)
        self.asked = [[(j + d, w, x) for d in range(1, reach) if j + d <= levels and self.rules[j + d] is not None
                       for w, x, _ in self.rules[j + d].windows if d <= w - 1] for j in range(levels + 1)]
        self.before: dict[tuple[int, int], np.ndarray] = {}  # the level below's arrays, keyed (K, w)
        self.now: dict[tuple[int, int], np.ndarray] = {}

    def rule(self, k: int) -> PaceRule | None:
        return self.rules[k] if k < len(self.rules) else None

    def requests(self, j: int) -> list[tuple[int, int, int]]:
        """(K, w, x) of the windows whose A_{K-j} the states at level j keep."""
        return self.asked[j] if j < len(self.asked) else []

    def start(self, j: int, shape: tuple[int, ...]) -> None:
        """A new level j: last level's arrays become `before`, fresh ones (inf) for level j's requests."""
        self.before, self.now = self.now, {(K, w): np.full(shape, np.inf) for K, w, _ in self.requests(j)}

    def kept(self, k: int, band: np.ndarray, cand: np.ndarray, next_min: NextMin,
             take: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """`cand` (..., L+1, W) where every window of level k's rule is under its cap, inf elsewhere; `take`
        selects, from a `before` array, the next states of these fronts (as the DP indexes its values)."""
        rule = self.rule(k)
        for w, x, y in (rule.windows if rule is not None else ()):
            if (k, w) in self.before:
                rest = next_min(take(self.before[(k, w)]), x + 1.0)
                with np.errstate(invalid="ignore"):
                    cand = np.where((x + y + 1) * band + rest <= rule.cap, cand, np.inf)
        return cand

    def record(self, j: int, where: tuple, band: np.ndarray, cand: np.ndarray, next_min: NextMin | None,
               take: Callable[[np.ndarray], np.ndarray]) -> None:
        """Level j's A values at `where` from its front stages `band` and admitted candidates `cand` (W = F + B
        per front length, R per front length: inf where not admitted); `next_min` None at level 1."""
        for K, w, x in self.requests(j):
            if K - j == w - 1:
                self.now[(K, w)][where] = paired_values(x, band, cand)
            elif next_min is not None and (K, w) in self.before:
                rest = next_min(take(self.before[(K, w)]), x + 1.0)
                with np.errstate(invalid="ignore"):
                    self.now[(K, w)][where] = np.where(np.isfinite(cand), (x + 1) * band + rest, np.inf).min(axis=-1)


def spread(h: np.ndarray, width: int, L: int) -> np.ndarray:
    """windows[i, lo, w] = h[i, lo + w + 1] (inf past the last unit), a view, not a copy: per front stage's start
    and length, the value at the next stage's start (the count DP's gather).

    Example:
        >>> spread(np.array([[0.0, 1.0, 2.0]]), 2, 2).tolist()
        [[[1.0, 2.0], [2.0, inf], [inf, inf]]]
    """
    padded = np.concatenate((h, np.full((h.shape[0], width), np.inf)), axis=1)
    return np.lib.stride_tricks.sliding_window_view(padded, width, axis=1)[:, 1:L + 2, :]


def pace_kept(rule: PaceRule, band: np.ndarray, cand: np.ndarray, paired: np.ndarray | None, prev: np.ndarray,
              comm: np.ndarray, width: int, units: slice = slice(None)) -> np.ndarray:
    """The count DP's filters (`dp.CountDP`): `cand` (n, U, W) where the rule's round trips and pair chain
    are under its cap; band (L+1, W) the front stages' W, paired the level below's `paired_values` (or None),
    prev the next states' rows, comm (C, L+1) 2C to each next class; `units` the front start units (U of the
    L+1) that `cand` holds (`count_pass.run_counts` computes only those a finite suffix can follow)."""
    L = band.shape[0] - 1
    with np.errstate(invalid="ignore"):
        cand = np.where(rule.trips * cand + rule.steps * band[units][None] <= rule.cap, cand, np.inf)
        if rule.pairs >= 0 and paired is not None:
            rest = spread(pair_filter(rule, comm[None], paired[prev]), width, L)[:, units]
            cand = pair_kept(rule, band[units][None], rest, cand)
    return cand


def count_next_min(comm: np.ndarray, width: int, after: np.ndarray, mu: float,
                   units: slice = slice(None)) -> np.ndarray:
    """`NextMin` of the count DP: after (n, C, L+1) at the next states, comm (C, L+1) 2C to each next
    class from one front class; only the front start units `units` (as `pace_kept`)."""
    return spread((mu * comm[None] + after).min(axis=1), width, after.shape[-1] - 1)[:, units]
