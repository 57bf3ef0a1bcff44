"""Issue #5: simulating a 64-stage, 256-micro-batch 1F1B iteration takes under 2 s here.

Times `hetpipe.schedule.simulate.simulate` (schedule validation included, as users call
it) on heterogeneous stage costs (seeded: F uniform in [1, 2] ms, B = 2F, C uniform in
[0.1, 0.5] ms), plus building the schedule, for growing pipelines; medians and minima
over ``--repeats`` runs in one process.  Writes benchmarks/results/simulator.md.

Usage:
    python benchmarks/simulator.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import markdown_table, write_result  # noqa: E402

SIZES = ((8, 32), (16, 64), (32, 128), (64, 256))  # (stages, micro-batches)
TARGET = (64, 256)
TARGET_S = 2.0


def _costs(p: int, seed: int = 0) -> "SimCosts":  # noqa: F821 - imported lazily, like every benchmark
    from hetpipe.schedule.simulate import SimCosts

    rng = random.Random(seed)
    fwd = tuple(rng.uniform(1e-3, 2e-3) for _ in range(p))
    return SimCosts(fwd_s=fwd, bwd_s=tuple(2 * f for f in fwd), send_s=tuple(rng.uniform(1e-4, 5e-4) for _ in range(p - 1)))


def time_size(p: int, m: int, repeats: int) -> dict[str, float]:
    """Seconds to build the 1F1B schedule and to simulate it (median and min over `repeats`)."""
    from hetpipe.schedule.builders import one_f_one_b
    from hetpipe.schedule.simulate import simulate

    costs, build, sim, events = _costs(p), [], [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        schedule = one_f_one_b(p, m)
        t1 = time.perf_counter()
        result = simulate(schedule, costs)
        t2 = time.perf_counter()
        build.append(t1 - t0)
        sim.append(t2 - t1)
        events = len(result.events)
    actions = sum(len(a) for a in schedule.values())
    return {"actions": actions, "events": events, "build_s": statistics.median(build),
            "sim_s": statistics.median(sim), "sim_min_s": min(sim)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    rows, ok = [], True
    for p, m in SIZES:
        r = time_size(p, m, args.repeats)
        verdict = ""
        if (p, m) == TARGET:
            ok = r["sim_s"] < TARGET_S
            verdict = f"{'ok' if ok else 'FAIL'} (target < {TARGET_S:.0f} s)"
        rows.append([p, m, f"{r['actions']:,}", f"{r['events']:,}", f"{r['build_s'] * 1e3:.0f} ms",
                     f"{r['sim_s']:.3f} s", f"{r['sim_min_s']:.3f} s", verdict])
        print(" | ".join(map(str, rows[-1])), flush=True)
    header = ["stages", "micro-batches", "actions", "events", "build schedule (median)",
              "simulate incl. validation (median)", "simulate (min)", "check"]
    body = (f"{__doc__.split('Usage:')[0].strip()}\n\nRepeats: {args.repeats}.\n\n{markdown_table(header, rows)}\n")
    print(f"wrote {write_result('simulator', 'Simulator speed (issue #5)', body)}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
