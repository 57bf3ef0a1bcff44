"""Issue 17, item 1: the objective is the schedule it runs, optimizer step included -- before / after.

Before: the planner minimised the H-1F1B estimate T_est (no optimizer step) and the plan's T was
that estimate; the runtime runs the 1F1B action lists, whose simulated time (with steps) is what a
user sees.  After: T is that simulation (`evaluate`), the solvers' estimate answer is verified and
improved under it, with a valid lower bound (`partitioner/solvers/verify.py`).

1. Scenarios (analytic GPT graphs, `benchmarks/scenarios.py`, on example clusters and on
   generated mixed clusters with slow networks): T_est of the estimate's plan, its simulation
   (what it really takes: "before"), the new plan's T (= its simulation: "after"), the bound, the
   optimizer step's share, planner wall time before / after.
2. Random small instances with links 1-100x slower (the brute-force test's generator):
   the new answer vs the enumerated schedule optimum, and the bound's gap.

Writes benchmarks/results/objective.md.

Usage:
    python benchmarks/objective.py [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import markdown_table, write_result  # noqa: E402
from benchmarks.scenarios import CLUSTERS_DIR, gpt_graph, mixed_cluster  # noqa: E402

#: (label, cluster factory, layers, micro-batches)
SCENARIOS = (
    ("homelab (1 GbE)", lambda: _load("homelab.yaml"), 24, 6),
    ("homelab (1 GbE)", lambda: _load("homelab.yaml"), 24, 24),
    ("community-16 (internet)", lambda: _load("community-16.yaml"), 48, 32),
    ("mixed-8, 1 Gbit/s between nodes", lambda: mixed_cluster(8, per_node=2, network="1Gbit/s"), 24, 16),
    ("mixed-8, 100 Mbit/s between nodes", lambda: mixed_cluster(8, per_node=2, network="100Mbit/s"), 24, 16),
    ("mixed-16, 1 Gbit/s between nodes", lambda: mixed_cluster(16, per_node=4, network="1Gbit/s"), 48, 32),
)
QUICK = SCENARIOS[:1] + SCENARIOS[3:5]


def _load(name: str):
    from hetpipe.cost_models.cluster import load_cluster

    return load_cluster(CLUSTERS_DIR / name)


def scenario_row(label: str, cluster, layers: int, m: int) -> list[object]:
    from hetpipe.partitioner.problem import evaluate
    from hetpipe.partitioner.solvers.solve import solve, solve_estimate
    from hetpipe.plan.build import build_problem

    graph = gpt_graph(layers=layers, hidden=1024, seq=1024, batch=1)
    problem = build_problem(graph, cluster, microbatches=m, recompute="auto")
    t0 = time.perf_counter()
    old = solve_estimate(dataclasses.replace(problem, objective="estimate"), time_limit_s=10.0)
    t1 = time.perf_counter()
    new = solve(problem, time_limit_s=10.0)
    t2 = time.perf_counter()
    before = evaluate(problem, old.stages)  # the estimate's plan under the schedule it runs
    after = evaluate(problem, new.stages)
    steps = max(c.step_s for c in after.stages)
    return [label, f"{layers}L", str(m), f"{len(old.stages)} / {len(new.stages)}",
            f"{before.estimate_s:.3f} s", f"{before.iteration_s:.3f} s", f"{before.iteration_s / before.estimate_s - 1:+.1%}",
            f"{after.iteration_s:.3f} s", f"{before.iteration_s / after.iteration_s - 1:+.1%}",
            f"{new.bound_s:.3f} s ({new.gap:.1%})", f"{steps * 1e3:.1f} ms", f"{t1 - t0:.2f} s / {t2 - t0:.2f} s"]


def random_stats(instances: int) -> list[list[object]]:
    """Answer vs the enumerated schedule optimum on random small instances with slow links."""
    from hetpipe.partitioner.problem import evaluate
    from hetpipe.partitioner.solvers.solve import solve, solve_estimate
    from tests.instances import all_placements, random_problem, recompute_choices

    rng = random.Random(17)
    rows = []
    for slow in (1.0, 10.0, 100.0):
        excess, old_excess, gaps, exact, n = [], [], [], 0, 0
        for _ in range(instances):
            prob = random_problem(rng, units=rng.randint(2, 6), devices=rng.randint(2, 4),
                                  microbatches=rng.randint(2, 12), objective="schedule")
            prob = dataclasses.replace(prob, bandwidth_bytes_s=tuple(tuple(b / slow for b in row)
                                                                     for row in prob.bandwidth_bytes_s))
            best = min((evaluate(prob, c).iteration_s for st in all_placements(prob)
                        for c in recompute_choices(prob, st) if evaluate(prob, c).fits), default=None)
            if best is None:
                continue
            sol = solve(prob)
            old = solve_estimate(dataclasses.replace(prob, objective="estimate"))
            n += 1
            excess.append(sol.iteration_s / best - 1)
            old_excess.append(evaluate(prob, old.stages).iteration_s / best - 1)
            gaps.append(sol.gap)
            exact += sol.iteration_s <= best * (1 + 1e-9)
        rows.append([f"{slow:g}x slower", str(n), f"{exact / n:.0%}", f"{statistics.mean(excess):.2%}",
                     f"{max(excess):.1%}", f"{statistics.mean(old_excess):.2%}", f"{max(old_excess):.1%}",
                     f"{statistics.median(gaps):.1%}", f"{max(gaps):.1%}"])
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="three scenarios, fewer random instances")
    args = ap.parse_args(argv)
    rows = []
    for label, make, layers, m in QUICK if args.quick else SCENARIOS:
        rows.append(scenario_row(label, make(), layers, m))
        print(" | ".join(map(str, rows[-1])), flush=True)
    header = ["cluster", "model", "m", "stages before / after", "T_est (old T)", "old plan simulated",
              "old T's error", "new T (= simulated)", "old plan slower by", "bound (gap)", "largest S_s",
              "planner wall before / after"]
    rand = random_stats(60 if args.quick else 200)
    for row in rand:
        print(" | ".join(map(str, row)), flush=True)
    rheader = ["links", "instances", "answer = optimum", "mean excess over optimum", "worst",
               "old plan: mean excess", "old plan: worst", "median bound gap", "worst bound gap"]
    body = (f"{__doc__.split('Usage:')[0].strip()}\n\n### Scenarios (GPT, h = 1024, s = 1024, micro-batch 1, "
            f"bf16-mixed Adam, recompute auto)\n\n{markdown_table(header, rows)}\n\n"
            f"### Random small instances vs enumeration (tests/instances.py generator, 2-6 units, 2-4 cards, "
            f"m = 2-12, optimizer steps drawn)\n\n{markdown_table(rheader, rand)}\n")
    print(f"wrote {write_result('objective', 'Objective = the schedule it runs (issue 17, item 1)', body)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
