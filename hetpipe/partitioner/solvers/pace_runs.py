"""The pace walk beyond the count DP: kinds exact, card counts dropped, node boundaries kept (issue 12 item 3).

Why.  Past the count DP's budget (64 cards of eight kinds and up) the pace walk of `schedule_bound`
ran on the node-free relaxation with merged kinds: every link as fast as the fastest between two
kinds (the PCIe inside a node) and the slow kinds as fast as the fastest of them.  The schedule's
pace at 256 cards is set by the round trips across node boundaries, which that relaxation drops
(gpt2-xl on 256 cards: bound 7.6 s against a replayed 9.6 s).

The relaxation.  A real pipeline is a sequence of *runs*: maximal blocks of consecutive stages on
one node.  A run has at most as many stages as the largest node has cards; a cut inside a run costs
at least the fastest same-node link between the two kinds, a cut between runs at least the fastest
link between two different nodes (latency and bandwidth taken separately: C = latency + bytes /
bandwidth).  Card counts are dropped: a stage may take any kind, with the kind's roomiest card's
memory (`relax.relaxed_problem`).  Every real placement is such a pipeline with no larger F, B, C, so
its R_s and W_s are no larger and `schedule_bound.schedule_walk` on this DP bounds the real optimum.

The DP runs from the last stage back over (stages from the end k, stages of the front run from the
front stage to its end, front kind, start unit); its value is the suffix's round trip R_s, so the
pace walk's caps and `dp.PaceRule` filters apply exactly as in the count DP.

Example (two cards of one kind on two nodes, a slow link between them: two stages cross it):
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem
    >>> prob = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (2.0, 2.0)}, state_bytes=(1, 1),
    ...                activation_bytes=(1, 1), boundary_bytes=(1, 0),
    ...                devices=(DeviceSlot("d0", "a", "n0", 99), DeviceSlot("d1", "a", "n1", 99)),
    ...                bandwidth_bytes_s=((1.0, 1.0), (1.0, 1.0)), latency_s=((0.0, 0.0), (0.0, 0.0)), microbatches=4)
    >>> dp = RunDP(prob)
    >>> value, picks = dp.min_sum(float("inf"))
    >>> value, [(p.first_unit, p.last_unit, p.round_trip_s) for p in picks]   # one stage: R_0 = 6
    (6.0, [(0, 1, 0.0)])
    >>> dp.min_sum(5.0)[1][0].round_trip_s   # W <= 5: two stages and a round trip of 2 x 1 s over the node link
    2.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Sequence

import numpy as np

from hetpipe.partitioner.problem import Problem, Stage
from hetpipe.partitioner.solvers.cap_walk import check_deadline
from hetpipe.partitioner.solvers.dp import DeviceClass, StageTables, StateSpaceTooLarge
from hetpipe.partitioner.solvers.pace_rule import (LevelCaps, PaceRule, WindowCompanions, next_pairs, pair_filter, pair_kept,
                                                   paired_values)
from hetpipe.partitioner.solvers.relax import relaxed_problem
from hetpipe.partitioner.solvers.schedule_bound import stage_pace, window_pace


@dataclass(frozen=True)
class RunStage:
    """One stage of a relaxed pipeline: its kind, units [first_unit, last_unit], W = F + B with its levers,
    F, and the round trip 2 C over the cut after it (0 for the last stage)."""

    kind: str
    first_unit: int
    last_unit: int
    work_s: float
    fwd_s: float
    round_trip_s: float
    new_node_after: bool  # the next stage starts another run


def link_tables(problem: Problem, kinds: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(same node, across nodes): 2 C from kind a to kind b at the cut before unit u, (K, K, L+1), the least
    latency plus the cut's bytes over the best bandwidth of any such card pair; inf where no pair exists."""
    of = np.asarray([kinds.index(d.kind) for d in problem.devices])
    node = np.asarray([d.node for d in problem.devices])
    bw, lat = np.asarray(problem.bandwidth_bytes_s, dtype=float), np.asarray(problem.latency_s, dtype=float)
    K, L = len(kinds), problem.num_units
    key = (of[:, None] * K + of[None, :]) * 2 + (node[:, None] == node[None, :])
    off = ~np.eye(len(of), dtype=bool)  # a card's link to itself is not a link
    best_bw, best_lat = np.zeros(2 * K * K), np.full(2 * K * K, math.inf)
    np.maximum.at(best_bw, key[off], bw[off])
    np.minimum.at(best_lat, key[off], lat[off])
    cut = np.concatenate(([0.0], np.asarray(problem.boundary_bytes, dtype=float)[:L - 1], [0.0]))  # index u: cut u-1
    with np.errstate(divide="ignore", invalid="ignore"):
        per = 2.0 * (best_lat[:, None] + cut[None, :] / best_bw[:, None])  # (2 K K, L+1)
    per[:, 0] = per[:, L] = 0.0
    per = np.where((best_bw > 0)[:, None], per, math.inf).reshape(K, K, 2, L + 1)
    return per[:, :, 1], per[:, :, 0]


