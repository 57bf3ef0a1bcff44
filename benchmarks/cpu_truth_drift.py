"""Host drift in the CPU truth benchmark (`benchmarks/cpu_truth.py`, issue 17 item 4).

A round of that benchmark calibrates the core groups, plans on them and runs the plan minutes
later; on a shared virtual machine the host's speed drifts in between (session 15: the same stage's
F 30.6 then 53.5 ms ten minutes apart), so the raw ratio mixes the cost model's error with the
drift.  Two measured ways to separate them, each beside the raw ratios (the headline):

* **Both calibrations** (the round design): the rounds form a chain, calibration k, the runs of
  round k, calibration k+1, ...; each run's plan is priced again on the calibration after it
  (`plan_prices` with the next plan's unit tables and links: the same stages, the same objective),
  and the run is compared with the mean of the two prices (`mean_prices`): a drift linear in time
  over the round cancels.  One calibration and one plan per model more than before, in all.
* **Drift divided out**: the fixed reference workload (`hetpipe.cost_models.host_reference`) timed
  on every core group right before and after each calibration and each run; a stage's ratio is
  divided by its group's reference wall seconds at the run / at its calibration (`HostDrift`),
  the iteration's by the mean over the groups.  A correction measured in the same round, not a
  constant; it takes out what slows the reference and the stage alike (the host), not what only
  a model's kernels meet.

Example:
    >>> drifted(1.30, 1.25)
    1.04
    >>> drifted(1.30, None) is None
    True
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Sequence

from hetpipe.cost_models.host_reference import HostDrift, ReferenceTiming, host_drift
from hetpipe.partitioner.problem import evaluate
from hetpipe.plan.schema import Plan, problem_from_plan, stages_from_plan

#: The per-stage measures `Prices` holds, in the run report's names (`benchmarks/cpu_truth.MEASURES`' keys).
PRICED = ("F", "B", "C", "Cb", "S")


@dataclass(frozen=True)
class Prices:
    """One plan's stages priced on one calibration: seconds per stage under each of `PRICED`, and T."""

    per_stage: tuple[dict[str, float], ...]
    iteration_s: float


@dataclass(frozen=True)
class RunDrift:
    """What one run of a round adds to its raw ratios: the prices on the calibration after it and each
    stage's host drift (None where a stage's cores have no reference sample)."""

    next_prices: Prices
    own_prices: Prices
    stage_drift: tuple[HostDrift | None, ...]
    #: the reference samples of the round: "calibration" (before and after the plan's calibration), "run" (right
    #: before and after the run), "next" (before and after the calibration after the run)
    refs: dict[str, tuple[ReferenceTiming, ...]] = dataclasses.field(default_factory=dict)


def _grad_s(plan: Plan, s: int) -> float:
    """The gradient message back over the cut after stage `s`, as the run report prices it (latency + bytes / bw)."""
    if s + 1 >= len(plan.stages):
        return 0.0
    src, dst = plan.stages[s + 1].device, plan.stages[s].device
    link = next((k for k in plan.links if (k.src, k.dst) == (src, dst)), None)
    unit = plan.units[plan.stages[s].last_unit]
    grad_bytes = unit.boundary_grad_bytes if plan.memory_model >= 2 else unit.boundary_bytes
    return 0.0 if link is None else link.latency_s + grad_bytes / link.bandwidth_bytes_s


def plan_prices(plan: Plan, tables: Plan | None = None) -> Prices:
    """`plan`'s stages priced by `evaluate` on `tables`' unit times, links and step launch shares (a plan of the
    same model on another calibration of the same devices); on `plan`'s own tables without `tables`."""
    src = plan if tables is None else tables
    if [u.name for u in src.units] != [u.name for u in plan.units] or (
            {d.kind for d in src.devices} < {d.kind for d in plan.devices}):
        raise ValueError("the other plan is not of the same model's units on the same device kinds")
    hybrid = dataclasses.replace(plan, units=src.units, links=src.links, step_launch_s=src.step_launch_s)
    ev = evaluate(problem_from_plan(hybrid), stages_from_plan(plan))
    per = tuple({"F": c.fwd_s, "B": c.bwd_s, "C": c.send_s, "Cb": _grad_s(hybrid, s), "S": c.step_s}
                for s, c in enumerate(ev.stages))
    return Prices(per, ev.iteration_s)


