"""Discrete-event simulation of a pipeline schedule on heterogeneous stages.

Model (the executor's semantics, `hetpipe.schedule.builders`): F, B and STEP
occupy their rank for ``fwd_s[s]``, ``bwd_s[s]``, ``step_s[s]``; on a rank whose list has W
actions (ZB-H1), B lasts ``bwd_s[s] - bwd_weight_s[s]`` and W ``bwd_weight_s[s]``.  A SEND does
not block its rank; its transfer starts when the SEND is reached and that
direction of the link is free (one transfer at a time per direction, FIFO),
and lasts ``send_s[cut]`` (activation and gradient have the same size).  A
RECV completes at ``max(RECV reached, transfer end)``; the rank waits meanwhile.

Every resource (a rank, a direction of a link) has exactly one user whose
order is fixed by the schedule, so each event's time is a max-plus recurrence
of its predecessors.  The simulator therefore evaluates events in dependency
order with a worklist of runnable ranks (O(actions), no global event heap);
a schedule that shares a resource between two senders would need a heap.

The simulator reads plain per-stage costs (`SimCosts`); `hetpipe.partitioner.placement`
turns a solver placement into them.  Where it agrees with `hetpipe.partitioner.problem.evaluate` (1F1B, the
H-1F1B formula ``T = sum(F+B) + sum(2C) + (m-1) max(max(F+B), max(2C))``,
cost_formulas.md §3.3), and where it does not:

* Exact: one stage (``m (F+B)``); uniform stages with zero comm
  (``(m+p-1)(F+B)`` for GPipe and 1F1B); a bottleneck on the last stage.
* Downstream double counting.  When stage k dominates (every other stage's
  ``F+B+2C`` at most ``min(F_k, B_k)``), 1F1B hides the round trip of the
  stages after k under k's warm-up forwards: the simulated time is
  ``sum_{j<k}(F_j+B_j+2C_j) + m (F_k+B_k)``, so the formula over-estimates by
  ``sum_{j>k}(F_j+B_j) + 2 sum_{j>=k} C_j``.  Example (tests): p=4, F=B=1,
  stage 1 at F=B=3, m=8: simulated 50 s, formula 54 s (+8%).  GPipe has no such
  overlap and takes the formula's 54 s.  The gap shrinks as 1/m: with that
  dominance at least 8x and m >= 4p it is under 2%.
* A slow link.  The formula charges a link ``2C`` per micro-batch, but the two
  directions are independent, and what actually binds is 1F1B's in-flight cap:
  stage s holds at most ``p-s`` micro-batches, so its period is at least
  ``(sum_{j>=s}(F_j+B_j) + 2 sum_{j>=s} C_j) / (p-s)``.  The formula misses this
  when the round trip through a slow link is long.  With p=4, F=B=0.5 and
  m=32 (README, "Simulator vs T"): C=0.5 on the middle cut (2C equal to F+B)
  gives 51 s against the formula's 36 s (stages 1 and 2 form a cycle:
  (1 + 1 + 1)/2 = 1.5 s per micro-batch); C=1.5 on the middle cut gives 84 s
  against 100 s (the two directions overlap); C=0.5 on every cut gives 61 s
  against 38 s (stage 0 holds only p micro-batches in flight: a round trip
  of 7 s gives 1.75 s per micro-batch).
* Bubbles from non-bottleneck stages: with two near-equal slow stages the
  second one's fill/drain does not overlap the first's, which the single
  ``max`` cannot express; the simulator charges it exactly.

Example:
    >>> from hetpipe.schedule.builders import one_f_one_b
    >>> res = simulate(one_f_one_b(2, 4), SimCosts(fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), send_s=(0.0,)))
    >>> res.iteration_s, round(res.bubble_fraction, 3), res.peak_in_flight_microbatches
    (15.0, 0.2, (2, 1))
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from hetpipe.errors import ConfigError, ScheduleError
from hetpipe.schedule.actions import Action, Op
from hetpipe.schedule.builders import Schedule, make_schedule, validate_schedule
from hetpipe.schedule.interleaved import chunks_of


#: ``str(Action)`` without the enum attribute lookup per event (the 64x256 benchmark makes ~85k events).
_OP_TEXT = {op: op.value for op in Op}


def _label(a: Action) -> str:
    """``str(a)``, e.g. ``1F3``, computed cheaply."""
    return f"{a.stage}{_OP_TEXT[a.op]}{'' if a.microbatch is None else a.microbatch}"


@dataclass(frozen=True)
class SimCosts:
    """Per-stage costs in seconds: per micro-batch for F/B, per cut for a one-way transfer.

    Example:
        >>> SimCosts(fwd_s=(1.0, 2.0), bwd_s=(2.0, 4.0), send_s=(0.1,)).step_s
        ()
    """

    fwd_s: tuple[float, ...]  # stage s forward of one micro-batch
    bwd_s: tuple[float, ...]  # stage s backward of one micro-batch
    send_s: tuple[float, ...]  # cut s (stage s <-> s+1), len p-1; gradient same size as activation
    step_s: tuple[float, ...] = ()  # optimizer step per stage; empty means 0
    # The weight-gradient part of bwd_s per stage (`hetpipe.cost_models.backward_split`): on a rank
    # whose list splits the backward, B lasts bwd_s - bwd_weight_s and W bwd_weight_s; empty = 0
    bwd_weight_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in ("fwd_s", "bwd_s", "send_s", "step_s", "bwd_weight_s"):
            values = tuple(float(v) for v in getattr(self, name))
            bad = [v for v in values if not (math.isfinite(v) and v >= 0.0)]
            if bad:
                raise ConfigError(f"SimCosts.{name} must be finite and >= 0 seconds, got {bad[0]!r}")
            object.__setattr__(self, name, values)
        p = len(self.fwd_s)
        if p == 0 or len(self.bwd_s) != p:
            raise ConfigError(f"SimCosts needs fwd_s and bwd_s of equal, non-zero length (stages), got {p} and {len(self.bwd_s)}")
        if len(self.send_s) != p - 1:
            raise ConfigError(f"SimCosts.send_s has {len(self.send_s)} entries; {p} stages have {p - 1} cuts")
        if len(self.step_s) not in (0, p):
            raise ConfigError(f"SimCosts.step_s has {len(self.step_s)} entries; give one per stage ({p}) or none")
        if len(self.bwd_weight_s) not in (0, p) or any(w > b for w, b in zip(self.bwd_weight_s, self.bwd_s)):
            raise ConfigError(f"SimCosts.bwd_weight_s is {self.bwd_weight_s}; give one per stage ({p}), each at most "
                              "its bwd_s, or none")

    @property
    def num_stages(self) -> int:
        return len(self.fwd_s)


@dataclass(frozen=True, slots=True)
class SimEvent:
    """One timed interval: compute or a RECV wait on ``lane == "rank r"``, a transfer on ``"link a->b"``.

    `rank` is the rank whose action it is (the sender, for a transfer).
    """

    rank: int
    lane: str
    action: str
    op: Op
    microbatch: int | None
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class SimResult:
    """Outcome of one simulated iteration; per-rank tuples are indexed by rank (= stage, or its chunks).

    ``bubble_fraction = 1 - sum(busy_s) / (p * iteration_s)``; busy time is F, B and STEP.
    `events` are sorted by start time.
    """

    iteration_s: float
    bubble_fraction: float
    busy_s: tuple[float, ...]
    idle_s: tuple[float, ...]
    peak_in_flight_microbatches: tuple[int, ...]  # max over time of (F done - B (or W if split) done) per stage
    events: tuple[SimEvent, ...]


@dataclass
class _State:
    """Mutable simulation state (internal)."""

    clock: list[float]
    busy: list[float]
    in_flight: list[int]
    peak: list[int]
    done: list[int]
    link_free: dict[tuple[int, int], float]  # (src, dst) -> time the direction is free
    arrival: dict[tuple[Op, int, int | None], float]  # (recv op, receiving rank, mb) -> transfer end
    waiting: dict[tuple[Op, int, int | None], int]  # same key -> rank blocked on it
    events: list[SimEvent]


def _send(st: _State, costs: SimCosts, rank: int, a: Action, t: float, ready: deque[int]) -> None:
    # Virtual stages (interleaved): the message goes to stage a.stage +- 1 on its rank, over the
    # physical link direction (rank -> dst); cuts c and c + p share it, one transfer at a time.
    forward = a.op is Op.SEND_F
    dst_stage = a.stage + 1 if forward else a.stage - 1
    dst = dst_stage % len(st.clock)
    start = max(t, st.link_free.get((rank, dst), 0.0))
    end = start + costs.send_s[a.stage if forward else dst_stage]
    st.link_free[(rank, dst)] = end
    key = (Op.RECV_F if forward else Op.RECV_B, dst_stage, a.microbatch)
    st.arrival[key] = end
    st.events.append(SimEvent(rank, f"link {rank}->{dst}", _label(a), a.op, a.microbatch, start, end))
    if key in st.waiting:
        ready.append(st.waiting.pop(key))


def _advance(st: _State, schedule: Schedule, costs: SimCosts, rank: int, ready: deque[int]) -> None:
    """Run `rank` from its current step until it finishes or blocks on a RECV."""
    actions, i, t = schedule[rank], st.done[rank], st.clock[rank]
    lane = f"rank {rank}"
    split = any(a.op is Op.W for a in actions)  # B is then the input gradient only
    durations = _durations(costs, rank, len(st.clock), split)
    release = Op.W if split else Op.B  # a micro-batch is in flight until its last backward part
    while i < len(actions):
        a = actions[i]
        op = a.op
        if op is Op.RECV_F or op is Op.RECV_B:
            key = (op, a.stage, a.microbatch)
            end = st.arrival.get(key)
            if end is None:
                st.waiting[key] = rank
                break
            if end > t:
                st.events.append(SimEvent(rank, lane, _label(a), op, a.microbatch, t, end))
                t = end
        elif op is Op.SEND_F or op is Op.SEND_B:
            _send(st, costs, rank, a, t, ready)
        else:
            dur = durations[(op, a.stage)]
            st.events.append(SimEvent(rank, lane, _label(a), op, a.microbatch, t, t + dur))
            t += dur
            st.busy[rank] += dur
            if op is Op.F:
                st.in_flight[rank] += 1
                st.peak[rank] = max(st.peak[rank], st.in_flight[rank])
            elif op is release:
                st.in_flight[rank] -= 1
        i += 1
    st.done[rank], st.clock[rank] = i, t


def _durations(costs: SimCosts, rank: int, num_ranks: int, split: bool) -> dict[tuple[Op, int], float]:
    """(op, stage) -> seconds on `rank`; its STEP (named by its first stage) steps all its chunks."""
    out: dict[tuple[Op, int], float] = {}
    stages = range(rank, costs.num_stages, num_ranks)
    for s in stages:
        weight = costs.bwd_weight_s[s] if costs.bwd_weight_s else 0.0
        out[(Op.F, s)] = costs.fwd_s[s]
        out[(Op.B, s)] = costs.bwd_s[s] - weight if split else costs.bwd_s[s]
        out[(Op.W, s)] = weight
    out[(Op.STEP, rank)] = sum(costs.step_s[s] for s in stages) if costs.step_s else 0.0
    return out


def _check_match(schedule: Schedule, costs: SimCosts) -> None:
    """The schedule has p ranks and the costs p (or, interleaved, v p virtual) stages."""
    v = costs.num_stages
    ranks = len(schedule) if isinstance(schedule, dict) else 0
    if not isinstance(schedule, dict) or not ranks or v % ranks:
        shown = ranks if isinstance(schedule, dict) else type(schedule).__name__
        raise ScheduleError(f"the costs describe {v} stages but the schedule has {shown} ranks; "
                            f"fix: build the schedule with num_stages={v} (or a divisor of it, interleaved)")
    first = schedule.get(0, [])
    m = sum(1 for a in first if isinstance(a, Action) and a.op is Op.F and a.stage == 0)
    validate_schedule(schedule, num_stages=ranks, num_microbatches=max(m, 1), chunks=v // ranks)


def simulate(schedule: Schedule, costs: SimCosts) -> SimResult:
    """Simulate one training iteration of a validated `schedule` under `costs`.

    Raises `ScheduleError` if the schedule is invalid or its stage count differs from the costs'.

    Example:
        >>> from hetpipe.schedule.builders import gpipe
        >>> simulate(gpipe(1, 3), SimCosts(fwd_s=(1.0,), bwd_s=(2.0,), send_s=())).iteration_s
        9.0
    """
    _check_match(schedule, costs)
    p = len(schedule)  # ranks; the costs may describe v p virtual stages (interleaved)
    st = _State(clock=[0.0] * p, busy=[0.0] * p, in_flight=[0] * p, peak=[0] * p, done=[0] * p,
                link_free={}, arrival={}, waiting={}, events=[])
    ready: deque[int] = deque(range(p))
    while ready:
        _advance(st, schedule, costs, ready.popleft(), ready)
    assert all(st.done[r] == len(schedule[r]) for r in range(p)), "validated schedule did not finish"
    iteration = max(max(st.clock), max((e.end_s for e in st.events), default=0.0))
    busy = tuple(st.busy)
    bubble = 1.0 - sum(busy) / (p * iteration) if iteration > 0 else 0.0
    events = sorted(st.events, key=lambda e: (e.start_s, e.end_s))
    return SimResult(iteration_s=iteration, bubble_fraction=bubble, busy_s=busy,
                     idle_s=tuple(iteration - b for b in busy),
                     peak_in_flight_microbatches=tuple(st.peak), events=tuple(events))


def simulate_stages(costs: SimCosts, microbatches: int, *, schedule: str = "1f1b") -> SimResult:
    """Simulate the schedule called `schedule` over stages with these plain costs (one stage per rank;
    ``interleaved:V``: the costs' stages are virtual, V per rank).

    Example:
        >>> simulate_stages(SimCosts(fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), send_s=(0.0,)), 4).iteration_s
        15.0
        >>> simulate_stages(SimCosts(fwd_s=(0.5,) * 4, bwd_s=(1.0,) * 4, send_s=(0.0,) * 3), 4,
        ...                 schedule="interleaved:2").iteration_s
        13.5
    """
    ranks, chunks = divmod(len(costs.fwd_s), chunks_of(schedule))
    if chunks:
        raise ScheduleError(f"schedule {schedule!r} needs a multiple of {chunks_of(schedule)} stages (chunks per rank), "
                            f"the costs describe {len(costs.fwd_s)}; fix: give {chunks_of(schedule)} per rank")
    return simulate(make_schedule(schedule, ranks, microbatches), costs)
