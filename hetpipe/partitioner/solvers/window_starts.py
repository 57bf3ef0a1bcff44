"""Starts for the annealing on the windowed pace: the least window cap over node orders (issue 12 item 3).

Why.  1F1B's window chains (`schedule_bound.window_pace`) run w neighbouring stages' W and the 2 C of the w - 1
cuts between them per w micro-batches, so a placement paces at least m times its **window cap**

    cap(stages) = max over windows [s, j] of (sum_{i=s..j} W_i + 2 sum_{i=s..j-1} C_i) / (j - s + 1)

(the single stages, w = 1, included), plus the fill R_0.  The annealing (`pace_search.anneal`) reaches across
the pipeline one unit or one stage at a time and stalls above such placements: gpt2-xl on 256 cards (load 0-6),
the answer 8.110 s and annealing 8.04-8.16 s, where the placement of least cap this module builds (a 1-2-2
pattern of blocks on the 32 A100s, a light stage beside each node boundary) replays in 7.882 s in 0.2 s of CPU.

The construction.  Cards are grouped by (node, kind) ("groups": cards of a group are the same to the pace) and
the groups put in an order (`ORDERS`); a placement takes groups in that order, skipping any, and consecutive
cards of each group it uses.  For a cap tau, with a_i = W_i - tau, the condition "every window's average <= tau"
is M_j <= 0 for every stage j, where M_j = W_j - tau + max(0, M_{j-1} + 2 C_{j-1}) (the largest window sum
ending at j; Kadane's recurrence).  A smaller M_j never hurts a later stage, so a DP over (units placed, group,
cards used in it) keeping the least M decides exactly whether some placement in the family meets tau
(`window_dp`); bisection on tau finds the family's least cap (tests/test_window_starts.py: against
enumeration).  Links: one figure per group (its first two cards) and per pair of groups (their first cards);
the placements are priced exactly afterwards (`FastPace`) and kept only if they fit (`evaluate`).

The cap leaves out the fill and each rank's count of window chains (x = (m - 1 - k_s) // w, fewer on the first
ranks when m is near p): at 64 cards (m = 128, 41 stages) the least-cap placement paces 4.13 s against the
annealing's 3.35-3.45 s, and the annealing starts from the best start by pace, so there it costs only its time.

Example (four equal units on two cards of one node, free links: two stages of two units, cap 6 s):
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem
    >>> inf = float("inf")
    >>> prob = Problem(fwd_s={"a": (1.0,) * 4}, bwd_s={"a": (2.0,) * 4}, state_bytes=(1,) * 4,
    ...                activation_bytes=(1,) * 4, boundary_bytes=(0,) * 4,
    ...                devices=(DeviceSlot("d0", "a", "n", 99), DeviceSlot("d1", "a", "n", 99)),
    ...                bandwidth_bytes_s=((inf, inf), (inf, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)), microbatches=8)
    >>> cap_s, placed = least_cap(prob, "fast")
    >>> [(st.first_unit, st.last_unit) for st in placed], round(cap_s, 3)
    ([(0, 1), (2, 3)], 6.0)
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hetpipe.partitioner.problem import Problem, Stage, evaluate
from hetpipe.partitioner.solvers.pace_search import FastPace

#: Group orders tried, best first (a deadline cuts the last): "fast" (kinds by their whole model's W, fastest
#: first: the DP may skip groups, so any selection of groups in that order), "inter" (round-robin over the kinds
#: in that order: a slower kind's node between two of the fastest's), and both reversed, "slow" and "inter-slow"
#: (the fastest kind's groups last: the heaviest last unit, a head, on them).  gpt2-xl, best windowed pace:
#: 64 cards 3.376 s ("slow"), 4.13 s ("fast": the head lands on a slow kind); 256 cards 7.830 s ("inter-slow"),
#: 7.866 ("slow"), 7.879 ("fast"), 7.908 ("inter").
ORDERS = ("slow", "inter-slow", "fast", "inter")
#: Bisection steps on the cap: between the heaviest unit on its fastest kind (every placement has a stage that
#: holds it) and the fastest kind's whole model (one stage on one card); 2^-16 of that is 0.03% of gpt2-xl's
#: least cap on 256 cards (0.30 s / 65,536 = 4.6 us against 14.6 ms).
BISECTION_STEPS = 16
#: Caps tried above the least (ratios): a slightly looser cap may need fewer stages and cross fewer nodes, so
#: less fill (gpt2-xl on 256 cards, order "slow": 7.872 s of windowed pace at 1.0, 7.905 at 1.005, 8.003 at 1.02;
#: order "inter": 7.908 and 7.920 s, 8.073 at 1.02); `verify` keeps the best by pace.
#: Weights of the fill (the stages' W + 2 C so far) beside M in the DP's choice per state (`end_placements`): 0
#: is the exact least-M DP; with the fill weighed a placement found still meets the cap, with fewer or lighter
#: stages, but a state of lower M may be dropped and none found (then the least-M placement stands)
#: (gpt2-xl, least cap, windowed pace at 0 / 0.1 / 1: 64 cards, order "slow", 3.408 / 3.399 / 3.376 s; 256 cards,
#: "inter-slow", 7.890 / 7.884 / 7.830 s, which replays in 7.833 s).
FILL_WEIGHTS = (0.0, 0.1, 1.0)
SLACK = (1.0, 1.005)


@dataclass(frozen=True)
class Groups:
    """Cards grouped by (node, kind) in an order: per group its kind's prefix sums of W (seconds, by unit),
    its cards, and the link figures the DP prices cuts with."""

    prefix: np.ndarray  # (groups, units + 1): W of units [0, u) on the group's kind
    cards: tuple[tuple[int, ...], ...]
    intra_latency_s: np.ndarray  # (groups,): between a group's first two cards (0 for one card)
    intra_bandwidth: np.ndarray  # (groups,) bytes/s (inf for one card: no cut inside it)
    latency_s: np.ndarray  # (groups, groups): between first cards
    bandwidth: np.ndarray  # (groups, groups) bytes/s


def groups(problem: Problem, order: str) -> Groups:
    """The (node, kind) groups of `problem`'s cards in `order` (`ORDERS`)."""
    members: dict[tuple[str, str], list[int]] = {}
    for i, d in enumerate(problem.devices):
        members.setdefault((d.node, d.kind), []).append(i)
    whole = {k: sum(problem.fwd_s[k]) + sum(problem.bwd_s[k]) for k in problem.fwd_s}
    keys = sorted(members, key=lambda g: (whole[g[1]], members[g][0]))
    if order not in ORDERS:
        raise ValueError(f"unknown group order {order!r}: one of {ORDERS}")
    if order.startswith("inter"):  # the r-th group of every kind, kinds fastest first, for r = 0, 1, ...
        rank = {g: sum(1 for h in keys[:i] if h[1] == g[1]) for i, g in enumerate(keys)}
        keys.sort(key=lambda g: (rank[g], whole[g[1]], members[g][0]))
    if order.endswith("slow"):  # reversed: the fastest kind's groups last, the heaviest last unit (a head) on them
        keys.reverse()
    prefix = np.array([np.concatenate(([0.0], np.cumsum(np.add(problem.fwd_s[k], problem.bwd_s[k])))) for _, k in keys])
    cards = tuple(tuple(members[g]) for g in keys)
    lat, bw = problem.latency_s, problem.bandwidth_bytes_s
    heads = [c[0] for c in cards]
    return Groups(prefix, cards,
                  np.array([lat[c[0]][c[1]] if len(c) > 1 else 0.0 for c in cards]),
                  np.array([bw[c[0]][c[1]] if len(c) > 1 else math.inf for c in cards]),
                  np.array([[lat[a][b] for b in heads] for a in heads]),
                  np.array([[bw[a][b] for b in heads] for a in heads]))