def mean_prices(a: Prices, b: Prices) -> Prices:
    """The mean of two pricings of the same stages, figure by figure.

    Example:
        >>> m = mean_prices(Prices(({"F": 1.0},), 3.0), Prices(({"F": 2.0},), 5.0))
        >>> m.per_stage[0]["F"], m.iteration_s
        (1.5, 4.0)
    """
    per = tuple({k: (x[k] + y[k]) / 2 for k in x} for x, y in zip(a.per_stage, b.per_stage))
    return Prices(per, (a.iteration_s + b.iteration_s) / 2)


def stage_drifts(stage_cores: Sequence[Sequence[int]], at_calibration: Sequence[ReferenceTiming],
                 at_run: Sequence[ReferenceTiming]) -> tuple[HostDrift | None, ...]:
    """Per stage (its rank's cores): the host drift of its core group, None where a side has no sample.

    Example:
        >>> cal = [ReferenceTiming((0,), 0.01, 0.01, (), 0.0)]
        >>> run = [ReferenceTiming((0,), 0.02, 0.01, (), 9.0)]
        >>> [d and d.wall_ratio for d in stage_drifts([(0,), (1,)], cal, run)]
        [2.0, None]
    """
    by = {d.cores: d for d in host_drift(at_calibration, at_run)}
    return tuple(by.get(tuple(sorted(c))) for c in stage_cores)


def drifted(ratio: float | None, drift: float | None) -> float | None:
    """A measured / predicted ratio with the host's drift divided out (None if either is unknown)."""
    return None if ratio is None or drift is None or drift <= 0 else round(ratio / drift, 12)


def iteration_drift(stage_drift: Sequence[HostDrift | None]) -> float | None:
    """The iteration's drift: the mean wall drift over the stages' groups (every stage runs in every step).

    Example:
        >>> iteration_drift([HostDrift((0,), 1.2, 1.0), HostDrift((1,), 1.0, 1.0)])
        1.1
    """
    got = [d.wall_ratio for d in stage_drift if d is not None]
    return round(statistics.fmean(got), 12) if got else None


def cell(ratios: Sequence[float | None], digits: int = 2) -> str:
    """The median of the known ratios and their spread, ``-`` if none.

    Example:
        >>> cell([1.1, None, 0.9, 1.0]), cell([None])
        ('1.00 (0.90-1.10)', '-')
    """
    got = [r for r in ratios if r is not None]
    if not got:
        return "-"
    mid = statistics.median(got)
    spread = f" ({min(got):.{digits}f}-{max(got):.{digits}f})" if len(got) > 1 else ""
    return f"{mid:.{digits}f}{spread}"


def _ms(samples: Sequence[ReferenceTiming], cores: tuple[int, ...]) -> str:
    """A side's samples on `cores`, wall ms each (``/`` between them)."""
    return " / ".join(f"{s.wall_s * 1e3:.2f}" for s in samples if tuple(s.cores) == cores) or "-"


