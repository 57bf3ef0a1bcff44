"""One pass of the count-vector DP (`dp`), level by level, and its threshold prune (issue 12 item 3, session 16).

`run_counts` is the pass `dp._min_sum_counts` and `dp.CountDP.min_sum` run: every count vector with the same
total k in one numpy batch, from the last stage back.  Two things keep it from touching states that cannot
matter, without changing any answer:

* **Dead rows and units.**  A vector whose every suffix (one card fewer, any class) is inf at every unit has no
  finite entry either: such rows are neither computed nor stored (`CountPass.rows`); and a front stage of at most
  `width` units can only start within `width` units before a unit where some suffix is finite, so each level
  computes only those start units.  gpt2-xl on 64 cards under the pace walk's caps: half to two thirds of a
  level's rows are dead, about 10 of the 51 start units live, 1.7-3.5% of the entries finite; the walks to their
  end take 3.7-4.6x fewer CPU seconds (`benchmarks/results/pace_windows.md`).
* **A threshold** (`Threshold`, for callers that only need to know whether the least value is under theta: the
  pace walk's decision passes, `schedule_bound.schedule_walk`): a suffix starting at unit u whose least value
  R_s plus a floor on any prefix covering units [0, u) (`prefix_floor`) reaches theta cannot complete a pipeline
  under theta, so its state is dropped.  Every placement with R_0 < theta keeps all its suffix states (each
  state's least value is at most the placement's own suffix value), so a pass returns the same least R_0 when
  it is under theta and either nothing or a value >= theta otherwise: min(result, theta) is a floor.

Example (two classes of one card, three units; the pass's least sum and the same pass under thresholds):
    >>> import math
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem
    >>> from hetpipe.partitioner.solvers.dp import CountDP
    >>> devs = (DeviceSlot("a0", "a", "n", 99), DeviceSlot("b0", "b", "n", 99))
    >>> prob = Problem({"a": (1.0,) * 3, "b": (2.0,) * 3}, {"a": (1.0,) * 3, "b": (2.0,) * 3}, (1,) * 3,
    ...                (1,) * 3, (0,) * 3, devs, ((math.inf, 1.0), (1.0, math.inf)), ((0.0, 0.0), (0.0, 0.0)), 2)
    >>> dp = CountDP(prob)
    >>> dp.min_sum(math.inf)[0], dp.min_sum(math.inf, threshold=6.5)[0], dp.min_sum(math.inf, threshold=6.0)
    (6.0, 6.0, None)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import numpy as np

from hetpipe.partitioner.solvers.cap_walk import check_deadline
from hetpipe.partitioner.solvers.pace_rule import (LevelCaps, PaceRule, WindowCompanions, count_next_min, next_pairs, pace_kept,
                                                   paired_values, spread)


def prefix_floor(tab: Any) -> np.ndarray:
    """Per start unit u (L+1): a floor on R_0 - R_s of any prefix covering units [0, u) before a suffix starting
    at u: every unit's F + B on its fastest class, plus the least 2C any class pair pays over the cut before u
    (`dp.StageTables`: compute[c][0, u - 1] is units [0, u) on class c, comm2 (C, C, L+1) the round trips).

    Example:
        >>> from types import SimpleNamespace
        >>> inf = np.inf   # two classes, two units: (1, 2) s on the first, (2, 0.5) s on the second
        >>> tab = SimpleNamespace(L=2, compute=[np.array([[1.0, 3.0], [2.0, inf], [inf, inf]]),
        ...                                     np.array([[2.0, 2.5], [0.5, inf], [inf, inf]])],
        ...                       comm2=np.full((2, 2, 3), 0.5))
        >>> prefix_floor(tab).tolist()   # unit 0 on the first, unit 1 on the second; the cut before unit 1
        [0.0, 1.5, 1.5]
    """
    # each unit on its own fastest class (a prefix may change class at every cut): compute[c][0, u] - [0, u - 1]
    per_unit = np.min([np.diff(np.concatenate(([0.0], comp[0, :]))) for comp in tab.compute], axis=0)
    floor = np.concatenate(([0.0], np.cumsum(per_unit)))
    floor[1:tab.L] += tab.comm2.min(axis=(0, 1))[1:tab.L]  # the cut before u (none before unit 0 or after L)
    return floor


def _ruled_band(tab: Any, c: int, k: int, cap: float, width: int, rule: PaceRule | None) -> np.ndarray:
    """Class c's front stages at level k under `cap`, and under the rule's single-step filter when given."""
    band = tab.band(c, k - 1, cap, width)
    if rule is None:
        return band
    with np.errstate(invalid="ignore"):  # inf entries give nan here: they stay inf
        return np.where(rule.weighted * band - rule.forward * tab.forward[c][:, :width] <= rule.cap, band, np.inf)


def _last_stages(lattice: Any, c: int, band: np.ndarray, val: np.ndarray, pv: np.ndarray | None, xn: int,
                 windows: WindowCompanions) -> None:
    """Level 1 (the last stage alone) on class c: its values and companions, in place."""
    has = np.asarray([st[c] > 0 for st in lattice.groups[1]])
    val[has, c] = band.min(axis=1)
    if pv is not None:
        pv[has, c] = paired_values(xn, band, band)
    windows.record(1, (has, c), band, band, None, lambda a: a)


def _front_class(tab: Any, c: int, k: int, band: np.ndarray, where: tuple[np.ndarray, np.ndarray, slice], *,
                 combine: Callable, comm: np.ndarray, after: np.ndarray, rule: PaceRule | None,
                 paired: np.ndarray | None, windows: WindowCompanions,
                 out: tuple[np.ndarray, np.ndarray, np.ndarray | None, int]) -> None:
    """Level k's states with a front stage on class c, in place in `out` (val, bp, pv, x of `next_pairs`): rows
    `idx` over their suffix rows `prev` (level k - 1's values `after`), front start units `units` only."""
    (idx, prev, units), (val, bp, pv, xn) = where, out
    width, L = band.shape[1], tab.L
    tot = combine(comm[None], after[prev])  # (n, C, L+1): 2C(c->f, u) (+|max) suffix
    f_best = np.argmin(tot, axis=1)
    h = np.take_along_axis(tot, f_best[:, None, :], axis=1)[:, 0, :]
    front = band[units][None]  # (1, U, W): the front stages that start in `units`
    cand = combine(front, spread(h, width, L)[:, units])  # (n, U, W)
    if rule is not None:
        cand = pace_kept(rule, band, cand, paired, prev, comm, width, units)
    next_min = partial(count_next_min, comm, width, units=units)
    cand = windows.kept(k, front, cand, next_min, lambda a: a[prev])
    if pv is not None:
        pv[idx, c, units] = paired_values(xn, front, cand)
    windows.record(k, (idx, c, units), front, cand, next_min, lambda a: a[prev])
    w_best = np.argmin(cand, axis=2)
    val[idx, c, units] = np.take_along_axis(cand, w_best[..., None], axis=2)[..., 0]
    u_best = np.minimum(np.arange(L + 1)[units][None, :] + w_best + 1, L)
    bp[idx, c, units, 0] = u_best
    bp[idx, c, units, 1] = np.take_along_axis(f_best, u_best, axis=1)


@dataclass(frozen=True)
class CountPass:
    """One pass's levels: vals[k] (r, C, L+1) and backs[k] (r, C, L+1, 2) over the r live rows of level k, and
    rows[k] (n,) each count vector's row there (-1: dead, every entry inf; `run_counts`)."""

    vals: dict[int, np.ndarray]
    backs: dict[int, np.ndarray]
    rows: dict[int, np.ndarray]

    def vector(self, k: int, row: int) -> int:
        """The count vector (index in `lattice.groups[k]`) of live row `row` of level k."""
        return int(np.flatnonzero(self.rows[k] == row)[0])


def _live_rows(lattice: Any, k: int, classes: int, after: np.ndarray, after_rows: np.ndarray, width: int,
               ) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray, slice]:
    """Level k's live rows: per class, (its rows at k, their suffix rows at k - 1) where the suffix row has a finite
    entry; each vector's row at k (-1 dead); the front start units a finite suffix can follow."""
    finite = np.isfinite(after)
    alive, starts = finite.any(axis=(1, 2)), np.flatnonzero(finite.any(axis=(0, 1)))
    units = slice(max(0, int(starts[0]) - width), int(starts[-1])) if starts.size else slice(0, 0)
    picked = []
    for c in range(classes):
        idx, prev = lattice.moves[(k, c)]
        q = after_rows[prev]
        keep = q >= 0
        keep[keep] = alive[q[keep]]  # a dead suffix row gives an inf row: skip it
        picked.append((idx[keep], q[keep]))
    live = np.unique(np.concatenate([i for i, _ in picked]))
    rows = np.full(len(lattice.groups[k]), -1, dtype=np.int64)
    rows[live] = np.arange(live.size)
    return [(rows[i], q) for i, q in picked], rows, units


