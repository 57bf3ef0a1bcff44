"""Issue 12 item 3: the annealing on the windowed pace, configuration by configuration (`solvers/pace_search.py`).

The search side of the schedule gap at 64 and 256 cards (benchmarks/planner_scale.py): `verify` anneals the
best candidate on the windowed pace for about a second inside the 10 s limit.  This script starts from the
estimate's answer (`solve_estimate`, 6 s, seed 0: the placement `verify` gets) on the planner_scale clusters
(gpt2-xl, eight kinds, 8 cards per node) and gives each configuration of the annealing the same budget of
CPU seconds (`--cpu`; CPU, not wall: the machine's 2 cores are shared) for `--seeds` seeds; the table lists
the replayed T (`evaluate`, objective ``schedule``) of what each run returns: median, best and worst.

Configurations (module constants of `pace_search`, set for the run; the pricing, `FastPace`, is this
branch's vectorised one in every row, so the rows differ in the search alone):
* session 11: a stall of 2,000 moves ends the walk, local moves only (in the rows below, 2,000 moves in all);
* + restarts: a stalled walk more than `RESTART_GAP` above its floor starts again from its best;
* + reorderings: `REORDER_SHARE` of the moves pass a unit along several stages or move a stage;
* session 12: as above, the stall `STALL_MOVES_PER_STAGE` moves a stage of the start (at least `STALL_MOVES`);
* window start (session 13): session 12's annealing from the placement of least windowed pace among
  `window_starts.starts` (least window cap over four group orders; `verify` builds it as a candidate), not from
  the estimate's answer; its build's CPU seconds are in the start column.

Usage:
    python benchmarks/planner_anneal.py [--devices 64 256] [--cpu 2] [--seeds 5]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, write_result  # noqa: E402
from benchmarks.planner_scale import BATCH, eight_kind_cluster  # noqa: E402
from hetpipe.models import build  # noqa: E402
from hetpipe.partitioner.capture.capture import capture  # noqa: E402
from hetpipe.partitioner.problem import evaluate  # noqa: E402
from hetpipe.partitioner.solvers import pace_search, window_starts  # noqa: E402
from hetpipe.partitioner.solvers.solve import solve_estimate  # noqa: E402
from hetpipe.plan.build import build_problem  # noqa: E402

MODEL = "gpt2-xl"
#: The estimate's search time (`solve`'s share of the 10 s limit: `solve.SCHEDULE_SHARE`).
ESTIMATE_S = 6.0
#: (label, STALL_MOVES_PER_STAGE, RESTART_GAP, REORDER_SHARE) per configuration (module docstring; STALL_MOVES 2,000).
CONFIGS = (("session 11", 0, math.inf, 0.0), ("+ restarts", 0, pace_search.RESTART_GAP, 0.0),
           ("+ reorderings", 0, pace_search.RESTART_GAP, pace_search.REORDER_SHARE),
           ("session 12", pace_search.STALL_MOVES_PER_STAGE, pace_search.RESTART_GAP, pace_search.REORDER_SHARE),
           ("window start", pace_search.STALL_MOVES_PER_STAGE, pace_search.RESTART_GAP, pace_search.REORDER_SHARE))


def run_device_count(devices: int, cpu_s: float, seeds: int) -> list[list[object]]:
    """One row per configuration for `devices` cards."""
    model, inputs = build(MODEL, device="meta", batch=BATCH[MODEL])
    problem = build_problem(capture(model, inputs, name=MODEL, precision="bf16-mixed"),
                            eight_kind_cluster(devices), microbatches=2 * devices)
    answer = solve_estimate(problem, time_limit_s=ESTIMATE_S, seed=0).stages
    built_cpu = time.process_time()
    built = min(window_starts.starts(problem), key=pace_search.FastPace(problem).value)
    built_cpu = time.process_time() - built_cpu
    saved = (pace_search.STALL_MOVES_PER_STAGE, pace_search.RESTART_GAP, pace_search.REORDER_SHARE, pace_search.time)
    rows = []
    try:
        pace_search.time = SimpleNamespace(perf_counter=time.process_time)  # the deadline in CPU seconds
        for label, stall, restart, reorder in CONFIGS:
            pace_search.STALL_MOVES_PER_STAGE, pace_search.RESTART_GAP, pace_search.REORDER_SHARE = stall, restart, reorder
            start = built if label == "window start" else answer
            start_s = f"{evaluate(problem, start).iteration_s:.3f}" + (f" ({built_cpu:.2f} CPU s)" if start is built else "")
            found = []
            for seed in range(seeds):
                best = pace_search.anneal(problem, start, deadline=time.process_time() + cpu_s, seed=seed)
                found.append(evaluate(problem, best).iteration_s)
            rows.append([devices, start_s, label, f"{statistics.median(found):.3f}", f"{min(found):.3f}",
                         f"{max(found):.3f}"])
            print(" | ".join(map(str, rows[-1])), flush=True)
    finally:
        pace_search.STALL_MOVES_PER_STAGE, pace_search.RESTART_GAP, pace_search.REORDER_SHARE, pace_search.time = saved
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--cpu", type=float, default=2.0, help="CPU seconds per annealing run")
    ap.add_argument("--seeds", type=int, default=5)
    args = ap.parse_args(argv)
    load_before = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = [row for devices in args.devices for row in run_device_count(devices, args.cpu, args.seeds)]
    load_after = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    header = ["devices", "start T (s)", "configuration", "T median (s)", "T best (s)", "T worst (s)"]
    table = markdown_table(header, rows)
    body = (f"{__doc__.split('Usage:')[0].strip()}\n\n{MODEL}; {args.cpu:g} CPU s per run, seeds 0-{args.seeds - 1}; "
            f"load average (1/5/15 min) {load_before} before, {load_after} after.\n\n{table}\n")
    path = write_result("planner_anneal", "Annealing on the windowed pace: the search side of the gap (issue 12)", body)
    print(table)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