def round_rows(outcomes: Sequence[object]) -> list[list[object]]:
    """Per run and core group: the reference at the calibration, the run and the next calibration, and the drift."""
    rows = []
    for o in outcomes:
        d: RunDrift | None = getattr(o, "drift", None)
        if d is None:
            continue
        both = {x.cores: x for x in host_drift((*d.refs["calibration"], *d.refs["next"]), d.refs["run"])}
        for x in d.stage_drift:
            if x is None:
                continue
            parts = ", ".join(f"{p} {r:.2f}" for p, r in x.parts_wall_ratio)
            rows.append([o.round + 1, o.model, ",".join(map(str, x.cores)), _ms(d.refs["calibration"], x.cores),
                         _ms(d.refs["run"], x.cores), _ms(d.refs["next"], x.cores),
                         f"{x.wall_ratio:.2f} ({x.cpu_ratio:.2f})", parts,
                         f"{both[x.cores].wall_ratio:.2f}" if x.cores in both else "-", f"{o.load_before:.1f}"])
    return rows


def _ratios(o: object, s: int, k: str) -> tuple[float | None, float | None, float | None]:
    """Stage `s`'s `k` in run `o`: measured / (its plan's price, the mean over both calibrations, the plan's price
    with the drift divided out)."""
    st, d = o.stages[s], o.drift
    m, p = st.measured.get(k), st.predicted.get(k, 0.0)
    raw = None if m is None or p <= 0 else m / p
    if d is None:
        return raw, None, None
    both = mean_prices(d.own_prices, d.next_prices).per_stage[s][k]
    drift = d.stage_drift[s].wall_ratio if s < len(d.stage_drift) and d.stage_drift[s] else None
    return raw, (None if m is None or both <= 0 else m / both), drifted(raw, drift)


def ratio_rows(outcomes: Sequence[object], measures: Sequence[str] = ("F", "B", "S")) -> tuple[list, list, list]:
    """(stage rows, iteration rows, verdict lines): raw ratios, on both calibrations, drift divided out."""
    stage_rows, it_rows, verdicts = [], [], []
    for model in dict.fromkeys(o.model for o in outcomes):
        runs = [o for o in outcomes if o.model == model]
        worst = [0.0, 0.0, 0.0]
        for s in range(len(runs[0].stages)):
            row: list[object] = [model, s]
            for k in measures:
                per = list(zip(*[_ratios(o, s, k) for o in runs if len(o.stages) > s]))
                row += [cell(list(col)) for col in per]
                for j, col in enumerate(per):
                    got = [x for x in col if x is not None]
                    if k in ("F", "B") and got:
                        worst[j] = max(worst[j], abs(statistics.median(got) - 1.0))
            stage_rows.append(row)
        its = [_iteration(o) for o in runs]
        cols = [list(c) for c in zip(*its)]
        it_rows.append([model, *(cell(c) for c in cols)])
        med = [abs(statistics.median([x for x in c if x is not None]) - 1.0) if any(x is not None for x in c) else None
               for c in cols]
        verdicts.append(f"- {model}: worst stage F/B off by {worst[0]:.0%} raw, {worst[1]:.0%} on both calibrations, "
                        f"{worst[2]:.0%} with the drift divided out (goal 15%); iteration off by "
                        + ", ".join("-" if v is None else f"{v:.0%}" for v in med) + " (goal 10%)")
    return stage_rows, it_rows, verdicts


def _iteration(o: object) -> tuple[float | None, float | None, float | None]:
    raw = o.measured_iteration_s / o.predicted_iteration_s
    d = o.drift
    if d is None:
        return raw, None, None
    both = mean_prices(d.own_prices, d.next_prices).iteration_s
    return raw, o.measured_iteration_s / both, drifted(raw, iteration_drift(d.stage_drift))