def window_cap(problem: Problem, stages: Sequence[Stage]) -> float:
    """cap(stages) of the module docstring (seconds per micro-batch), by its definition (the tests' reference).

    Example (stages of 3 s and 6 s, a free link: the pair averages 4.5 s, the second alone 6 s):
        >>> from hetpipe.partitioner.problem import DeviceSlot
        >>> inf = float("inf")
        >>> prob = Problem(fwd_s={"a": (1.0,) * 3}, bwd_s={"a": (2.0,) * 3}, state_bytes=(1,) * 3,
        ...                activation_bytes=(1,) * 3, boundary_bytes=(0,) * 3,
        ...                devices=(DeviceSlot("d0", "a", "n", 99), DeviceSlot("d1", "a", "n", 99)),
        ...                bandwidth_bytes_s=((inf, inf), (inf, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)), microbatches=4)
        >>> window_cap(prob, (Stage(0, 0, 0), Stage(1, 1, 2)))
        6.0
    """
    kinds = [problem.devices[st.device].kind for st in stages]
    work = [sum(problem.fwd_s[k][u] + problem.bwd_s[k][u] for u in range(st.first_unit, st.last_unit + 1))
            for k, st in zip(kinds, stages)]
    cut2 = [2.0 * (problem.latency_s[a.device][b.device] + problem.boundary_bytes[a.last_unit]
                   / problem.bandwidth_bytes_s[a.device][b.device]) for a, b in zip(stages, stages[1:])]
    return max((sum(work[s:j + 1]) + sum(cut2[s:j])) / (j - s + 1)
               for s in range(len(stages)) for j in range(s, len(stages)))


