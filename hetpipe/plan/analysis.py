"""What-if questions about a saved plan: simulate its schedule, compare it with the baselines.

Everything here reads only the plan file: `problem_from_plan` rebuilds the solver's
tables, `problem.evaluate` gives the analytic T (the H-1F1B formula of
cost_formulas.md §3.3) and `hetpipe.schedule.simulate` replays the same per-rank
action lists the runtime executes.  The two disagree where the formula's
assumptions do not hold (see the simulator's docstring and the README section
"Simulator vs the analytic T"); these functions put both side by side.

Example (the CLI front-ends):
    $ hetpipe show plan.json --gantt gantt.png --trace trace.json
    $ hetpipe simulate plan.json --microbatches 32 --schedule gpipe
    $ hetpipe compare plan.json --baselines
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from hetpipe.errors import ConfigError
from hetpipe.partitioner.baseline_search import best_baseline
from hetpipe.partitioner.baselines import BASELINES, baseline_stages, without_offload
from hetpipe.plan.schema import Plan, problem_from_plan, stages_from_plan
from hetpipe.partitioner.problem import Problem, Stage, evaluate
from hetpipe.partitioner.recompute import with_recompute
from hetpipe.schedule.actions import Op
from hetpipe.partitioner.placement import costs_from_problem
from hetpipe.schedule.simulate import SimResult, simulate_stages

#: Relative gap between simulated and analytic T above which views explain the difference
#: (the fidelity tests hold the two within this where the formula's assumptions hold).
AGREEMENT_RTOL = 0.02
# Where the formula's assumptions hold (tests/test_simulate_fidelity.py checks AGREEMENT_RTOL there;
# with these bounds the measured worst case is about 0.8% for "balanced" and 1.6% for "dominant"):
#: "balanced": max(F+B) / min(F+B) over the stages at most this ...
BALANCED_MAX_RATIO = 1.05
#: ... and every cut's round trip 2C at most this share of min(F+B) (1F1B puts C on its critical path).
CHEAP_COMM_SHARE = 0.01
#: "dominant": one stage's F+B at least this many times everything else of one round trip,
#: sum of the other stages' F+B plus 2 sum C; then m (F+B)_k <= T_sim, T = m (F+B)_k + rest.
DOMINANCE_RATIO = 8.0
#: Both need at least this many micro-batches per stage (fill and drain are a small share of T).
MIN_MICROBATCHES_PER_STAGE = 4


def formula_regime(work_s: Sequence[float], send_s: Sequence[float], microbatches: int) -> str:
    """Which of the formula's assumptions a placement meets: "balanced", "dominant" or "" (neither).

    `work_s` is F+B per stage, `send_s` the one-way C per cut.  See the constants above.

    Example:
        >>> formula_regime((1.0, 1.02, 1.01), (0.004, 0.0), 12)
        'balanced'
        >>> formula_regime((0.05, 2.0, 0.05), (0.01, 0.01), 12)
        'dominant'
        >>> formula_regime((1.0, 1.0), (0.5,), 12)   # 1F1B waits for that link every other micro-batch
        ''
    """
    p = len(work_s)
    if p == 0 or microbatches < MIN_MICROBATCHES_PER_STAGE * p:
        return ""
    lo, hi = min(work_s), max(work_s)
    round_trip = 2.0 * max(send_s, default=0.0)
    if hi <= BALANCED_MAX_RATIO * lo and round_trip <= CHEAP_COMM_SHARE * lo:
        return "balanced"
    rest = sum(work_s) - hi + 2.0 * sum(send_s)
    if p > 1 and rest * DOMINANCE_RATIO <= hi:
        return "dominant"
    return ""


@dataclass(frozen=True)
class PlanSimulation:
    """One simulated iteration of a placement next to its analytic T.

    ``analytic_s`` is `evaluate`'s T at ``microbatches``: the plan's objective (the simulated 1F1B
    schedule since plan version 4, the H-1F1B formula before), whatever `schedule` is simulated;
    ``estimate_s`` is the H-1F1B formula (`Evaluation.estimate_s`), kept for comparison.
    """

    name: str  # "hetpipe" or a baseline's name
    schedule: str
    microbatches: int
    stages: tuple[Stage, ...]
    labels: tuple[str, ...]  # per stage: "device (kind)"
    stage_work_s: tuple[float, ...]  # F+B per micro-batch, per stage
    send_s: tuple[float, ...]  # C per cut, one way
    analytic_s: float
    fits: bool
    note: str
    result: SimResult
    placement: str = ""  # baselines: "forced" (every card, file order) or "best" (best cards and order)
    estimate_s: float = 0.0

    @property
    def simulated_s(self) -> float:
        return self.result.iteration_s

    @property
    def gap(self) -> float:
        """simulated / analytic - 1 (0.05: the simulator is 5% slower than the formula)."""
        return relative_gap(self.simulated_s, self.analytic_s)

    @property
    def analytic_bubble_fraction(self) -> float:
        """1 - m sum(F+B) / (p T): the formula's idle share of the stages."""
        p, m = len(self.stages), self.microbatches
        return 1.0 - m * sum(self.stage_work_s) / (p * self.analytic_s) if self.analytic_s > 0 else 0.0

    @property
    def regime(self) -> str:
        """`formula_regime` of this placement ("" when the formula's assumptions do not hold)."""
        return formula_regime(self.stage_work_s, self.send_s, self.microbatches)

    def recv_wait_s(self) -> tuple[float, ...]:
        """Per stage: seconds blocked in RECV (waiting on a peer or a link)."""
        waits = [0.0] * len(self.stages)
        for e in self.result.events:
            if e.lane.startswith("rank ") and e.op in (Op.RECV_F, Op.RECV_B):
                waits[e.rank] += e.duration_s
        return tuple(waits)


