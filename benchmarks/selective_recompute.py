"""Issue 14, cost of memory: what a sub-unit ("selective") recompute level would buy -- an estimate.

NOT a lever hetpipe has: the planner's recompute lever is a prefix of whole units (one unit per
GPT-2 block).  This script derives, from the captured fx graph, a finer level per block and
prices a plan that uses it, so the lead can see what implementing it would give before doing so.

The level (Korthikanti et al. 2022, selective recomputation: recompute what is cheap to redo and
heavy to keep): inside a block, a memory-bound node n (norms, activations: ``memory_traffic_bytes``
> 0 at node granularity) whose output is held for backward is dropped and re-run in the backward
when (a) every tensor it reads is held anyway (or is a parameter), so recomputing it keeps nothing
new, and (b) every node reading it is compute-bound (a matmul or attention kernel), whose output is
then kept instead of recomputed (PyTorch's selective checkpoint policy: the compute-bound ops
``MUST_SAVE``, n ``PREFER_RECOMPUTE``): that output costs its bytes unless it is held anyway.
Per block: freed = sum of the dropped outputs - the kept consumer outputs not held otherwise,
seconds = sum of the dropped nodes' forward times on the stage's kind (node-granularity capture).
On GPT-2 that selects ln_1, ln_2 and the GELU (not the residual adds: they read a projection's
output, which nothing holds).

The estimate is a plan a runtime could execute: every block runs the selective level (its
seconds added to B, its freed bytes off A and off what a whole-block recompute frees), and the
exact DP then chooses cuts, cards, order and each stage's whole-block recompute prefix on top.
Conservative on purpose: a block recomputed whole is still charged its selective seconds, and
every card's usable bytes are reduced by the largest selective peak (the dropped outputs of one
block live again during its backward).  A solver choosing the level per stage could only be faster.

Model and cluster as `memory_tightness.py` (GPT-2 XL captured, fp32, Adam, micro-batch 4,
sequence 1024, m = 6, examples/clusters/homelab.yaml).  Writes benchmarks/results/selective_recompute.md.

Usage:
    python benchmarks/selective_recompute.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, write_result  # noqa: E402
from benchmarks.memory_tightness import KIND, capture_gpt2xl, lower_bound_s  # noqa: E402
from benchmarks.scenarios import CLUSTERS_DIR  # noqa: E402
from hetpipe.cost_models.cluster import load_cluster  # noqa: E402
from hetpipe.partitioner.capture.graph import Unit, UnitGraph  # noqa: E402
from hetpipe.partitioner.problem import Problem, evaluate  # noqa: E402
from hetpipe.partitioner.solvers.dp import solve_exact  # noqa: E402
from hetpipe.plan.build import build_problem  # noqa: E402

MICROBATCHES = 6


@dataclasses.dataclass(frozen=True)
class Selective:
    """One block's selective level: the nodes it drops, bytes freed per micro-batch, peak, seconds per kind."""

    nodes: tuple[str, ...]
    freed_bytes: int
    peak_bytes: int  # the dropped outputs, live again once during the block's backward
    seconds: dict[str, float]


def selective_level(block: Unit, node_graph: UnitGraph, node_prob: Problem) -> Selective:
    """The selective level of `block` (module docstring), from the node-granularity capture."""
    inside = set(block.node_names)
    by_node = {u.node_names[0]: u for u in node_graph.units if u.node_names[0] in inside}
    g = node_graph.graph
    held = {u.node_names[0]: u.activation_bytes > 0 for u in node_graph.units}  # the whole graph's

    def available(p: str) -> bool:  # held anyway, or a parameter / input of the graph
        return held.get(p, False) or g.nodes[p]["op"] in ("get_attr", "placeholder")

    def compute_bound(c: str) -> bool:
        return c in by_node and by_node[c].memory_traffic_bytes == 0 and by_node[c].fwd_flops > 0

    dropped, kept = [], set()
    for n, u in by_node.items():
        readers = [c for c in g.successors(n) if g.nodes[c]["bytes"] > 0]  # not shape reads (x.size())
        if (u.memory_traffic_bytes > 0 and held[n] and all(available(p) for p in g.predecessors(n))
                and readers and all(compute_bound(c) for c in readers)):
            dropped.append(n)
            kept.update(c for c in readers if not held[c])
    freed = sum(by_node[n].activation_bytes for n in dropped) - sum(g.nodes[c]["bytes"] for c in kept)
    seconds = {k: sum(node_prob.fwd_s[k][by_node[n].index] for n in dropped) for k in node_prob.fwd_s}
    return Selective(tuple(dropped), max(0, freed), sum(by_node[n].activation_bytes for n in dropped), seconds)


