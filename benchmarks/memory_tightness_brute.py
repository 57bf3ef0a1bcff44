"""Issue 14, cost of memory at the home lab: the true optimum under the contract, by enumeration, against `solve`.

GPT-2 XL captured (fp32, Adam, micro-batch 4, m = 6, as in benchmarks/memory_tightness.py) on the home lab with
every card's usable memory x scale and every lever on (recompute auto, the selective level, offload auto).
Enumerated: every placement (ordered subset of the 3 cards, every cut) and per stage every lever choice --
selective level on/off x offload on/off, each with its shortest fitting recompute prefix (optimal for a fixed
stage: `partitioner/recompute.py`) -- priced by the contract's `evaluate` (the schedule T).  Per stage only the
choices not dominated in (added backward seconds, step seconds) are crossed: the replayed schedule is
non-decreasing in every B_s and every step, so a dominated choice is never better (checked without the pruning
at scale 1.0: the same optimum over 274,804 choices).

Then the offload price of the optimum at scale 1.0 term by term (README contract, `cost_models/offload.py`):
the host link (gradients down, weights up), the host Adam step (28 B/param at the host's memory bandwidth), and
what the drain hides (the offloading stage's tail runs while stage 0 finishes its last backward and step).

The enumeration does not depend on the machine; `solve`'s column does: its search is wall-clock bound (10 s), so
under load it can return less than the optimum it finds on a quiet machine (and than the same scale's row of
benchmarks/memory_tightness.py, run at another moment).

Usage:
    python benchmarks/memory_tightness_brute.py [--scales 1.0 0.95 0.9]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, write_result  # noqa: E402
from benchmarks.memory_tightness import (MICROBATCHES, capture_gpt2xl, load_note, lower_bound_s, scaled,  # noqa: E402
                                         solved)
from benchmarks.scenarios import CLUSTERS_DIR  # noqa: E402
from hetpipe.cost_models.cluster import load_cluster  # noqa: E402
from hetpipe.partitioner.problem import (Problem, Stage, can_offload, evaluate, offload_if,  # noqa: E402
                                         stage_memory_bytes, stage_params, stage_step_or_tail_s)
from hetpipe.partitioner.recompute import added_backward_s, choose_recompute, selective_choices  # noqa: E402
from hetpipe.partitioner.selective import selective_tables  # noqa: E402
from hetpipe.plan.build import build_problem  # noqa: E402

SCALES = (1.0, 0.95, 0.9)


@dataclasses.dataclass(frozen=True)
class Optimum:
    """The enumeration's least T and its placement, with how many lever choices were priced."""

    iteration_s: float
    stages: tuple[Stage, ...]
    priced: int


def stage_choices(prob: Problem, plain: list[Stage], s: int) -> list[Stage]:
    """Stage `s`'s lever choices that fit, not dominated in (added backward seconds, step seconds)."""
    out: list[tuple[float, float, Stage]] = []
    trial = list(plain)
    for off in (False, True) if can_offload(prob, plain[s]) else (False,):
        for sel in selective_choices(prob, plain[s], "auto"):
            trial[s] = dataclasses.replace(plain[s], offload=off, selective=sel)
            trial[s] = dataclasses.replace(trial[s], recompute_units=choose_recompute(prob, trial, s, "auto"))
            if stage_memory_bytes(prob, trial, s) <= prob.devices[plain[s].device].usable_bytes:
                out.append((added_backward_s(prob, trial[s]), stage_step_or_tail_s(prob, trial[s]), trial[s]))
    return [c for a, b, c in out if not any(x <= a and y <= b and (x, y) != (a, b) for x, y, _ in out)]


def enumerate_optimum(prob: Problem) -> Optimum:
    """Least schedule T over every placement x lever choice (module docstring)."""
    n, best, priced = prob.num_units, Optimum(math.inf, (), 0), 0
    for p in range(1, len(prob.devices) + 1):
        for devs in itertools.permutations(range(len(prob.devices)), p):
            for cuts in itertools.combinations(range(n - 1), p - 1):
                ends = [-1, *cuts, n - 1]
                plain = [Stage(d, ends[i] + 1, ends[i + 1]) for i, d in enumerate(devs)]
                choices = [stage_choices(prob, plain, s) for s in range(p)]
                for combo in itertools.product(*choices):
                    priced += 1
                    t = evaluate(prob, combo).iteration_s
                    if t < best.iteration_s:
                        best = Optimum(t, tuple(combo), 0)
    return dataclasses.replace(best, priced=priced)