def relative_gap(simulated_s: float, analytic_s: float) -> float:
    """``simulated / analytic - 1``; 0 when both are 0.

    Example:
        >>> round(relative_gap(50.0, 54.0), 4)
        -0.0741
    """
    if analytic_s == 0:
        return 0.0 if simulated_s == 0 else float("inf")
    return simulated_s / analytic_s - 1.0


def _problem(plan: Plan, microbatches: int | None) -> Problem:
    problem = problem_from_plan(plan)
    if microbatches is None:
        return problem
    if microbatches < 1:
        raise ConfigError(f"--microbatches must be at least 1, got {microbatches}")
    return dataclasses.replace(problem, microbatches=microbatches)


def _simulate_stages(problem: Problem, stages: tuple[Stage, ...], *, name: str, schedule: str,
                     note: str = "") -> PlanSimulation:
    ev = evaluate(problem, stages)
    costs = costs_from_problem(problem, stages)
    result = simulate_stages(costs, problem.microbatches, schedule=schedule)
    labels = tuple(f"{problem.devices[st.device].id} ({problem.devices[st.device].kind})" for st in stages)
    return PlanSimulation(
        name=name, schedule=schedule.lower(), microbatches=problem.microbatches, stages=stages, labels=labels,
        stage_work_s=tuple(c.fwd_s + c.bwd_s for c in ev.stages), send_s=costs.send_s,
        analytic_s=ev.iteration_s, fits=ev.fits, note=note, result=result, estimate_s=ev.estimate_s)


def simulate_plan(plan: Plan, *, microbatches: int | None = None, schedule: str | None = None) -> PlanSimulation:
    """Simulate `plan`'s placement (default: its own micro-batch count and schedule).

    Raises `ConfigError` for ``microbatches < 1`` and `ScheduleError` for an unknown schedule.

    Example:
        sim = simulate_plan(Plan.load("plan.json"), microbatches=16)
        print(sim.simulated_s, sim.analytic_s, sim.result.bubble_fraction)
    """
    problem = _problem(plan, microbatches)
    return _simulate_stages(problem, stages_from_plan(plan), name="hetpipe",
                            schedule=schedule or plan.training.schedule)


