"""Run `hetpipe demo` into benchmarks/results/demo and record what it measured.

The run report it leaves (benchmarks/results/demo/run.json) is also what
`simulator_fidelity.py` lists as the measured emulated run (issue #5, acceptance 2:
simulator vs measured within 10% on the home-lab demo plan).

Usage:
    python benchmarks/demo_run.py [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS_DIR, markdown_table, write_result  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from hetpipe.cli.demo import run_demo
    from hetpipe.plan.baseline_report import headline
    from hetpipe.plan.schema import Plan
    from hetpipe.runtime.report import RunReport

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args(argv)
    out = RESULTS_DIR / "demo"
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    run_demo(out=out, steps=args.steps, run=True, console=Console(quiet=True))
    wall = time.perf_counter() - start
    plan, rep = Plan.load(out / "plan.json"), RunReport.load(out / "run.json")
    rows = [["hetpipe demo (gpt-demo, emulated home lab)", f"{rep.predicted_iteration_s:.4f}",
             f"{rep.simulated_iteration_s:.4f}", f"{rep.measured_emulated_iteration_s:.4f}",
             f"{rep.measured_emulated_iteration_s / rep.simulated_iteration_s - 1:+.1%}",
             f"{rep.prediction_error:+.1%}", f"{wall:.0f} s"]]
    for name, b in plan.baselines.items():  # each rule forced onto every card, then on its best cards (issue 17)
        rows.append([f"baseline {name}, forced onto every card", f"{b.iteration_s:.4f}", "",
                     "OOM (not run)" if not b.fits else "not run", "", "", ""])
        if b.best is not None and b.best.fits:
            cards = ", ".join(s.device for s in b.best.stages)
            rows.append([f"baseline {name} on its best cards ({cards}; {b.best.search})", f"{b.best.iteration_s:.4f}",
                         "", "not run", "", "", ""])
    head = headline(plan)
    header = ["plan", "analytic T (emu s)", "simulated (emu s)", "measured (emu s)", "measured vs simulated",
              "measured vs T", "demo wall"]
    body = (f"{__doc__.split('Usage:')[0].strip()}\n\n{markdown_table(header, rows)}\n\n"
            f"Headline (predicted): {head.text()}.\n\n"
            f"Steps: {rep.steps}, time scale {rep.time_scale:.3g} real s per emulated s; 1-min load average "
            f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after (other processes share the cores).\n\n"
            "![predicted vs measured timeline](results/demo/gantt.png)\n")
    print(f"wrote {write_result('demo_run', 'The demo: predicted vs measured (issue #5)', body)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