class RunDP:
    """The node-aware, count-free DP of the module docstring, with `dp.CountDP.min_sum`'s protocol."""

    def __init__(self, problem: Problem, *, max_units_x_stages: int = 20000) -> None:
        relaxed = relaxed_problem(problem, one_per_kind=True)  # the stage tables need one card per kind
        # one class per kind: relaxed, a kind's cards share memory, host figures and links (what
        # `dp.device_classes` finds, in seconds at 1,024 cards)
        classes = tuple(DeviceClass(d.kind, d.node, d.usable_bytes, (i,)) for i, d in enumerate(relaxed.devices))
        members = {d.kind: [i] for i, d in enumerate(relaxed.devices)}
        self.kinds = list(members)
        self.problem, self.tab = problem, StageTables(relaxed, classes)
        self.intra2, self.inter2 = link_tables(problem, self.kinds)
        nodes: dict[str, int] = {}
        for d in problem.devices:
            nodes[d.node] = nodes.get(d.node, 0) + 1
        self.run = max(nodes.values())
        self.stages = min(problem.num_units, len(problem.devices))
        if self.stages * problem.num_units * self.run > max_units_x_stages * len(self.kinds):
            raise StateSpaceTooLarge(f"{self.stages} stages x {problem.num_units} units x runs of {self.run}")

    def min_sum(self, cap: float, *, level_caps: LevelCaps | None = None,
                deadline: float = math.inf) -> tuple[float, tuple[RunStage, ...]] | None:
        """Least R_0 over relaxed pipelines whose stages' F + B are under `cap` and the caps of `level_caps`."""
        tab, K, L, run = self.tab, len(self.kinds), self.tab.L, self.run
        width = tab.width(cap)
        ends = tab.hi[:, :width]
        values = np.full((run, K, L + 1), math.inf)  # [stages after the front in its run, front kind, unit]
        paired = None  # least x W_front + R per state, x of the level above (`dp.next_pairs`)
        levels: list[tuple[np.ndarray, list[np.ndarray]]] = []
        best: tuple[float, int, int, int] | None = None
        windows = WindowCompanions(level_caps, self.stages)  # chains of 3+ ranks (`PaceRule.windows`)
        for k in range(1, self.stages + 1):
            check_deadline(deadline)
            values, paired, level = self._level(k, cap, width, ends, (values, paired), level_caps, windows)
            levels.append(level)
            at0 = values[:, :, 0]
            if np.isfinite(at0).any() and (best is None or at0.min() < best[0]):
                p, c = np.unravel_index(int(np.argmin(at0)), at0.shape)
                best = (float(at0[p, c]), k, int(p), int(c))
            if not np.isfinite(values).any():
                break
        if best is None:
            return None
        return best[0], self._unwind(levels, best[1:], ends)

    def _level(self, k: int, cap: float, width: int, ends: np.ndarray,
               after_values: tuple[np.ndarray, np.ndarray | None], level_caps: LevelCaps | None,
               windows: WindowCompanions,
               ) -> tuple[np.ndarray, np.ndarray | None, tuple[np.ndarray, list[np.ndarray]]]:
        """Values of the suffixes of k stages, their `dp.next_pairs` companion, and (back-pointers
        (run, K, L+1, 3): width, next kind, next position; each kind's band) to unwind them."""
        tab, K, L, run = self.tab, len(self.kinds), self.tab.L, self.run
        after, paired = after_values
        band_cap, value_cap, *rule = (cap, math.inf) if level_caps is None else level_caps(k)
        xn = next_pairs(level_caps, k)
        pv = np.full((run, K, L + 1), math.inf) if xn >= 0 else None
        out = np.full((run, K, L + 1), math.inf)
        back = np.full((run, K, L + 1, 3), -1, dtype=np.int64)
        bands = []
        windows.start(k, (run, K, L + 1))
        for c in range(K):
            band = tab.band(c, k - 1, min(cap, band_cap), width)
            with np.errstate(invalid="ignore"):  # inf entries give nan: they stay inf
                if rule:
                    band = np.where(rule[0].weighted * band - rule[0].forward * tab.forward[c][:, :width]
                                    <= rule[0].cap, band, math.inf)
                bands.append(band)
                if k == 1:
                    out[0, c], back[0, c, :, 0] = band.min(axis=1), band.argmin(axis=1)
                    if pv is not None:
                        pv[0, c] = paired_values(xn, band, band)
                    windows.record(1, (0, c), band, band, None, lambda a: a)
                    continue
                h, nxt = self._next(c, after)  # (run, L+1): best suffix from each next start, per position
                cand = band[None] + h[:, ends]  # (run, L+1, W)
                if rule:
                    cand = np.where(rule[0].trips * cand + rule[0].steps * band[None] <= rule[0].cap, cand, math.inf)
                    if rule[0].pairs >= 0 and paired is not None:  # `dp.PaceRule`'s pair chain, next stages as `_next`
                        cand = pair_kept(rule[0], band[None], self._pair_next(c, paired, rule[0])[:, ends], cand)
                next_min = partial(self._window_next, c, ends)
                cand = windows.kept(k, band[None], cand, next_min, lambda a: a)
                if pv is not None:
                    pv[:, c] = paired_values(xn, band[None], cand)
                windows.record(k, (slice(None), c), band[None], cand, next_min, lambda a: a)
            w = cand.argmin(axis=2)
            out[:, c] = np.take_along_axis(cand, w[..., None], axis=2)[..., 0]
            starts = ends[np.arange(L + 1)[None, :], w]  # (run, L+1): the next stage's first unit
            back[:, c, :, 0] = w
            back[:, c, :, 1:] = np.take_along_axis(nxt, np.repeat(starts[..., None], 2, axis=2), axis=1)
        out[out > value_cap] = math.inf  # suffixes over their level's cap are not extended
        return out, pv, (back, bands)

    def _next(self, c: int, after: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(h, where): h[p, v] the least 2C + R of a suffix starting at unit v after a front stage of kind c
        at run position p (0: the suffix starts a new run; p >= 1: it continues this run at position
        p - 1); where[p, v] = (its kind, its position)."""
        run, K, L1 = after.shape
        new = (self.inter2[c][None] + after).reshape(run * K, L1)  # any position, across nodes
        pick = new.argmin(axis=0)
        h = np.empty((run, L1))
        where = np.empty((run, L1, 2), dtype=np.int64)
        h[0], where[0, :, 0], where[0, :, 1] = new[pick, np.arange(L1)], pick % K, pick // K
        if run > 1:
            same = self.intra2[c][None] + after[:-1]  # (run-1, K, L+1)
            f = same.argmin(axis=1)
            h[1:] = np.take_along_axis(same, f[:, None, :], axis=1)[:, 0]
            where[1:, :, 0], where[1:, :, 1] = f, np.arange(run - 1)[:, None]
        return h, where

    def _pair_next(self, c: int, paired: np.ndarray, rule: PaceRule) -> np.ndarray:
        """(run, L+1): `dp.pair_filter` over the next stages `_next` may pick after a front stage of kind c."""
        run, _, L1 = paired.shape
        out = np.empty((run, L1))
        out[0] = pair_filter(rule, self.inter2[c][None], paired).min(axis=0)  # a new run: any position
        if run > 1:
            out[1:] = pair_filter(rule, self.intra2[c][None], paired[:-1])
        return out

    def _window_next(self, c: int, ends: np.ndarray, after: np.ndarray, mu: float) -> np.ndarray:
        """`pace_rule.NextMin` over the next stages `_next` may pick after a front stage of kind c: after
        (run, K, L+1) a window companion at the level below; (run, L+1, W) per front start and length."""
        run, _, L1 = after.shape
        out = np.empty((run, L1))
        out[0] = (mu * self.inter2[c][None] + after).min(axis=(0, 1))  # a new run: any position
        if run > 1:
            out[1:] = (mu * self.intra2[c][None] + after[:-1]).min(axis=1)
        return out[:, ends]

    def priced_min(self, cap: float, price: np.ndarray, *, level_caps: LevelCaps | None = None,
                   deadline: float = math.inf) -> tuple[float, int] | None:
        """min over the pipelines `min_sum` admits of R_0 plus, per stage, `price` of its kind (seconds, (K,) in
        `kinds`' order), and how many stages of a priced kind that pipeline has; None when none passes.

        The filters see each state's least R exactly as `min_sum`'s (the priced value is minimised beside it, not
        instead: a suffix is dropped only where the least-R one fails), so for any pipeline that `min_sum` admits
        its R_0 plus its prices is at least this value (`pace_prices`)."""
        K, L, run = len(self.kinds), self.tab.L, self.run
        width = self.tab.width(cap)
        ends = self.tab.hi[:, :width]
        after = (np.full((run, K, L + 1), math.inf), None, np.full((run, K, L + 1), math.inf), np.zeros((run, K, L + 1)))
        best: tuple[float, int] | None = None
        for k in range(1, self.stages + 1):
            check_deadline(deadline)
            after = self._priced_level(k, cap, width, ends, after, level_caps, price)
            at0, counts = after[2][:, :, 0], after[3][:, :, 0]
            if np.isfinite(at0).any() and (best is None or at0.min() < best[0]):
                where = np.unravel_index(int(np.argmin(at0)), at0.shape)
                best = (float(at0[where]), int(counts[where]))
            if not np.isfinite(after[0]).any():
                break
        return best

    def _priced_level(self, k: int, cap: float, width: int, ends: np.ndarray, after_all: tuple, level_caps: LevelCaps | None,
                      price: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray]:
        """`_level`'s values and pair companion, with the least priced value per state and its priced stages."""
        K, L, run = len(self.kinds), self.tab.L, self.run
        after, paired, after_p, after_n = after_all
        band_cap, value_cap, *rule = (cap, math.inf) if level_caps is None else level_caps(k)
        xn = next_pairs(level_caps, k)
        pv = np.full((run, K, L + 1), math.inf) if xn >= 0 else None
        out, out_p, out_n = (np.full((run, K, L + 1), math.inf), np.full((run, K, L + 1), math.inf),
                             np.zeros((run, K, L + 1)))
        for c in range(K):
            band = self.tab.band(c, k - 1, min(cap, band_cap), width)
            mine = float(price[c] > 0)
            with np.errstate(invalid="ignore"):
                if rule:
                    band = np.where(rule[0].weighted * band - rule[0].forward * self.tab.forward[c][:, :width]
                                    <= rule[0].cap, band, math.inf)
                if k == 1:
                    out[0, c], out_p[0, c], out_n[0, c] = band.min(axis=1), band.min(axis=1) + price[c], mine
                    if pv is not None:
                        pv[0, c] = paired_values(xn, band, band)
                    continue
                cand = band[None] + self._next(c, after)[0][:, ends]  # (run, L+1, W): as `_level`
                if rule:
                    cand = np.where(rule[0].trips * cand + rule[0].steps * band[None] <= rule[0].cap, cand, math.inf)
                    if rule[0].pairs >= 0 and paired is not None:
                        cand = pair_kept(rule[0], band[None], self._pair_next(c, paired, rule[0])[:, ends], cand)
                if pv is not None:
                    pv[:, c] = paired_values(xn, band[None], cand)
                h_p, h_n = self._priced_next(c, after_p, after_n)
                cand_p = np.where(np.isfinite(cand), band[None] + price[c] + h_p[:, ends], math.inf)
            out[:, c] = cand.min(axis=2)
            w = cand_p.argmin(axis=2)
            out_p[:, c] = np.take_along_axis(cand_p, w[..., None], axis=2)[..., 0]
            out_n[:, c] = mine + np.take_along_axis(h_n[:, ends], w[..., None], axis=2)[..., 0]
        gone = out > value_cap  # as `_level`: a state whose least R is over its cap holds no admitted suffix
        out[gone], out_p[gone] = math.inf, math.inf
        return out, pv, out_p, out_n

    def _priced_next(self, c: int, after_p: np.ndarray, after_n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`_next` on the priced values: (least 2C + priced value, its priced stages), per run position and unit."""
        run, K, L1 = after_p.shape
        new = (self.inter2[c][None] + after_p).reshape(run * K, L1)
        pick = new.argmin(axis=0)
        h, n = np.empty((run, L1)), np.empty((run, L1))
        h[0], n[0] = new[pick, np.arange(L1)], after_n.reshape(run * K, L1)[pick, np.arange(L1)]
        if run > 1:
            same = self.intra2[c][None] + after_p[:-1]
            f = same.argmin(axis=1)
            h[1:] = np.take_along_axis(same, f[:, None, :], axis=1)[:, 0]
            n[1:] = np.take_along_axis(after_n[:-1], f[:, None, :], axis=1)[:, 0]
        return h, n

    def _unwind(self, levels: list[tuple[np.ndarray, list[np.ndarray]]], key: tuple[int, int, int],
                ends: np.ndarray) -> tuple[RunStage, ...]:
        """The pipeline of the best value, front to back."""
        k, p, c = key
        u, out = 0, []
        while True:
            back, bands = levels[k - 1]
            w = int(back[p, c, u, 0])
            hi = int(ends[u, w])
            fwd = float(self.tab.forward[c][u, w])
            if k == 1:
                out.append(RunStage(self.kinds[c], u, hi - 1, float(bands[c][u, w]), fwd, 0.0, False))
                return tuple(out)
            f, q = int(back[p, c, u, 1]), int(back[p, c, u, 2])
            links = self.inter2 if p == 0 else self.intra2
            out.append(RunStage(self.kinds[c], u, hi - 1, float(bands[c][u, w]), fwd, float(links[c, f, hi]), p == 0))
            k, p, c, u = k - 1, q, f, hi

    def realise(self, picks: Sequence[RunStage]) -> tuple[Stage, ...] | None:
        """Real cards for a relaxed pipeline: each run on the node with the most free cards of its kinds
        (each stage its own kind where the node has one, else the node's fastest free card); None when
        the cluster runs out of cards."""
        free: dict[str, list[int]] = {}
        for i, d in enumerate(self.problem.devices):
            free.setdefault(d.node, []).append(i)
        speed = {k: i for i, k in enumerate(self.kinds)}
        work = {k: float(self.tab.compute[i][0, -1]) for i, k in enumerate(self.kinds)}
        stages: list[Stage] = []
        runs: list[list[RunStage]] = [[]]
        for st in picks:
            runs[-1].append(st)
            if st.new_node_after:
                runs.append([])
        for block in runs:
            def match(node: str) -> tuple[int, int]:
                kinds = [self.problem.devices[i].kind for i in free[node]]
                return sum(min(kinds.count(k), [s.kind for s in block].count(k)) for k in set(kinds)), len(kinds)
            node = max(free, key=match)
            for st in block:
                pool = free[node] or next((ids for ids in free.values() if ids), [])
                if not pool:
                    return None
                own = [i for i in pool if self.problem.devices[i].kind == st.kind]
                dev = own[0] if own else min(pool, key=lambda i: (work.get(self.problem.devices[i].kind, math.inf),
                                                                   speed.get(self.problem.devices[i].kind, 0)))
                pool.remove(dev)
                stages.append(Stage(dev, st.first_unit, st.last_unit))
        return tuple(stages)


def run_terms(m: int, picks: Sequence[RunStage], *, windows: bool = False) -> tuple[float, float]:
    """(R_0, G) of a relaxed pipeline (`schedule_bound.pace_terms` on its own costs; with `windows`, G takes
    every window chain too: the terms of a walk whose filters keep windows, `schedule_walk(..., windows=w)`)."""
    suffix, g, p = 0.0, 0.0, len(picks)
    for s in range(p - 1, -1, -1):
        st = picks[s]
        suffix += st.work_s + st.round_trip_s
        pair = st.work_s + st.round_trip_s + picks[s + 1].work_s if s < p - 1 else 0.0
        g = max(g, stage_pace(m, p - s, st.fwd_s, st.work_s - st.fwd_s, suffix, pair))
    if windows:
        g = max(g, window_pace(m, [st.work_s for st in picks], [st.round_trip_s / 2.0 for st in picks[:-1]]))
    return suffix, g