@dataclass
class _Table:
    """The DP's table: least key M + weight x fill (seconds: `_fill`) with its M, fill and the first unit of the
    last stage, by (units placed, group, cards of the group used); and per units placed > 0 the best (group,
    cards used) to leave a group from."""

    least: np.ndarray  # M: (units + 1, groups, most cards + 1); index 0 of the last axis unused
    fill: np.ndarray  # same shape: sum of W + 2 C of the stages so far (the fill R_0 of the prefix)
    first: np.ndarray  # same shape: first unit of the stage that ends there (-1: unreached)
    leave: dict[int, tuple[np.ndarray, np.ndarray]]  # units placed -> (group left, its cards used) per next group


def window_dp(problem: Problem, grp: Groups, cap_s: float) -> tuple[Stage, ...] | None:
    """A placement in `grp`'s family whose every window averages at most `cap_s`, of least M at its end;
    None when there is none (module docstring)."""
    table = _fill(problem, grp, cap_s)
    assert table is not None  # no deadline
    ends = table.least[problem.num_units, :, 1:]
    if not np.isfinite(ends).any():
        return None
    g, used = np.unravel_index(np.argmin(ends), ends.shape)
    return _placement(grp, table, problem.num_units, int(g), int(used) + 1)


def end_placements(problem: Problem, grp: Groups, cap_s: float, weight: float = 0.0, *,
                   deadline: float = math.inf) -> list[tuple[Stage, ...]]:
    """A placement meeting `cap_s` for every last (group, card) that has one, not only the least M's: their
    fill and window counts differ (gpt2-xl on 64 cards: 3.408 s of windowed pace against the least M's 3.422 s).
    `weight` > 0 keeps per state the least M + weight x fill instead of the least M (`FILL_WEIGHTS`).  Past
    `deadline` (`time.perf_counter()` seconds) those unwound so far, none while the table fills (gpt2-xl on 1,024
    cards, order "slow": 0.04 s of CPU for the table, 0.04 s more for its 72 ends)."""
    table = _fill(problem, grp, cap_s, weight, deadline=deadline)
    if table is None:
        return []
    ends = table.least[problem.num_units, :, 1:]
    out = []
    for g, used in zip(*np.nonzero(np.isfinite(ends))):
        if time.perf_counter() > deadline:
            break
        out.append(_placement(grp, table, problem.num_units, int(g), int(used) + 1))
    return out


def _fill(problem: Problem, grp: Groups, cap_s: float, weight: float = 0.0, *,
          deadline: float = math.inf) -> _Table | None:
    """The DP's table for `cap_s` (module docstring): units placed in order, stages ending at every unit; each
    state keeps the least M + `weight` x fill among the paths that meet the cap (weight 0: the exact DP); None
    once `deadline` passes."""
    n, count = problem.num_units, len(grp.cards)
    most = max(map(len, grp.cards))
    shape = (n + 1, count, most + 1)
    table = _Table(np.full(shape, np.inf), np.full(shape, np.inf), np.full(shape, -1), {})
    sizes = np.array([len(c) for c in grp.cards])
    beyond = np.arange(most + 1)[None, :] > sizes[:, None]  # cards a group lacks
    later = np.triu(np.ones((count, count), dtype=bool), 1)  # group i may hand over to group j > i only
    bytes_, rows = np.asarray(problem.boundary_bytes, dtype=float), np.arange(count)
    for e in range(n):
        if time.perf_counter() > deadline:
            return None
        work = grp.prefix[:, e + 1:] - grp.prefix[:, [e]]  # (groups, n - e): a stage of units e .. e' - 1
        if e == 0:
            entry, entry_fill = np.full(count, -np.inf), np.zeros(count)  # the first stage: no window before it
        else:
            held, held_fill = table.least[e, :, 1:], table.fill[e, :, 1:]
            key = _key(held, held_fill, weight)
            used = key.argmin(axis=1)
            cut2 = 2.0 * (grp.latency_s + bytes_[e - 1] / grp.bandwidth)  # (from group, to group)
            over = np.where(later, key[rows, used][:, None] + (1.0 + weight) * cut2, np.inf)
            src = over.argmin(axis=0)
            reached = np.isfinite(over.min(axis=0))
            entry = np.where(reached, held[src, used[src]] + cut2[src, rows], np.inf)
            entry_fill = np.where(reached, held_fill[src, used[src]] + cut2[src, rows], np.inf)
            table.leave[e] = (src, used + 1)
            intra2 = (2.0 * (grp.intra_latency_s + bytes_[e - 1] / grp.intra_bandwidth))[:, None]
            _relax(table, e, 2, work[:, None, :] - cap_s + np.maximum(0.0, held[:, :-1] + intra2)[:, :, None],
                   work[:, None, :] + (held_fill[:, :-1] + intra2)[:, :, None], weight)
        _relax(table, e, 1, (work - cap_s + np.maximum(0.0, entry)[:, None])[:, None, :],
               (work + entry_fill[:, None])[:, None, :], weight)
        table.least[e + 1:][:, beyond] = np.inf
    return table


