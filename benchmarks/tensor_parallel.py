"""Issue 15, first increment: what uneven tensor-parallel groups would buy — COST MODEL ONLY.

The solver does not choose groups yet (a stage is one card in every plan hetpipe makes), so
every figure here is the cost model's, on the issue's scenario (c): 2x RTX 3090 + RTX 3060 12GB
in one node, no NVLink, PCIe through host memory (10 GB/s, 20 us; docs/cluster-file.md; asking
for ``pcie-p2p`` gives the same ring, since the catalog gives the RTX 3060 no peer-to-peer and the
ring is bounded by its slowest link).  The unit set is one transformer block stack (the
captured blocks of the model only: embedding and head left out), bf16-mixed, Adam,
micro-batch 1, sequence 1024.  Compared, each for a global batch of G sequences:

* pipeline-only hetpipe: the exact partitioner's T for the block stack (`solve`, 1F1B,
  any subset and order of the 3 cards);
* even TP: one stage on all 3 cards, each holding 1/3 of every block (Megatron style, same
  degree), G micro-batches one after another;
* uneven TP: the same group with equal-finish shares capped by memory (`tp_groups.price_group`),
  priced with each member's integer heads / columns (largest remainder).

Group time per micro-batch = slowest member's compute + 2 ring all-reduces per block per
direction (`hetpipe.cost_models.tensor_parallel`); no overlap of all-reduces with compute.
Memory per card = its share of the split state and per-head / per-column activations + the
replicated rest (one micro-batch in flight: a one-stage group runs them one after another).
Writes benchmarks/results/tensor_parallel.md.  No run: the CPU equality tests
(tests/test_tensor_parallel.py) show the runtime's numbers, not its speed.

Usage:
    python benchmarks/tensor_parallel.py [--models gpt2-medium llama-1b] [--global-batches 4 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, write_result  # noqa: E402
from hetpipe.cost_models.cluster import cluster_from_dict  # noqa: E402
from hetpipe.models import build  # noqa: E402
from hetpipe.partitioner.capture.capture import capture  # noqa: E402
from hetpipe.partitioner.capture.graph import UnitGraph  # noqa: E402
from hetpipe.partitioner.solvers.solve import solve  # noqa: E402
from hetpipe.partitioner.tp_groups import price_group, rounded_member_s  # noqa: E402
from hetpipe.plan.build import build_problem  # noqa: E402

PRECISION = "bf16-mixed"


def scenario_c(intra: str):
    return cluster_from_dict({"name": f"2x3090+3060 ({intra})", "nodes": [{
        "name": "box", "intra": intra,
        "devices": [{"gpu": "rtx3090"}, {"gpu": "rtx3090"}, {"gpu": "rtx3060-12gb"}]}]})


def block_stack(name: str) -> UnitGraph:
    """The captured model's transformer blocks only, re-indexed from 0 (no embedding, no head)."""
    g = capture(*build(name, device="meta", batch=1, seq=1024), name=name, precision=PRECISION)
    blocks = [u for u in g.units if u.tensor_parallel]
    units = tuple(dataclasses.replace(u, index=i) for i, u in enumerate(blocks))
    units = units[:-1] + (dataclasses.replace(units[-1], boundary_bytes=0, boundary_held_bytes=0,
                                              boundary_grad_bytes=0),)
    return dataclasses.replace(g, units=units, tied=(), param_count=sum(u.param_count for u in units))


def row(graph: UnitGraph, cluster, global_batch: int) -> list[object]:
    pipeline = solve(build_problem(graph, cluster, microbatches=global_batch, recompute="none"), solver="dp")
    out: list[object] = [graph.model_name, cluster.name, global_batch, f"{pipeline.iteration_s:.3f}"]
    times = {}
    for rule in ("even", "uneven"):
        shares, cost = price_group(graph.units, cluster.devices, cluster, precision=PRECISION, rule=rule)
        compute = max(rounded_member_s(graph.units, shares, cluster.devices, precision=PRECISION))
        times[rule] = global_batch * (compute + cost.allreduce_s)
        fits = "" if cost.fits else " (does not fit)"
        out.append(f"{times[rule]:.3f}{fits}")
        if rule == "uneven":
            out.append(" / ".join(f"{w:.2f}" for w in shares.weights))
            out.append(" / ".join(f"{m / 2**30:.1f}" for m in cost.memory_bytes))
            out.append(f"{global_batch * cost.allreduce_s:.3f}")
    out += [f"{times['even'] / times['uneven']:.2f}x", f"{pipeline.iteration_s / times['uneven']:.2f}x"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt2-medium", "llama-1b"])
    ap.add_argument("--global-batches", nargs="+", type=int, default=[4, 32])
    args = ap.parse_args()
    rows = []
    for name in args.models:
        graph = block_stack(name)
        for g in args.global_batches:
            rows.append(row(graph, scenario_c("pcie-host"), g))
    header = ["blocks of", "cluster", "G", "pipeline-only T (s)", "even TP T (s)", "uneven TP T (s)",
              "uneven shares", "uneven GiB per card", "of which all-reduce (s)", "even / uneven", "pipeline / uneven"]
    body = ("**Cost model only: the solver does not choose tensor-parallel groups yet; no plan or run "
            "uses them.** " + __doc__.split("\n\n")[1].replace("\n", " ") + "\n\n" + markdown_table(header, rows))
    print(body)
    write_result("tensor_parallel", "Tensor-parallel groups, cost model only (issue 15, scenario c)", body)


if __name__ == "__main__":
    main()
