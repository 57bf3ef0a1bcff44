"""Issue #5: the plan's T vs the discrete-event simulation of its 1F1B schedule (vs a measured run).

Since issue 17 the plan's T is the replayed 1F1B schedule with optimizer steps (plan version 4), so
"plan T" and "simulated T" agree to float noise; "T_est" is the H-1F1B formula that was the
objective before (kept in the plan as `t_1f1b_estimate_s`), and "sim vs T_est" its error.

For each plan_quality scenario (a bundled model captured on meta, an example cluster,
bf16 mixed precision with Adam, the planner's micro-batch count) this script plans with
hetpipe, then simulates the plan and every baseline placement with the same stage costs
(`hetpipe.plan.analysis.compare_plan`): analytic T (the H-1F1B formula the solver
minimises), simulated iteration, their gap, and which of the formula's assumptions the
plan meets (`formula_regime`: "balanced" or "dominant"; where one holds, the tests hold
the gap within 2%).  It also reports whether the plan still beats each baseline under
the simulator, i.e. whether the formula's error changes the answer; the baselines are
each rule forced onto every card and on its best cards (issue 17), and the speed-up is
over the fastest of them that fits.

Measured runs: every run report (``format: "hetpipe.run"``) given with ``--reports`` or
found as benchmarks/results/**/*.json -- e.g. ``hetpipe demo --out benchmarks/results/demo``
leaves ``run.json`` there -- is listed with its predicted, simulated and measured
(emulated seconds) iteration.

Writes benchmarks/results/simulator_fidelity.md.

Usage:
    python benchmarks/simulator_fidelity.py [--quick] [--reports run.json ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS_DIR, markdown_table, write_result  # noqa: E402
from benchmarks.plan_quality import QUICK, SCENARIOS, Scenario, evaluate_scenario  # noqa: E402


def scenario_row(sc: Scenario) -> list[object]:
    """One table row: the plan's analytic vs simulated T and the speed-ups under both."""
    from hetpipe.plan.analysis import compare_plan

    plan = evaluate_scenario(sc)["plan"]
    rows = compare_plan(plan)
    mine, others = rows[0], [r for r in rows[1:] if r.fits]
    best = min(others, key=lambda r: r.analytic_s, default=None)
    if best is None:
        speedup = "no baseline fits"
    else:
        speedup = (f"{best.name}: {best.analytic_s / mine.analytic_s:.2f}x / "
                   f"{best.simulated_s / mine.simulated_s:.2f}x")
    wins = all(r.simulated_s >= mine.simulated_s for r in others)
    return [sc.cluster.removesuffix(".yaml"), sc.model, f"{len(mine.stages)}", str(mine.microbatches),
            f"{mine.analytic_s:.3f} s", f"{mine.simulated_s:.3f} s", f"{mine.gap:+.1%}",
            f"{mine.estimate_s:.3f} s", f"{mine.simulated_s / mine.estimate_s - 1:+.1%}",
            mine.regime or "neither", f"{mine.analytic_bubble_fraction:.0%} / {mine.result.bubble_fraction:.0%}",
            speedup, "yes" if wins else "NO"]


def measured_rows(paths: list[Path]) -> list[list[object]]:
    """Rows for every run report among `paths` (other JSON files are skipped): predicted, simulated, measured."""
    from hetpipe.runtime.report import RunReport

    rows = []
    for path in paths:
        try:
            if json.loads(path.read_text()).get("format") != "hetpipe.run":
                continue
        except (OSError, json.JSONDecodeError, AttributeError):
            continue
        rep = RunReport.load(path)
        meas = rep.measured_emulated_iteration_s
        name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
        rows.append([name, rep.model, str(rep.world_size), str(rep.microbatches),
                     f"{rep.predicted_iteration_s:.4f} s", f"{rep.simulated_iteration_s:.4f} s", f"{meas:.4f} s",
                     f"{meas / rep.predicted_iteration_s - 1:+.1%}", f"{meas / rep.simulated_iteration_s - 1:+.1%}"])
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="three scenarios only")
    ap.add_argument("--reports", nargs="*", type=Path, default=None,
                    help="run reports to list (default: every benchmarks/results/**/*.json that is one)")
    args = ap.parse_args(argv)
    rows = []
    for sc in QUICK if args.quick else SCENARIOS:
        rows.append(scenario_row(sc))
        print(" | ".join(map(str, rows[-1])), flush=True)
    header = ["cluster", "model", "stages", "m", "plan T", "simulated T", "sim vs plan T", "T_est (old objective)",
              "sim vs T_est", "T_est's assumptions",
              "bubble analytic / sim", "speed-up over the fastest fitting baseline, hand-tuned cards included (analytic / simulated)",
              "plan still fastest when simulated"]
    body = f"{__doc__.split('Usage:')[0].strip()}\n\n{markdown_table(header, rows)}\n"
    measured = measured_rows(args.reports if args.reports is not None else sorted(RESULTS_DIR.rglob("*.json")))
    mheader = ["run report", "model", "stages", "m", "predicted T", "simulated", "measured (emulated s)",
               "measured vs T", "measured vs simulated"]
    body += ("\n### Measured runs\n\n" + markdown_table(mheader, measured) + "\n" if measured else
             "\n### Measured runs\n\n_no run report under benchmarks/results/ (run `hetpipe demo --out "
             "benchmarks/results/demo`, then re-run this script)_\n")
    for row in measured:
        print(" | ".join(map(str, row)), flush=True)
    title = "Simulator vs the plan's T (issues #5, 17)"
    print(f"wrote {write_result('simulator_fidelity', title, body)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
