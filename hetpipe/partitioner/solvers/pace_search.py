"""Annealing on the windowed pace: placements whose replay the local search cannot reach (issue 12 item 3).

Why.  `verify`'s local search prices every move by replaying the 1F1B schedule (O(p m) actions: 5-20 ms a
move at 64-256 cards) and takes only moves that improve it, one neighbour at a time; on gpt2-xl at 64 and
256 cards it stops at local optima 2.8% above placements an annealing finds (3.548 s against 3.447 s, 8.19 s
against 7.96 s, load ~10, 150 s each).  Those placements differ from the answer in where the light stages sit
between heavy ones: the window chains of `schedule_bound.window_pace` set their pace, and the windowed pace
R_0 + G is within 0.1% of their replay there (3.443 against 3.447 s, 8.189 against 8.192 s), at a fraction of
a replay's cost.

The search.  Simulated annealing (Kirkpatrick et al., Science 1983: accept a worse neighbour with probability
exp(-delta / temperature), the temperature falling linearly to 0 over a round of moves, rounds restarting from
the best: session 15, so the answer is a function of the seed, not of the load) over plain placements
(no recompute, offload or groups: `applies`), priced by `FastPace`, the windowed pace from per-kind prefix
sums (exactly `pace_terms(..., windows=True)` for such placements; tests/test_pace_search.py).  Moves: a cut
moved by one unit, two stages' cards swapped (anywhere in the pipeline), a stage moved to an unused card or
split onto one (one card per kind and node: the rest are the same), two neighbours merged; and reorderings
(`_reordered`, session 12): a unit passed from one stage to any other (the cuts between them move along), a stage
moved elsewhere in the pipeline with its card and unit count; and whole node runs (`run_moves`, session 15: two
runs swapped, a run moved onto another node's unused cards).  A new best must fit (`evaluate`); memory is checked only then, so the walk itself may cross placements that do not fit.

Example (two equal units, two cards: one stage of both units on one card or two stages; with a free link two
stages pace 2 x 3 + 7 x 3 = 27 s against one stage's 8 x 6 = 48 s):
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem
    >>> inf = float("inf")
    >>> prob = Problem(fwd_s={"a": (1.0, 1.0)}, bwd_s={"a": (2.0, 2.0)}, state_bytes=(1, 1),
    ...                activation_bytes=(1, 1), boundary_bytes=(0, 0),
    ...                devices=(DeviceSlot("d0", "a", "n", 99), DeviceSlot("d1", "a", "n", 99)),
    ...                bandwidth_bytes_s=((inf, inf), (inf, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)), microbatches=8)
    >>> found = anneal(prob, (Stage(0, 0, 1),), deadline=time.perf_counter() + 0.2)
    >>> [(st.first_unit, st.last_unit) for st in found], FastPace(prob).value(found)
    ([(0, 0), (1, 1)], 27.0)
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hetpipe.partitioner.problem import Problem, Stage, evaluate
from hetpipe.partitioner.solvers.run_moves import run_rehomed, runs_swapped
from hetpipe.partitioner.solvers.schedule_bound import round_trip_factor

log = logging.getLogger(__name__)

#: Moves of one annealing round (the temperature falls linearly from `START_TEMPERATURE` to 0 over them; the next
#: round starts again from the best): at least this many, and `ROUND_MOVES_PER_STAGE` per stage of the start.
ROUND_MOVES = 2000
#: Session 15 (gpt2-xl on 64 cards from the window start, 30,000 moves in all at `START_TEMPERATURE` 0.002, ten
#: seeds, median windowed pace): 12 rounds of 2,500 moves 3.302 s, 6 of 5,000 3.341 s (five seeds), 3 of 10,000
#: 3.345 s: shorter rounds, more restarts from the best (37 stages x 70 = 2,590 moves).
ROUND_MOVES_PER_STAGE = 70
#: Rounds at most: the annealing's work is fixed (and its answer a function of its seed and start) unless its
#: deadline comes first (gpt2-xl on 64 cards: 12 x 2,590 moves, about 2 s of CPU).
MAX_ROUNDS = 12
#: Pipelines of at least this many stages are priced with numpy (`_pace`; 41 stages: 0.10 ms against 0.40 ms in
#: plain Python), shorter ones in plain Python (`_rank_pace`: 4 stages 10 us against numpy's 40 us).
VECTOR_STAGES = 16
#: Starting temperature of each round as a share of the best pace so far: a move 0.2% worse is taken with
#: probability 1/e at a round's start.  Session 15 (gpt2-xl on 64 cards from the window start, 6 rounds of 5,000
#: moves, five seeds, median / best windowed pace): 0.001 3.340 / 3.334 s, 0.002 3.341 / 3.269 s, 0.003 3.341 /
#: 3.260 s, 0.005 3.376 / 3.371 s, 0.01 3.376 / 3.358 s, 0.02 3.376 s (the start's: too hot, the walk drifts off
#: and never settles; sessions 11-14 used 0.005 with the time as the clock).
START_TEMPERATURE = 0.002
#: Gap to `anneal`'s floor above which the annealing goes on to its next round after a round without a new best
#: (instead of stopping): issue 12 item 3's 2%; only from `RESTART_STAGES` stages.
RESTART_GAP = 0.02
#: Shortest pipeline whose annealing goes on past a round without a new best: `verify`'s floor leaves the window chains out, so on a short
#: pipeline the windowed pace optimum may sit more than 2% above it and restarts would take every call's whole
#: share (the suite's thousands of small `solve` calls); where the gap lives (gpt2-xl, 34-41 stages) they pay.
RESTART_STAGES = 16
#: Share of the moves that reorder the pipeline (`_reordered`: a unit passed along several stages, a stage moved
#: elsewhere with its card); the rest are the local moves of `_neighbour` (gpt2-xl on 64 and 256 cards: see
#: benchmarks/results/planner_anneal.md).
REORDER_SHARE = 0.3
#: Share of the moves on whole node runs (`run_moves`: two runs swapped, a run moved to another node's unused
#: cards), drawn before the others (session 15, gpt2-xl on 64 cards: see benchmarks/results/planner_anneal.md).
RUN_SHARE = 0.1


def applies(problem: Problem) -> bool:
    """Whether `FastPace` prices `problem`'s placements exactly: 1F1B, plain stages only (no recompute,
    offload or tensor-parallel groups: those change F, B or the cards per stage)."""
    return (problem.schedule == "1f1b" and problem.recompute == "none" and problem.offload == "never"
            and problem.group_max <= 1)


@dataclass(frozen=True)
class FastPace:
    """R_0 + G with window chains (`schedule_bound.pace_terms(..., windows=True)`) of plain placements, from
    per-kind prefix sums of W and F (seconds) and the link tables: no `evaluate`, no memory."""

    problem: Problem

    def __post_init__(self) -> None:
        work, fwd = {}, {}
        for k in self.problem.fwd_s:
            w, f = [0.0], [0.0]
            for a, b in zip(self.problem.fwd_s[k], self.problem.bwd_s[k]):
                w.append(w[-1] + a + b)
                f.append(f[-1] + a)
            work[k], fwd[k] = w, f
        object.__setattr__(self, "_work", work)
        object.__setattr__(self, "_fwd", fwd)
        object.__setattr__(self, "_shapes", {})  # p -> `_WindowIndex` (the window chains' (s, w) pairs)
        object.__setattr__(self, "_numpy", None)  # `_Tables`, on the first long pipeline priced

    def value(self, stages: Sequence[Stage]) -> float:
        """R_0 + G of `stages` (module docstring)."""
        prob, m, p = self.problem, self.problem.microbatches, len(stages)
        if p >= VECTOR_STAGES:
            return self._vector_value(stages)
        kinds = [prob.devices[st.device].kind for st in stages]
        work = [self._work[k][st.last_unit + 1] - self._work[k][st.first_unit] for k, st in zip(kinds, stages)]
        fwd = [self._fwd[k][st.last_unit + 1] - self._fwd[k][st.first_unit] for k, st in zip(kinds, stages)]
        cut2 = [2.0 * (prob.latency_s[a.device][b.device] + prob.boundary_bytes[a.last_unit]
                       / prob.bandwidth_bytes_s[a.device][b.device]) for a, b in zip(stages, stages[1:])] + [0.0]
        ends = [0.0]  # numpy's fixed cost per call outweighs the loops here (4 stages: 40 us against 10 us)
        for w, c in zip(work, cut2):
            ends.append(ends[-1] + w + c)
        return ends[p] + max(_rank_pace(m, p - s, work[s], fwd[s], ends, cut2, s) for s in range(p))

    def _vector_value(self, stages: Sequence[Stage]) -> float:
        """`value` of a long pipeline: W, F and 2 C gathered from `_Tables` by numpy indexing (37 stages: 0.04 ms
        against 0.07 ms with Python lists; session 15), then `_pace`."""
        if self._numpy is None:
            object.__setattr__(self, "_numpy", _tables(self.problem))
        tab, p = self._numpy, len(stages)
        if p not in self._shapes:
            self._shapes[p] = _window_index(self.problem.microbatches, p)
        dev, first, last = np.array([(st.device, st.first_unit, st.last_unit) for st in stages]).T
        kind = tab.kind[dev]
        work = tab.work[kind, last + 1] - tab.work[kind, first]
        fwd = tab.fwd[kind, last + 1] - tab.fwd[kind, first]
        a, b = dev[:-1], dev[1:]
        cut2 = np.append(tab.latency2[a, b] + tab.boundary_bytes[last[:-1]] * tab.inverse_bandwidth2[a, b], 0.0)
        return _pace(self.problem.microbatches, self._shapes[p], work, fwd, cut2)


@dataclass(frozen=True)
class _Tables:
    """`FastPace`'s numpy tables: each card's kind index, per kind the prefix sums of W and F (seconds, by unit),
    per card pair 2 x latency (s) and 2 / bandwidth (s per byte; 0 on an infinite link), the boundary bytes."""

    kind: np.ndarray
    work: np.ndarray
    fwd: np.ndarray
    latency2: np.ndarray
    inverse_bandwidth2: np.ndarray
    boundary_bytes: np.ndarray


def _tables(problem: Problem) -> _Tables:
    """`_Tables` of `problem` (built on the first long pipeline priced: p^2 link figures, 0.05 s at 1,024 cards)."""
    kinds = sorted(problem.fwd_s)
    index = {k: i for i, k in enumerate(kinds)}
    fwd = np.array([problem.fwd_s[k] for k in kinds], dtype=float).reshape(len(kinds), problem.num_units)
    work = fwd + np.array([problem.bwd_s[k] for k in kinds], dtype=float).reshape(fwd.shape)
    zero = np.zeros((len(kinds), 1))
    return _Tables(np.array([index[d.kind] for d in problem.devices]),
                   np.concatenate((zero, np.cumsum(work, axis=1)), axis=1),
                   np.concatenate((zero, np.cumsum(fwd, axis=1)), axis=1),
                   2.0 * np.asarray(problem.latency_s, dtype=float),
                   2.0 / np.asarray(problem.bandwidth_bytes_s, dtype=float),
                   np.asarray(problem.boundary_bytes, dtype=float))


def _rank_pace(m: int, k: int, work: float, fwd: float, ends: list[float], cut2: list[float], s: int) -> float:
    """Rank s's longest chain: `schedule_bound.stage_pace`'s round trips, single steps and work, and every
    window chain (`schedule_bound.window_pace`; the pair is its w = 2): `_pace` for one rank, in plain Python."""
    p = len(ends) - 1
    trip = ends[p] - ends[s]
    kk, q = min(k, m), round_trip_factor(m, k)
    best = max((m - kk) * work + (kk - 1) * (work - fwd), m * work - trip)
    if q > 0:
        best = max(best, q * trip + (m - 1 - q * kk) * work)
    left = m - 1 - k
    if k >= 2 and left >= 0:
        for w in range(2, k + 1):
            window = ends[s + w] - ends[s] - cut2[s + w - 1]
            best = max(best, (left // w) * window + (left % w) * work + trip)
    return best


@dataclass(frozen=True)
class _WindowIndex:
    """For a pipeline of p stages and m micro-batches: k_s, min(k_s, m) and q_s per rank, and every window chain's
    rank s, width w and counts x = (m - 1 - k_s) // w, y = (m - 1 - k_s) % w (`schedule_bound.window_pace`)."""

    k: np.ndarray
    kk: np.ndarray
    q: np.ndarray
    s: np.ndarray
    w: np.ndarray
    x: np.ndarray
    y: np.ndarray
    trips: np.ndarray  # q > 0: ranks with a round-trip chain
    rest: np.ndarray  # m - 1 - q kk: the single steps beside the q round trips


