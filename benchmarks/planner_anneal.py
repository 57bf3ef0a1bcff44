"""Issue 12 item 3: the annealing on the windowed pace, configuration by configuration (`solvers/pace_search.py`).

The search side of the schedule gap at 64 and 256 cards (benchmarks/planner_scale.py): `verify` anneals on the
windowed pace inside the 10 s limit.  This script builds the starts `verify` gets on the planner_scale clusters
(gpt2-xl, eight kinds, 8 cards per node): the estimate's answer (`solve_estimate`, 6 s, seed 0) and the window
start (`window_starts.starts`, least windowed pace), and runs each configuration for `--seeds` seeds; the
table lists the replayed T (`evaluate`, objective ``schedule``) of what each run returns (median, best, worst)
and its CPU seconds (median).  Since session 15 the annealing's work is fixed (`MAX_ROUNDS` rounds of
`ROUND_MOVES_PER_STAGE` moves a stage), so its answer is a function of seed and start; `--cpu` is only a
guard (CPU seconds per run: the machine's 2 cores are shared).

Configurations (module constants of `pace_search`, set for the run):
* local moves, 0.5%: session 14's moves (no node-run moves) at session 11-14's starting temperature, in rounds;
* local moves: the same at session 15's 0.2%;
* + run moves: `RUN_SHARE` of the moves on whole node runs (`run_moves`);
* two chains: + run moves from both starts, rounds taken in turn (`anneal_chains`: what `verify` runs with
  `ANNEAL_CHAINS` = 2, its two least-pace starts; at 64 cards under the 10 s limit the second is a walk's
  placement or the estimate's answer).

Usage:
    python benchmarks/planner_anneal.py [--devices 64 256] [--cpu 20] [--seeds 8]
"""

from __future__ import annotations

import argparse
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
#: (label, START_TEMPERATURE, RUN_SHARE, starts) per configuration (module docstring).
CONFIGS = (("local moves, 0.5%", 0.005, 0.0, ("window",)), ("local moves", 0.002, 0.0, ("window",)),
           ("+ run moves", 0.002, pace_search.RUN_SHARE, ("window",)),
           ("+ run moves", 0.002, pace_search.RUN_SHARE, ("estimate",)),
           ("two chains", 0.002, pace_search.RUN_SHARE, ("window", "estimate")))


def run_device_count(devices: int, cpu_s: float, seeds: int) -> list[list[object]]:
    """One row per configuration for `devices` cards."""
    model, inputs = build(MODEL, device="meta", batch=BATCH[MODEL])
    problem = build_problem(capture(model, inputs, name=MODEL, precision="bf16-mixed"),
                            eight_kind_cluster(devices), microbatches=2 * devices)
    built_cpu = time.process_time()
    starts = {"window": min(window_starts.starts(problem), key=pace_search.FastPace(problem).value)}
    built_cpu = time.process_time() - built_cpu
    starts["estimate"] = solve_estimate(problem, time_limit_s=ESTIMATE_S, seed=0).stages
    saved = (pace_search.START_TEMPERATURE, pace_search.RUN_SHARE, pace_search.time)
    rows = []
    try:
        pace_search.time = SimpleNamespace(perf_counter=time.process_time)  # the guard in CPU seconds
        for label, temperature, run_share, names in CONFIGS:
            pace_search.START_TEMPERATURE, pace_search.RUN_SHARE = temperature, run_share
            start_s = " + ".join(f"{name} {evaluate(problem, starts[name]).iteration_s:.3f}" for name in names)
            found, spent = [], []
            for seed in range(seeds):
                began = time.process_time()
                best = pace_search.anneal_chains(problem, [starts[n] for n in names],
                                                 deadline=time.process_time() + cpu_s, seed=seed)
                spent.append(time.process_time() - began)
                found.append(evaluate(problem, best).iteration_s)
            rows.append([devices, start_s, label, f"{statistics.median(found):.3f}", f"{min(found):.3f}",
                         f"{max(found):.3f}", f"{statistics.median(spent):.2f}"])
            print(" | ".join(map(str, rows[-1])), flush=True)
    finally:
        pace_search.START_TEMPERATURE, pace_search.RUN_SHARE, pace_search.time = saved
    print(f"window start built in {built_cpu:.2f} CPU s", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--cpu", type=float, default=20.0, help="CPU seconds per annealing run at most (a guard)")
    ap.add_argument("--seeds", type=int, default=8)
    args = ap.parse_args(argv)
    load_before = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = [row for devices in args.devices for row in run_device_count(devices, args.cpu, args.seeds)]
    load_after = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    header = ["devices", "start T (s)", "configuration", "T median (s)", "T best (s)", "T worst (s)", "CPU s (median)"]
    table = markdown_table(header, rows)
    body = (f"{__doc__.split('Usage:')[0].strip()}\n\n{MODEL}; at most {args.cpu:g} CPU s per run, seeds 0-{args.seeds - 1}; "
            f"load average (1/5/15 min) {load_before} before, {load_after} after.\n\n{table}\n")
    path = write_result("planner_anneal", "Annealing on the windowed pace: the search side of the gap (issue 12)", body)
    print(table)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
