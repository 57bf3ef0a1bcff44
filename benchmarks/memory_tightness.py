"""Issue 14, cost of memory: hetpipe's T against recomputing every layer, swept over memory tightness.

The issue's goal: where a model fits only with some recomputation, hetpipe's T is >= 1.2x faster
than recomputing every layer and within 5% of the lower bound (T without any recomputation, the
memory limit ignored).  Recomputing a fraction rho of the forward work costs about rho of a
forward on top of F + B = 3F (B = 2F), so against recomputing everything (4F) the ratio is at
most 4 / (3 + rho) and the gap to the bound at least rho / 3: both goals hold only while
rho <= 0.15 (4 / 3.15 = 1.27x, +5%), and 1.2x needs rho <= 1/3.  rho is set by how many bytes must
be freed, so this script sweeps the cards' usable memory (scale x the home lab's) instead of
picking one scenario.

Model: GPT-2 XL captured (`capture_builtin`, fp32, Adam, micro-batch 4, sequence 1024, m = 6, the
README's example that fits the home lab only with recomputation); cluster
examples/clusters/homelab.yaml with every card's usable memory x scale.  Every T is the
schedule objective of the plan `solve` returns (what `hetpipe plan` runs, 10 s limit, seed 0):

* recompute: ``--recompute auto --offload never``;
* recompute + offload: ``--recompute auto --offload auto`` (the solver frees memory by offloading a
  stage's optimizer state where that costs less than recomputing the same bytes);
* recompute all: hetpipe's own placement search with every unit recomputed (Megatron-LM
  ``--recompute-granularity full``; offload never);
* table 1b, with the selective level (`Problem.selective` from the node-granularity capture,
  `partitioner/selective.py`: ln_1, ln_2 and the GELU of every block dropped and re-run; planner
  only, see benchmarks/selective_recompute.py): selective + recompute (offload never), and every
  lever, selective + recompute + offload: what `solve` returns with all of them on;
* bound: the least T of `solve` and the exact DP with no recomputation and unlimited memory.

rho = the recomputed units' forward seconds over the plan's forward seconds (each on its stage's card).
`solve`'s local search under the schedule has a wall-clock budget, so on a loaded machine a row
can differ between runs (seen: the tightest scale with offload, 7.68 vs 8.05 s); the rest repeat.

Recompute granularity (table 2): what each candidate region frees per second of recompute, on
the 4090, from captures at three granularities -- whole blocks (the default units), half blocks
(split at each ``ln_2``: attention half, MLP half), and single nodes (the attention core,
``scaled_dot_product_attention``, Megatron's selective-recompute region).  Freed = what the
region saves itself less the input it must keep (`cost_models.recompute`); the last column is the
sweep's T at scale 1.0 and 0.9 with the half-block units as the recompute candidates.

Usage:
    python benchmarks/memory_tightness.py [--scales 1.3 1.2 ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, write_result  # noqa: E402
from benchmarks.scenarios import CLUSTERS_DIR  # noqa: E402
from hetpipe.cost_models.cluster import load_cluster  # noqa: E402
from hetpipe.errors import InfeasibleError  # noqa: E402
from hetpipe.partitioner.capture.graph import UnitGraph  # noqa: E402
from hetpipe.partitioner.problem import Problem, Stage  # noqa: E402
from hetpipe.partitioner.selective import selective_tables  # noqa: E402
from hetpipe.partitioner.solvers.dp import solve_exact  # noqa: E402
from hetpipe.partitioner.solvers.solve import solve  # noqa: E402
from hetpipe.plan.build import build_problem  # noqa: E402

MODEL, BATCH, SEQ, MICROBATCHES, LAYERS = "gpt2-xl", 4, 1024, 6, 48
SCALES = (1.3, 1.25, 1.2, 1.15, 1.1, 1.05, 1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)
#: The device kind table 2's rates are quoted on.
KIND = "rtx4090"


def capture_gpt2xl(granularity: str = "block", split_points: tuple[str, ...] = ()) -> UnitGraph:
    from hetpipe.models import build, training_loss
    from hetpipe.partitioner.capture.capture import capture

    model, inputs = build(MODEL, device="meta", batch=BATCH, seq=SEQ)
    fn, targets = training_loss(MODEL, inputs)
    return capture(model, inputs, name=MODEL, precision="fp32", loss_fn=fn, targets=targets,
                   granularity=granularity, split_points=split_points)


def scaled(prob: Problem, scale: float, **levers: object) -> Problem:
    """`prob` with every card's usable memory x `scale` and the given lever settings."""
    devices = tuple(dataclasses.replace(d, usable_bytes=int(d.usable_bytes * scale)) for d in prob.devices)
    return dataclasses.replace(prob, devices=devices, **levers)


