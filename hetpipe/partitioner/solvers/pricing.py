"""Schedule pricing against a hard deadline: `verify` starts a pricing only if it ends in time (issue 12).

Why.  `evaluate` under the schedule objective cannot stop half-way: it replays the 1F1B program of the
pipeline's length, compiling it first where that length is new (`schedule.replay.compile_schedule`, cached per
length).  Measured on the 2-core VM (CPU seconds, `benchmarks/limit_trace.py`'s problems, 2 micro-batches per
card): a compile with its first replay 0.011 s at 32 cards (28 stages), 0.094-0.193 s at 256 (25-50 stages),
0.44-0.58 s at 1,024 (34-50 stages); a replay alone 0.002, 0.010-0.019 and 0.045-0.050 s.  One pricing started
just before `verify`'s deadline ran 0.36 s of CPU past it (llama-7b on 1,024 cards).  So `verify` asks a `Pricer`
first (`fits`): its forecast is the pipeline's p x m actions times the largest rate per action this pricer has
seen, a compile's where the length is new to it, a replay's otherwise.  Until it has seen a compile, a compile's
rate is `COMPILE_OVER_REPLAY` times the replay's; until it has seen anything, the forecast is 0 (the first
pricing starts whenever the deadline has not passed).  A forecast that is too high only skips a pricing that
would have ended in time (a start, a move, priced no more); the answer and the bound stay valid.

The one pricing no deadline stops is `verify`'s first that fits: it must answer with a placement priced by the
schedule.  That pricing (and `solve`'s re-pricing of ``--recompute none``'s answer under ``auto``) is what
`solve`'s time limit allows beyond itself (README, *time limit*).

Example (a clock that only pricing moves: 1 s per replay, nothing compiled; the deadline at 2.5 s lets two in):
    >>> from hetpipe.partitioner.problem import DeviceSlot, Problem, Stage
    >>> inf = float("inf")
    >>> prob = Problem(fwd_s={"a": (1.0,) * 2}, bwd_s={"a": (2.0,) * 2}, state_bytes=(1,) * 2,
    ...                activation_bytes=(1,) * 2, boundary_bytes=(0,) * 2,
    ...                devices=(DeviceSlot("d0", "a", "n", 100),), bandwidth_bytes_s=((inf,),),
    ...                latency_s=((0.0,),), microbatches=2)
    >>> clock = [0.0]
    >>> def priced(problem, stages, objective):
    ...     clock[0] += 1.0
    ...     return evaluate(problem, stages, objective=objective)
    >>> pricer = Pricer(prob, deadline=2.5, clock=lambda: clock[0], price_fn=priced)
    >>> one = (Stage(0, 0, 1),)
    >>> [pricer.fits(one) and pricer.price(one).iteration_s for _ in range(3)], clock[0]
    ([12.0, 12.0, False], 2.0)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from hetpipe.partitioner.problem import Evaluation, Problem, Stage, evaluate
from hetpipe.schedule.replay import compile_schedule

#: A compile's rate per action over a replay's, until the pricer has seen a compile: measured 9.4-11.6 (the CPU
#: seconds in the module docstring: 0.094 / 0.010, 0.193 / 0.019, 0.578 / 0.050, 0.444 / 0.045), rounded up.
COMPILE_OVER_REPLAY = 12.0


@dataclass
class Pricer:
    """Schedule pricings of `problem` that must end by `deadline` (`clock` seconds): `fits` forecasts, `price` prices
    and learns (module docstring).  `price_fn` is `evaluate` (the tests' clocks wrap it)."""

    problem: Problem
    deadline: float
    clock: Callable[[], float] = field(default=lambda: time.perf_counter())  # looked up per call (tests' clocks)
    price_fn: Callable[..., Evaluation] = evaluate
    replay_rate_s: float = 0.0  # the largest seconds per action of a pricing that compiled nothing
    compile_rate_s: float = 0.0  # the largest seconds per action of one that compiled its length's program
    lengths: set[int] = field(default_factory=set)  # pipeline lengths priced here (their programs are compiled)

    def forecast_s(self, stages: Sequence[Stage], *, new: bool = False) -> float:
        """Seconds `stages`' pricing is expected to take (module docstring); with `new`, as if its length were new."""
        actions = len(stages) * self.problem.microbatches
        if len(stages) in self.lengths and not new:
            return actions * self.replay_rate_s
        return actions * max(self.compile_rate_s, COMPILE_OVER_REPLAY * self.replay_rate_s)

    def fits(self, stages: Sequence[Stage]) -> bool:
        """Whether pricing `stages` is expected to end by the deadline."""
        return self.clock() + self.forecast_s(stages) <= self.deadline

    def left_s(self) -> float:
        """Seconds to the deadline (0 past it)."""
        return max(0.0, self.deadline - self.clock())

    def price(self, stages: Sequence[Stage]) -> Evaluation:
        """`stages` priced by the schedule (whatever the time: callers ask `fits` first), the rates updated."""
        misses, start = compile_schedule.cache_info().misses, self.clock()
        ev = self.price_fn(self.problem, stages, objective="schedule")
        rate = (self.clock() - start) / max(1, len(stages) * self.problem.microbatches)
        if compile_schedule.cache_info().misses > misses:
            self.compile_rate_s = max(self.compile_rate_s, rate)
        else:
            self.replay_rate_s = max(self.replay_rate_s, rate)
        self.lengths.add(len(stages))
        return ev


def price_in_order(pricer: Pricer, starts: Sequence[tuple[Stage, ...]],
                   priced: dict[tuple[Stage, ...], Evaluation] | None = None, *,
                   first_only: bool = False) -> dict[tuple[Stage, ...], Evaluation]:
    """`priced` (default none) and `starts` priced in order while each fits before the deadline, the first one that
    fits (in memory) whatever the time unless `priced` has one (`verify` must answer); the ones skipped are left
    out.  With `first_only`, no more once one fits (`verify` prices its answer first, within its time where it can).

    Example (a deadline already past: only the first start that fits is priced):
        >>> from hetpipe.partitioner.problem import DeviceSlot
        >>> inf = float("inf")
        >>> prob = Problem(fwd_s={"a": (1.0,) * 2}, bwd_s={"a": (2.0,) * 2}, state_bytes=(1,) * 2,
        ...                activation_bytes=(1,) * 2, boundary_bytes=(0,) * 2,
        ...                devices=(DeviceSlot("d0", "a", "n", 100), DeviceSlot("d1", "a", "n", 100)),
        ...                bandwidth_bytes_s=((inf, inf), (inf, inf)), latency_s=((0.0, 0.0), (0.0, 0.0)),
        ...                microbatches=2)
        >>> starts = [(Stage(0, 0, 1),), (Stage(0, 0, 0), Stage(1, 1, 1))]
        >>> [len(s) for s in price_in_order(Pricer(prob, deadline=-math.inf), starts)]
        [1]
    """
    out = dict(priced or {})
    answered = any(ev.fits for ev in out.values())
    for start in starts:
        if answered and first_only:
            break
        if start in out or (answered and not pricer.fits(start)):
            continue
        out[start] = ev = pricer.price(start)
        answered = answered or ev.fits
    return out