def compare_plan(plan: Plan, *, baselines: Sequence[str] | None = None, microbatches: int | None = None,
                 schedule: str | None = None) -> tuple[PlanSimulation, ...]:
    """The plan, then each baseline (default: all of `BASELINES`) forced and on its best cards.

    Forced baselines are re-placed from the plan's own tables (`baseline_stages`), so their
    analytic T equals the one recorded in ``plan.baselines`` at the plan's micro-batch count.
    A baseline's best cards (row ``"NAME (best cards)"``) are the recorded ones at the plan's
    micro-batch count, and searched again (`best_baseline`) at another.

    Example:
        rows = compare_plan(Plan.load("plan.json"))
        print([(r.name, r.analytic_s / rows[0].analytic_s) for r in rows[1:]])  # speed-ups
    """
    names = list(BASELINES) if baselines is None else list(baselines)
    unknown = [n for n in names if n not in BASELINES]
    if unknown:
        raise ConfigError(f"unknown baseline {unknown[0]!r}; choose from: {', '.join(BASELINES)}")
    problem = _problem(plan, microbatches)
    sched = schedule or plan.training.schedule
    rows = [_simulate_stages(problem, stages_from_plan(plan), name="hetpipe", schedule=sched)]
    for name in names:
        recorded = plan.baselines.get(name)
        rows.append(dataclasses.replace(
            _simulate_stages(problem, baseline_stages(problem, name), name=name, schedule=sched,
                             note=recorded.note if recorded is not None else ""), placement="forced"))
        best = _best_stages(plan, problem, name, same_m=microbatches in (None, plan.training.microbatches))
        if best is not None:
            rows.append(dataclasses.replace(
                _simulate_stages(problem, best, name=f"{name} (best cards)", schedule=sched), placement="best"))
    return tuple(rows)


def _best_stages(plan: Plan, problem: Problem, name: str, *, same_m: bool) -> tuple[Stage, ...] | None:
    """Baseline `name` on its best cards: as recorded at the plan's m, else searched; None if none fits."""
    recorded = plan.baselines.get(name)
    if same_m and recorded is not None and recorded.best is not None:
        index = plan.device_index()
        stages = tuple(Stage(index[s.device], s.first_unit, s.last_unit) for s in recorded.best.stages)
        return with_recompute(without_offload(problem), stages) if stages else None  # the plan's lever, as searched
    best = best_baseline(problem, name)
    return best.stages if best.fits else None


def divergence_reason(sim: PlanSimulation) -> str:
    """Why the simulated and analytic T differ by more than `AGREEMENT_RTOL` ("" when they agree).

    Example:
        >>> from hetpipe.schedule.simulate import SimResult
        >>> res = SimResult(51.0, 0.0, (), (), (), ())
        >>> sim = PlanSimulation("x", "1f1b", 32, (), (), (1.0, 1.0, 1.0, 1.0), (0.0, 0.5, 0.0), 36.0, True, "", res)
        >>> divergence_reason(sim).split(":")[0]
        'the simulator is slower'
    """
    if abs(sim.gap) <= AGREEMENT_RTOL:
        return ""
    slow_link = bool(sim.send_s) and 2.0 * max(sim.send_s) > max(sim.stage_work_s)
    if sim.gap < 0:
        why = ("a link's 2C is the formula's bottleneck, but the two directions run at once and the round trip "
               "overlaps compute" if slow_link else
               "the formula counts the fill and drain of every stage, while 1F1B hides the stages after the "
               "bottleneck under its warm-up")
        return f"the simulator is faster: {why}"
    if sim.schedule == "gpipe":
        return "the simulator is slower: the formula is 1F1B's; GPipe drains all backwards after all forwards"
    return ("the simulator is slower: 1F1B keeps at most p - s micro-batches in flight on stage s, so every "
            "transfer on a round trip lands on the critical path, which the formula does not charge")