def _key(least: np.ndarray, fill: np.ndarray, weight: float) -> np.ndarray:
    """M + weight x fill where M is reached, else inf (an unreached state's fill is inf: 0 x inf would be nan)."""
    return np.where(np.isfinite(least), least + weight * np.where(np.isfinite(fill), fill, 0.0), np.inf)


def _relax(table: _Table, e: int, card: int, cand: np.ndarray, cand_fill: np.ndarray, weight: float) -> None:
    """Keep, for every end e' > e, (group, cards used from `card` on), the state of least M + `weight` x fill
    among the table's and `cand` ((groups, cards, ends) of M, `cand_fill` their fill) where M meets the cap
    (M <= 0; a rounding's worth above counts as 0)."""
    cand = np.where(cand <= 1e-12, cand, np.inf)
    width = cand.shape[1]
    view = (slice(e + 1, None), slice(None), slice(card, card + width))
    now = np.moveaxis(table.least[view], 0, -1)
    now_fill = np.moveaxis(table.fill[view], 0, -1)
    better = _key(cand, cand_fill, weight) < _key(now, now_fill, weight)
    table.least[view] = np.moveaxis(np.where(better, cand, now), -1, 0)
    table.fill[view] = np.moveaxis(np.where(better, cand_fill, now_fill), -1, 0)
    table.first[view] = np.moveaxis(np.where(better, e, np.moveaxis(table.first[view], 0, -1)), -1, 0)


def _placement(grp: Groups, table: _Table, n: int, g: int, used: int) -> tuple[Stage, ...]:
    """The stages back from the state with every unit placed and the last stage on card `used` of group `g`."""
    out, e = [], n
    while e > 0:
        first = int(table.first[e, g, used])
        out.append(Stage(grp.cards[g][used - 1], first, e - 1))
        if used > 1:
            used -= 1
        elif first > 0:
            left, cards_used = table.leave[first]
            g, used = int(left[g]), int(cards_used[left[g]])
        e = first
    return tuple(reversed(out))


def least_cap(problem: Problem, order: str, *, deadline: float = math.inf) -> tuple[float, tuple[Stage, ...]]:
    """The least cap (seconds) over `order`'s family, to `BISECTION_STEPS`, and a placement that meets it (one
    stage on one card of the fastest kind always does); past `deadline` the best so far."""
    grp = groups(problem, order)
    low = float(np.max(np.min(np.diff(grp.prefix, axis=1), axis=0)))
    high = float(grp.prefix[:, -1].min())
    best = window_dp(problem, grp, high)
    assert best is not None, "one stage of every unit on one card of the fastest kind meets that kind's whole model"
    for _ in range(BISECTION_STEPS):
        if time.perf_counter() > deadline:
            break
        mid = 0.5 * (low + high)
        found = window_dp(problem, grp, mid)
        if found is None:
            low = mid
        else:
            high, best = mid, found
    return high, best


def starts(problem: Problem, *, deadline: float = math.inf, hard_deadline: float = math.inf) -> list[tuple[Stage, ...]]:
    """Per order of `ORDERS`, cap of `SLACK` (times the order's least) and weight of `FILL_WEIGHTS`, the placement
    of least windowed pace (`FastPace`) among `end_placements` that fits; fewer past `deadline` (`time.perf_counter()`
    seconds: no order starts past it but the first), and past `hard_deadline` (the caller's end: nothing more
    starts, the first order's placements included) those found so far."""
    pace = FastPace(problem)
    found: list[tuple[Stage, ...]] = []
    for order in ORDERS:
        if (found and time.perf_counter() > deadline) or time.perf_counter() > hard_deadline:
            break  # the first order's least cap so far, whatever the share's time, until the caller's end
        cap_s, least = least_cap(problem, order, deadline=min(deadline, hard_deadline))
        grp = groups(problem, order)
        for ratio, weight in itertools.product(SLACK, FILL_WEIGHTS):
            if time.perf_counter() > hard_deadline:  # each is a DP over the units and its ends' pricing: tens of ms
                break
            ends = end_placements(problem, grp, cap_s * ratio, weight, deadline=hard_deadline) or [least]
            # ranked, then the first that fits, checked one by one until the caller's end (llama-7b on 1,024 cards
            # under a loose cap: 1,020 ends, 0.07 s of CPU to rank, none fits, 0.4 s to check)
            ranked = sorted(ends, key=pace.value) if time.perf_counter() <= hard_deadline else []
            placed = next((p for p in ranked if time.perf_counter() <= hard_deadline
                           and evaluate(problem, p, objective="estimate").fits), None)
            if placed is not None and placed not in found:
                found.append(placed)
    return found
