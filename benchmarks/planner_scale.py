"""Issue 12, item 3: no size at which the planner's answer falls off a cliff (gap <= 2% up to 1,024 cards).

Models: the built-in `gpt2-xl` (micro-batch 4, seq 1024) and `llama-7b` (micro-batch 1,
seq 4096), captured on meta, bf16-mixed with Adam.  Clusters: 16 to 1,024 cards, 8 per
node, eight kinds (node i holds kind i mod 8: A100 80GB, V100 32GB, RTX 3090, RTX 4090,
A6000, A5000, L4, RTX 4080), PCIe through the host inside a node, 25 Gbit/s and 10 us
between nodes.  Two micro-batches per card per iteration.  The CLI's default time limit
(10 s), seed 0.

Columns: the solver that answered and its status, then two objectives.  **Estimate**: the
H-1F1B estimate the solvers search exactly (`solve_estimate`): its T, its proven lower bound
and the gap (T - bound) / T.  **Schedule** (issue 17, the plan's T since version 4): the same
answer priced by the replayed 1F1B schedule with each stage's optimizer step, improved by
`verify`'s local search, and `verify`'s lower bound on the schedule optimum.  Wall: seconds of
the whole `solve` (one run: the gaps, not the time, are the claim here; `planner_speed.py`
has the timing medians).

Usage:
    python benchmarks/planner_scale.py [--devices 16 64 256 1024] [--models gpt2-xl llama-7b]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, write_result  # noqa: E402
from hetpipe.cost_models.cluster import Cluster, cluster_from_dict  # noqa: E402
from hetpipe.models import build  # noqa: E402
from hetpipe.partitioner.capture.capture import capture  # noqa: E402
from hetpipe.partitioner.solvers.dp import device_classes  # noqa: E402
from hetpipe.partitioner.solvers.solve import SCHEDULE_SHARE, solve_estimate  # noqa: E402
from hetpipe.partitioner.solvers.verify import verify  # noqa: E402
from hetpipe.plan.build import build_problem  # noqa: E402

#: Node i holds kind KINDS[i % 8] (all in hetpipe/cost_models/catalog.json).
KINDS = ("a100-80gb", "v100-32gb", "rtx3090", "rtx4090", "a6000", "a5000", "l4", "rtx4080")
PER_NODE = 8
TIME_LIMIT_S = 10.0  # `hetpipe plan --time-limit` default
#: Micro-batch size per model (the built-in defaults of `hetpipe models`).
BATCH = {"gpt2-xl": 4, "llama-7b": 1}


def eight_kind_cluster(devices: int) -> Cluster:
    """`devices` cards, 8 per node, node i of kind KINDS[i % 8], 25 Gbit/s between nodes."""
    nodes = [{"name": f"n{i}", "intra": "pcie-host", "network": {"bandwidth": "25Gbit/s", "latency": "10us"},
              "devices": [{"gpu": KINDS[i % len(KINDS)], "count": PER_NODE}]} for i in range(devices // PER_NODE)]
    return cluster_from_dict({"name": f"eight-kinds-{devices}", "nodes": nodes}, source=f"eight-kinds-{devices}")


def run_case(model_name: str, devices: int) -> list[object]:
    model, inputs = build(model_name, device="meta", batch=BATCH[model_name])
    graph = capture(model, inputs, name=model_name, precision="bf16-mixed")
    problem = build_problem(graph, eight_kind_cluster(devices), microbatches=2 * devices)
    start = time.perf_counter()
    # `solve` step by step (solvers/solve.py), to keep the estimate's figures beside the schedule's.
    verify_s = SCHEDULE_SHARE * TIME_LIMIT_S
    est = solve_estimate(problem, time_limit_s=TIME_LIMIT_S - verify_s, seed=0)
    left_s = max(TIME_LIMIT_S - (time.perf_counter() - start), verify_s / 4)
    sched = verify(problem, [est.stages], limit_s=left_s)
    wall = time.perf_counter() - start
    gap = (sched.iteration_s - sched.bound_s) / sched.iteration_s
    return [model_name, devices, len(device_classes(problem)), len(sched.stages), est.solver, est.status,
            f"{est.iteration_s:.3f}", f"{est.bound_s:.3f}", f"{est.gap:.2%}",
            f"{sched.iteration_s:.3f}", f"{sched.bound_s:.3f}", f"{gap:.2%}", f"{wall:.1f}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, nargs="+", default=[16, 64, 256, 1024])
    ap.add_argument("--models", nargs="+", default=["gpt2-xl", "llama-7b"])
    args = ap.parse_args(argv)
    header = ["model", "devices", "classes", "stages", "solver", "status", "estimate T (s)", "estimate bound (s)",
              "estimate gap", "schedule T (s)", "schedule bound (s)", "schedule gap", "wall (s)"]
    rows = []
    for model_name in args.models:
        for devices in args.devices:
            rows.append(run_case(model_name, devices))
            print(" | ".join(map(str, rows[-1])), flush=True)
    table = markdown_table(header, rows)
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    body = (f"{__doc__.split('Usage:')[0].strip()}\n\nLoad average (1/5/15 min) when the table was written: "
            f"{load} (the machine's 2 cores are shared; wall times grow with it, the gaps do not).\n\n{table}\n\n"
            "Before session 5's fix (llama-7b): 64 cards `cpsat` FEASIBLE T = 17.04 s, "
            "bound 7.82 s; 256 cards `cpsat`/heuristic T = 46.33 s, bound 25.06 s (the relaxation was too "
            "large for its DP and only the trivial bound was left).  Since then the node-free relaxation merges its "
            "slowest kinds until its DP fits (`relax.aggregate_kinds`) and the DP counts only reachable "
            "device-count vectors (`solvers/counts.py`).\n\n"
            "After the memory-model-2 and recomputation merges gpt2-xl regressed (64 cards 21.2% gap; 256 and "
            "1,024 cards 1.06% in 22 s and 0.28% in 92 s, past the 10 s limit).  Causes: (1) the memory model's "
            "moments (`schedule/held.py`) rebuilt every rank's 1F1B list at every pipeline length, with a "
            "quadratic receive scan (thousands of micro-batches at 1,024 cards), and O(n^2) Python loops over "
            "card pairs ran outside any time check; the 64-card heuristic alone took 7.8 s of the 10, so CP-SAT, "
            "which used to prove that optimum, no longer ran; (2) the bound itself was always weak there: the "
            "merged kinds (fastest member's times) let 48 cards run at the speed of the best of six kinds, "
            "while gpt2-xl puts one block per card and the slowest kind used sets the bottleneck (bound "
            "2.48 s against T = 3.14 s; `recompute` is `none` here, so the merged kinds' unlimited memory "
            "under `auto` was not the cause).  Fixes: the moments in linear time, replayed over one rank "
            "and a bounded number of 1F1B repetitions (`steady_microbatches`), numpy link tables, and a "
            "Lagrangian bound that keeps every kind exact and prices the card counts "
            "(`solvers/lagrange.py`).\n\n"
            "Since issue 17 the plan's T is the schedule's.  The search stays exact for the estimate (gaps "
            "above), but `verify`'s lower bound on the schedule optimum (the bottleneck stage's m micro-batches "
            "and a fill term) is far from the answer at these sizes: the schedule gap is what a plan made here "
            "records.  A tighter schedule bound is open (issue 12 item 3 is not met under the new objective).\n")
    path = write_result("planner_scale", "Planner at scale: gap up to 1,024 cards (issue 12)", body)
    print(table)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
