"""Timelines of an iteration: a Gantt PNG (matplotlib) and a Chrome/Perfetto trace.

Both draw `hetpipe.schedule.simulate.SimResult.events`: one row per rank (F blue, B
orange, optimizer step purple, RECV waits grey) and one per link direction (transfers
green), micro-batch numbers written on the bars.  A measured run's per-action timings
become the same kind of result with `timeline_from_actions`, so `save_gantt_compare`
can stack predicted and measured on one time axis.

Example:
    >>> from hetpipe.schedule.builders import one_f_one_b
    >>> from hetpipe.schedule.simulate import SimCosts, simulate
    >>> res = simulate(one_f_one_b(2, 2), SimCosts(fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), send_s=(0.5,)))
    >>> trace = chrome_trace(res, labels=["gpu0", "gpu1"])
    >>> sorted(row_names(trace).values())[:2]
    ['0: gpu0', '1: gpu1']
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping, Protocol, Sequence

from hetpipe.cost_models.outputs import atomic_path, atomic_write_text
from hetpipe.errors import ConfigError
from hetpipe.plan.analysis import PlanSimulation, simulate_plan
from hetpipe.plan.schema import Plan
from hetpipe.runtime.measured_links import message_spans
from hetpipe.runtime.report import RunReport
from hetpipe.schedule.actions import Action, Op
from hetpipe.schedule.simulate import SimEvent, SimResult

#: Bar colours per op (matplotlib named colours).
COLOURS = {Op.F: "tab:blue", Op.B: "tab:orange", Op.STEP: "tab:purple"}
TRANSFER_COLOUR = "tab:green"
WAIT_COLOUR = "lightgrey"
#: Chrome trace timestamps are microseconds.
US_PER_S = 1e6
#: Micro-batch numbers are written on bars longer than this share of the iteration (readable at 12 in wide).
LABEL_MIN_SHARE = 1 / 120
#: A link row busy for less than this share of the iteration is not drawn: at 12 in and 110 dpi the
#: time axis is ~1000 px wide, so its bars add up to under 20 px -- a near-empty row of slivers, not a
#: timeline (issue 17 item 5); the panel title names the rows left out.  Rank rows always stay.
LANE_MIN_SHARE = 1 / 50


class TimedAction(Protocol):
    """What a measured run records per action (`hetpipe.runtime.execute.executor.ActionTiming` has this shape)."""

    action: str  # e.g. "1F3"
    start_s: float  # since the start of the step, seconds
    duration_s: float


def _lane_label(lane: str, labels: Sequence[str]) -> str:
    if lane.startswith("rank "):
        r = int(lane.split()[1])
        return f"{r}: {labels[r]}" if r < len(labels) else lane
    return lane


def chrome_trace(result: SimResult, *, labels: Sequence[str] = (), process: str = "hetpipe",
                 pid: int = 1) -> dict[str, Any]:
    """The Chrome trace-event JSON (``{"traceEvents": [...]}``) of an iteration as process `pid` named `process`.

    Numeric ids with ``process_name`` / ``thread_name`` metadata events (the trace-event format's
    way to name rows, which Perfetto and chrome://tracing both read); one thread per row, ranks
    first (``thread_sort_index``).
    """
    lanes = _lanes(result)
    tid = {lane: i + 1 for i, lane in enumerate(lanes)}
    meta: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process}},
                                  {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                                   "args": {"sort_index": pid}}]
    for lane in lanes:
        meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid[lane],
                     "args": {"name": _lane_label(lane, labels)}})
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid[lane],
                     "args": {"sort_index": tid[lane]}})
    events = [{"name": e.action, "ph": "X", "ts": e.start_s * US_PER_S, "dur": e.duration_s * US_PER_S,
               "pid": pid, "tid": tid[e.lane],
               "args": {"microbatch": e.microbatch, "op": str(e.op.value if hasattr(e.op, "value") else e.op)}}
              for e in result.events]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms"}


def row_names(trace: Mapping[str, Any]) -> dict[tuple[int, int], str]:
    """(pid, tid) -> row name, from a trace's ``thread_name`` metadata (for readers and tests).

    Example:
        >>> from hetpipe.schedule.builders import gpipe
        >>> from hetpipe.schedule.simulate import SimCosts, simulate
        >>> sim = simulate(gpipe(2, 1), SimCosts(fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), send_s=(0.5,)))
        >>> sorted(row_names(chrome_trace(sim, labels=["a", "b"], pid=3)).values())
        ['0: a', '1: b', 'link 0->1', 'link 1->0']
    """
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
            if e.get("ph") == "M" and e.get("name") == "thread_name"}


def timeline_from_actions(actions_by_rank: Mapping[int, Sequence[TimedAction]]) -> SimResult:
    """A `SimResult` from measured per-action timings (rank -> actions of one step), for drawing.

    F, B and STEP count as busy; RECV_* are waits; SEND_* (posting a send) stay on the rank's
    row.  Raises `ValueError` naming the rank if an action string does not parse.

    Example:
        >>> from types import SimpleNamespace as T
        >>> res = timeline_from_actions({0: [T(action="0F0", start_s=0.0, duration_s=1.0),
        ...                                  T(action="0RECV_B0", start_s=1.0, duration_s=0.5),
        ...                                  T(action="0B0", start_s=1.5, duration_s=2.0)]})
        >>> res.iteration_s, res.busy_s, round(res.bubble_fraction, 3)
        (3.5, (3.0,), 0.143)
    """
    events, busy = [], {}
    for rank in sorted(actions_by_rank):
        busy[rank] = 0.0
        for t in actions_by_rank[rank]:
            try:
                a = Action.parse(t.action)
            except ValueError as err:
                raise ValueError(f"rank {rank}: {err}") from None
            if a.op in (Op.F, Op.B, Op.STEP):
                busy[rank] += t.duration_s
            events.append(SimEvent(rank, f"rank {rank}", t.action, a.op, a.microbatch, t.start_s,
                                   t.start_s + t.duration_s))
    ranks = range(max(busy) + 1) if busy else range(0)
    busy_s = tuple(busy.get(r, 0.0) for r in ranks)
    iteration = max((e.end_s for e in events), default=0.0)
    bubble = 1.0 - sum(busy_s) / (len(busy_s) * iteration) if iteration > 0 else 0.0
    return SimResult(iteration_s=iteration, bubble_fraction=bubble, busy_s=busy_s,
                     idle_s=tuple(iteration - b for b in busy_s), peak_in_flight_microbatches=(),
                     events=tuple(sorted(events, key=lambda e: (e.start_s, e.end_s))))


def _lanes(result: SimResult) -> list[str]:
    lanes = list(dict.fromkeys(e.lane for e in result.events))
    ranks = sorted((lane for lane in lanes if lane.startswith("rank ")), key=lambda s: int(s.split()[1]))
    return ranks + sorted(lane for lane in lanes if not lane.startswith("rank "))


def _shown_lanes(result: SimResult) -> tuple[list[str], list[str]]:
    """(rows to draw, link rows left out for being nearly empty: see `LANE_MIN_SHARE`)."""
    busy: dict[str, float] = {}
    for e in result.events:
        busy[e.lane] = busy.get(e.lane, 0.0) + max(e.duration_s, 0.0)
    keep, dropped = [], []
    for lane in _lanes(result):
        quiet = not lane.startswith("rank ") and busy.get(lane, 0.0) < LANE_MIN_SHARE * result.iteration_s
        (dropped if quiet else keep).append(lane)
    return keep, dropped


def _draw(ax: Any, result: SimResult, labels: Sequence[str], title: str) -> None:
    lanes, dropped = _shown_lanes(result)
    row = {lane: i for i, lane in enumerate(lanes)}
    for e in result.events:
        if e.duration_s <= 0 or e.lane not in row:
            continue
        waiting = e.lane.startswith("rank ") and e.op not in COLOURS
        colour = WAIT_COLOUR if waiting else COLOURS.get(e.op, TRANSFER_COLOUR)
        y = row[e.lane]
        ax.broken_barh([(e.start_s, e.duration_s)], (y - 0.4, 0.8), facecolors=colour, edgecolor="white")
        if e.microbatch is not None and not waiting and e.duration_s > result.iteration_s * LABEL_MIN_SHARE:
            ax.text(e.start_s + e.duration_s / 2, y, str(e.microbatch), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(lanes)), [_lane_label(lane, labels) for lane in lanes], fontsize=8)
    ax.set_ylim(len(lanes) - 0.5, -0.5)  # rank 0 on top
    title = title or f"iteration {result.iteration_s:.4g} s, bubble {result.bubble_fraction:.0%}"
    if dropped:
        title += f" (not drawn, busy < {LANE_MIN_SHARE:.1%}: {', '.join(dropped)})"
    ax.set_title(title, fontsize=10)


def _legend(ax: Any, plt: Any) -> None:
    names = {"forward": COLOURS[Op.F], "backward": COLOURS[Op.B], "optimizer step": COLOURS[Op.STEP],
             "transfer": TRANSFER_COLOUR, "waiting": WAIT_COLOUR}
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in names.values()]
    # Outside the plot, right of the top panel, so it never hides bars.
    ax.legend(handles, list(names), fontsize=8, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0.0)


#: Characters per line of a Gantt's headline: the 12-inch figure holds ~140 of 11 pt bold DejaVu Sans (~0.085 in
#: each); 120 leaves the margins.
SUPTITLE_CHARS = 120


def gantt_figure(panels: Sequence[tuple[str, SimResult]], *, labels: Sequence[str] = (), suptitle: str = "") -> Any:
    """The matplotlib Figure of `save_gantt_compare` (one axis per panel, rank rows first, then links).

    Example:
        >>> from hetpipe.schedule.builders import gpipe
        >>> from hetpipe.schedule.simulate import SimCosts, simulate
        >>> sim = simulate(gpipe(2, 2), SimCosts(fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), send_s=(0.5,)))
        >>> fig = gantt_figure([("predicted", sim)], labels=["gpu0", "gpu1"])
        >>> [t.get_text() for t in fig.axes[0].get_yticklabels()]
        ['0: gpu0', '1: gpu1', 'link 0->1', 'link 1->0']
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not panels:
        raise ValueError("a Gantt chart needs at least one (title, result) panel")
    heights = [max(len(_shown_lanes(r)[0]), 1) for _, r in panels]
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": heights},
                             figsize=(12, 0.6 * sum(heights) + 1.2 * len(panels) + 0.5))
    for ax, (title, result) in zip(axes[:, 0], panels):
        _draw(ax, result, labels, title)
    _legend(axes[0, 0], plt)
    axes[-1, 0].set_xlabel("seconds")
    if suptitle:  # wrapped: a long headline (model, cards, two speed-ups) ran off both sides of the figure
        fig.suptitle(textwrap.fill(suptitle, SUPTITLE_CHARS), fontsize=11, fontweight="bold")
    fig.tight_layout()
    return fig


