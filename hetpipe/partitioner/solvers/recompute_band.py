"""The recomputation lever inside the DP's stage tables: per table entry, the seconds it adds.

`dp.StageTables` describes a stage on units [lo, lo + w + 1) in band form.  For a device
class c (kind kappa, usable bytes U) and a position (how many stages follow it: that fixes the
moments of its action list), `RecomputeBand.extra_s` returns, for every entry, the recompute seconds of the
stage's choice under `Problem.recompute` (`hetpipe.partitioner.recompute`):

* ``all``: the whole order's forward time where M_s with it fits, inf elsewhere;
* ``auto``: 0 where M_s fits without recomputation; else the seconds of the *smallest* r
  whose prefix of the stage's order fits (inf when none does).  Taking the smallest
  fitting r inside the table keeps the DP exact (argument in `partitioner/recompute.py`).

Cost.  The order of a stage is the kind's global order of the units' keys (saved bytes per
recompute second, `cost_models.recompute`) restricted to the stage, except its first unit,
whose key uses no input bytes.  One walk down the global order visits every entry's prefixes
in their own order at once (a stage's first unit is inserted where its key ranks), so an
(entry, r) pair costs O(1): O(L) numpy steps over the entries that need recomputation, i.e.
whose M_s does not fit without it but can with it (with all savings, `memory_with`), and only
once each: results are cached per (kind, usable bytes, stages after it), shared by every
table of the same `Problem` object (`shared_band`: the heuristic's device orders, the DP), and an entry is walked only when
a pass first needs it (inside the pass's width, its F+B without recomputation under the cap;
entries beyond the cap cannot be used, so they stay inf until a pass needs them).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from hetpipe.partitioner.problem import Problem

#: The moments of every band entry (L+1, L) for a stage with that many stages after it: per moment of
#: its action list, (micro-batches in flight k_t, inside a backward, its bytes without recomputation)
#: (`dp.StageTables.moments`).
MomentsFn = Callable[[int], list[tuple[int, int, np.ndarray]]]


def memory_with(moments: list[tuple[int, int, np.ndarray]], saved: np.ndarray | float,
                peak: np.ndarray | float) -> np.ndarray:
    """M_s when each in-flight micro-batch keeps `saved` bytes less and `peak` lives again inside a
    backward: max_t (M_t - k_t * saved), a backward's moments plus `peak` where it is > 0
    (`pipeline_stage_bytes`)."""
    return np.max([held - k * saved if not backward else np.where(np.asarray(peak) > 0, held - k * saved + peak,
                                                                   -np.inf)
                   for k, backward, held in moments], axis=0)


class RecomputeBand:
    """Per-class recompute seconds in the band form of `dp.StageTables` (module docstring)."""

    def __init__(self, problem: Problem, hi: np.ndarray, valid: np.ndarray) -> None:
        L, kinds = problem.num_units, tuple(problem.fwd_s)
        self.mode, self.valid = problem.recompute, valid
        self.lo = np.broadcast_to(np.arange(L + 1)[:, None], valid.shape)
        self.hi = hi  # exclusive end of each entry, clamped to L
        a = np.asarray(problem.unit_recompute_bytes, dtype=np.float64)
        bd = np.asarray(problem.boundary_bytes, dtype=np.float64)
        self.act = np.concatenate((a, [0.0]))  # index L: the empty start of a past-the-end entry
        # saved bytes as a non-first unit (keeps boundary_bytes[u-1]) and as a stage's first unit
        self.save_n = np.concatenate(([0.0], a[1:] - bd[:-1], [0.0])) if L else np.zeros(1)
        self.elig_n = self.save_n > 0
        self.elig_f = self.act > 0
        self.fwd = {k: np.concatenate((np.asarray(problem.fwd_s[k], dtype=np.float64), [0.0])) for k in kinds}
        lo, hic = self.lo, hi
        cs = np.concatenate(([0.0], np.cumsum(np.where(self.elig_n, self.save_n, 0.0)[:L])))
        first_a = np.where(self.elig_f, self.act, 0.0)
        # the whole order's savings and peak (kind-independent) per entry
        self.save_all = first_a[lo] + cs[hic] - cs[np.minimum(lo + 1, hic)]
        inner = np.where(self.elig_n, self.act, 0.0)
        w = np.arange(valid.shape[1])[None, :]
        later = np.where(w >= 1, inner[np.minimum(lo + w, L)], 0.0)  # unit lo+w as a non-first unit
        self.peak_all = np.maximum(first_a[lo], np.maximum.accumulate(later, axis=1))
        # (kind, usable, stages after) -> (seconds, entries still to walk, moments without recomputation)
        self._cache: dict[tuple[str, int, int, str], tuple[np.ndarray, np.ndarray, list]] = {}

    def extra_s(self, kind: str, usable: int, after_stages: int, moments: MomentsFn,
                usable_within: np.ndarray, *, tag: str = "") -> np.ndarray:
        """(L+1, width) seconds added to the stage's F+B by its recompute choice; inf = does not fit
        (or, for an entry outside `usable_within`, the band's (L+1, width) mask of entries whose F+B
        is under the cap, not worked out: the band cannot use it anyway).  `tag` names `moments` when they
        are not the table's own (the offload lever's, its bytes taken off every moment): cached apart."""
        key, width = (kind, usable, after_stages, tag), usable_within.shape[1]
        if key not in self._cache:
            mom = moments(after_stages)
            mem0 = memory_with(mom, 0.0, 0.0)
            if self.mode == "all":
                all_s = self._all(kind, usable, mom)
                self._cache[key] = (all_s, np.zeros(mem0.shape, dtype=bool), mom)
            else:
                todo = self.valid & (mem0 > usable) & (memory_with(mom, self.save_all, 0.0) <= usable)
                self._cache[key] = (np.where(mem0 <= usable, 0.0, np.inf), todo, mom)
        out, todo, mom = self._cache[key]
        need = todo[:, :width] & usable_within
        if need.any():
            rows, cols = np.nonzero(need)
            out[rows, cols] = self._walk(kind, usable, rows, self.hi[rows, cols],
                                         [(k, b, m[rows, cols]) for k, b, m in mom])
            todo[rows, cols] = False
        return out[:, :width]

    def _time_all(self, kind: str) -> np.ndarray:
        f = self.fwd[kind]
        cs = np.concatenate(([0.0], np.cumsum(np.where(self.elig_n, f, 0.0)[:-1])))
        lo, hi = self.lo, self.hi
        return np.where(self.elig_f[lo], f[lo], 0.0) + cs[hi] - cs[np.minimum(lo + 1, hi)]

    def _all(self, kind: str, usable: int, moments: list[tuple[int, int, np.ndarray]]) -> np.ndarray:
        mem = memory_with(moments, self.save_all, self.peak_all)
        return np.where(self.valid & (mem <= usable), self._time_all(kind), np.inf)

    def _walk(self, kind: str, usable: int, lo: np.ndarray, hi: np.ndarray,
              moments: list[tuple[int, int, np.ndarray]]) -> np.ndarray:
        """Smallest-fitting-prefix seconds for entries [lo, hi) (see the module docstring)."""
        f, act = self.fwd[kind], self.act
        with np.errstate(divide="ignore"):
            key_n = np.where(f > 0, self.save_n / np.where(f > 0, f, 1.0), np.inf)
            key_f = np.where(f > 0, act / np.where(f > 0, f, 1.0), np.inf)
        span = np.zeros(len(f), dtype=bool)
        span[int(lo.min()) + 1:int(hi.max())] = True  # only units inside some entry can join a prefix
        order = sorted(np.flatnonzero(self.elig_n & span).tolist(), key=lambda u: (-key_n[u], u))
        saved, peak, secs = np.zeros(lo.shape), np.zeros(lo.shape), np.zeros(lo.shape)
        res = np.full(lo.shape, np.inf)
        first_left = self.elig_f[lo].copy()  # first units not yet in their stage's prefix
        kf = key_f[lo]

        def add(mask: np.ndarray, gain: np.ndarray | float, a: np.ndarray | float, t: np.ndarray | float) -> None:
            saved[mask] += gain if np.isscalar(gain) else gain[mask]
            np.maximum(peak, np.where(mask, a, 0.0), out=peak)
            secs[mask] += t if np.isscalar(t) else t[mask]
            fit = mask & np.isinf(res) & (memory_with(moments, saved, peak) <= usable)
            res[fit] = secs[fit]

        for v in order:
            kv = key_n[v]
            now = first_left & ((kf > kv) | ((kf == kv) & (lo < v)))  # the first unit ranks before v
            if now.any():
                add(now, act[lo], act[lo], f[lo])
                first_left &= ~now
            add((lo < v) & (v < hi), float(self.save_n[v]), float(act[v]), float(f[v]))
            if not np.isinf(res).any():
                return res
        if first_left.any():
            add(first_left, act[lo], act[lo], f[lo])
        return res


#: The last problems' bands, by identity: `dp.StageTables` of one `Problem` object (the heuristic's
#: device orders, the exact DP, the infeasibility search's passes) share its walked entries.  Two: a
#: problem and its selective variant (`cost_models.selective`) alternate.
_SHARED: list[tuple[Problem, RecomputeBand]] = []
SHARED_BANDS = 2


def shared_band(problem: Problem, hi: np.ndarray, valid: np.ndarray) -> RecomputeBand:
    """The `RecomputeBand` of `problem` (the same object for the same `problem` object)."""
    for held, band in _SHARED:
        if held is problem:
            return band
    band = RecomputeBand(problem, hi, valid)
    _SHARED[:] = [(problem, band), *_SHARED[:SHARED_BANDS - 1]]
    return band
