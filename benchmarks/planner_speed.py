"""Issue #3, acceptance 3: time to an optimal plan for GPT-style models on mixed clusters.

Models: analytic GPT unit tables (`scenarios.gpt_graph`, h=1024, s=1024, micro-batch 4)
of 24, 48 and 96 layers.  Clusters: 4, 8, 16, 32 and 64 cards of 4 kinds (RTX 4090,
RTX 3090, A5000, RTX 3060 12GB), one kind per node, PCIe inside nodes, 10 Gbit/s
between (`scenarios.mixed_cluster`).  Two micro-batches per card per iteration.

For each case: median wall time of `solve` over --repeats runs (time limit 10 s, seed 0),
which solver answered, its status and the gap to its proven lower bound.
Targets on the 2-core VM: 16 devices proved optimal in <= 2 s; 64 devices <= 10 s (gap
stated where not proved).

Usage:
    python benchmarks/planner_speed.py [--repeats 3] [--layers 24 48 96] [--devices 4 8 16 32 64]
        [--recompute none|auto|all]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, write_result  # noqa: E402
from benchmarks.scenarios import gpt_graph, mixed_cluster  # noqa: E402
from hetpipe.plan.build import build_problem  # noqa: E402
from hetpipe.partitioner.solvers.dp import device_classes  # noqa: E402
from hetpipe.partitioner.solvers.solve import solve  # noqa: E402

#: Cards per node for each cluster size (4 kinds over the nodes).
PER_NODE = {4: 1, 8: 2, 16: 4, 32: 8, 64: 8}
TIME_LIMIT_S = 10.0


def run_case(layers: int, devices: int, repeats: int, recompute: str = "none") -> list[object]:
    graph = gpt_graph(layers=layers)
    cluster = mixed_cluster(devices, per_node=PER_NODE.get(devices, 8))
    problem = build_problem(graph, cluster, microbatches=2 * devices, recompute=recompute)
    walls, sol = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        sol = solve(problem, time_limit_s=TIME_LIMIT_S, seed=0)
        walls.append(time.perf_counter() - start)
    assert sol is not None
    return [layers, devices, len(device_classes(problem)), len(sol.stages), sol.solver, sol.status,
            f"{sol.iteration_s:.4f}", f"{sol.gap:.1%}", f"{statistics.median(walls):.2f}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, nargs="+", default=[24, 48, 96])
    ap.add_argument("--devices", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    ap.add_argument("--recompute", default="none", choices=("none", "auto", "all"),
                    help="the activation-recomputation lever (issue 14); the recorded table uses none")
    args = ap.parse_args(argv)
    header = ["layers", "devices", "classes", "stages", "solver", "status", "T (s)", "gap", "median wall (s)"]
    rows = []
    for layers in args.layers:
        for devices in args.devices:
            rows.append(run_case(layers, devices, args.repeats, args.recompute))
            print(" | ".join(map(str, rows[-1])), flush=True)
    table = markdown_table(header, rows)
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    body = (f"{__doc__.split('Usage:')[0].strip()}\n\nRepeats: {args.repeats}.  Load average (1/5/15 min) when "
            f"the table was written: {load} (2 shared cores: wall times grow with it).\n\n{table}\n")
    path = write_result("planner_speed", "Planner speed (issue #3)", body)
    print(table)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