def save_gantt_compare(panels: Sequence[tuple[str, SimResult]], path: str | Path, *,
                       labels: Sequence[str] = (), suptitle: str = "") -> Path:
    """Stack one Gantt panel per ``(title, result)`` on a shared time axis (e.g. predicted over measured).

    Example:
        >>> import tempfile
        >>> from hetpipe.schedule.builders import gpipe
        >>> from hetpipe.schedule.simulate import SimCosts, simulate
        >>> sim = simulate(gpipe(2, 2), SimCosts(fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), send_s=(0.5,)))
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     png = save_gantt_compare([("predicted", sim), ("measured", sim)], f"{tmp}/g.png")
        ...     png.stat().st_size > 1000
        True
    """
    import matplotlib.pyplot as plt

    fig = gantt_figure(panels, labels=labels, suptitle=suptitle)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save_gantt(result: SimResult, path: str | Path, *, labels: Sequence[str] = (), title: str = "",
               suptitle: str = "") -> Path:
    """Draw `result` as a Gantt chart PNG at `path` (one panel of `save_gantt_compare`)."""
    return save_gantt_compare([(title or f"simulated iteration: {result.iteration_s:.4g} s, bubble "
                                         f"{result.bubble_fraction:.0%}", result)], path, labels=labels,
                              suptitle=suptitle)


