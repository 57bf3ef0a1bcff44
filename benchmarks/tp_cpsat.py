"""Issue 15: CP-SAT with tensor-parallel group variables against the group DP, by cluster size.

For each scenario (GPT-2 medium, whole model, sequence 1024, bf16-mixed, Adam, micro-batch 1,
recompute auto, `plan/build.build_problem` with ``--tensor-parallel auto``: groups of up to 4 cards of
at most two nodes) the script measures,
under the estimate T_est both solvers search:

* the model's size: member sets (`group_dp.candidate_groups`, leads merged) and terms
  (position x member set x unit range that fits), CPU seconds to price them
  (`cpsat_groups.position_tables`, the group DP's own tables);
* the group DP (`group_dp.solve_groups`, exact; declined above `MAX_GROUP_CARDS` cards): T_est, CPU s;
* CP-SAT (`cpsat_groups.solve_cpsat_groups`) hinted by the DP's answer, or by the pipeline-only
  one where the DP declines, within `TIME_LIMIT_S`: status, T_est, CPU s (both workers' threads);
* the pipeline-only optimum (`solve`, group_max 1).

CPU seconds (`time.process_time`), one run each; the load average is printed with them.  Pricing
that passes `PRICE_LIMIT_S` of wall time is recorded as such (the planner would keep the
pipeline-only plan there).  Writes
benchmarks/results/tp_cpsat.md.

Usage:
    python benchmarks/tp_cpsat.py
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, write_result  # noqa: E402
from benchmarks.tensor_parallel import graph_of  # noqa: E402
from hetpipe.cost_models.cluster import cluster_from_dict, load_cluster  # noqa: E402
from hetpipe.partitioner.problem import evaluate  # noqa: E402
from hetpipe.partitioner.solvers.cpsat_groups import position_tables, solve_cpsat_groups  # noqa: E402
from hetpipe.partitioner.solvers.group_dp import GroupSpaceTooLarge, solve_groups  # noqa: E402
from hetpipe.partitioner.solvers.solve import solve  # noqa: E402
from hetpipe.plan.build import build_problem  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: CP-SAT's time limit per scenario (seconds of wall time).
TIME_LIMIT_S = 30.0
#: Micro-batches per iteration (global batch 8 at micro-batch 1).
MICROBATCHES = 8
#: Wall seconds the tables may take to price (the planner prices them within its time limit too).
PRICE_LIMIT_S = 120.0


def nodes_of(name: str, gpus: list[list[str]]):
    """Nodes of cards over PCIe through the host, 1 GbE between nodes."""
    return cluster_from_dict({"name": name, "nodes": [
        {"name": f"n{i}", "intra": "pcie-host", "network": {"bandwidth": "1Gbit/s", "latency": "0.2ms"},
         "devices": [{"gpu": g} for g in cards]} for i, cards in enumerate(gpus)]})


def scenario(label: str, graph, cluster) -> list[object]:
    prob = replace(build_problem(graph, cluster, microbatches=MICROBATCHES, recompute="auto",
                                 tensor_parallel="auto"), objective="estimate")
    cache: dict = {}
    t0 = time.process_time()
    pipe = solve(replace(prob, group_max=1), time_limit_s=20.0)
    pipe_t = f"{evaluate(prob, pipe.stages, objective='estimate').iteration_s:.4f}"
    try:
        tables = position_tables(prob, cost_cache=cache, deadline=time.perf_counter() + PRICE_LIMIT_S)
    except GroupSpaceTooLarge as err:
        print(label, err, flush=True)
        return [label, len(prob.devices), prob.num_units, "-", "-", f"past {PRICE_LIMIT_S:.0f} s wall", "-", "-",
                "-", "-", "-", "-", "-", pipe_t, "-"]
    price_s = time.process_time() - t0
    t0 = time.process_time()
    try:
        dp = solve_groups(prob, cost_cache=cache)
        dp_cell, dp_t = f"{dp.iteration_s:.4f}", dp.iteration_s
    except GroupSpaceTooLarge:
        dp, dp_cell, dp_t = None, "declined", math.inf
    dp_s = time.process_time() - t0
    hint = dp.stages if dp is not None else pipe.stages
    t0 = time.process_time()
    cp = solve_cpsat_groups(prob, time_limit_s=TIME_LIMIT_S, seed=0, hint=hint, cost_cache=cache)
    cp_s = time.process_time() - t0
    groups = sum(bool(st.members) for st in cp.stages) if cp.stages else 0
    gap = (cp.iteration_s - cp.bound_s) / cp.iteration_s if cp.stages else math.nan
    out = [label, len(prob.devices), prob.num_units, len(tables.sets), tables.terms(), f"{price_s:.1f}",
           dp_cell, f"{dp_s:.1f}" if dp is not None else "-", cp.status, f"{cp.iteration_s:.4f}", f"{gap:.1%}",
           f"{cp_s:.1f}", groups, pipe_t,
           "-" if math.isinf(dp_t) else "=" if abs(cp.iteration_s - dp_t) <= 1e-5 * dp_t else f"{cp.iteration_s / dp_t:.6f}"]
    print(out, open("/proc/loadavg").read().split()[:3], flush=True)
    return out


def main() -> None:
    medium = graph_of("gpt2-medium", 1024, None)
    rows = [
        scenario("3x4090 + T4", medium, load_cluster(ROOT / "examples/clusters/box-3x4090-t4.yaml")),
        scenario("home lab", medium, load_cluster(ROOT / "examples/clusters/homelab.yaml")),
        scenario("2 nodes x (3090 + 2x3060)", medium, nodes_of("2x3", [["rtx3090", "rtx3060-12gb", "rtx3060-12gb"]] * 2)),
        scenario("3 nodes x (3090 + 2x3060)", medium, nodes_of("3x3", [["rtx3090", "rtx3060-12gb", "rtx3060-12gb"]] * 3)),
        scenario("8x A100 (the DP's limit)", medium,
                 load_cluster(ROOT / "examples/clusters/homogeneous-8xa100.yaml")),
    ]
    load = open("/proc/loadavg").read().split()[:3]
    body = "\n".join([
        f"GPT-2 medium (sequence 1024, bf16-mixed, Adam), {MICROBATCHES} micro-batches, recompute auto, groups of "
        f"up to 4 cards of at most two nodes; T_est in seconds; CPU seconds of one run each; load average {' '.join(load)} "
        f"on {os.cpu_count()} cores.  CP-SAT is hinted by the DP's answer (by the pipeline-only one where the DP "
        f"declines), {TIME_LIMIT_S:.0f} s limit; gap = (T - CP-SAT's proved bound) / T.",
        "",
        markdown_table(["cluster", "cards", "units", "member sets", "terms", "pricing CPU s", "group DP T_est",
                        "DP CPU s", "CP-SAT status", "CP-SAT T_est", "gap", "CP-SAT CPU s", "groups",
                        "pipeline-only T_est", "CP-SAT / DP"], rows),
    ])
    print(body)
    write_result("tp_cpsat", "CP-SAT with tensor-parallel group variables (issue 15)", body)


if __name__ == "__main__":
    main()
