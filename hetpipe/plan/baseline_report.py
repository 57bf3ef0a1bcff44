"""The baselines a plan records and the plan's headline speed-up (issue 17).

Each baseline is recorded twice: forced (every card in the cluster file's order, what
``baselines.baseline`` gives) and ``best`` (the same cut rule on the device subset and
order a careful user would pick, `partitioner.baseline_search`).  The headline speed-up
is over the fastest fitting baseline on its best cards; the forced figure is reported
beside it, labelled, because that is what the framework does when pointed at every card.
`plan.baseline_check` re-derives both from the plan's tables.

Example:
    >>> from hetpipe.plan.schema import BaselineReport, BestBaselineReport, BaselineStage
    >>> recs = {"uniform": BaselineReport(9.0, True, best=BestBaselineReport(2.2, True, "exact",
    ...                                   (BaselineStage("a", 0, 1), BaselineStage("b", 2, 3)))),
    ...         "parameters": BaselineReport(8.0, False)}
    >>> h = headline_from(2.0, recs)
    >>> h.best_name, h.best_devices, round(h.speedup, 2), h.forced_name, round(h.forced_speedup, 2)
    ('uniform', ('a', 'b'), 1.1, 'uniform', 4.5)
    >>> h.text()
    '1.10x faster than the best hand-tuned baseline (uniform on a, b; exact search); 4.50x over uniform forced onto every card'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from hetpipe.partitioner.baseline_search import best_baseline
from hetpipe.partitioner.baselines import BASELINES, baseline
from hetpipe.partitioner.problem import Problem
from hetpipe.plan.schema import BaselineReport, BaselineStage, BestBaselineReport, Plan


def baseline_reports(problem: Problem) -> dict[str, BaselineReport]:
    """Every baseline of `BASELINES`, forced and on its best cards, as the plan records them."""
    out = {}
    for name in BASELINES:
        forced, best = baseline(problem, name), best_baseline(problem, name)
        stages = tuple(BaselineStage(problem.devices[s.device].id, s.first_unit, s.last_unit) for s in best.stages)
        out[name] = BaselineReport(forced.iteration_s, forced.fits, forced.note,
                                   BestBaselineReport(best.iteration_s, best.fits, best.search,
                                                      stages if best.fits else (), best.profile_kind, best.note))
    return out


@dataclass(frozen=True)
class Headline:
    """The plan's speed-up over the best hand-tuned baseline, and over the best forced one.

    A speed-up is None when no baseline of that kind fits.
    """

    plan_s: float
    best_name: str
    best_s: float
    best_devices: tuple[str, ...]
    best_search: str
    forced_name: str
    forced_s: float
    rules_recorded: bool = True  # False: only other baselines (a replica plan's), no forced figure to give

    @property
    def speedup(self) -> float | None:
        return self.best_s / self.plan_s if self.best_name else None

    @property
    def forced_speedup(self) -> float | None:
        return self.forced_s / self.plan_s if self.forced_name else None

    def text(self) -> str:
        """One line: the headline, then the forced figure, labelled."""
        if self.speedup is None:
            head = "no baseline fits on any subset of the cards"
        elif not self.best_search:  # no best placement recorded (an older plan, or a replica plan's baselines)
            head = f"{self.speedup:.2f}x faster than the best recorded baseline ({self.best_name})"
        else:
            where = f" on {', '.join(self.best_devices)}" if self.best_devices else ""
            head = (f"{self.speedup:.2f}x faster than the best hand-tuned baseline ({self.best_name}{where}; "
                    f"{self.best_search} search)")
        if not self.rules_recorded:
            return head
        forced = (f"{self.forced_speedup:.2f}x over {self.forced_name} forced onto every card"
                  if self.forced_speedup is not None else "every baseline forced onto every card is out of memory")
        return f"{head}; {forced}"


def headline_from(plan_s: float, baselines: Mapping[str, BaselineReport]) -> Headline:
    """`Headline` of a plan with T `plan_s` and these recorded baselines (see the module docstring)."""
    best = ("", 0.0, (), "")
    forced = ("", 0.0)
    for name, rec in baselines.items():
        if name in BASELINES and rec.fits and (not forced[0] or rec.iteration_s < forced[1]):
            forced = (name, rec.iteration_s)
        if rec.best is not None:
            cand = (name, rec.best.iteration_s, tuple(s.device for s in rec.best.stages), rec.best.search)
            ok = rec.best.fits
        else:  # a plan without best placements (older, or a replica plan's own baselines): as recorded
            cand, ok = (name, rec.iteration_s, (), ""), rec.fits
        if ok and (not best[0] or cand[1] < best[1]):
            best = cand
    return Headline(plan_s, best[0], best[1], best[2], best[3], forced[0], forced[1],
                    rules_recorded=any(name in BASELINES for name in baselines))


def headline(plan: Plan) -> Headline:
    """`headline_from` for a saved plan."""
    return headline_from(plan.predicted.iteration_s, plan.baselines)