def write_timelines(sim: PlanSimulation, *, gantt: Path | None = None, trace: Path | None = None,
                    title: str = "") -> tuple[Path, ...]:
    """Write the Gantt PNG and/or Chrome trace JSON of `sim`; returns the paths written.

    Example:
        write_timelines(simulate_plan(Plan.load("plan.json")), gantt=Path("g.png"), trace=Path("t.json"))
    """
    written = []
    if gantt is not None:
        title = title or (f"{sim.name}: simulated {sim.schedule} iteration {sim.simulated_s:.4g} s "
                          f"(analytic T {sim.analytic_s:.4g} s), m={sim.microbatches}")
        with atomic_path(gantt, option="--gantt") as tmp:  # an existing picture survives a failed drawing
            save_gantt(sim.result, tmp, labels=sim.labels, title=title)
        written.append(Path(gantt))
    if trace is not None:
        atomic_write_text(trace, json.dumps(chrome_trace(sim.result, labels=sim.labels)), option="--trace")
        written.append(Path(trace))
    return tuple(written)


def stage_labels(plan: Plan) -> list[str]:
    """One row label per stage: ``"desk:0 (rtx3090)"``."""
    kinds = {d.id: d.kind for d in plan.devices}
    return [f"{s.device} ({kinds[s.device]})" for s in plan.stages]