def run_counts(tab: Any, cap: float, lattice: Any, combine: Callable = np.add, *, deadline: float = math.inf,
               level_caps: LevelCaps | None = None, threshold: float = math.inf) -> CountPass:
    """Backward DP over count vectors (`dp.StageTables` `tab`, `dp._Lattice` `lattice`): vals[k][r] (C, L+1) is
    the least cost of a suffix that uses the devices of the count vector of live row r (`CountPass`), starts at
    unit u and has its front stage on class f; backs[k][r] (C, L+1, 2) the next stage's start unit and front class.
    Dead rows are left out and, with a finite `threshold` (sums only), states that cannot end under it dropped
    (module docstring)."""
    C, L = len(tab.classes), tab.L
    width = tab.width(cap)
    comm_ok = np.where(tab.comm2 <= cap, tab.comm2, np.inf)
    ceiling = threshold - prefix_floor(tab) if math.isfinite(threshold) else None  # (L+1,) per start unit
    out = CountPass({}, {}, {})
    paired: dict[int, np.ndarray] = {}  # least x W_front + R per state, x of the level above (`next_pairs`)
    windows = WindowCompanions(level_caps, max(lattice.groups, default=0))  # chains of 3+ ranks (`PaceRule.windows`)
    for k in sorted(lattice.groups):
        check_deadline(deadline)  # one level is at most a few hundred ms at the state budget
        band_cap, value_cap, *rule = (cap, math.inf) if level_caps is None else level_caps(k)
        if k == 1:
            rows, moves, units = np.arange(len(lattice.groups[1])), None, slice(0, 0)
        else:
            moves, rows, units = _live_rows(lattice, k, C, out.vals[k - 1], out.rows[k - 1], width)
        n, xn = int(rows.max(initial=-1)) + 1, next_pairs(level_caps, k)
        val = np.full((n, C, L + 1), np.inf)
        bp = np.full((n, C, L + 1, 2), -1, dtype=np.int32)
        pv = np.full((n, C, L + 1), np.inf) if xn >= 0 else None
        windows.start(k, (n, C, L + 1))
        for c in range(C):
            band = _ruled_band(tab, c, k, min(cap, band_cap), width, rule[0] if rule else None)
            if k == 1:
                _last_stages(lattice, c, band, val, pv, xn, windows)
            elif moves[c][0].size and units.stop > units.start:
                _front_class(tab, c, k, band, (*moves[c], units), combine=combine, comm=comm_ok[c],
                             after=out.vals[k - 1], rule=rule[0] if rule else None, paired=paired.get(k - 1),
                             windows=windows, out=(val, bp, pv, xn))
        val[val > value_cap] = np.inf  # suffixes over their level's cap are not extended
        if ceiling is not None:
            val[val >= ceiling] = np.inf  # (broadcast over the last axis, the start unit) they cannot end under it
        out.vals[k], out.backs[k], out.rows[k] = val, bp, rows
        if pv is not None:
            paired[k] = pv
        if not np.isfinite(val).any():
            break  # every longer suffix extends one of these: none (a cap nothing meets costs one level)
    return out