def solved(prob: Problem) -> tuple[float, tuple[Stage, ...]]:
    """(T, stages) of `solve`; (inf, ()) when nothing fits."""
    try:
        res = solve(prob, time_limit_s=10.0, seed=0)
    except InfeasibleError:
        return math.inf, ()
    return res.iteration_s, tuple(res.stages)


def rho(prob: Problem, stages: tuple[Stage, ...]) -> float:
    """The recomputed share of the plan's forward seconds."""
    total = again = 0.0
    for st in stages:
        fwd = prob.fwd_s[prob.devices[st.device].kind]
        total += sum(fwd[st.first_unit:st.last_unit + 1])
        again += sum(fwd[u] for u in st.recompute_units)
    return again / total if total else 0.0


def lower_bound_s(prob: Problem) -> float:
    """T without recomputation and without the memory limit: the least of `solve` and the exact DP."""
    roomy = scaled(prob, 2.0**20, recompute="none", offload="never")
    exact = solve_exact(roomy)
    return min(solved(roomy)[0], exact.iteration_s if exact is not None else math.inf)


def _fmt(t: float, ref: float | None = None, *, ratio: bool = False) -> str:
    if not math.isfinite(t):
        return "no fit"
    if ref is None or not math.isfinite(ref):
        return f"{t:.3f} s"
    return f"{t:.3f} s ({ref / t:.2f}x)" if ratio else f"+{t / ref - 1:.1%}"


def selective_row(prob: Problem, scale: float, bound: float, figures: dict[str, float]) -> list[object]:
    """One memory scale with the selective level offered (`prob.selective`): without and with offload; adds
    ``t_sel`` and ``t_every`` to `figures` (``t_all`` from `sweep_row`)."""
    t_sel, st_sel = solved(scaled(prob, scale, recompute="auto", offload="never"))
    t_every, st_every = solved(scaled(prob, scale, recompute="auto", offload="auto"))
    figures.update(t_sel=t_sel, t_every=t_every)

    def levers(stages: tuple[Stage, ...], offload: bool) -> str:
        if not stages:
            return "-"
        sel = sum(1 for st in stages if st.selective)
        offl = f", {sum(1 for st in stages if st.offload)} offl." if offload else ""
        return f"{rho(prob, stages):.2f}, {sel} sel.{offl}"

    t_all = figures["t_all"]
    return [f"{scale:.2f}", levers(st_sel, False), _fmt(t_sel, t_all, ratio=True), _fmt(t_sel, bound),
            levers(st_every, True), _fmt(t_every, t_all, ratio=True), _fmt(t_every, bound)]


def sweep_row(prob: Problem, scale: float, bound: float) -> tuple[list[object], dict[str, float]]:
    """One memory scale: recompute only, recompute + offload, recompute all; against the bound."""
    t_rc, st_rc = solved(scaled(prob, scale, recompute="auto", offload="never"))
    t_both, st_both = solved(scaled(prob, scale, recompute="auto", offload="auto"))
    t_all, _ = solved(scaled(prob, scale, recompute="all", offload="never"))
    r_rc, r_both = rho(prob, st_rc), rho(prob, st_both)
    offl = sum(1 for st in st_both if st.offload)
    figures = {"t_rc": t_rc, "t_both": t_both, "t_all": t_all, "rho_rc": r_rc, "rho_both": r_both}
    usable = [d.usable_bytes * scale / 2**30 for d in prob.devices]
    return ([f"{scale:.2f} ({'/'.join(f'{u:.1f}' for u in usable)} GiB)",
             f"{r_rc:.2f}" if st_rc else "-", _fmt(t_rc, t_all, ratio=True), _fmt(t_rc, bound),
             f"{r_both:.2f}, {offl} offl." if st_both else "-", _fmt(t_both, t_all, ratio=True), _fmt(t_both, bound),
             _fmt(t_all), f"{4 / (3 + r_rc):.2f}x / +{r_rc / 3:.1%}" if st_rc else "-"], figures)


def verdict(figures: list[tuple[float, dict[str, float]]], bound: float) -> str:
    """Where the goals hold, computed from the sweep (only scales that need some memory lever)."""
    def holds(f: dict[str, float], key: str) -> tuple[bool, bool]:
        t = f[key]
        return math.isfinite(t) and f["t_all"] / t >= 1.2, math.isfinite(t) and t / bound - 1 <= 0.05

    lines = []
    for key, label in (("t_rc", "recompute only"), ("t_both", "recompute + offload"),
                       ("t_sel", "selective + recompute"), ("t_every", "selective + recompute + offload")):
        if not all(key in f for _, f in figures):
            continue
        tight = [(s, f) for s, f in figures if math.isfinite(f[key]) and f[key] / bound - 1 > 0.005]
        fast = [s for s, f in tight if holds(f, key)[0]]
        near = [s for s, f in tight if holds(f, key)[1]]
        both = [s for s, f in tight if all(holds(f, key))]
        lines.append(f"- {label}: of {len(tight)} scales where memory costs time (T > bound + 0.5%), >= 1.2x at "
                     f"{fast or 'none'}, within 5% of the bound at {near or 'none'}, both at {both or 'none'}.")
    return "\n".join(lines)