def measured_timeline(report: RunReport) -> SimResult:
    """A run's last recorded step as a timeline, in the run's seconds (emulated seconds under ``--emulate``).

    The ranks line up on their steps' CLOCK_MONOTONIC origins (one host; a report without
    origins keeps each rank's own step start), and every message seen whole
    (`hetpipe.runtime.measured_links.message_spans`) is a transfer on its link row, like the
    simulator's.
    """
    scale = report.time_scale
    aligned = bool(report.timelines) and all(t.origin_s > 0 for t in report.timelines)
    zero = min(t.origin_s for t in report.timelines) if aligned else 0.0
    per_rank = {t.stage: [SimpleNamespace(action=a.action, start_s=(a.start_s + (t.origin_s - zero if aligned else 0.0))
                                          / scale, duration_s=a.duration_s / scale) for a in t.actions]
                for t in report.timelines}
    ranks = timeline_from_actions(per_rank)
    links = tuple(SimEvent(m.src, f"link {m.src}->{m.dst}", m.action, Action.parse(m.action).op, m.microbatch,
                           (m.start_s - zero) / scale, (m.end_s - zero) / scale)
                  for m in (message_spans(report.timelines) if aligned else ()))
    return replace(ranks, events=tuple(sorted(ranks.events + links, key=lambda e: (e.start_s, e.end_s))))


def run_trace(plan: Plan, report: RunReport) -> dict[str, Any]:
    """One Perfetto trace with two processes: the plan's simulated iteration and the run's measured last step."""
    labels = stage_labels(plan)
    seconds = "emulated s" if report.emulate else "real s"
    predicted = chrome_trace(simulate_plan(plan).result, labels=labels, process="predicted (simulated)", pid=1)
    measured = chrome_trace(measured_timeline(report), labels=labels, pid=2,
                            process=f"measured ({seconds}, last step{', not emulated' if not report.emulate else ''})")
    return {"traceEvents": predicted["traceEvents"] + measured["traceEvents"], "displayTimeUnit": "ms"}


def check_run_report(plan: Plan, report: RunReport) -> None:
    """Raise `ConfigError` unless `report` can be drawn under `plan` (``show --run`` checks it before any output)."""
    if not report.timelines:
        raise ConfigError("the run report holds no recorded step (a run that stopped before its first step); "
                          "re-run `hetpipe run --report run.json` and draw that")
    if report.fingerprint != plan.model.fingerprint:
        raise ConfigError(f"the run report is of model {report.model} ({report.fingerprint[:12]}), the plan of "
                          f"{plan.model.name} ({plan.model.fingerprint[:12]}); pass the plan the run used")


def write_run_timelines(plan: Plan, report: RunReport, *, gantt: Path | None = None, trace: Path | None = None,
                        suptitle: str = "", flags: tuple[str, str] = ("--gantt", "--trace")) -> tuple[Path, ...]:
    """Predicted (simulated) over measured: a two-panel Gantt PNG and/or a two-process Perfetto trace.

    ``flags``: the options that gave `gantt` and `trace`, named when they cannot be written.
    """
    check_run_report(plan, report)
    written = []
    if gantt is not None:
        sim, measured = simulate_plan(plan).result, measured_timeline(report)
        how = "emulated" if report.emulate else "real, not emulated"
        with atomic_path(gantt, option=flags[0]) as tmp:
            save_gantt_compare([(f"predicted (simulated): {sim.iteration_s:.4g} s", sim),
                                (f"measured ({how}): {measured.iteration_s:.4g} s (last step)", measured)],
                               tmp, labels=stage_labels(plan), suptitle=suptitle)
        written.append(Path(gantt))
    if trace is not None:
        atomic_write_text(trace, json.dumps(run_trace(plan, report)), option=flags[1])
        written.append(Path(trace))
    return tuple(written)
