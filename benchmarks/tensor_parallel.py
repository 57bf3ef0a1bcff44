"""Issue 15: what the solver's tensor-parallel groups buy, under the cost model (no run).

For each scenario the planner solves the same problem twice (`plan/build.build_problem`,
1F1B schedule with optimizer steps, the plan's objective T):

* **pipeline-only**: `solve` (``--tensor-parallel off``: every stage one card);
* **uneven TP**: `solve_tp` (``--tensor-parallel auto``): stages may be groups of up to 4 cards
  of one node or two, shares by equal finish capped by memory (`partitioner/tp_tables.py`);
* **even TP**: the uneven answer's placement, every group re-priced with Megatron's 1/k shares
  (same degree, same members, same cuts): its T, or "does not fit" when a member overflows.

Scenarios: (a) the home lab (3090 + 4090 on one node over PCIe through the host, a 3060 on
another node over 1 GbE), GPT-2 medium (whole model, sequence 1024) and eight Llama-7B blocks
(sequence 2048: `llama-7b` rows are that block stack, no embedding or head) at small global
batches (bubble-dominated); (b) a layer
wider than the smallest card: four Llama-7B blocks at sequence 4096, micro-batch 2 (one block:
3.0 GiB of state + 1.3 GiB of activations) on a 3090 + two 3060s in one node whose 3060s have
only 4 GiB usable (8 GiB held back for other jobs, the cluster file's ``reserve``), no
recomputation; (c) 2x 3090 + a 3060 12GB in one node, PCIe through the host (no NVLink),
GPT-2 medium and the eight Llama-7B blocks; (b + ends) scenario (b) with Llama-7B's token embedding
and its final norm + LM head with the cross-entropy loss (vocabulary 32,000), which split by
vocabulary rows (`capture/vocab_parallel.py`).  The column "no vocabulary split" solves the same
problem with the embedding and head blocks removed (replicated on every member, as before them).  bf16-mixed, Adam, micro-batch 1 (2 in (b)); G = micro-batches per iteration.

(d) groups across two nodes: Llama-1B-like (sequence 2048) on two nodes of two NVLink A100 80GB each,
the nodes linked at 400, 100, 25 or 10 Gbit/s (5 us); `solve_tp` with groups of one node's cards only
(`Problem.group_nodes` = 1, as before) and with two nodes' cards too (2, what ``auto`` offers): T of
each, the plan of the second, and whether a group crosses the nodes.

Writes benchmarks/results/tensor_parallel.md.  Usage:
    python benchmarks/tensor_parallel.py
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, write_result  # noqa: E402
from hetpipe.cost_models.cluster import cluster_from_dict, load_cluster  # noqa: E402
from hetpipe.errors import InfeasibleError  # noqa: E402
from hetpipe.models import build, example_targets, lm_loss  # noqa: E402
from hetpipe.partitioner.capture.capture import capture  # noqa: E402
from hetpipe.partitioner.capture.graph import UnitGraph  # noqa: E402
from hetpipe.partitioner.problem import Problem, Stage, evaluate, schedule_s, stage_position  # noqa: E402
from hetpipe.partitioner.solvers.solve import solve  # noqa: E402
from hetpipe.partitioner.solvers.tp_solve import solve_tp  # noqa: E402
from hetpipe.partitioner.tp_tables import group_stage  # noqa: E402
from hetpipe.plan.build import build_problem  # noqa: E402

PRECISION = "bf16-mixed"
ROOT = Path(__file__).resolve().parents[1]


def one_node(name: str, gpus: list[str], reserve: dict[int, str] | None = None):
    """One node of `gpus` over PCIe through the host; `reserve`: card index -> memory held back."""
    devices = [{"gpu": g, **({"reserve": reserve[i]} if reserve and i in reserve else {})} for i, g in enumerate(gpus)]
    return cluster_from_dict({"name": name, "nodes": [{"name": "box", "intra": "pcie-host", "devices": devices}]})


def graph_of(name: str, seq: int, blocks: int | None, batch: int = 1, *, ends: bool = False) -> UnitGraph:
    """The captured model; with `blocks`, only its first that many transformer blocks (re-indexed), and with
    `ends` also its embedding (first unit) and its final norm + LM head with the loss (last unit)."""
    g = capture(*build(name, device="meta", batch=batch, seq=seq), name=name, precision=PRECISION, optimizer="adam",
                **({"loss_fn": lm_loss, "targets": example_targets(name, build(name, device="meta", batch=batch,
                                                                                seq=seq)[1])} if ends else {}))
    if blocks is None:
        return g
    layers = [u for u in g.units if any(not b.is_vocab for b in u.tensor_parallel)][:blocks]
    picked = [g.units[0], *layers, g.units[-1]] if ends else layers
    units = tuple(dataclasses.replace(u, index=i) for i, u in enumerate(picked))
    units = units[:-1] + (dataclasses.replace(units[-1], boundary_bytes=0, boundary_held_bytes=0, boundary_grad_bytes=0),)
    return dataclasses.replace(g, units=units, tied=(), param_count=sum(u.param_count for u in units))


def without_vocab(graph: UnitGraph) -> UnitGraph:
    """`graph` with its embedding and head blocks (split by vocabulary) removed: the runtime before them."""
    units = []
    for u in graph.units:
        blocks = tuple(b for b in u.tensor_parallel if not b.is_vocab)
        units.append(dataclasses.replace(
            u, tensor_parallel=blocks,
            tp_flops_fraction=sum(b.fwd_flops for b in blocks) / u.fwd_flops if blocks and u.fwd_flops else 0.0,
            tp_param_fraction=sum(b.param_numel for b in blocks) / u.param_count if blocks and u.param_count else 0.0))
    return dataclasses.replace(graph, units=tuple(units))


def even_t(problem: Problem, stages: tuple[Stage, ...]) -> tuple[float, bool]:
    """T of `stages` with every group's shares even (1/k), and whether every member fits."""
    ev = evaluate(problem, stages)
    costs, fits = list(ev.stages), True
    for s, st in enumerate(stages):
        if st.members:
            g = group_stage(problem, first=st.first_unit, last=st.last_unit, members=st.members,
                            position=stage_position(problem, stages, s), rule="even")
            costs[s] = dataclasses.replace(costs[s], fwd_s=g.fwd_s, bwd_s=g.bwd_s, step_s=g.step_s)
            fits &= g.fits
    return schedule_s(costs, problem.microbatches), fits


