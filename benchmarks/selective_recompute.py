"""Issue 14, cost of memory: the selective recompute level, chosen per stage by the planner.

The level (Korthikanti et al. 2022, selective recomputation: recompute what is cheap to redo and
heavy to keep; derived from the node-granularity capture by `hetpipe.partitioner.selective`): inside
a block, a memory-bound node (norms, activations) whose output is held for backward is dropped and
re-run in the backward when every tensor it reads is held anyway and every node reading it is a
matmul or attention kernel, which is never re-run (PyTorch's selective checkpoint policy: those ops
``MUST_SAVE``, the dropped ones ``PREFER_RECOMPUTE``).  On GPT-2 that selects ln_1, ln_2 and the GELU
of every block.  Per block: freed = the dropped outputs' bytes (the readers' saved copies, which the
runtime re-makes in the backward: `hetpipe/runtime/stage/selective.py`); seconds = the dropped nodes'
forward times on the stage's kind; peak = the dropped nodes' held bytes.

The lever (`Problem.selective`, `Stage.selective`; `cost_models/selective.py`): each stage runs the
level on its blocks or not, and recomputes a whole-block prefix on top; priced on the selective
variant (activations less freed, backward plus seconds) with the model's largest peak added to M_s
once (conservative: at every moment).  The exact DP chooses cuts, cards, order and each stage's level
and prefix (brute-force tested: tests/test_selective_recompute.py).  `hetpipe plan --recompute auto`
offers it (plan version 7) and `hetpipe run` runs it (tests/test_selective_runtime.py); the figures
here are the planner's.

Model and cluster as `memory_tightness.py` (GPT-2 XL captured, fp32, Adam, micro-batch 4,
sequence 1024, m = 6, examples/clusters/homelab.yaml).  T of each plan is `evaluate`'s (the replayed
schedule) of the exact DP's placement.  Writes benchmarks/results/selective_recompute.md.

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
from hetpipe.partitioner.problem import Problem, evaluate  # noqa: E402
from hetpipe.partitioner.selective import selective_tables, unit_level  # noqa: E402
from hetpipe.partitioner.solvers.dp import solve_exact  # noqa: E402
from hetpipe.plan.build import build_problem  # noqa: E402

MICROBATCHES = 6


def solved_t(prob: Problem) -> tuple[float, str]:
    """T of the exact DP's plan and a short description of its stages."""
    res = solve_exact(prob)
    assert res is not None, "no plan fits"
    stages = tuple(res.stages)
    ev = evaluate(prob, stages)
    assert ev.fits
    desc = "; ".join(f"{prob.devices[st.device].kind} units {st.first_unit}-{st.last_unit}, "
                     f"{len(st.recompute_units)} recomputed{', selective' if st.selective else ''}" for st in stages)
    return ev.iteration_s, desc


def main() -> int:
    cluster = load_cluster(CLUSTERS_DIR / "homelab.yaml")
    block_graph, node_graph = capture_gpt2xl("block"), capture_gpt2xl("node")
    prob = build_problem(block_graph, cluster, microbatches=MICROBATCHES, recompute="auto")
    node_prob = build_problem(node_graph, cluster, microbatches=MICROBATCHES, recompute="none")
    blocks = [u for u in block_graph.units if u.name.startswith("transformer.h.")]
    tables = selective_tables(block_graph.units, node_graph, node_prob.fwd_s)
    u1 = next(u.index for u in blocks if u.name == "transformer.h.1")
    one = unit_level(block_graph.units[u1], node_graph)
    whole_freed = prob.unit_recompute_bytes[u1] - prob.boundary_bytes[u1 - 1]
    sel_s = tables.extra_s[KIND][u1]
    rate = [["whole block (recompute prefix)", f"{whole_freed / 2**20:.0f} MiB", f"{prob.fwd_s[KIND][u1] * 1e3:.2f} ms",
             f"{whole_freed / prob.fwd_s[KIND][u1] / 1e9:.1f} GB/s"],
            [f"selective: {', '.join(one.nodes)}", f"{one.freed_bytes / 2**20:.0f} MiB",
             f"{sel_s * 1e3:.2f} ms", f"{one.freed_bytes / sel_s / 1e9:.1f} GB/s"]]
    t_auto, d_auto = solved_t(prob)
    t_all, _ = solved_t(dataclasses.replace(prob, recompute="all"))
    t_sel, d_sel = solved_t(dataclasses.replace(prob, selective=tables))
    bound = lower_bound_s(prob)
    rows = [["hetpipe --recompute auto (whole blocks)", f"{t_auto:.3f} s", f"{t_all / t_auto:.3f}x",
             f"+{t_auto / bound - 1:.1%}", d_auto],
            ["hetpipe --recompute auto + selective level per stage", f"{t_sel:.3f} s",
             f"{t_all / t_sel:.3f}x", f"+{t_sel / bound - 1:.1%}", d_sel],
            ["hetpipe --recompute all", f"{t_all:.3f} s", "1.000x", f"+{t_all / bound - 1:.1%}", ""],
            ["lower bound (no recompute, no memory limit)", f"{bound:.3f} s", f"{t_all / bound:.3f}x", "+0.0%", ""]]
    verdict = (f"With the selective level chosen per stage T is {t_all / t_sel:.3f}x faster than recomputing every block "
               f"(goal >= 1.2x: {'met' if t_all / t_sel >= 1.2 else 'not met'}) and +{t_sel / bound - 1:.1%} over the "
               f"bound (goal within 5%: {'met' if t_sel / bound <= 1.05 else 'not met'}); today's whole-block lever: "
               f"{t_all / t_auto:.3f}x, +{t_auto / bound - 1:.1%}.")
    table1 = markdown_table([f"region (GPT-2 XL block 1, {KIND})", "freed per micro-batch", "recompute",
                             "freed per second"], rate)
    table2 = markdown_table(["plan", "T", "vs recompute all", "vs bound", "stages"], rows)
    body = f"{__doc__.split('Usage:')[0].strip()}\n\n{table1}\n\n{table2}\n\n{verdict}\n"
    print(body)
    path = write_result("selective_recompute", "Selective recomputation below the unit: the lever, per stage (issue 14)", body)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
