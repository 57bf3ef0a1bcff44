"""Issue 12 item 3: card counts priced into the node-run pace walk's bound (`solvers/pace_prices.py`).

The node-run relaxation (`pace_runs.RunDP`: kinds exact, node boundaries kept, card counts dropped) bounds the
schedule optimum where counts do not bind (gpt2-xl on 256 cards: 32 cards of each kind, 38 stages); its walk's
argmin there puts 33 stages on the 32 A100s.  `pace_prices.tighten` prices the overused kinds' stages on the
walk's weakest bands (Lagrangian relaxation, cutting planes on the price).  This script builds the planner_scale
problems, takes the estimate's answers as hints (`solve_estimate`, 6 s, seed 0, as `verify` gets them), runs the
node-run walk with the pair filter to its end (its band tolerance, as `verify._runs_walk` runs it first) and then
`tighten`: the bound before and after (plus the least first step, as `verify` adds it), the walk's passes, the
priced passes and CPU seconds of each, and the schedule gap against the planner_scale answer's T (`ANSWER_S`: the
lead's quiet table).  `verify` prices only where card counts do not bind (`verify.counts_bind`: not at 64 cards).

Usage:
    python benchmarks/pace_prices.py [--cases gpt2-xl:256 gpt2-xl:64]
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
from hetpipe.partitioner.solvers.pace_prices import tighten  # noqa: E402
from hetpipe.partitioner.solvers.pace_runs import RunDP, run_terms  # noqa: E402
from hetpipe.partitioner.solvers.schedule_bound import BAND_TOLERANCE, schedule_walk  # noqa: E402
from hetpipe.partitioner.solvers.solve import solve_estimate  # noqa: E402
from hetpipe.partitioner.solvers.verify import first_step_floor  # noqa: E402
from hetpipe.plan.build import build_problem  # noqa: E402

#: Seconds of the estimate's search whose answers are the hints (`solve`'s share of the 10 s limit).
ESTIMATE_S = 6.0
#: The schedule T of the planner_scale answers (benchmarks/results/planner_scale.md, the lead's quiet rerun of
#: session 13's merged head, load 1.2), the gap's numerator.
ANSWER_S = {"gpt2-xl:256": 7.833, "gpt2-xl:64": 3.361}


def run_case(case: str) -> list[object]:
    """One row: the node-run pair walk's bound, then `tighten`'s, with CPU seconds and priced passes."""
    model_name, devices = case.split(":")
    model, inputs = build(model_name, device="meta", batch=BATCH[model_name])
    graph = capture(model, inputs, name=model_name, precision="bf16-mixed")
    problem = build_problem(graph, eight_kind_cluster(int(devices)), microbatches=2 * int(devices))
    est = solve_estimate(problem, time_limit_s=ESTIMATE_S, seed=0)
    first = first_step_floor(problem)
    cpu = time.process_time()
    runs = RunDP(problem)
    walk = schedule_walk(problem, hints=[est.stages, *est.alternatives], dp=runs, pairs=True,
                         terms=lambda picks: run_terms(problem.microbatches, picks), band_tolerance=BAND_TOLERANCE)
    walk_cpu = time.process_time() - cpu
    passes = [0]
    plain = runs.priced_min

    def counted(*args: object, **kwargs: object) -> object:
        passes[0] += 1
        return plain(*args, **kwargs)  # type: ignore[arg-type]
    runs.priced_min = counted  # type: ignore[method-assign]
    cpu = time.process_time()
    bound = tighten(walk, runs, problem)
    tight_cpu = time.process_time() - cpu
    answer = ANSWER_S.get(case)
    gaps = ["", ""] if answer is None else [f"{(answer - b - first) / answer:.2%}" for b in (walk.bound_s, bound)]
    return [model_name, devices, f"{walk.bound_s + first:.4f}", walk.passes, f"{walk_cpu:.2f}",
            f"{bound + first:.4f}", passes[0], f"{tight_cpu:.2f}", "" if answer is None else f"{answer:.3f}", *gaps]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["gpt2-xl:256", "gpt2-xl:64"])
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    rows = [run_case(case) for case in args.cases]
    load_after = os.getloadavg()
    header = ["model", "devices", "node-run bound (s)", "walk passes", "walk CPU s", "priced bound (s)",
              "priced passes", "pricing CPU s", "answer T (s)", "gap before", "gap after"]
    body = "\n".join([
        __doc__.split("Usage:")[0].split("\n", 1)[1].strip(), "",
        f"Load average (1/5/15 min) {' / '.join(f'{x:.1f}' for x in load_before)} before, "
        f"{' / '.join(f'{x:.1f}' for x in load_after)} after.", "", markdown_table(header, rows), ""])
    path = write_result("pace_prices", "Card counts priced into the node-run pace walk (issue 12)", body)
    print(markdown_table(header, rows))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