def with_selective(prob: Problem, levels: dict[int, Selective]) -> Problem:
    """`prob` with every block running its selective level (module docstring: conservative terms)."""
    freed = [levels[u].freed_bytes if u in levels else 0 for u in range(prob.num_units)]
    extra = {k: [levels[u].seconds[k] if u in levels else 0.0 for u in range(prob.num_units)] for k in prob.bwd_s}
    peak = max((lv.peak_bytes for lv in levels.values()), default=0)
    return dataclasses.replace(
        prob, activation_bytes=tuple(a - f for a, f in zip(prob.activation_bytes, freed)),
        recompute_bytes=tuple(max(0, a - f) for a, f in zip(prob.unit_recompute_bytes, freed)),
        bwd_s={k: tuple(b + e for b, e in zip(prob.bwd_s[k], extra[k])) for k in prob.bwd_s},
        devices=tuple(dataclasses.replace(d, usable_bytes=d.usable_bytes - peak) for d in prob.devices))


def solved_t(prob: Problem) -> tuple[float, str]:
    """T of the exact DP's plan and a short description of its stages."""
    res = solve_exact(prob)
    assert res is not None, "no plan fits"
    stages = tuple(res.stages)
    ev = evaluate(prob, stages)
    assert ev.fits
    desc = "; ".join(f"{prob.devices[st.device].kind} units {st.first_unit}-{st.last_unit}, "
                     f"{len(st.recompute_units)} recomputed" for st in stages)
    return ev.iteration_s, desc


def main() -> int:
    cluster = load_cluster(CLUSTERS_DIR / "homelab.yaml")
    block_graph, node_graph = capture_gpt2xl("block"), capture_gpt2xl("node")
    prob = build_problem(block_graph, cluster, microbatches=MICROBATCHES, recompute="auto")
    node_prob = build_problem(node_graph, cluster, microbatches=MICROBATCHES, recompute="none")
    levels = {u.index: selective_level(u, node_graph, node_prob) for u in block_graph.units
              if u.name.startswith("transformer.h.")}
    one = next(lv for u, lv in levels.items() if block_graph.units[u].name == "transformer.h.1")
    u1 = next(u.index for u in block_graph.units if u.name == "transformer.h.1")
    whole_freed = prob.unit_recompute_bytes[u1] - prob.boundary_bytes[u1 - 1]
    rate = [["whole block (today's lever)", f"{whole_freed / 2**20:.0f} MiB", f"{prob.fwd_s[KIND][u1] * 1e3:.2f} ms",
             f"{whole_freed / prob.fwd_s[KIND][u1] / 1e9:.1f} GB/s"],
            [f"selective: {', '.join(one.nodes)}", f"{one.freed_bytes / 2**20:.0f} MiB",
             f"{one.seconds[KIND] * 1e3:.2f} ms", f"{one.freed_bytes / one.seconds[KIND] / 1e9:.1f} GB/s"]]
    t_auto, d_auto = solved_t(prob)
    t_all, _ = solved_t(dataclasses.replace(prob, recompute="all"))
    t_sel, d_sel = solved_t(with_selective(prob, levels))
    bound = lower_bound_s(prob)
    rows = [["hetpipe --recompute auto (whole blocks)", f"{t_auto:.3f} s", f"{t_all / t_auto:.3f}x",
             f"+{t_auto / bound - 1:.1%}", d_auto],
            ["selective level on every block + whole-block prefix (estimate)", f"{t_sel:.3f} s",
             f"{t_all / t_sel:.3f}x", f"+{t_sel / bound - 1:.1%}", d_sel],
            ["hetpipe --recompute all", f"{t_all:.3f} s", "1.000x", f"+{t_all / bound - 1:.1%}", ""],
            ["lower bound (no recompute, no memory limit)", f"{bound:.3f} s", f"{t_all / bound:.3f}x", "+0.0%", ""]]
    verdict = (f"With the selective level the estimate is {t_all / t_sel:.3f}x faster than recomputing every block "
               f"(goal >= 1.2x: {'met' if t_all / t_sel >= 1.2 else 'not met'}) and +{t_sel / bound - 1:.1%} over the "
               f"bound (goal within 5%: {'met' if t_sel / bound <= 1.05 else 'not met'}); today's whole-block lever: "
               f"{t_all / t_auto:.3f}x, +{t_auto / bound - 1:.1%}.")
    table1 = markdown_table([f"region (GPT-2 XL block 1, {KIND})", "freed per micro-batch", "recompute",
                             "freed per second"], rate)
    table2 = markdown_table(["plan", "T", "vs recompute all", "vs bound", "stages"], rows)
    body = f"{__doc__.split('Usage:')[0].strip()}\n\n{table1}\n\n{table2}\n\n{verdict}\n"
    print(body)
    path = write_result("selective_recompute", "Selective recomputation below the unit: an estimate (issue 14)", body)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