def describe(problem: Problem, stages: tuple[Stage, ...]) -> str:
    ev = evaluate(problem, stages)
    out = []
    for st, c in zip(stages, ev.stages):
        cards = "+".join(problem.devices[d].id for d in (st.members or (st.device,)))
        shares = f" ({'/'.join(f'{w:.2f}' for w in c.shares)})" if st.members else ""
        out.append(f"{cards}{shares}: {st.first_unit}-{st.last_unit}")
    return "; ".join(out)


def row(label: str, graph: UnitGraph, cluster, global_batch: int, recompute: str) -> list[object]:
    m = global_batch  # micro-batches per iteration
    base = build_problem(graph, cluster, microbatches=m, recompute=recompute)
    tp = build_problem(graph, cluster, microbatches=m, recompute=recompute, tensor_parallel="auto")
    try:
        no_vocab = f"{solve_tp(build_problem(without_vocab(graph), cluster, microbatches=m, recompute=recompute, tensor_parallel='auto'), time_limit_s=20.0).iteration_s:.3f}"
    except InfeasibleError:
        no_vocab = "does not fit"
    try:
        pipe_t = f"{solve(base, time_limit_s=20.0).iteration_s:.3f}"
    except InfeasibleError:
        pipe_t = "does not fit"
    start = time.perf_counter()
    sol = solve_tp(tp, time_limit_s=20.0)
    wall = time.perf_counter() - start
    even, fits = even_t(tp, sol.stages)
    even_s = f"{even:.3f}" + ("" if fits else " (does not fit)")
    vs_pipe = f"{float(pipe_t) / sol.iteration_s:.2f}x" if pipe_t != "does not fit" else "-"
    return [label, graph.model_name, global_batch, pipe_t, even_s, no_vocab, f"{sol.iteration_s:.3f}",
            f"{even / sol.iteration_s:.2f}x", vs_pipe, describe(tp, sol.stages), f"{wall:.1f}"]


