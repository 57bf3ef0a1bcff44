"""Issue 14, first part of its benchmarks: what activation recomputation buys on the home lab (planner only).

Cluster: examples/clusters/homelab.yaml (RTX 3090 24 GB + RTX 4090 24 GB on one node, RTX 3060
12 GB on another, 1 GbE).  Models: the analytic GPT family of `scenarios.gpt_graph` (embedding,
L transformer layers of width h, fp32-logit head; bf16-mixed with Adam, 16 bytes of state per
parameter; Korthikanti et al.'s 34·s·b·h saved bytes per layer; one unit per layer), at the demo's
GPT-2 XL settings: micro-batch 1, sequence 1024, two micro-batches per card (m = 6).  Every figure
is the planner's contract (`problem.evaluate`: the replayed 1F1B schedule with each stage's
optimizer step, the T a plan records): no training run.

Approaches (each under the same cost model and memory check):
* hetpipe, ``--recompute auto``: the exact DP over cuts, devices, order and each stage's
  recompute prefix (`partitioner/recompute.py`);
* hetpipe, ``--recompute none``;
* even split + full recomputation: equal layers per card, every unit recomputed (Megatron-LM
  ``--recompute-granularity full`` on the `uniform` baseline);
* even split without recomputation (the `uniform` baseline as is).
  Every even split is given its best ordered subset of the cards (issue 17: the best a careful
  user could do by hand; on three cards all 15 ordered subsets are tried); table 1 also gives
  the even split forced onto every card in file order.
* hetpipe, ``--recompute auto --offload auto``: the same DP, each stage also choosing whether to
  keep its optimizer state (fp32 master weights and Adam's moments: 12 of 16 bytes per parameter)
  on the host, inside the exact outer walk over the offload tail (`solvers/offload_walk.py`);
* even split + ZeRO-Offload: the `uniform` baseline with every stage offloading (DeepSpeed
  ZeRO-Offload on every card), with and without full recomputation.
Offload prices: each card's PCIe 4.0 x16 link (32 GB/s per direction, the catalog) and the
host's DDR4-3200 dual-channel memory (51.2 GB/s) for the host Adam step
(`hetpipe.cost_models.offload`).  ZeRO sharding is not modelled yet (issue 14's third lever).

Table 1, largest trainable model: over widths h and depths L (step 2), the largest parameter
count each approach fits ("L>=": the deepest searched, --max-layers), and two upper bounds no plan
without offload exceeds: the model state alone (16 B per parameter) within every card's usable
bytes together, and also in whole layers, contiguous on distinct cards (`state_fits`).  Table 2, cost of memory: for models that fit only with some
recomputation, hetpipe's T against recompute-every-layer (hetpipe's own placement with
``--recompute all``, and the even split with it) and against the lower bound T without any
recomputation and without the memory limit; on the captured GPT-2 XL hetpipe also chooses, per
stage, the selective recompute level (`partitioner/selective.py`: ln_1, ln_2 and the GELU of each
block; `runtime/stage/selective.py` runs it), its row without the level given beside it
and left out of the summary.  Table 3, what the lever costs the planner: median
wall of `solve` on `planner_speed.py`'s analytic GPTs (h=1024, micro-batch 4) and mixed clusters,
``--recompute none`` vs ``auto``, side by side (``auto`` first runs the ``none`` search within 90% of the
limit and returns its answer where its own is not better, `solve._none_floor`: auto <= none by construction,
up to the wall-clock bound search's run-to-run variation; its own search gets the rest, `solve.LEVER_MIN_SHARE`).
Writes benchmarks/results/memory_levers.md.

Usage:
    python benchmarks/memory_levers.py [--widths 1600 2048 2560 3072 4096] [--max-layers 200]
    python benchmarks/memory_levers.py --speed-only   # table 3 alone, spliced into the results file
    python benchmarks/memory_levers.py --no-speed     # tables 1 and 2 (and the summary); table 3 kept from the file
    python benchmarks/memory_levers.py --cost-only    # table 2 and the summary from table 1's recorded depths
"""

from __future__ import annotations

