"""Issue 12 item 3: the pace walk's count relaxation, by which kinds it merges (`relax.pace_relaxation`).

Beyond the count DP (64 cards of eight kinds and up) `verify` bounds the schedule optimum with the pace walk
(`schedule_bound.schedule_walk`) on a count relaxation: the node-free problem with groups of kinds merged,
each at its fastest member's speed.  Before session 13 the groups were `aggregate_kinds`'s (the slowest kinds
merged until the DP fits: on gpt2-xl at 64 cards A100 | 4090 | the six others at the A6000's speed); now they
are the cut of least `relax.merge_loss` for pipelines as long as the best candidate.  This script builds the
planner_scale problems, takes the estimate's answers as hints (`solve_estimate`, 6 s, seed 0, as `verify`
gets them), and runs each relaxation's walk to its end (no deadline but `--limit`): the bound it proves
(plus the least first step, as `verify` adds it), its passes and CPU seconds (the walks in `verify` get
about 1.5 s of the 10 s limit at quiet load, so the CPU column says how much of a bound fits there).

Usage:
    python benchmarks/pace_relaxation.py [--cases gpt2-xl:64 llama-7b:64 gpt2-xl:256] [--limit 120]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, write_result  # noqa: E402
from benchmarks.planner_scale import BATCH, eight_kind_cluster  # noqa: E402
from hetpipe.models import build  # noqa: E402
from hetpipe.partitioner.capture.capture import capture  # noqa: E402
from hetpipe.partitioner.solvers.relax import pace_relaxation, relaxation_levels  # noqa: E402
from hetpipe.partitioner.solvers.schedule_bound import BAND_TOLERANCE, pace_terms, schedule_walk  # noqa: E402
from hetpipe.partitioner.solvers.solve import solve_estimate  # noqa: E402
from hetpipe.partitioner.solvers.verify import first_step_floor  # noqa: E402
from hetpipe.plan.build import build_problem  # noqa: E402

#: Seconds of the estimate's search whose answers are the hints (`solve`'s share of the 10 s limit).
ESTIMATE_S = 6.0


def run_case(model_name: str, devices: int, limit_s: float) -> list[list[object]]:
    """Rows for one model and cluster: each relaxation's groups, bound, passes and CPU seconds."""
    model, inputs = build(model_name, device="meta", batch=BATCH[model_name])
    graph = capture(model, inputs, name=model_name, precision="bf16-mixed")
    problem = build_problem(graph, eight_kind_cluster(devices), microbatches=2 * devices)
    est = solve_estimate(problem, time_limit_s=ESTIMATE_S, seed=0)
    hints = [est.stages, *est.alternatives]
    best = min(hints, key=lambda h: sum(pace_terms(problem, h, windows=True)))
    first = first_step_floor(problem)
    rows = []
    cuts = (("aggregate_kinds (before)", lambda: relaxation_levels(problem)[0]),
            ("pace_relaxation (now)", lambda: pace_relaxation(problem, stages=len(best))))
    for name, make in cuts:
        cpu = time.process_time()
        relaxed, members = make()
        walk = schedule_walk(relaxed, deadline=time.perf_counter() + limit_s, hints=hints,
                             band_tolerance=BAND_TOLERANCE)
        groups = " \\| ".join(" ".join(k.split("-")[0] for k in g) for g in members.values())
        rows.append([model_name, devices, len(best), name, groups, f"{walk.bound_s + first:.3f}", walk.passes,
                     "yes" if walk.exact else "no", f"{time.process_time() - cpu:.1f}"])
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["gpt2-xl:64", "llama-7b:64", "gpt2-xl:256"])
    ap.add_argument("--limit", type=float, default=120.0, help="wall seconds each walk may take at most")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    rows = []
    for case in args.cases:
        model_name, devices = case.split(":")
        rows += run_case(model_name, int(devices), args.limit)
    load_after = os.getloadavg()
    header = ["model", "devices", "stages of the best hint", "cut", "groups (fastest first)", "bound (s)",
              "passes", "bound met a placement", "CPU s"]
    body = "\n".join([
        __doc__.split("Usage:")[0].split("\n", 1)[1].strip(), "",
        f"Load average (1/5/15 min) {' / '.join(f'{x:.1f}' for x in load_before)} before, "
        f"{' / '.join(f'{x:.1f}' for x in load_after)} after.", "",
        markdown_table(header, rows)])
    print(body)
    write_result("pace_relaxation", "The pace walk's count relaxation: which kinds merge (issue 12)", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