def _window_index(m: int, p: int) -> _WindowIndex:
    """`_WindowIndex` of p stages (once per pipeline length: the annealing prices thousands of each)."""
    k = p - np.arange(p)
    kk = np.minimum(k, m)
    ranks, widths = [], []
    for s in range(max(0, p - m + 1), p - 1):  # k_s in 2..m - 1: at least one micro-batch left over
        ranks += [s] * (p - s - 1)
        widths += range(2, p - s + 1)
    s_arr, w_arr = np.asarray(ranks, dtype=int), np.asarray(widths, dtype=int)
    left = m - 1 - k[s_arr]
    q = -(-m // kk) - 1
    return _WindowIndex(k, kk, q, s_arr, w_arr, left // np.maximum(w_arr, 1), left % np.maximum(w_arr, 1), q > 0,
                        m - 1 - q * kk)


def _pace(m: int, idx: _WindowIndex, work: np.ndarray, fwd: np.ndarray, cut2: np.ndarray) -> float:
    """R_0 + G from per-stage W, F and 2 C (the last 0): each rank's round trips, single steps, work and window
    chains (`schedule_bound.stage_pace`, `window_pace`), vectorised over ranks and windows."""
    ends = np.concatenate(([0.0], np.cumsum(work + cut2)))
    p = len(work)
    trip = ends[p] - ends[:p]  # R_s
    g = max(((m - idx.kk) * work + (idx.kk - 1) * (work - fwd)).max(), (m * work - trip).max())
    if idx.trips.any():
        g = max(g, (idx.q[idx.trips] * trip[idx.trips] + idx.rest[idx.trips] * work[idx.trips]).max())
    if len(idx.s):
        s, end = idx.s, idx.s + idx.w
        windows = ends[end] - ends[s] - cut2[end - 1]
        g = max(g, (idx.x * windows + idx.y * work[s] + trip[s]).max())
    return float(ends[p] + g)


def _neighbour(rng: random.Random, problem: Problem, stages: list[Stage], spare: list[int]) -> list[Stage] | None:
    """One random move of the module docstring, or None where the drawn move does not apply."""
    draw = rng.random()
    if draw < RUN_SHARE:  # a whole node run swapped with another or moved to another node (`run_moves`)
        moved = (runs_swapped if draw < 0.5 * RUN_SHARE else run_rehomed)(rng, stages, problem.devices)
        return None if moved is None else list(moved)
    if len(stages) > 2 and rng.random() < REORDER_SHARE:
        return _reordered(rng, stages)
    p, draw = len(stages), rng.random()
    out = list(stages)
    if draw < 0.35 and p > 1:  # a cut moved by one unit
        s = rng.randrange(p - 1)
        a, b = out[s], out[s + 1]
        cut = a.last_unit + rng.choice((-1, 1))
        if not a.first_unit <= cut < b.last_unit:
            return None
        out[s], out[s + 1] = Stage(a.device, a.first_unit, cut), Stage(b.device, cut + 1, b.last_unit)
    elif draw < 0.55 and p > 1:  # two stages' cards swapped
        i, j = rng.sample(range(p), 2)
        out[i], out[j] = Stage(out[j].device, out[i].first_unit, out[i].last_unit), \
            Stage(out[i].device, out[j].first_unit, out[j].last_unit)
    elif draw < 0.85 and spare:  # a stage moved to an unused card, or split onto one
        s, dev = rng.randrange(p), rng.choice(spare)
        st = out[s]
        if draw < 0.7 or st.first_unit == st.last_unit:
            out[s] = Stage(dev, st.first_unit, st.last_unit)
        else:
            cut = rng.randrange(st.first_unit, st.last_unit)
            head, tail = (st.device, dev) if rng.random() < 0.5 else (dev, st.device)
            out[s:s + 1] = [Stage(head, st.first_unit, cut), Stage(tail, cut + 1, st.last_unit)]
    elif p > 1:  # two neighbours merged onto one of their cards
        s = rng.randrange(p - 1)
        out[s:s + 2] = [Stage(rng.choice((out[s].device, out[s + 1].device)), out[s].first_unit, out[s + 1].last_unit)]
    else:
        return None
    return out


def _reordered(rng: random.Random, stages: list[Stage]) -> list[Stage] | None:
    """A move on the sequence of (card, unit count) pairs, cuts re-derived from the counts: one unit passed from
    stage i to stage j anywhere (every cut between them moves by one), or stage i with its card and unit count
    moved to position j (a light stage set between two heavy ones: the windows' pace, module docstring)."""
    p = len(stages)
    i, j = rng.sample(range(p), 2)
    cards = [st.device for st in stages]
    counts = [st.last_unit - st.first_unit + 1 for st in stages]
    if rng.random() < 0.5:
        if counts[i] < 2:
            return None
        counts[i], counts[j] = counts[i] - 1, counts[j] + 1
    else:
        cards.insert(j, cards.pop(i))
        counts.insert(j, counts.pop(i))
    out, first = [], stages[0].first_unit
    for card, count in zip(cards, counts):
        out.append(Stage(card, first, first + count - 1))
        first += count
    return out


def _spare(problem: Problem, stages: Sequence[Stage]) -> list[int]:
    """One unused card per (kind, node): the others are the same to the pace."""
    used = {st.device for st in stages}
    first: dict[tuple[str, str], int] = {}
    for i, d in enumerate(problem.devices):
        if i not in used:
            first.setdefault((d.kind, d.node), i)
    return list(first.values())


def _cards_changed(before: Sequence[Stage], after: Sequence[Stage]) -> bool:
    """Whether `after` uses another set of cards than `before` (same length: compared in order, sorted)."""
    return sorted(st.device for st in before) != sorted(st.device for st in after)


def anneal(problem: Problem, start: Sequence[Stage], *, deadline: float, seed: int = 0,
           floor_s: float = 0.0) -> tuple[Stage, ...]:
    """The best placement that fits found by annealing from `start` (a plain placement that fits): up to
    `MAX_ROUNDS` rounds of `ROUND_MOVES` (per stage: `ROUND_MOVES_PER_STAGE`) moves, each round from the best so
    far and cooling by its move count, so the answer depends on `seed` and `start` only, unless `deadline`
    (`time.perf_counter()` seconds) comes first; it stops after a round without a new best within `RESTART_GAP`
    of `floor_s` or below `RESTART_STAGES` stages, and at a pace of `floor_s` (where the answer would meet the
    bound: no search pays); `start` itself when nothing better fits or `applies` is false."""
    return anneal_chains(problem, [start], deadline=deadline, seed=seed, floor_s=floor_s)


def anneal_chains(problem: Problem, starts: Sequence[Sequence[Stage]], *, deadline: float, seed: int = 0,
                  floor_s: float = 0.0) -> tuple[Stage, ...]:
    """`anneal` from each of `starts` (one chain each, chain i seeded `seed` + i), the chains taking their rounds
    in turn and `MAX_ROUNDS` // len(starts) each, so a deadline cuts them alike: the best any chain found (the
    first chain's on a tie).  A start of least pace can sit in a basin the moves do not leave (gpt2-xl on 64 cards:
    from the window start, ten seeds, replayed T median 3.283 s, worst 3.345 s; from the estimate's answer, 3.60 s
    before, 3.253 s and 3.269 s: session 15)."""
    if not applies(problem):
        return tuple(starts[0])
    pace = FastPace(problem)
    best = [tuple(Stage(st.device, st.first_unit, st.last_unit) for st in start) for start in starts]
    best_v = [pace.value(b) for b in best]
    rngs = [random.Random(seed + i) for i in range(len(starts))]
    live = list(range(len(starts)))
    for _ in range(max(1, MAX_ROUNDS // len(starts))):
        for i in list(live):
            if best_v[i] <= floor_s:
                return best[i]
            moves = max(ROUND_MOVES, ROUND_MOVES_PER_STAGE * len(best[i]))
            found, found_v, finished = _round(problem, pace, rngs[i], best[i], best_v[i], moves=moves, deadline=deadline)
            improved, best[i], best_v[i] = found_v < best_v[i], found, found_v
            if not finished:
                return best[min(range(len(best)), key=best_v.__getitem__)]
            if not improved and (found_v <= floor_s * (1.0 + RESTART_GAP) or len(found) < RESTART_STAGES):
                live.remove(i)
    return best[min(range(len(best)), key=best_v.__getitem__)]


def anneal_passes(problem: Problem, starts: Sequence[Sequence[Stage]], *, deadline: float, seed: int = 0,
                  floor_s: float = 0.0) -> tuple[Stage, ...]:
    """`anneal_chains` from `starts` (the first pass), then more passes while each finds a new best, the best's pace is
    above `floor_s` by more than `RESTART_GAP`, it has `RESTART_STAGES` stages or more (the suite's thousands of small
    `solve` calls anneal once, as before), and another pass, forecast to take as long as the longest so far, ends
    by `deadline` (`time.perf_counter()` seconds): pass i anneals from the best so far alone (one chain, all the
    rounds), seeded `seed` + i (len(`starts`) + 1).  So a longer time limit anneals more where the gap is large, and
    with time to spare the answer is a function of the seed and starts; a pass cut by the deadline keeps what it
    found.  gpt2-xl on 64 cards from the two starts `verify` anneals (replayed T, twelve seeds, CPU seconds:
    `benchmarks/results/finer_walk.md`, load 3.1): the first pass 3.253-3.299 s; 2-3 passes (3.6-5.9 s) 3.253 s in all twelve.
    Later passes from the best and the starts (three chains of a third of the rounds each; session 17, that variant
    in this one's place) left 2-3 of the twelve in a basin at 3.267 s.  The least pace over all passes (the earlier
    pass's on a tie)."""
    if not applies(problem):
        return tuple(starts[0])
    pace = FastPace(problem)
    best, best_v, longest_s, passes, improved = tuple(starts[0]), math.inf, 0.0, 0, True
    while passes == 0 or (improved and best_v > floor_s * (1.0 + RESTART_GAP) and len(best) >= RESTART_STAGES
                          and time.perf_counter() + longest_s <= deadline):
        began = time.perf_counter()
        chains = list(starts) if passes == 0 else [best]
        found = anneal_chains(problem, chains, deadline=deadline, seed=seed + passes * (len(starts) + 1),
                              floor_s=floor_s)
        longest_s, passes = max(longest_s, time.perf_counter() - began), passes + 1
        improved = pace.value(found) < best_v * (1 - 1e-12)
        if improved:
            best, best_v = found, pace.value(found)
    log.info("annealing passes: %d, pace %.4f s (floor %.4f s)", passes, best_v, floor_s)
    return best


def _round(problem: Problem, pace: FastPace, rng: random.Random, best: tuple[Stage, ...], best_v: float, *,
           moves: int, deadline: float) -> tuple[tuple[Stage, ...], float, bool]:
    """One round of `anneal` from `best` (pace `best_v`): `moves` draws, the temperature falling linearly from
    `START_TEMPERATURE` x `best_v` to 0 (Kirkpatrick et al.: a worse neighbour taken with probability
    exp(-delta / temperature)); its best that fits, that best's pace, and whether it ran all its moves."""
    current, current_v, top = list(best), best_v, START_TEMPERATURE * best_v
    spare = _spare(problem, current)
    for i in range(moves):
        if time.perf_counter() >= deadline:
            return best, best_v, False
        moved = _neighbour(rng, problem, current, spare)
        if moved is None:
            continue
        value = pace.value(moved)
        temperature = top * (1.0 - i / moves)
        if value < current_v or (temperature > 0 and rng.random() < math.exp((current_v - value) / temperature)):
            if value < best_v * (1 - 1e-12):
                if not evaluate(problem, tuple(moved), objective="estimate").fits:
                    continue  # a new best must fit: the walk stays where it was
                best, best_v = tuple(moved), value
            if len(moved) != len(current) or _cards_changed(current, moved):
                spare = _spare(problem, moved)  # O(cards): only when the cards in use change
            current, current_v = moved, value
    return best, best_v, True
