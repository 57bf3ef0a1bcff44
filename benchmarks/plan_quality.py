"""Issue #3, acceptance 4, and issue 17 item 3: hetpipe's plan vs what Megatron/torchtitan, DeepSpeed and
torchgpipe would do, forced onto every card and on the cards a careful user would pick.

For each scenario (a bundled model captured on meta, an example cluster file, bf16
mixed precision with Adam, two micro-batches per card) the planner's T is compared with
the three baselines of `hetpipe.partitioner.baselines`, all under the same cost model
and memory check, each twice: forced onto every card in the cluster file's order (what
the framework does when pointed at all of them), and on its best device subset and order
(`hetpipe.partitioner.baseline_search`: exact branch and bound where it finishes, else a
local search; the cut rule stays the framework's).  The headline is the speed-up over the
fastest fitting baseline on its best cards; the forced figure is beside it.  A baseline
that does not fit is flagged OOM.  The check: hetpipe is never slower than any baseline
that fits (its search space holds every baseline placement).

Writes benchmarks/results/plan_quality.md and plan_quality.png (speed-ups per scenario).

Usage:
    python benchmarks/plan_quality.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS_DIR, markdown_table, write_result  # noqa: E402
from benchmarks.scenarios import Scenario  # noqa: E402


SCENARIOS = (
    Scenario("homelab.yaml", "gpt2-xl", 1, 1024, True),
    Scenario("homelab.yaml", "gpt2-medium", 4, 1024, True),
    Scenario("box-3x4090-t4.yaml", "gpt2-medium", 4, 1024, True),
    Scenario("lab-a100-v100.yaml", "llama-7b", 1, 4096, True),
    Scenario("community-16.yaml", "gpt2-xl", 1, 1024, True),
    Scenario("mixed-64.yaml", "llama-7b", 1, 2048, True),
    Scenario("homogeneous-4x3090.yaml", "gpt2-medium", 4, 1024, False),
    Scenario("homogeneous-8xa100.yaml", "llama-7b", 1, 4096, False),
)
QUICK = SCENARIOS[:3] + SCENARIOS[6:7]


def evaluate_scenario(sc: Scenario) -> dict[str, object]:
    from hetpipe.cost_models.cluster import load_cluster
    from hetpipe.plan.build import capture_builtin, partition_graph

    cluster = load_cluster(sc.cluster_path())
    graph = capture_builtin(sc.model, batch=sc.batch, seq=sc.seq, precision="bf16-mixed")
    plan = partition_graph(graph, cluster, time_limit_s=10.0, seed=0)
    return {"scenario": sc, "plan": plan}


def cards_in_order(plan: object, devices: tuple[str, ...]) -> str:
    """Pipeline order as runs of one node and kind, e.g. ``3x desk (rtx4090) -> 1x shelf (t4)``."""
    by_id = {d.id: d for d in plan.devices}
    runs: list[list[object]] = []
    for dev in (by_id[d] for d in devices):
        if runs and runs[-1][1:] == [dev.node, dev.kind]:
            runs[-1][0] += 1
        else:
            runs.append([1, dev.node, dev.kind])
    return " -> ".join(f"{n}x {node} ({kind})" for n, node, kind in runs)


def _best_cell(plan: object) -> tuple[str, float | None, float | None]:
    """The best hand-tuned baseline (rule on its chosen cards, search), its speed-up and the forced one."""
    from hetpipe.plan.baseline_report import headline

    head = headline(plan)
    if head.speedup is None:
        return "none fits on any subset", None, head.forced_speedup
    cell = f"{head.best_name} on {cards_in_order(plan, head.best_devices)}, {head.best_search}: {head.best_s:.3f} s"
    return cell, head.speedup, head.forced_speedup


def _row(result: dict[str, object]) -> tuple[list[object], dict[str, float | None]]:
    sc, plan = result["scenario"], result["plan"]
    t = plan.predicted.iteration_s
    best_cell, headline_x, forced_x = _best_cell(plan)
    speedups: dict[str, float | None] = {"best hand-tuned": headline_x, "forced onto every card": forced_x}
    cells = []
    for name, b in plan.baselines.items():
        cells.append(f"{b.iteration_s:.3f} s ({b.iteration_s / t:.2f}x)" if b.fits else f"OOM ({b.iteration_s:.3f} s)")
        if b.best is not None and b.best.fits:  # every rule on its best cards: hetpipe must not lose to any
            speedups[f"{name} best"] = b.best.iteration_s / t
    row = [sc.cluster.removesuffix(".yaml"), sc.model, "mixed" if sc.mixed else "homogeneous",
           f"{len(plan.stages)}/{len(plan.devices)}", f"{t:.3f} s", _solver_cell(plan), best_cell,
           f"**{headline_x:.2f}x**" if headline_x else "-", f"{forced_x:.2f}x" if forced_x else "all OOM", *cells]
    return row, speedups


def _solver_cell(plan: object) -> str:
    """Solver and status, with the gap to the proven lower bound when not proved optimal."""
    sol = plan.solver
    gap = "" if sol.status == "OPTIMAL" else f", gap {(sol.objective_s - sol.bound_s) / sol.objective_s:.1%}"
    return f"{sol.name} {sol.status}{gap} ({sol.wall_s:.1f} s)"


def _check(sc: Scenario, speedups: dict[str, float | None]) -> str:
    """hetpipe's search space holds every baseline placement: it is never slower than any that fits."""
    fitting = [v for v in speedups.values() if v is not None]
    return "ok" if all(v >= 1.0 - 1e-9 for v in fitting) else "FAIL: worse than a baseline"


def _plot(labels: list[str], speedups: list[dict[str, float | None]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["best hand-tuned", "forced onto every card"]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        xs = [i + k * width for i in range(len(labels))]
        ys = [s[name] or 0.0 for s in speedups]
        ax.bar(xs, ys, width, label=("over the best hand-tuned baseline (headline)" if k == 0 else
                                     "over the best baseline forced onto every card"))
        for x, y in zip(xs, ys):
            ax.text(x, y, f"{y:.2f}x" if y else "OOM", ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(labels))], labels, rotation=20, ha="right",
                  fontsize=8)
    ax.set_ylabel("baseline T / hetpipe T (log)")
    ax.set_title("hetpipe speed-up over the fastest fitting baseline (predicted, same cost model)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="three scenarios only")
    args = ap.parse_args(argv)
    rows, labels, all_speedups, failures = [], [], [], 0
    for sc in QUICK if args.quick else SCENARIOS:
        row, speedups = _row(evaluate_scenario(sc))
        verdict = _check(sc, speedups)
        failures += verdict != "ok"
        rows.append([*row, verdict])
        labels.append(f"{row[0]}\n{row[1]}")
        all_speedups.append(speedups)
        print(" | ".join(map(str, rows[-1])), flush=True)
    header = ["cluster", "model", "kind", "stages/devices", "hetpipe T", "solver",
              "best hand-tuned baseline (rule on its cards, search): T", "speed-up over it (headline)",
              "speed-up over the best forced baseline", "forced uniform", "forced parameters",
              "forced time-homogeneous", "check"]
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    _plot(labels, all_speedups, RESULTS_DIR / "plan_quality.png")
    body = (f"{__doc__.split('Usage:')[0].strip()}\n\n{markdown_table(header, rows)}\n\n"
            "![speed-up per scenario](results/plan_quality.png)\n")
    print(f"wrote {write_result('plan_quality', 'Plan quality vs baselines, hand-tuned and forced (issues #3, #17)', body)}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