def levers(stages: tuple[Stage, ...]) -> str:
    """Stages as card:units and their levers."""
    names = {0: "3090", 1: "4090", 2: "3060"}
    return "; ".join(f"{names.get(st.device, st.device)} {st.first_unit}-{st.last_unit}"
                     f"{' sel.' if st.selective else ''}{f' rc {len(st.recompute_units)}' if st.recompute_units else ''}"
                     f"{' offl.' if st.offload else ''}" for st in stages)


def price_rows(prob: Problem, stages: tuple[Stage, ...]) -> list[list[object]]:
    """The offload price of `stages`, term by term, and the T it adds beyond the drain."""
    rows: list[list[object]] = []
    rates = prob.offload_rates
    for s, st in enumerate(stages):
        if not st.offload or rates is None:
            continue
        dev, params = prob.devices[st.device], stage_params(prob, st)
        link_s = params * rates.link_bytes_per_param / dev.host_link_bytes_s
        host_s = params * rates.step_bytes_per_param / dev.host_memory_bytes_s
        kept = tuple(dataclasses.replace(x, offload=False) for x in stages)
        roomy = scaled(prob, 2.0**20)
        without = evaluate(roomy, kept).iteration_s
        rows.append([s, f"{params / 1e9:.3f} B", f"{link_s:.3f} s ({rates.link_bytes_per_param} B/param at "
                     f"{dev.host_link_bytes_s / 1e9:.0f} GB/s)", f"{host_s:.3f} s ({rates.step_bytes_per_param} B/param "
                     f"at {dev.host_memory_bytes_s / 1e9:.1f} GB/s)", f"{offload_if(prob, st).tail_s:.3f} s",
                     f"{without:.4f} s", f"+{evaluate(prob, stages).iteration_s - without:.4f} s"])
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scales", type=float, nargs="+", default=list(SCALES))
    args = ap.parse_args(argv)
    graph, node = capture_gpt2xl(), capture_gpt2xl(granularity="node")
    cluster = load_cluster(CLUSTERS_DIR / "homelab.yaml")
    base = build_problem(graph, cluster, microbatches=MICROBATCHES)
    node_fwd = build_problem(node, cluster, microbatches=MICROBATCHES).fwd_s
    every = dataclasses.replace(base, selective=selective_tables(graph.units, node, node_fwd))
    bound = lower_bound_s(base)
    rows, prices = [], []
    for scale in args.scales:
        prob = scaled(every, scale, recompute="auto", offload="auto")
        cpu = time.process_time()
        best = enumerate_optimum(prob)
        cpu = time.process_time() - cpu
        t_solve, st_solve = solved(prob)
        rows.append([f"{scale:.2f}", f"{best.iteration_s:.4f} s (+{best.iteration_s / bound - 1:.2%})",
                     levers(best.stages), f"{best.priced:,} ({cpu:.0f} s CPU)",
                     f"{t_solve:.4f} s (+{t_solve / bound - 1:.2%})", levers(st_solve)])
        print(" | ".join(map(str, rows[-1])), flush=True)
        if not prices:
            prices = [[f"{scale:.2f}", *r] for r in price_rows(prob, best.stages)]
    table = markdown_table(["usable memory x", "enumerated optimum (vs bound)", "its placement", "choices priced",
                            "solve, 10 s (vs bound)", "its placement"], rows)
    price = markdown_table(["scale", "offloading stage", "parameters", "host link", "host step", "O_s",
                            "T of the same stages, no offload, memory ignored", "T added"], prices)
    body = (f"{__doc__.split('Usage:')[0].strip()}\n\nLower bound (no recomputation, no memory limit): {bound:.4f} s; "
            f"machine load {load_note()} (the enumeration is CPU-bound; `solve` has a 10 s wall limit).\n\n"
            f"{table}\n\n### The offload price at the optimum\n\n{price}\n")
    print(body)
    print(f"wrote {write_result('memory_tightness_brute', 'Cost of memory at the home lab: enumerated optimum (issue 14)', body)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