def cross_node_rows() -> list[list[object]]:
    """Scenario (d): the solver's choice of a group across two nodes by the nodes' link (module docstring)."""
    graph = capture(*build("llama-1b", device="meta", batch=1, seq=2048), name="llama-1b", precision=PRECISION,
                    optimizer="adam")
    rows = []
    for gbit_s in (400, 100, 25, 10):
        net = {"bandwidth": f"{gbit_s}Gbit/s", "latency": "5us"}  # InfiniBand / RoCE class small-message latency
        lab = cluster_from_dict({"name": f"2x2 A100, {gbit_s} Gbit/s", "nodes": [
            {"name": n, "intra": "nvlink", "network": net, "devices": [{"gpu": "a100-80gb", "count": 2}]}
            for n in ("a", "b")]})
        for m in (1, 4):
            tp = build_problem(graph, lab, microbatches=m, recompute="auto", tensor_parallel="auto")
            one = solve_tp(dataclasses.replace(tp, group_nodes=1), time_limit_s=20.0)
            start = time.perf_counter()
            two = solve_tp(tp, time_limit_s=20.0)
            wall = time.perf_counter() - start
            nodes = [len({tp.devices[d].node for d in st.members}) for st in two.stages if st.members]
            rows.append([f"{gbit_s} Gbit/s", m, f"{one.iteration_s:.4f}", f"{two.iteration_s:.4f}",
                         f"{one.iteration_s / two.iteration_s:.2f}x", "yes" if 2 in nodes else "no",
                         describe(tp, two.stages), f"{wall:.1f}"])
    return rows


def main() -> None:
    homelab = load_cluster(ROOT / "examples/clusters/homelab.yaml")
    wide = one_node("3090+2x3060, 8 GiB of each 3060 held back", ["rtx3090", "rtx3060-12gb", "rtx3060-12gb"],
                    reserve={1: "8GiB", 2: "8GiB"})
    c = one_node("2x3090+3060 (PCIe host)", ["rtx3090", "rtx3090", "rtx3060-12gb"])
    medium, llama = graph_of("gpt2-medium", 1024, None), graph_of("llama-7b", 2048, 8)
    rows = [row("(a) home lab", medium, homelab, 4, "auto"),
            row("(a) home lab", medium, homelab, 16, "auto"),
            row("(a) home lab", llama, homelab, 4, "auto"),
            row("(a) home lab", llama, homelab, 16, "auto"),
            row("(b) layer wider than a 3060", graph_of("llama-7b", 4096, 4, batch=2), wide, 8, "none"),
            row("(b) + embedding and head", graph_of("llama-7b", 4096, 4, batch=2, ends=True), wide, 8, "none"),
            row("(c) 2x3090+3060", medium, c, 4, "auto"),
            row("(c) 2x3090+3060", medium, c, 32, "auto"),
            row("(c) 2x3090+3060", llama, c, 4, "auto"),
            row("(c) 2x3090+3060", llama, c, 32, "auto")]
    header = ["scenario", "model", "G", "pipeline-only T (s)", "even TP T (s)", "uneven TP, no vocabulary split T (s)",
              "uneven TP T (s)", "even / uneven",
              "pipeline / uneven", "uneven plan (cards (shares): units)", "solve_tp wall (s)"]
    cross = ["link between the nodes", "G", "one-node groups T (s)", "two-node groups T (s)", "one / two",
             "a group crosses the nodes", "plan (cards (shares): units)", "solve_tp wall (s)"]
    body = (__doc__.split("\n\n")[1].replace("\n", " ") + "\n\n" + __doc__.split("\n\n")[2].replace("\n", " ")
            + "\n\n" + markdown_table(header, rows) + "\n\n" + __doc__.split("\n\n")[4].replace("\n", " ")
            + "\n\n" + markdown_table(cross, cross_node_rows()) + f"\n\nLoad average at the end: {_load()}")
    print(body)
    write_result("tensor_parallel", "Tensor-parallel groups chosen by the solver (issue 15, cost model)", body)


def _load() -> str:
    """The 1, 5 and 15 minute load averages (the wall column depends on them)."""
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