import argparse
import datetime
import dataclasses
import functools
import itertools
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS_DIR, markdown_table, write_result  # noqa: E402
from benchmarks.scenarios import CLUSTERS_DIR, HALF_BYTES, gpt_graph  # noqa: E402
from hetpipe.cost_models.cluster import load_cluster  # noqa: E402
from hetpipe.cost_models.devices import Cluster  # noqa: E402
from hetpipe.partitioner.baselines import rule_bounds  # noqa: E402
from hetpipe.partitioner.problem import Problem, Stage, evaluate  # noqa: E402
from hetpipe.partitioner.recompute import with_recompute  # noqa: E402
from hetpipe.partitioner.selective import selective_tables  # noqa: E402
from hetpipe.partitioner.solvers.dp import solve_exact  # noqa: E402
from hetpipe.partitioner.solvers.offload_walk import tail_walk  # noqa: E402
from hetpipe.plan.build import build_problem  # noqa: E402

#: The demo's GPT-2 XL settings (README quick start): micro-batch 1 of 1024 tokens, 2 micro-batches per card.
BATCH, SEQ = 1, 1024
#: approach -> (who places: the exact DP or the even split, --recompute, --offload).
SETTINGS = {
    "hetpipe auto + offload": ("hetpipe", "auto", "auto"),
    "hetpipe auto": ("hetpipe", "auto", "never"),
    "hetpipe none": ("hetpipe", "none", "never"),
    "even + ZeRO-Offload + recompute all": ("even", "all", "all"),
    "even + ZeRO-Offload": ("even", "none", "all"),
    "even + recompute all": ("even", "all", "never"),
    "even, no recompute": ("even", "none", "never"),
    "even, no recompute, every card in file order": ("forced", "none", "never"),
}
APPROACHES = tuple(SETTINGS)  # table 1's rows
#: Table 1's upper bounds (no plan without offload exceeds them): the model state alone within every
#: card's usable bytes together, and also in whole layers on distinct cards (`state_fits`).
CEILING = "memory ceiling: model state alone in every card's usable bytes"
PACKED_CEILING = "memory ceiling in whole layers (state alone, contiguous units per card)"
CEILINGS = {CEILING: False, PACKED_CEILING: True}
#: Issue 14's goal for the largest model without offload, as a multiple of the best even split's.
GOAL_LARGEST = 1.3
SETTINGS["hetpipe all"] = ("hetpipe", "all", "never")  # table 2: hetpipe's placement recomputing everything


@functools.lru_cache(maxsize=None)
def _cluster() -> Cluster:
    return load_cluster(CLUSTERS_DIR / "homelab.yaml")


def problem_for(layers: int, hidden: int, recompute: str) -> tuple[Problem, int]:
    """(the planner's problem of the GPT of `layers` x `hidden` on the home lab, its parameter count)."""
    cluster = _cluster()
    graph = gpt_graph(layers=layers, hidden=hidden, seq=SEQ, batch=BATCH)
    # the bf16 gradients within the state (2 B/param): what the offload lever counts parameters by
    graph = dataclasses.replace(graph, units=tuple(dataclasses.replace(u, grad_bytes=HALF_BYTES * u.param_count)
                                                   for u in graph.units))
    return build_problem(graph, cluster, microbatches=2 * len(cluster.devices), recompute=recompute), graph.param_count


def t_of(approach: str, prob: Problem) -> float:
    """T of one approach on `prob` (its lever settings replaced; inf when it does not fit): the
    schedule T of the exact DP's placement for hetpipe, the best ordered card subset's for an even
    split (``forced``: every card in file order instead)."""
    who, recompute, offload = SETTINGS[approach]
    prob = dataclasses.replace(prob, recompute=recompute, offload=offload)
    if who == "hetpipe":  # the DP inside the offload lever's exact outer walk (a plain DP for never)
        res = tail_walk(prob, lambda p, _: solve_exact(p))
        return evaluate(prob, tuple(res.stages)).iteration_s if res is not None else math.inf
    if who == "forced":
        return _even_t(prob, tuple(range(len(prob.devices))))
    n = len(prob.devices)
    return min(_even_t(prob, order) for p in range(1, n + 1) for order in itertools.permutations(range(n), p))


def _even_t(prob: Problem, order: tuple[int, ...]) -> float:
    """T of the even split over the cards `order` (one stage each, in that order); inf when it does not fit."""
    if len(order) > prob.num_units:
        return math.inf
    bounds = rule_bounds(prob, "uniform", len(order))
    stages = tuple(Stage(d, lo, hi - 1) for d, (lo, hi) in zip(order, bounds))
    ev = evaluate(prob, with_recompute(prob, stages))
    return ev.iteration_s if ev.fits else math.inf


