"""The recomputation lever inside the DP's stage tables: per table entry, the seconds it adds.

`dp.StageTables` describes a stage on units [lo, lo + w + 1) in band form.  For a device
class c (kind kappa, usable bytes U) and a position (in-flight count k, whether a stage
follows), `RecomputeBand.extra_s` returns, for every entry, the recompute seconds of the
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
whose M_s does not fit without it but can with it (M_s >= M_s(0) - k * all savings), and only
once each: results are cached per (kind, usable bytes, k, has a successor), shared by every
table of the same `Problem` object (`shared_band`: the heuristic's device orders, the DP), and an entry is walked only when
a pass first needs it (inside the pass's width, its F+B without recomputation under the cap;
entries beyond the cap cannot be used, so they stay inf until a pass needs them).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from hetpipe.partitioner.problem import Problem

#: Memory of every band entry (L+1, L) for (in-flight k, a stage follows): M_s without recomputation.
MemoryFn = Callable[[int, bool], np.ndarray]


class RecomputeBand:
    """Per-class recompute seconds in the band form of `dp.StageTables` (module docstring)."""

    def __init__(self, problem: Problem, hi: np.ndarray, valid: np.ndarray) -> None:
        L, kinds = problem.num_units, tuple(problem.fwd_s)
        self.mode, self.valid = problem.recompute, valid
        self.lo = np.broadcast_to(np.arange(L + 1)[:, None], valid.shape)
        self.hi = hi  # exclusive end of each entry, clamped to L
        a = np.asarray(problem.activation_bytes, dtype=np.float64)
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
        # (kind, usable, k, follows) -> (seconds, entries still to walk, M_s without recomputation)
        self._cache: dict[tuple[str, int, int, bool], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def extra_s(self, kind: str, usable: int, inflight: int, follows: bool, memory: MemoryFn,
                usable_within: np.ndarray) -> np.ndarray:
        """(L+1, width) seconds added to the stage's F+B by its recompute choice; inf = does not fit
        (or, for an entry outside `usable_within`, the band's (L+1, width) mask of entries whose F+B
        is under the cap, not worked out: the band cannot use it anyway)."""
        key, width = (kind, usable, inflight, follows), usable_within.shape[1]
        if key not in self._cache:
            mem0 = memory(inflight, follows)
            if self.mode == "all":
                all_s = self._all(kind, usable, inflight, mem0)
                self._cache[key] = (all_s, np.zeros(mem0.shape, dtype=bool), mem0)
            else:
                todo = self.valid & (mem0 > usable) & (mem0 - inflight * self.save_all <= usable)
                self._cache[key] = (np.where(mem0 <= usable, 0.0, np.inf), todo, mem0)
        out, todo, mem0 = self._cache[key]
        need = todo[:, :width] & usable_within
        if need.any():
            rows, cols = np.nonzero(need)
            out[rows, cols] = self._walk(kind, usable, inflight, rows, self.hi[rows, cols], mem0[rows, cols])
            todo[rows, cols] = False
        return out[:, :width]

    def _time_all(self, kind: str) -> np.ndarray:
        f = self.fwd[kind]
        cs = np.concatenate(([0.0], np.cumsum(np.where(self.elig_n, f, 0.0)[:-1])))
        lo, hi = self.lo, self.hi
        return np.where(self.elig_f[lo], f[lo], 0.0) + cs[hi] - cs[np.minimum(lo + 1, hi)]

    def _all(self, kind: str, usable: int, k: int, mem0: np.ndarray) -> np.ndarray:
        mem = mem0 - k * self.save_all + self.peak_all
        return np.where(self.valid & (mem <= usable), self._time_all(kind), np.inf)

    def _walk(self, kind: str, usable: int, k: int, lo: np.ndarray, hi: np.ndarray, mem0: np.ndarray) -> np.ndarray:
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
            fit = mask & np.isinf(res) & (mem0 - k * saved + peak <= usable)
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


#: The last problem's band, by identity: `dp.StageTables` of one `Problem` object (the heuristic's
#: device orders, the exact DP, the infeasibility search's passes) share its walked entries.
_SHARED: list[tuple[Problem, RecomputeBand]] = []


def shared_band(problem: Problem, hi: np.ndarray, valid: np.ndarray) -> RecomputeBand:
    """The `RecomputeBand` of `problem` (the same object for the same `problem` object)."""
    if _SHARED and _SHARED[0][0] is problem:
        return _SHARED[0][1]
    band = RecomputeBand(problem, hi, valid)
    _SHARED[:] = [(problem, band)]
    return band
