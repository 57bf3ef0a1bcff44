"""Timelines of a simulated iteration: a Gantt PNG (matplotlib) and a Chrome/Perfetto trace.

Both draw `hetpipe.runtime.simulate.SimResult.events`: one row per rank (F blue, B
orange, RECV waits grey) and one per link direction (transfers green), micro-batch
numbers written on the bars.

Example:
    >>> from hetpipe.runtime.schedule import one_f_one_b
    >>> from hetpipe.runtime.simulate import SimCosts, simulate
    >>> res = simulate(one_f_one_b(2, 2), SimCosts(fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), send_s=(0.5,)))
    >>> trace = chrome_trace(res, labels=["gpu0", "gpu1"])
    >>> sorted({e["tid"] for e in trace["traceEvents"]})[:2]
    ['0: gpu0', '1: gpu1']
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from hetpipe.runtime.actions import Op
from hetpipe.runtime.simulate import SimResult

#: Bar colours per op (matplotlib named colours).
COLOURS = {Op.F: "tab:blue", Op.B: "tab:orange"}
TRANSFER_COLOUR = "tab:green"
WAIT_COLOUR = "lightgrey"
#: Chrome trace timestamps are microseconds.
US_PER_S = 1e6


def _lane_label(lane: str, labels: Sequence[str]) -> str:
    if lane.startswith("rank "):
        r = int(lane.split()[1])
        return f"{r}: {labels[r]}" if r < len(labels) else lane
    return lane


def chrome_trace(result: SimResult, *, labels: Sequence[str] = ()) -> dict[str, Any]:
    """The Chrome trace-event JSON (``{"traceEvents": [...]}``) of a simulated iteration."""
    events = [{"name": e.action, "ph": "X", "ts": e.start_s * US_PER_S, "dur": e.duration_s * US_PER_S,
               "pid": "hetpipe", "tid": _lane_label(e.lane, labels),
               "args": {"microbatch": e.microbatch, "op": str(e.op.value if hasattr(e.op, "value") else e.op)}}
              for e in result.events]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def save_gantt(result: SimResult, path: str | Path, *, labels: Sequence[str] = (), title: str = "") -> Path:
    """Draw `result` as a Gantt chart PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = list(dict.fromkeys(e.lane for e in sorted(result.events, key=lambda e: e.lane)))
    ranks = sorted((lane for lane in lanes if lane.startswith("rank ")), key=lambda s: int(s.split()[1]))
    lanes = ranks + [lane for lane in lanes if not lane.startswith("rank ")]
    row = {lane: i for i, lane in enumerate(lanes)}
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(lanes) + 1.5))
    for e in result.events:
        if e.duration_s <= 0:
            continue
        waiting = e.lane.startswith("rank ") and e.op not in COLOURS
        colour = WAIT_COLOUR if waiting else COLOURS.get(e.op, TRANSFER_COLOUR)
        y = row[e.lane]
        ax.broken_barh([(e.start_s, e.duration_s)], (y - 0.4, 0.8), facecolors=colour, edgecolor="white")
        if e.microbatch is not None and not waiting and e.duration_s > result.iteration_s / 120:
            ax.text(e.start_s + e.duration_s / 2, y, str(e.microbatch), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(lanes)), [_lane_label(lane, labels) for lane in lanes], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title or f"simulated iteration: {result.iteration_s:.4g} s, bubble {result.bubble_fraction:.0%}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (COLOURS[Op.F], COLOURS[Op.B], TRANSFER_COLOUR,
                                                              WAIT_COLOUR)]
    ax.legend(handles, ["forward", "backward", "transfer", "waiting"], fontsize=8, loc="upper right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