def largest(approach: str, hidden: int, max_layers: int) -> int:
    """The deepest model of width `hidden` the approach fits (0: none); memory grows with depth."""
    lo, hi = 0, max_layers // 2 * 2 + 2  # even depths; fits(lo) (or lo = 0), hi assumed not to fit
    while hi - lo > 2:
        mid = lo + (hi - lo) // 4 * 2  # even, in (lo, hi)
        if math.isfinite(t_of(approach, problem_for(mid, hidden, "none")[0])):
            lo = mid
        else:
            hi = mid
    return lo


def state_fits(prob: Problem, *, packed: bool) -> bool:
    """Whether the model state alone (parameters, gradients, optimizer state: no activation, no
    message) fits the cards: a necessary condition of every plan without offload, since each
    stage's M_s is at least its units' state.  ``packed=False``: the sum over the units within
    the sum of every card's usable bytes (the cluster's physical ceiling); ``packed=True``: also
    in whole units, contiguous ranges on distinct cards in some order (each card filled greedily
    in that order, which is optimal for a fixed order)."""
    state, usable = prob.state_bytes, [d.usable_bytes for d in prob.devices]
    if not packed:
        return sum(state) <= sum(usable)
    for order in itertools.permutations(range(len(usable))):
        u, room = 0, 0
        for d in order:
            room = usable[d]
            while u < len(state) and state[u] <= room:
                room -= state[u]
                u += 1
        if u == len(state):
            return True
    return False


def ceiling_depth(hidden: int, max_layers: int, *, packed: bool) -> int:
    """The deepest model of width `hidden` (even depths) whose state alone fits (`state_fits`)."""
    depth = 0
    while depth + 2 <= max_layers and state_fits(problem_for(depth + 2, hidden, "none")[0], packed=packed):
        depth += 2
    return depth


def lower_bound_s(prob: Problem) -> float:
    """T without recomputation and without the memory limit (every card unlimited): the schedule T
    of the exact DP's placement there (the issue's "lower bound": no lever, no memory limit)."""
    roomy = dataclasses.replace(prob, devices=tuple(dataclasses.replace(d, usable_bytes=2**62) for d in prob.devices),
                                recompute="none")
    res = solve_exact(roomy)
    assert res is not None
    return evaluate(roomy, tuple(res.stages)).iteration_s


def largest_table(widths: list[int], max_layers: int) -> tuple[str, dict[str, dict[int, int]], dict[str, int]]:
    depth: dict[str, dict[int, int]] = {a: {h: largest(a, h, max_layers) for h in widths} for a in APPROACHES}
    rows, best = [], {}
    for a in APPROACHES:
        params = {h: problem_for(depth[a][h], h, "none")[1] if depth[a][h] else 0 for h in widths}
        best[a] = max(params.values())
        cap = max_layers // 2 * 2  # the deepest depth searched: reaching it means "at least"
        rows.append([a] + [f"L{'>=' if depth[a][h] >= cap else '='}{depth[a][h]} ({params[h] / 1e9:.2f} B)"
                           if depth[a][h] else "-" for h in widths]
                    + [f"{best[a] / 1e9:.2f} B"])
    for label, packed in CEILINGS.items():
        ceil = {h: ceiling_depth(h, max_layers, packed=packed) for h in widths}
        params = {h: problem_for(ceil[h], h, "none")[1] for h in widths}
        best[label] = max(params.values())
        rows.append([label] + [f"L={ceil[h]} ({params[h] / 1e9:.2f} B)" for h in widths] + [f"{best[label] / 1e9:.2f} B"])
    even = max(best["even + recompute all"], best["even, no recompute"])
    even_off = max(best["even + ZeRO-Offload + recompute all"], best["even + ZeRO-Offload"])
    for label, num, den in (("hetpipe auto + offload / best even split without offload", "hetpipe auto + offload", even),
                            ("hetpipe auto + offload / best even split with ZeRO-Offload", "hetpipe auto + offload",
                             even_off),
                            ("hetpipe auto + offload / hetpipe auto (no offload)", "hetpipe auto + offload",
                             best["hetpipe auto"]),
                            ("hetpipe auto / best even split", "hetpipe auto", even),
                            ("hetpipe auto / even split forced onto every card", "hetpipe auto",
                             best["even, no recompute, every card in file order"]),
                            ("hetpipe auto / hetpipe none", "hetpipe auto", best["hetpipe none"]),
                            ("memory ceiling / best even split", CEILING, even),
                            ("hetpipe auto / memory ceiling", "hetpipe auto", best[CEILING]),
                            ("hetpipe auto / ceiling in whole layers", "hetpipe auto", best[PACKED_CEILING])):
        rows.append([label] + [""] * len(widths) + [f"{best[num] / den:.2f}x" if den else "-"])
    header = ["approach"] + [f"h={h}" for h in widths] + ["largest"]
    return markdown_table(header, rows), depth, best