def drift_section(outcomes: Sequence[object]) -> str:
    """The markdown of the host drift: per round and group, then the ratios three ways (module docstring)."""
    from benchmarks.common import markdown_table

    stage_rows, it_rows, verdicts = ratio_rows(outcomes)
    cpu_rows = cpu_time_rows(outcomes)
    three = ("raw", "both cal.", "drift out")
    head = ["model", "stage", *(f"{k} {w}" for k in ("F", "B", "S") for w in three)]
    return "\n\n".join([
        "**Host drift** (`benchmarks/cpu_truth_drift.py`, `hetpipe.cost_models.host_reference`): the fixed reference "
        "workload (4 linear layers 1024 x 128 -> 512, a tanh GELU over 2 MiB, a 32 MiB copy; pinned, both core "
        "groups at once, median of 40 passes) right before and after each calibration and each run, wall ms per "
        "pass; drift = the run's mean / its calibration's mean, wall (thread CPU time), and per part; the last "
        "column against the mean of both calibrations around the run (what the both-calibration price assumes).",
        markdown_table(["round", "model", "cores", "reference at calibration (ms)", "at run (ms)",
                        "at next calibration (ms)", "drift run / calibration", "per part", "run / both calibrations",
                        "load before run"], round_rows(outcomes)),
        "Ratios three ways, medians over rounds (spread): **raw** (measured / the plan's price: the headline, what "
        "the goal is judged on), on **both cal.** (measured / the mean of the plan's price and the same stages' "
        "price on the calibration after the run) and with the **drift out** (raw / the stage's core-group drift; the "
        "iteration's / the mean over groups).",
        markdown_table(head, stage_rows),
        markdown_table(["model", "iteration raw", "iteration both cal.", "iteration drift out"], it_rows),
        "\n".join(verdicts),
        "In the run itself (session 16): each rank also times every F and B in its thread's CPU seconds "
        "(`RankResult.fwd_cpu_s`; time other processes held the stage's core does not count). Wall / CPU is the "
        "share of the core the stage did not get; the CPU-time ratio is measured CPU seconds / the plan's price "
        "(medians over rounds, spread).",
        markdown_table(["model", "stage", "F wall / CPU", "F CPU-time ratio", "B wall / CPU", "B CPU-time ratio"],
                       cpu_rows)])


def cpu_time_rows(outcomes: Sequence[object]) -> list[list[object]]:
    """Per model and stage: the run's wall / CPU seconds of F and B and their CPU seconds / the plan's price."""
    rows = []
    for model in dict.fromkeys(o.model for o in outcomes):
        runs = [o for o in outcomes if o.model == model]
        for s in range(len(runs[0].stages)):
            row: list[object] = [model, s]
            for wall_key, cpu_key in (("F", "Fcpu"), ("B", "Bcpu")):
                got = [(o.stages[s].measured.get(wall_key), o.stages[s].measured.get(cpu_key),
                        o.stages[s].predicted.get(wall_key, 0.0)) for o in runs if len(o.stages) > s]
                row += [cell([w / c if w and c else None for w, c, _ in got]),
                        cell([c / p if c and p > 0 else None for _, c, p in got])]
            rows.append(row)
    return rows


def row_drift(row: dict) -> HostDrift | None:
    """The load-robust check's row (`benchmarks/cpu_truth_cputime.py`): its reference at the measurement / at the
    calibration (None for rows without ``reference``, written before session 16).

    Example:
        >>> ref = lambda cpu_s: {"cores": [1], "wall_s": cpu_s, "cpu_s": cpu_s, "parts_wall_s": [], "taken_at_s": 0}
        >>> row_drift({"reference": {"calibration": [ref(0.01), ref(0.012)], "measure": [ref(0.0132)]}}).cpu_ratio
        1.2
    """
    refs = row.get("reference")
    if not refs:
        return None

    def timing(doc: dict) -> ReferenceTiming:
        pairs = {k: tuple((str(p), float(v)) for p, v in doc.get(k, ())) for k in ("parts_wall_s", "parts_cpu_s")}
        return ReferenceTiming(tuple(doc["cores"]), doc["wall_s"], doc["cpu_s"], pairs["parts_wall_s"],
                               doc["taken_at_s"], pairs["parts_cpu_s"])

    got = host_drift([timing(d) for d in refs["calibration"]], [timing(d) for d in refs["measure"]])
    return dataclasses.replace(got[0], cpu_ratio=round(got[0].cpu_ratio, 12)) if got else None