def granularity_rows(probs: dict[str, Problem], graphs: dict[str, UnitGraph], node: UnitGraph) -> list[list[object]]:
    """Freed bytes per recompute second of each candidate region (GPT-2 XL block 1), on `KIND`."""
    rows = []
    for label, key, name in (("whole block", "block", "transformer.h.1"),
                             ("attention half (ln_1 .. residual add)", "half", "transformer.h.1"),
                             ("MLP half (ln_2 .. residual add)", "half", "transformer.h.1.ln_2")):
        prob = probs[key]
        u = next(x.index for x in graphs[key].units if x.name == name)
        freed = prob.unit_recompute_bytes[u] - prob.boundary_bytes[u - 1]
        fwd = prob.fwd_s[KIND][u]
        rows.append([label, f"{prob.unit_recompute_bytes[u] / 2**20:.0f} MiB",
                     f"{prob.boundary_bytes[u - 1] / 2**20:.0f} MiB", f"{fwd * 1e3:.2f} ms",
                     f"{freed / fwd / 1e9:.1f} GB/s"])
    core = next(u for u in node.units if u.name.startswith("transformer.h.1.attn/scaled_dot_product"))
    before = node.units[core.index - 1]
    rows.append(["attention core (fused SDPA node)", f"{core.recompute_bytes / 2**20:.0f} MiB",
                 f"{before.boundary_bytes / 2**20:.0f} MiB", "-",
                 "none: it saves q, k, v, its output and the log-sum-exp, no s x s scores"])
    return rows


def load_note() -> str:
    """The 1/5/15-minute load averages (the local search's wall budget makes T depend on them)."""
    try:
        return "/".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", type=float, nargs="+", default=list(SCALES))
    args = ap.parse_args(argv)
    cluster = load_cluster(CLUSTERS_DIR / "homelab.yaml")
    graphs = {"block": capture_gpt2xl(),
              "half": capture_gpt2xl(split_points=tuple(f"transformer.h.{i}.ln_2" for i in range(LAYERS)))}
    probs = {k: build_problem(g, cluster, microbatches=MICROBATCHES) for k, g in graphs.items()}
    node = capture_gpt2xl(granularity="node")
    node_fwd = build_problem(node, cluster, microbatches=MICROBATCHES).fwd_s
    with_level = dataclasses.replace(probs["block"], selective=selective_tables(graphs["block"].units, node, node_fwd))
    bound = lower_bound_s(probs["block"])
    rows, sel_rows, figures = [], [], []
    for s in args.scales:
        row, f = sweep_row(probs["block"], s, bound)
        sel_rows.append(selective_row(with_level, s, bound, f))
        rows.append(row)
        figures.append((s, f))
        print(" | ".join(map(str, row + sel_rows[-1][1:])), flush=True)
    header = ["usable memory x (3090/4090/3060)", "rho", "recompute: T (vs all)", "vs bound",
              "rho, + offload", "recompute + offload: T (vs all)", "vs bound", "recompute all",
              "ceiling 4/(3+rho), floor rho/3"]
    table1 = markdown_table(header, rows)
    table1b = markdown_table(["usable memory x", "rho, selective stages", "selective + recompute: T (vs all)",
                              "vs bound", "rho, sel., offl.", "every lever: T (vs all)", "vs bound"], sel_rows)
    gran = granularity_rows(probs, graphs, node)
    half_t = {s: solved(scaled(probs["half"], s, recompute="auto", offload="never"))[0] for s in (1.0, 0.9)}
    block_t = {s: f["t_rc"] for s, f in figures if s in half_t}
    table2 = markdown_table(["candidate region", "saves itself", "keeps (its input)", "forward", "freed per second"],
                            gran)
    half_line = "; ".join(f"scale {s}: block units {_fmt(block_t.get(s, math.nan))}, half-block units "
                          f"{_fmt(half_t[s])}" for s in half_t)
    body = (f"{__doc__.split('Usage:')[0].strip()}\n\nLower bound: {bound:.3f} s; machine load "
            f"{load_note()}.\n\n{table1}\n\n### With the selective level (table 1b)\n\n{table1b}\n\n"
            f"{verdict(figures, bound)}\n\n### Recompute granularity\n\n{table2}\n\n"
            f"Recompute with half-block candidates (same solver, recompute only): {half_line}.\n")
    print(body)
    path = write_result("memory_tightness", "Cost of memory swept over memory tightness (issue 14)", body)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