def cost_row(label: str, prob: Problem) -> tuple[list[object], tuple[float, float, float]]:
    """One model that fits only with recomputation: hetpipe auto against recompute-everything and the bound."""
    start = time.perf_counter()
    res = solve_exact(dataclasses.replace(prob, recompute="auto"))
    wall = time.perf_counter() - start
    assert res is not None
    auto = evaluate(prob, tuple(res.stages)).iteration_s  # the schedule T a plan of these stages records
    # the same placement without its recomputation, memory ignored: what recomputing costs by itself
    plain = evaluate(prob, tuple(dataclasses.replace(st, recompute_units=(), selective=False)
                                 for st in res.stages)).iteration_s
    every, even_all, bound = t_of("hetpipe all", prob), t_of("even + recompute all", prob), lower_bound_s(prob)
    rc = sum(len(st.recompute_units) for st in res.stages)
    level = sum(st.selective for st in res.stages)
    return [label, f"{rc} of {prob.num_units}" + (f", selective level on {level} of {len(res.stages)} stages"
                                                  if level else ""), f"{auto:.3f} s", f"{every:.3f} s ({every / auto:.2f}x)",
            f"{even_all:.3f} s ({even_all / auto:.2f}x)" if math.isfinite(even_all) else "OOM",
            f"{plain:.3f} s (+{auto / plain - 1:.1%})", f"{bound:.3f} s (+{auto / bound - 1:.1%})", f"{wall:.2f} s"
            ], (every / auto, auto / bound - 1, auto / plain - 1)


def cost_rows(depth: dict[str, dict[int, int]], widths: list[int]
              ) -> tuple[list[list[object]], list[tuple[float, float, float]]]:
    """Models between the largest without recomputation and the largest with it, per width; and
    the captured GPT-2 XL at fp32, micro-batch 4 (README: no plan fits it without recomputation)."""
    rows: list[tuple[list[object], tuple[float, float, float]]] = []
    for h in widths:
        lo, hi = depth["hetpipe none"][h], depth["hetpipe auto"][h]
        for layers in sorted({x for x in (lo + 2, (lo + hi) // 2 // 2 * 2, hi) if lo < x <= hi}):
            prob, params = problem_for(layers, h, "auto")
            rows.append(cost_row(f"L={layers}, h={h} ({params / 1e9:.2f} B)", prob))
    from hetpipe.plan.build import capture_builtin

    graph = capture_builtin("gpt2-xl", batch=4, seq=1024, precision="fp32")
    prob = build_problem(graph, _cluster(), microbatches=6, recompute="auto")
    whole = None
    if math.isinf(t_of("hetpipe none", prob)):
        # the selective recompute level (`partitioner/selective.py`, from the node capture), chosen per stage by
        # the DP; the row without it beside it, left out of the summary (the same model)
        nodes = capture_builtin("gpt2-xl", batch=4, seq=1024, precision="fp32", granularity="node")
        node_prob = build_problem(nodes, _cluster(), microbatches=6, recompute="none")
        tables = selective_tables(graph.units, nodes, node_prob.fwd_s)
        rows.append(cost_row("gpt2-xl captured, fp32, micro-batch 4", dataclasses.replace(prob, selective=tables)))
        whole = cost_row("gpt2-xl captured, whole units only (no selective level)", prob)[0]
    return [r for r, _ in rows] + ([whole] if whole else []), [x for _, x in rows]


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def ceiling_verdict(best: dict[str, int]) -> str:
    """Whether the 1.3x goal (largest model without offload) is within what the memory can hold."""
    even = max(best["even + recompute all"], best["even, no recompute"])
    ceiling, packed, auto = best[CEILING], best[PACKED_CEILING], best["hetpipe auto"]
    goal = GOAL_LARGEST * even
    room = ("above what the memory can physically give" if goal > ceiling else
            f"below the ceiling, but it leaves {1 - goal / ceiling:.1%} of the cards' memory for every activation, "
            "message and tied copy, and for the rounding of whole layers onto cards")
    return (f"Memory ceiling (table 1): the model state alone (16 B per parameter) fills every card's usable bytes at "
            f"{ceiling / 1e9:.2f} B parameters, {ceiling / even:.3f}x the best even split; in whole layers on distinct "
            f"cards {packed / 1e9:.2f} B ({packed / even:.3f}x).  The {GOAL_LARGEST}x goal asks for "
            f"{goal / 1e9:.2f} B, {goal / ceiling:.1%} of the ceiling: {room}.  hetpipe without offload reaches "
            f"{auto / 1e9:.2f} B, {auto / ceiling:.1%} of the ceiling ({auto / packed:.1%} of the whole-layer one); "
            "its DP is exact over cuts, cards, order and the recompute prefix, so under the contract no plan "
            "without offload trains a larger model of these shapes.")


def summary(table1_best: dict[str, int], figures: list[tuple[float, float, float]]) -> str:
    """The issue's goals against what was measured (computed, not typed in)."""
    even = max(table1_best["even + recompute all"], table1_best["even, no recompute"])
    faster = sum(1 for r, _, _ in figures if r >= 1.2)
    close = sum(1 for _, g, _ in figures if g <= 0.05)
    levers, auto = table1_best["hetpipe auto + offload"], table1_best["hetpipe auto"]
    return (f"Goals of issue 14 (planner side): largest model with every lever {levers / even:.2f}x the best even "
            f"split without offload (goal >= 2x: {_met(levers >= 2 * even)}); without offload, {auto / even:.3f}x "
            f"(goal >= {GOAL_LARGEST}x: {_met(auto >= GOAL_LARGEST * even)}) and "
            f"{auto / table1_best['hetpipe none']:.2f}x hetpipe without recomputation.  "
            f"{ceiling_verdict(table1_best)}  "
            f"Against recomputing every unit: {min(r for r, _, _ in figures):.2f}-{max(r for r, _, _ in figures):.2f}x "
            f"faster, >= 1.2x in {faster} of {len(figures)} models (goal >= 1.2x).  Against the lower bound: "
            f"+{min(g for _, g, _ in figures):.1%} to +{max(g for _, g, _ in figures):.1%}, within 5% in {close} of "
            f"{len(figures)} models (goal within 5%); the bound also ignores memory in the placement, and "
            f"recomputation itself costs +{min(o for _, _, o in figures):.1%} to +{max(o for _, _, o in figures):.1%} "
            "(T of the same cuts without it): the rest of the gap is the placement memory forces (layers moved to "
            "slower or smaller cards).")


def planner_rows(layers: list[int], devices: list[int], repeats: int) -> list[list[object]]:
    """Median `solve` wall with the lever off and on (same problems, alternating runs)."""
    from benchmarks.planner_speed import PER_NODE
    from benchmarks.scenarios import mixed_cluster
    from hetpipe.partitioner.solvers.solve import solve

    rows: list[list[object]] = []
    for n_layers in layers:
        for n in devices:
            graph, cluster = gpt_graph(layers=n_layers), mixed_cluster(n, per_node=PER_NODE.get(n, 8))
            walls: dict[str, list[float]] = {"none": [], "auto": []}
            t: dict[str, list[float]] = {"none": [], "auto": []}
            for _ in range(repeats):
                for mode in walls:
                    prob = build_problem(graph, cluster, microbatches=2 * n, recompute=mode)
                    start = time.perf_counter()
                    t[mode].append(solve(prob, time_limit_s=10.0, seed=0).iteration_s)
                    walls[mode].append(time.perf_counter() - start)
            none, auto = statistics.median(walls["none"]), statistics.median(walls["auto"])
            # T: median and range of the repeats (the searches are wall-clock bound: a run's T depends on the load)
            rows.append([n_layers, n, _t_range(t["none"]), _t_range(t["auto"]), f"{none:.2f}", f"{auto:.2f}",
                         f"{auto / none:.2f}x"])
    return rows


def _t_range(values: list[float]) -> str:
    """Median T of the repeats and their range."""
    return f"{statistics.median(values):.4f} ({min(values):.4f}-{max(values):.4f})"


SPEED_HEADER = ["layers", "devices", "T none (s), median (range)", "T auto (s), median (range)", "wall none (s)", "wall auto (s)", "auto / none"]


def _loadavg() -> str:
    try:
        return "/".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def speed_only(args: argparse.Namespace) -> int:
    """Table 3 alone, spliced into benchmarks/results/memory_levers.md (tables 1 and 2 kept as they were)."""
    before = _loadavg()
    table3 = markdown_table(SPEED_HEADER, planner_rows(args.speed_layers, args.speed_devices, args.repeats))
    print(table3)
    path = RESULTS_DIR / "memory_levers.md"
    text = path.read_text()
    head = text[:text.index("### Planner speed with the lever")]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    path.write_text(f"{head}### Planner speed with the lever (median of {args.repeats})\n\n"
                    f"_table 3 rerun alone (`--speed-only`) {stamp}, load average (1/5/15 min) {before} before, "
                    f"{_loadavg()} after; on a loaded machine every search here is time-bound, so T varies between "
                    f"runs: auto's none pass is none's own search, but run at another moment_\n\n{table3}\n")
    print(f"wrote {path}")
    return 0


def kept_speed_section() -> str:
    """Table 3's section of the existing results file, as it is (its own rerun is `--speed-only`)."""
    text = (RESULTS_DIR / "memory_levers.md").read_text()
    return text[text.index("### Planner speed with the lever"):]


def recorded_table1() -> tuple[str, dict[str, dict[int, int]], list[int], str]:
    """Table 1 as the existing results file records it (``--cost-only``): its markdown, each row's depth per
    width (0 for "-"), the widths and the run's stamp; table 2 takes its models from those depths."""
    text = (RESULTS_DIR / "memory_levers.md").read_text()
    kept = "table 1 as recorded by the run of "  # a file written by --cost-only names table 1's own run
    stamp = text.split(kept)[1] if kept in text else text.split("\n\n")[1].strip("_")
    stamp = stamp.split(";")[0]
    section = text[text.index("### Largest trainable model"):text.index("### Cost of memory")]
    table = section[section.index("|"):].strip()
    lines = table.splitlines()
    widths = [int(c.strip()[2:]) for c in lines[0].strip().strip("|").split("|")[1:-1]]
    depth: dict[str, dict[int, int]] = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[1]:  # the ratio rows have no per-width cells
            depth[cells[0]] = {h: int(c.split("(")[0].strip("L>= ")) if c != "-" else 0
                               for h, c in zip(widths, cells[1:-1])}
    return table, depth, widths, stamp


def largest_params(depth: dict[str, dict[int, int]]) -> dict[str, int]:
    """Per row of table 1, the parameter count of its largest model (what `largest_table` returns as `best`)."""
    return {a: max(problem_for(d, h, "none")[1] if d else 0 for h, d in per.items()) for a, per in depth.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[1600, 2048, 2560, 3072, 4096])
    ap.add_argument("--max-layers", type=int, default=400)
    ap.add_argument("--speed-layers", type=int, nargs="+", default=[48, 96])
    ap.add_argument("--speed-devices", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--speed-only", action="store_true",
                    help="rerun table 3 only and replace its section in the existing results file")
    ap.add_argument("--no-speed", action="store_true",
                    help="rerun tables 1 and 2 only and keep table 3's section of the existing results file")
    ap.add_argument("--cost-only", action="store_true",
                    help="rerun table 2 and the summary from table 1's recorded depths; tables 1 and 3 kept")
    args = ap.parse_args(argv)
    if args.speed_only:
        return speed_only(args)
    before = _loadavg()
    if args.cost_only:
        table1, depth, widths, stamp = recorded_table1()
        best, rerun = largest_params(depth), f"table 1 as recorded by the run of {stamp}; table 2 and the summary"
    else:
        (table1, depth, best), widths, rerun = largest_table(args.widths, args.max_layers), args.widths, "tables 1 and 2"
    print(table1, flush=True)
    header = ["model", "units recomputed", "hetpipe auto T", "hetpipe --recompute all", "even + recompute all",
              "same cuts, no recompute", "lower bound (no recompute, no memory limit)", "DP wall"]
    rows2, figures = cost_rows(depth, widths)
    table2 = markdown_table(header, rows2)
    print(table2)
    speed = kept_speed_section() if args.no_speed or args.cost_only else (
        f"### Planner speed with the lever (median of {args.repeats})\n\n"
        f"{markdown_table(SPEED_HEADER, planner_rows(args.speed_layers, args.speed_devices, args.repeats))}\n")
    print(speed)
    load = f"_{rerun}: load average (1/5/15 min) {before} before, {_loadavg()} after_\n\n"
    body = (f"{__doc__.split('Usage:')[0].strip()}\n\n{load}### Largest trainable model\n\n{table1}\n\n"
            f"### Cost of memory (models that fit only with some recomputation)\n\n{table2}\n\n"
            f"{summary(best, figures)}\n\n{speed}")
    path = write_result("memory_levers", "Memory levers: activation recomputation and optimizer offload (issue 14)", body)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
